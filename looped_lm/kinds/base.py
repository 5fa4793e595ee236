"""What a model kind is: a self-describing plugin.

A `Kind` owns everything the rest of the project needs to know about one `model.kind`:

    section        its typed `model:` config section (a `ModelSection` subclass; `kind` is its tag)
    diffusion      its typed `diffusion:` section (a `DiffusionSection`; the base has no field: gpt, huginn)
    args           "package.module:Class": its network's frozen args, built once from the run config by
                   `Class.from_config(cfg, vocab_size)` (`model_args`); None (the default): the builder reads
                   the run config itself
    builder        "package.module:function" -> the nn.Module, called with (args, saved state), or without
                   args with (cfg, vocab_size, saved state)
    capabilities   what it offers (the names below); a verb that needs one asks `kind.offers(...)` and
                   refuses in one line naming the kind and what is missing (`require`)
    data_sources   the `data.source` values it reads ({source: what data.path names}); `prepare` /
                   `batches` ("module:function") find and serve its data (token files for language models, images or characters for the modules)
    num_blocks / block_layers / vocab / validate   its block layout, output vocabulary, own config checks

Callers (config, batches, parallel, train, merge, preflight, export, hf, checkpoint) ask the kind and
never branch on its name. Builders and data functions are named by string and imported on first use, so
this package imports no model and no data module (vLLM's lazy-registry pattern): the kinds sit below the
config in the import layers, and an out-of-tree kind is a module that calls `looped_lm.kinds.register`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar, Literal

from looped_lm.errors import UserError
from looped_lm.fields import Float, Section, Str, field


# --- capabilities: what a kind may offer ------------------------------------------------------------
CAPABILITIES = {
    "language_model": "token data, perplexity, prompts and the OpenAI server",
    "iterative": "K denoising or recurrence steps at inference (model.max_iterations)",
    "block_jobs": "diffusion.blocks_to_train: jobs that each train some blocks",
    "merge": "looped_lm merge: joining block jobs by ownership",
    "block_parallel": "train.mode block_parallel: one block per rank every step",
    "stacked_context": "diffusion.context stacked: a clean stream continued through the blocks",
    "layer_split": "diffusion.layers_per_block: blocks of their own depth",
    "partition_edges": "block edges computed from diffusion.partition (checked on every load)",
    "activation_checkpointing": "model.activation_checkpointing",
    "init_from": "model.init_from: starting from a Hugging Face checkpoint",
    "lora": "train.lora_rank: LoRA adapters on a pretrained base",
    "export_llama": "looped_lm export --format llama (a stock LlamaForCausalLM)",
    "export_native": "looped_lm export --format looped_lm (LoopedLMForCausalLM)",
    "vllm": "the vLLM plugin",
    "estimated_ppl": "ppl@k from the DiffusionBlocks estimator (a standard error beside every number)",
    "autocast": "bf16 under autocast with fp32 weights and optimizer state (deepspeed.bf16)",
}

# data.source -> what its data.path names ("" = no path: the corpus ships with the package)
LANGUAGE_SOURCES = {"bible": "", "shakespeare": "", "files": "a .txt / .jsonl / .parquet file",
                    "hf": "a Hugging Face dataset name", "bin": "a directory with train.bin / val.bin"}


# --- the model: section, common to every kind --------------------------------------------------------
class ModelSection(Section):
    """Fields every kind has. A kind's section subclasses this (or one below) and narrows `kind`."""

    kind: str = field("gpt", "which network (a registered kind; `looped_lm train --help-config` lists them)")
    n_layers: int = field(4, "layers (db_ar: split into diffusion.num_blocks blocks; looped: the core)")
    d_model: int = field(128, "residual width")
    n_heads: int = field(4, "attention heads (d_model must divide by it)")
    ffn_hidden: int = field(0, "SwiGLU hidden width; 0 = 8/3 * d_model rounded up to a multiple of 64")
    norm_eps: Float = field(1e-5, "RMSNorm epsilon")
    init_std: Float = field(0.02, "std of the normal init of linear and embedding weights")

    def check(self) -> None:
        for key in ("n_layers", "d_model", "n_heads"):
            ensure(getattr(self, key) >= 1, f"model.{key} must be >= 1 (got {getattr(self, key)})")
        ensure(self.d_model % self.n_heads == 0,
               f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        ensure((self.d_model // self.n_heads) % 2 == 0, "model.d_model / model.n_heads must be even (RoPE rotates "
                                                        "pairs)")
        ensure(self.ffn_hidden >= 0, f"model.ffn_hidden must be >= 0 (got {self.ffn_hidden})")
        ensure(self.init_std > 0 and self.norm_eps > 0, "model.init_std and norm_eps must be > 0")


class SequenceSection(ModelSection):
    """Models over sequences (RoPE positions)."""

    seq_len: int = field(256, "training context length in tokens")
    rope_theta: Float = field(10000.0, "RoPE base")

    def check(self) -> None:
        super().check()
        ensure(self.seq_len >= 1, f"model.seq_len must be >= 1 (got {self.seq_len})")
        ensure(self.rope_theta > 0, f"model.rope_theta must be > 0 (got {self.rope_theta})")


class LanguageModelSection(SequenceSection):
    """Autoregressive language models over a tokenizer's vocabulary."""

    vocab_size: int = field(0, "0 = the tokenizer's size; larger pads the embedding (e.g. 50304 for speed)")
    loss_chunk: int = field(0, "training: head + CE in chunks of this many positions, recomputed in backward, "
                               "so the (tokens, vocab) logits are never stored (0 = off; e.g. 128 with a 50257 "
                               "vocab)")
    init_from: Str = field("", "a local Hugging Face directory (config.json + safetensors) of LlamaForCausalLM / "
                               "MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / Gemma3ForCausalLM, a GGUF "
                               "file of a Llama (dequantised by transformers), or a `looped_lm export` of a gpt: a "
                               "fresh run starts from its weights (docs/pretrained.md); '' = random init. The shape "
                               "fields left unset (d_model, n_heads, ffn_hidden, norm_eps, rope_theta, vocab_size, the "
                               "layer options below; n_layers for gpt and db_ar) are read from it; one set to another "
                               "value is refused")

    head_dim: int = field(0, "the width of one attention head; 0 = d_model / n_heads (Qwen3 sets it apart: q, k, v "
                             "are n_heads x head_dim wide)")
    qkv_bias: bool = field(False, "biases on the q, k and v projections (Qwen2 / Qwen2.5)")
    qk_norm: bool = field(False, "an RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)")
    attn_scalar: Float = field(0.0, "attention scores are scaled by attn_scalar ** -0.5 instead of head_dim ** -0.5 "
                                    "(Gemma 3's query_pre_attn_scalar); 0 = head_dim")
    sandwich_norm: bool = field(False, "an RMSNorm on the attention's and on the MLP's output too, before each "
                                       "residual add (Gemma 3's post_attention_layernorm and post_feedforward_layernorm)")
    mlp_activation: Literal["silu", "gelu_tanh"] = field(
        "silu", "the gated MLP's activation: silu (SwiGLU, Llama) or gelu_tanh (GeGLU with gelu's tanh approximation, "
        "Gemma's gelu_pytorch_tanh)")
    embed_scale: bool = field(False, "the input embedding is multiplied by sqrt(d_model), rounded to the weights' "
                                     "dtype (Gemma); the head and the DiffusionBlocks targets read the table unscaled")
    layer_types: list[Literal["full_attention", "sliding_attention"]] = field(
        [], "one entry per source layer, in the source's order (Gemma 3's layer_types; a windowed Mistral's: all "
        "sliding_attention; the kind's layer plan places "
        "them, as model.init_from's layers): sliding_attention layers attend within model.sliding_window and rotate "
        "with model.rope_local_theta; [] = every layer full_attention")
    sliding_window: int = field(0, "the local layers' window: a query sees itself and the sliding_window - 1 "
                                   "positions before it (Gemma 3, Mistral); 0 = no local layers")
    rope_local_theta: Float = field(0.0, "the RoPE base of the local layers (Gemma 3's rope_local_base_freq; "
                                         "Mistral's: its rope_theta); "
                                         "0 = rope_theta")
    tie_embeddings: bool = field(True, "the head is the token embedding, transposed (tie_word_embeddings); false: a "
                                       "separate lm_head, as most sources above the smallest sizes have")
    max_positions: int = field(0, "the context the model serves by default (and is built for: RoPE up to the larger of "
                                  "this and 4 x seq_len); 0 = model.seq_len, its training context; model.init_from "
                                  "sets it to the source's max_position_embeddings")

    def positions(self) -> int:
        """The context the model was trained for: its own seq_len, or a pretrained source's positions."""
        return self.max_positions or self.seq_len

    def embedding_scale(self) -> float:
        """What the input embedding is multiplied by (embed_scale: sqrt(d_model))."""
        return self.d_model ** 0.5 if self.embed_scale else 1.0

    def local_rope_theta(self) -> float:
        """The RoPE base of the local layers, or 0 when no layer is local (one base)."""
        return (self.rope_local_theta or self.rope_theta) if "sliding_attention" in self.layer_types else 0.0

    def check(self) -> None:
        super().check()
        ensure(self.max_positions == 0 or self.max_positions >= self.seq_len,
               f"model.max_positions must be 0 (model.seq_len) or >= model.seq_len ({self.seq_len}) (got "
               f"{self.max_positions})")
        ensure(self.vocab_size >= 0, f"model.vocab_size must be >= 0 (got {self.vocab_size})")
        ensure(self.head_dim >= 0 and self.head_dim % 2 == 0,
               f"model.head_dim must be 0 (d_model / n_heads) or an even width (RoPE rotates pairs) (got {self.head_dim})")
        ensure(self.loss_chunk >= 0, f"model.loss_chunk must be >= 0 (got {self.loss_chunk})")
        ensure(self.attn_scalar >= 0 and self.rope_local_theta >= 0,
               f"model.attn_scalar and model.rope_local_theta must be >= 0 (got {self.attn_scalar}, "
               f"{self.rope_local_theta})")
        local = "sliding_attention" in self.layer_types
        ensure(self.sliding_window >= 0 and (self.sliding_window > 0) == local,
               f"model.sliding_window ({self.sliding_window}) must be >= 1 where model.layer_types has a "
               f"sliding_attention layer, and 0 where it has none")


# --- K: the one rule every verb reads ------------------------------------------------------------------
@dataclass(frozen=True)
class IterationLimits:
    """What a kind with K allows, from its config alone (`Kind.iteration_limits`): the default K of every
    verb (generate, eval, serve, export, the Hugging Face and vLLM wrappers), the largest K any of them
    accepts, and what resolving a request needs besides."""

    default_iterations: int  # K when a request names none: generate, serve, export, and eval's ppl@k
    max_iterations: int  # the largest K accepted
    num_blocks: int  # K < num_blocks skips blocks
    default_bridge: str | None  # DiffusionBlocks' bridge; None: the model has no bridge (huginn)
    adaptive_exit: bool  # whether an exit rule may cut a token's iterations (its cache must not depend on K)
    extra_calls: str = "spread"  # where calls beyond B run (diffusion.extra_calls)


# --- the diffusion: section, each kind's own ------------------------------------------------------------
class DiffusionSection(Section):
    """A kind's `diffusion:` section. This base has no field: the section of the kinds trained end to end
    (gpt, huginn), where every diffusion key is refused. A kind's own subclasses this (or one below)."""


class BlockDiffusion(DiffusionSection):
    """Kinds trained block by block: B blocks, each owning one interval of noise (or masking) levels."""

    num_blocks: int = field(4, "B: blocks that each own one interval of noise levels")
    overlap: Float = field(0.1, "gamma: each block trains on its interval widened by this share of its ln-width")
    blocks_to_train: list[int] = field([], "train only these blocks (others frozen, no optimiser state; the "
                                           "checkpoint records them, and `looped_lm merge` joins such jobs); [] = all")
    block_sampling: Literal["uniform", "round_robin", "fixed"] = field(
        "uniform", "which block a step trains: uniform (the paper), round_robin, or fixed (diffusion.block_weights)")
    block_weights: list[Float] = field([], "block_sampling fixed: one weight per block, block 0 (highest noise) "
                                           "first, e.g. [3, 1, 1]: block 0 gets 60 % of the steps; normalised")

    def trained_blocks(self) -> list[int]:
        """The blocks this run trains (what a checkpoint's `ownership` records): blocks_to_train, or every block."""
        return sorted(self.blocks_to_train) or list(range(self.num_blocks))

    def check(self) -> None:
        ensure(self.num_blocks >= 1, f"diffusion.num_blocks must be >= 1 (got {self.num_blocks})")
        ensure(0.0 <= self.overlap <= 0.5, f"diffusion.overlap must be in [0, 0.5] (got {self.overlap})")
        ensure(len(set(self.blocks_to_train)) == len(self.blocks_to_train),
               f"diffusion.blocks_to_train has duplicates: {self.blocks_to_train}")


class NoiseDiffusion(BlockDiffusion):
    """Block kinds over Gaussian noise levels sigma (EDM's log-normal law), sampled by a K-step chain."""

    partition: Literal["equi_probability", "uniform"] = field(
        "equi_probability", "block edges: equal noise mass (equi_probability) or equal ln-width")
    p_mean: Float = field(-1.2, "mean of ln(sigma) for training noise (EDM's; looped_db: set 1.0, docs/method.md §8)")
    p_std: Float = field(1.2, "std of ln(sigma) for training noise")
    sigma_min: Float = field(0.002, "lowest noise level")
    sigma_max: Float = field(80.0, "highest noise level")
    sigma_data: Float = field(0.5, "EDM sigma_data")
    last_call: Literal["edge", "sigma_min"] = field(
        "sigma_min", "where a K-step chain's last call runs: the last Euler grid point above sigma_min (edge, paper) "
        "or sigma_min itself (with parameterization likelihood an exact read-back of the last bridge's token, so "
        "K = B samples what block 0 drew)")
    extra_calls: Literal["spread", "block0"] = field(
        "spread", "where a chain's calls beyond B run: spread (all K equally in the noise CDF, about K / B per block) "
        "or block0 (the K = B grid, the extra K - B calls inside block 0's interval; docs/pretrained.md)")
    sample_top_quantile: Float = field(0.999, "chains start at this quantile of block 0's training sigma law instead "
                                              "of sigma_max, where block 0 never trains; 1 = sigma_max (paper and "
                                              "official code)")

    def check(self) -> None:
        super().check()
        ensure(0 < self.sigma_min < self.sigma_max, f"diffusion.sigma_min ({self.sigma_min}) must be > 0 and below "
                                                    f"diffusion.sigma_max ({self.sigma_max})")
        ensure(self.p_std > 0, f"diffusion.p_std must be > 0 (got {self.p_std})")
        ensure(self.sigma_data > 0, f"diffusion.sigma_data must be > 0 (got {self.sigma_data})")
        ensure(0 < self.sample_top_quantile <= 1,
               f"diffusion.sample_top_quantile must be in (0, 1] (got {self.sample_top_quantile})")


def ensure(ok: bool, message: str) -> None:
    """A config check: raise UserError(message), one line naming the key, unless ok."""
    if not ok:
        raise UserError(message)


# --- the plugin ---------------------------------------------------------------------------------------
def resolve(target: str):
    """"package.module:name" -> the object (imported on first use)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class Kind:
    """One model kind. Subclass it, set the class attributes, override what differs, and `register` an
    instance. The defaults describe an end-to-end language model (one unit of parameters, token data).
    Every method takes `cfg`, the validated run config (looped_lm.config.Config: this package sits below
    it and never imports it)."""

    name: ClassVar[str]
    section: ClassVar[type[ModelSection]]
    diffusion: ClassVar[type[DiffusionSection]] = DiffusionSection  # its `diffusion:` section (none: no field)
    builder: ClassVar[str]
    args: ClassVar[str | None] = None  # "module:Class" of its network's frozen args (None: the builder takes cfg)
    summary: ClassVar[str] = ""
    capabilities: ClassVar[frozenset[str]] = frozenset({"language_model"})
    data_sources: ClassVar[dict[str, str]] = LANGUAGE_SOURCES  # data.source -> what data.path names ("": none)
    prepare: ClassVar[str] = "looped_lm.data.batches:prepare_tokens"  # (cfg, vocab_size) -> data location
    batches: ClassVar[str] = "looped_lm.data.batches:token_batches"  # (cfg, data location, split) -> batches

    def offers(self, capability: str) -> bool:
        return capability in self.capabilities

    def num_blocks(self, cfg) -> int:
        """Blocks a training step chooses among (1: the whole network is one unit)."""
        return 1

    def block_layers(self, cfg) -> list[int]:
        """The layers of each block, block 0 (highest noise) first."""
        return [cfg.model.n_layers]

    def vocab(self, cfg) -> tuple[int, str] | None:
        """(output vocabulary, tokenizer name for the manifest) when the config alone fixes them (a
        module's classes or characters); None: the tokenizer's (data.tokenizer, model.vocab_size)."""
        return None

    def source_n_layers(self, model: dict, n_source: int) -> int | None:
        """model.init_from with model.n_layers unset: the n_layers that takes every source layer, given the
        user's raw `model:` section; None where n_layers is a layout choice the user must make (a looped core)."""
        return None

    def source_layers(self, cfg, n_source: int) -> dict[str, list]:
        """model.init_from: which source layer each part of the network takes, {part: [indices]} (parts as
        in the module's parameter names: "layers", "prelude", "blocks" (a list per block), "core", "coda").
        Raise UserError when the source's n_source layers cannot take the split. Kinds offering
        `init_from` override it."""
        raise UserError(f"model.kind {self.name} does not offer init_from ({CAPABILITIES['init_from']})")

    def lora_layers(self, cfg) -> tuple[list[str], bool]:
        """train.lora_rank: (regexes of the layer lists a job adapts, whether it trains the shared parts),
        for the blocks it owns (diffusion.blocks_to_train). Kinds offering `lora` override it."""
        raise UserError(f"model.kind {self.name} does not offer lora ({CAPABILITIES['lora']})")

    def iteration_limits(self, cfg) -> IterationLimits | None:
        """Which K by default, which K at most (the one rule: models, verbs and wrappers all ask this);
        None: the kind has no K at inference (an end-to-end model)."""
        return None

    def resolve(self, cfg) -> dict:
        """What this kind's config leaves to be worked out (db_ar: the block count its layers_per_block
        implies), as section updates {"diffusion": {"num_blocks": 3}}, after checking the fields it reads
        (UserError naming the key). The config applies them to a copy; nothing here writes into `cfg`."""
        return {}

    def validate(self, cfg) -> None:
        """Checks of this kind's own fields and of the other sections' options it gives meaning to, on the
        resolved config. Raise UserError naming the key; write nothing."""

    def step_flops(self, cfg, vocab_size: int, batch: int, key=None, frozen=()) -> float | None:
        """Matmul FLOPs (forward + backward) of one training micro-batch of `batch` sequences, by the cost
        model (looped_lm/cost.py); `key` is what the step's metrics say decides its cost ("block" for DB
        kinds, "recurrence" for huginn); `frozen`: cost terms whose weight gradients do not run
        (cost.FROZEN_UNDER_LORA). None: no cost model (no MFU is logged)."""
        return None

    def curve_flops(self, cfg, vocab_size: int, batch: int) -> float | None:
        """Matmul FLOPs of one CE(sigma) curve refresh (block_sampling loss_share / network_gain, every
        diffusion.curve_every steps, forward only on one batch of `batch` sequences); None: no curve."""
        return None

    def compile_for_training(self, model, backend: str) -> bool:
        """train.compile: torch.compile what this kind trains through, in place; -> whether anything was.
        Compile what runs with the same shapes every step (the step number or a host-drawn size must stay
        out of the graph: each value would be a recompilation)."""
        return False

    def model_args(self, cfg, vocab_size: int):
        """Its network's frozen args, from the run config: the one read of the config a network's build makes
        (`args.from_config`). None where the kind defines no args: its builder then reads the config."""
        return resolve(self.args).from_config(cfg, vocab_size) if self.args else None

    def build(self, cfg, vocab_size: int, state: dict | None):
        args = self.model_args(cfg, vocab_size)
        if args is None:
            return resolve(self.builder)(cfg, vocab_size, state)
        return resolve(self.builder)(args, state)

    def __repr__(self) -> str:
        return f"<model.kind {self.name}>"


def require(kind: Kind, capability: str, needed_by: str) -> None:
    """One line naming the kind and what it lacks, for `needed_by` (a verb or a config option)."""
    if not kind.offers(capability):
        raise UserError(f"model.kind {kind.name} does not offer {capability} ({CAPABILITIES.get(capability, '')}), "
                      f"which {needed_by} needs")
