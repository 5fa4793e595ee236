"""Each network's frozen args, and the one place in looped_lm/models that reads the run config.

A network is built from its args alone (nanoGPT's `GPT(GPTConfig)`, torchtitan's `ModelArgs`): the kind
builds them once from the validated run config (`Kind.model_args` -> `<Args>.from_config(cfg, vocab_size)`),
and the network, the DB objective and the chain never see the config. A test builds a model from a literal:

    GPT(GPTArgs(vocab_size=47, n_layers=2, d_model=32, n_heads=4, seq_len=16))

    LMArgs      the transformer's shape and layer options, every language model's (gpt: GPTArgs itself)
    HuginnArgs  + the prelude / core / coda and the recurrence it trains at, its K limits
    DBArgs      + the DiffusionBlocks layout (prelude, blocks, coda, context), noise schedule, partition, noisy
                slot, objective and K limits (db_ar and looped_db)
    VitArgs / DitArgs / MdmArgs   the supporting modules: shape, blocks, their noise or masking and sampling

`network_args(cfg, vocab_size)` is what `build_model` calls; a kind without args (an out-of-tree kind
written before them) gets `RunConfigArgs`, and its builder reads the run config as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from looped_lm.config import config_from_dict
from looped_lm.diffusion import NoiseSchedule
from looped_lm.kinds import IterationLimits, get_kind, kind_of, resolve
from looped_lm.models.layers import LayerOptions, mark_local_layers


@dataclass(frozen=True)
class LocalLayers:
    """Gemma 3's local layers: the source's layer_types, the window, and the kind's layer plan ({part: source
    layer indices}, as pairs of tuples) that places them in the network (`layers.mark_local_layers`)."""

    layer_types: tuple[str, ...]
    window: int
    plan: tuple[tuple[str, tuple], ...]

    def apply(self, net) -> None:
        mark_local_layers(net, dict(self.plan), list(self.layer_types), self.window)


def _frozen(value):
    """Lists (nested) -> tuples, so args hold no mutable value."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


# --- the language models ------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LMArgs:
    """The transformer of a language model (`model:` of LanguageModelSection: docs in kinds/base.py)."""

    kind: str = "gpt"  # the kind whose builder takes these args (`build_network`)
    vocab_size: int
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    ffn_hidden: int = 0  # 0: 8/3 d_model rounded up to a multiple of 64
    norm_eps: float = 1e-5
    init_std: float = 0.02
    seq_len: int = 256
    rope_theta: float = 10000.0
    max_positions: int = 0  # RoPE tables cover max(4 * seq_len, this)
    loss_chunk: int = 0
    activation_checkpointing: bool = False
    layer: LayerOptions = LayerOptions()
    tie_embeddings: bool = True
    embed_scale: float = 1.0  # the input embedding's factor (Gemma: sqrt(d_model))
    rope_local_theta: float = 0.0  # the local layers' RoPE base; 0: one base
    local_layers: LocalLayers | None = None

    @property
    def positions(self) -> int:
        """The RoPE table's length: generation may run past the training length."""
        return max(4 * self.seq_len, self.max_positions)

    @classmethod
    def from_config(cls, cfg, vocab_size: int):
        return cls(**_lm_fields(cfg, vocab_size))


def _lm_fields(cfg, vocab_size: int) -> dict:
    m = cfg.model
    local = None
    if m.layer_types:  # placed by the kind's layer plan, as a pretrained source's layers are
        plan = kind_of(cfg).source_layers(cfg, len(m.layer_types))
        local = LocalLayers(tuple(m.layer_types), m.sliding_window,
                            tuple((part, _frozen(indices)) for part, indices in plan.items()))
    return dict(kind=m.kind, vocab_size=vocab_size, n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads,
                ffn_hidden=m.ffn_hidden, norm_eps=m.norm_eps, init_std=m.init_std, seq_len=m.seq_len,
                rope_theta=m.rope_theta, max_positions=m.max_positions, loss_chunk=m.loss_chunk,
                activation_checkpointing=getattr(m, "activation_checkpointing", False),
                layer=LayerOptions.of(m), tie_embeddings=m.tie_embeddings, embed_scale=m.embedding_scale(),
                rope_local_theta=m.local_rope_theta(), local_layers=local)


GPTArgs = LMArgs  # gpt's args are the shape alone


@dataclass(frozen=True, kw_only=True)
class HuginnArgs(LMArgs):
    kind: str = "huginn"
    n_prelude: int = 0
    n_coda: int = 0
    mean_recurrence: int = 32  # the training recurrence's mean (Poisson-log-normal draw)
    backprop_depth: int = 8  # gradients through the last k iterations
    limits: IterationLimits  # the kind's K rule (`Kind.iteration_limits`)

    @classmethod
    def from_config(cls, cfg, vocab_size: int):
        m = cfg.model
        return cls(**_lm_fields(cfg, vocab_size), n_prelude=m.n_prelude, n_coda=m.n_coda,
                   mean_recurrence=m.mean_recurrence, backprop_depth=m.backprop_depth,
                   limits=kind_of(cfg).iteration_limits(cfg))


@dataclass(frozen=True, kw_only=True)
class DBArgs(LMArgs):
    """db_ar (B untied blocks) and looped_db (one weight-tied core): `diffusion:` of TokenDiffusion /
    DbArDiffusion (docs in kinds/sections.py)."""

    kind: str = "db_ar"
    # layout
    n_prelude: int = 0
    n_coda: int = 0
    block_layers: tuple[int, ...]  # the layers of each block, block 0 (highest noise) first
    context: str = "independent"  # or stacked: the clean stream runs through the blocks in stack_order
    stack_order: str = "high_noise_first"
    # noise, partition and the chain's grid
    schedule: NoiseSchedule = NoiseSchedule()
    partition: str = "equi_probability"
    overlap: float = 0.1
    sample_top_quantile: float = 0.999
    last_call: str = "sigma_min"
    extra_calls: str = "block0"  # the language models' default (diffusion.extra_calls); images spread
    # the noisy slot
    parameterization: str = "likelihood"
    noisy_self: bool = False
    noisy_input: str = "prev_token"
    posterior_input: str = "full"
    posterior_topk: int = 64
    head: str = "tied"
    target_scale: str = "unit"
    # the objective
    blocks_to_train: tuple[int, ...] = ()  # () = every block
    block_sampling: str = "network_gain"
    block_weights: tuple[float, ...] = ()
    loss_weight: str = "none"
    top_share: float = 0.0
    target_fraction: float = 1.0
    denoise_weight: float = 1.0
    clean_lm_weight: float = 0.0
    limits: IterationLimits

    @property
    def num_blocks(self) -> int:
        return len(self.block_layers)

    @classmethod
    def from_config(cls, cfg, vocab_size: int):
        m, d, kind = cfg.model, cfg.diffusion, kind_of(cfg)
        return cls(**_lm_fields(cfg, vocab_size), n_prelude=m.n_prelude, n_coda=m.n_coda,
                   block_layers=tuple(kind.block_layers(cfg)),
                   context=getattr(d, "context", "independent"),  # looped_db: one core, nothing to stack
                   stack_order=getattr(d, "stack_order", "high_noise_first"),
                   schedule=NoiseSchedule.of(d),
                   partition=d.partition, overlap=d.overlap, sample_top_quantile=d.sample_top_quantile,
                   last_call=d.last_call, extra_calls=d.extra_calls, parameterization=d.parameterization, noisy_self=d.noisy_self,
                   noisy_input=d.noisy_input, posterior_input=d.posterior_input, posterior_topk=d.posterior_topk,
                   head=d.head, target_scale=d.target_scale, blocks_to_train=tuple(d.blocks_to_train),
                   block_sampling=d.block_sampling, block_weights=tuple(d.block_weights), loss_weight=d.loss_weight,
                   top_share=d.top_share, target_fraction=d.target_fraction, denoise_weight=d.denoise_weight,
                   clean_lm_weight=d.clean_lm_weight, limits=kind.iteration_limits(cfg))


# --- the supporting modules -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModuleArgs:
    """What vit, dit and mdm share: the shape and the blocks (`model:` and `diffusion:` of the modules)."""

    kind: str
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    ffn_hidden: int = 0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    end_to_end: bool = False  # one block of every layer over the whole range (the baseline)
    num_blocks: int = 4
    overlap: float = 0.1
    block_sampling: str = "uniform"
    block_weights: tuple[float, ...] = ()
    blocks_to_train: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg, vocab_size: int = 0):
        return cls(**_module_fields(cfg))


def _module_fields(cfg) -> dict:
    m, d = cfg.model, cfg.diffusion
    return dict(kind=m.kind, n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, ffn_hidden=m.ffn_hidden,
                norm_eps=m.norm_eps, init_std=m.init_std, end_to_end=m.end_to_end, num_blocks=d.num_blocks,
                overlap=d.overlap, block_sampling=d.block_sampling, block_weights=tuple(d.block_weights),
                blocks_to_train=tuple(d.blocks_to_train))


def _image_fields(cfg) -> dict:
    m, d = cfg.model, cfg.diffusion
    return dict(image_size=m.image_size, channels=m.channels, patch=m.patch, num_classes=m.num_classes,
                schedule=NoiseSchedule.of(d),
                partition=d.partition, sample_top_quantile=d.sample_top_quantile, last_call=d.last_call,
                extra_calls=d.extra_calls)


@dataclass(frozen=True, kw_only=True)
class ImageArgs(ModuleArgs):
    image_size: int = 32
    channels: int = 3
    patch: int = 4
    num_classes: int = 10
    schedule: NoiseSchedule = NoiseSchedule()
    partition: str = "equi_probability"
    sample_top_quantile: float = 0.999
    last_call: str = "sigma_min"
    extra_calls: str = "spread"


@dataclass(frozen=True, kw_only=True)
class VitArgs(ImageArgs):
    kind: str = "vit"
    label_table: str = "fixed"
    parameterization: str = "likelihood"
    loss_weight: str = "none"
    bridge: str = "sample"
    num_iterations: int = 0  # default K; 0 = num_blocks

    @classmethod
    def from_config(cls, cfg, vocab_size: int = 0):
        d = cfg.diffusion
        return cls(**_module_fields(cfg), **_image_fields(cfg), label_table=cfg.model.label_table,
                   parameterization=d.parameterization, loss_weight=d.loss_weight, bridge=d.bridge,
                   num_iterations=d.num_iterations)


@dataclass(frozen=True, kw_only=True)
class DitArgs(ImageArgs):
    kind: str = "dit"
    label_dropout: float = 0.1
    cfg_scale: float = 2.0
    sample_steps: int = 0  # 0 = 50
    clip_samples: bool = True  # pixels are in [-1, 1]; latents (data.source latents) are not bounded

    @classmethod
    def from_config(cls, cfg, vocab_size: int = 0):
        d = cfg.diffusion
        return cls(**_module_fields(cfg), **_image_fields(cfg), label_dropout=d.label_dropout, cfg_scale=d.cfg_scale,
                   sample_steps=d.sample_steps, clip_samples=cfg.data.source != "latents")


@dataclass(frozen=True, kw_only=True)
class MdmArgs(ModuleArgs):
    kind: str = "mdm"
    seq_len: int = 256
    rope_theta: float = 10000.0
    schedule: str = "linear"  # the masking schedule alpha(t)
    sample_steps: int = 0  # 0 = the sample's length

    @classmethod
    def from_config(cls, cfg, vocab_size: int = 0):
        m, d = cfg.model, cfg.diffusion
        return cls(**_module_fields(cfg), seq_len=m.seq_len, rope_theta=m.rope_theta, schedule=d.schedule,
                   sample_steps=d.sample_steps)


# --- building ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfigArgs:
    """The args of a kind that defines none (`Kind.args` unset: an out-of-tree kind): its builder takes the
    run config and the vocabulary, as every builder did before args."""

    kind: str
    cfg: Any = field(repr=False)
    vocab_size: int


def network_args(cfg, vocab_size: int):
    """The run config's network args, built once by its kind (`Kind.model_args`)."""
    kind = kind_of(cfg)
    return kind.model_args(cfg, vocab_size) or RunConfigArgs(kind.name, cfg, vocab_size)


def build_network(args, state: dict | None = None):
    """The network of `args` (`state`: the model metadata a checkpoint saved, e.g. block edges)."""
    builder = resolve(get_kind(args.kind).builder)
    if not isinstance(args, RunConfigArgs):
        return builder(args, state)
    model, cfg = builder(args.cfg, args.vocab_size, state), args.cfg
    layer_types = getattr(cfg.model, "layer_types", None)
    if layer_types:  # Gemma 3's local layers, placed by the kind's layer plan as the built-in kinds' args place them
        mark_local_layers(model, get_kind(args.kind).source_layers(cfg, len(layer_types)), layer_types,
                          cfg.model.sliding_window)
    return model


def lora_rank(cfg) -> int:
    """train.lora_rank: adapters on a frozen base, attached wherever a model is built (`build_model`)."""
    return cfg.train.lora_rank


def args_from_dict(raw: dict, vocab_size: int):
    """An exported run config (a manifest's or an HF config's `looped_lm_config`) -> its network args."""
    return network_args(config_from_dict(raw), vocab_size)
