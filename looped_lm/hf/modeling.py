"""`LoopedLMForCausalLM`: a Hugging Face `PreTrainedModel` around the native looped_lm module.

One definition: the wrapper holds the native model (`self.model`, built by `looped_lm.models.build_network` from
the args of the exported run config) and calls its own cached decoding, so `model.generate(..., do_sample=False)` gives the tokens of
`looped_lm generate --temperature 0`.

- gpt: `forward` returns logits at every position (and a loss with `labels`); with a cache, at the new
  positions.
- db_ar / looped_db: `forward` returns logits (B, 1, V) for the token after the last input position,
  from the native K-step routed chain. K, the bridge and the noise are per `generate` call
  (`num_iterations=`, `bridge=`, `seed=`; defaults from the generation config). The starting noise is drawn
  from a `torch.Generator` seeded with `seed`, one (B, 1, d) draw per forward, as the native engine does.

The cache is `NativeCache`: the native caches (GPT: per-layer KV; DB: clean-stream KV of the prelude
and of every block, plus the token history) inside a `transformers.Cache`, so HF's loop feeds only the
new tokens. Single sequences or equal-length batches only: a padded `attention_mask` is refused.
"""

from __future__ import annotations

import torch
from transformers import Cache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from looped_lm.hf.configuration import LoopedLMConfig
from looped_lm.kinds import get_kind
from looped_lm.models import build_network
from looped_lm.models.args import args_from_dict
from looped_lm.models.layers import RotaryEmbedding
from looped_lm.sampling import SamplingParams, SharedGenerator
from looped_lm.settings import InferenceSettings, RowBatch, iterations_note, resolve_settings

logger = logging.get_logger(__name__)


def bridge_sampler(gc, kwargs) -> SamplingParams:
    """The call's sampler as the `sample` bridge should draw with it: greedy unless do_sample."""
    def get(name, default):
        value = kwargs.get(name, getattr(gc, name, None))
        return default if value is None else value

    if not get("do_sample", False):
        return SamplingParams(0.0)
    return SamplingParams(float(get("temperature", 1.0)), int(get("top_k", 0)), float(get("top_p", 1.0)))


class NativeCache(Cache):
    """The native model's caches plus one call's inference settings and random stream."""

    def __init__(self, model, batch: int, max_len: int, settings: InferenceSettings,
                 generator: torch.Generator | None = None):
        super().__init__(layers=[])
        self.state = model.new_cache(batch, max_len)
        self.settings, self.random = settings, SharedGenerator(generator)
        self.seen = 0  # tokens the native caches hold (every row: equal-length batches only)
        self.max_len = max_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_len

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_dummy(self) -> list[bool]:
        return [False]


class LoopedLMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LoopedLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _supports_cache_class = True

    def __init__(self, config: LoopedLMConfig):
        super().__init__(config)
        self.args = args_from_dict(config.looped_lm_config, config.vocab_size)  # the native network's frozen args
        self.model = build_network(self.args, config.model_state or None)
        self.post_init()

    # --- Hugging Face plumbing ---------------------------------------------------------------------

    @torch.no_grad()
    def _init_weights(self, module):
        """Every weight comes from the checkpoint; only the non-persistent tables (RoPE cos/sin), which
        from_pretrained leaves uninitialised, are recomputed."""
        with torch.device("cpu"):
            if isinstance(module, RotaryEmbedding):
                fresh = RotaryEmbedding(self.model.head_dim, module.cos.shape[0], self.args.rope_theta,
                                        self.args.rope_local_theta)
                module.cos.copy_(fresh.cos)
                module.sin.copy_(fresh.sin)

    def get_input_embeddings(self):
        return self.model.tok_emb

    def get_output_embeddings(self):
        return self.model.lm_head  # None when tied: the head is then F.linear(norm(h), tok_emb.weight)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is a NativeCache, made by `new_native_cache`

    @property
    def is_db(self) -> bool:
        return get_kind(self.config.kind).offers("iterative")

    def call_settings(self, num_iterations=None, bridge=None, generation_config=None,
                      sampling: SamplingParams | None = None) -> InferenceSettings:
        """One call's settings: the arguments, else the generation config, else the model's defaults."""
        gc = generation_config or self.generation_config
        if not self.is_db:
            return resolve_settings(None, sampling=sampling or SamplingParams(0.0))
        K = num_iterations if num_iterations is not None else getattr(gc, "num_iterations", None)
        limits = self.model.iteration_limits()
        settings = resolve_settings(limits, num_iterations=K, bridge=bridge or getattr(gc, "bridge", None),
                                    sampling=sampling or SamplingParams(0.0))
        note = iterations_note(limits, settings)
        if note:  # K < B, or K above the usual chain: said once per process, as generate and the server say it
            logger.warning_once(note)
        return settings

    def new_native_cache(self, batch: int, max_len: int | None = None, num_iterations=None, bridge=None,
                         seed=None, generation_config=None, sampling=None) -> NativeCache:
        gc = generation_config or self.generation_config
        seed = seed if seed is not None else getattr(gc, "seed", None)
        device = self.model.tok_emb.weight.device
        generator = torch.Generator(device=device).manual_seed(0 if seed is None else int(seed))
        return NativeCache(self.model, batch, max_len or self.model.max_positions,
                           self.call_settings(num_iterations, bridge, gc, sampling), generator)

    # --- forward -----------------------------------------------------------------------------------

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: NativeCache | None = None, past_key_values: NativeCache | None = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None,
                num_iterations: int | None = None, bridge: str | None = None, seed: int | None = None,
                return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        """input_ids (B, T): the new tokens after what `cache` holds (all of them without a cache).

        Returns logits (B, T, V) for gpt, (B, 1, V) (the next token, K-step chain) for DB models.
        """
        if input_ids is None:
            raise ValueError("LoopedLMForCausalLM needs input_ids (inputs_embeds are not supported)")
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("LoopedLMForCausalLM does not take inputs_embeds")
        cache = cache if cache is not None else past_key_values
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("padded batches are not supported: give one sequence or equal-length rows")
        if cache is not None and not isinstance(cache, NativeCache):
            raise TypeError(f"expected a NativeCache (from new_native_cache), got {type(cache).__name__}")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        loss = None
        if cache is None and not use_cache and not self.is_db:
            logits, loss = self._gpt_loss(input_ids, labels) if labels is not None else (self.model(input_ids)[0], None)
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        if labels is not None:
            raise ValueError("labels are supported for gpt without a cache only")
        if cache is None:
            total = input_ids.shape[1] + (1 if self.is_db else 0)
            cache = self.new_native_cache(input_ids.shape[0], max(total, self.model.max_positions),
                                          num_iterations, bridge, seed)
        if self.is_db:
            batch = RowBatch.uniform(cache.settings, input_ids.shape[0], cache.random)
            logits = self.model.forward_cached(input_ids, cache.state, None, batch)[:, None]
        else:
            logits = self.model.decode(input_ids, cache.state)
        cache.seen += input_ids.shape[1]
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    def _gpt_loss(self, input_ids, labels):
        logits, _ = self.model(input_ids)
        shift = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), shift.flatten(),
                                                 ignore_index=-100)
        return logits, loss

    # --- generation ----------------------------------------------------------------------------------

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None,
                                      attention_mask=None, is_first_iteration=False, **kwargs):
        if cache is not None:
            input_ids = input_ids[:, cache.seen:]  # only what the native caches have not seen
        return {"input_ids": input_ids, "cache": cache, "attention_mask": attention_mask,
                "use_cache": kwargs.get("use_cache", True)}

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, num_iterations: int | None = None,
                 bridge: str | None = None, seed: int | None = None, **kwargs):
        """`GenerationMixin.generate` with a `NativeCache`. DB models: `num_iterations` (K), `bridge` and
        `seed` (of the starting noise) override the generation config's."""
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids")
        gc = generation_config or self.generation_config
        if (kwargs.get("num_beams") or getattr(gc, "num_beams", 1) or 1) > 1:
            raise ValueError("beam search is not supported: the native caches cannot reorder rows")
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None and kwargs.get("use_cache", True):
            new = kwargs.get("max_new_tokens") or getattr(gc, "max_new_tokens", None)
            max_len = input_ids.shape[1] + new if new else (kwargs.get("max_length") or gc.max_length)
            kwargs["cache"] = self.new_native_cache(input_ids.shape[0], min(max_len, self.model.max_positions),
                                                    num_iterations, bridge, seed, gc, bridge_sampler(gc, kwargs))
        return super().generate(input_ids, generation_config=generation_config, **kwargs)
