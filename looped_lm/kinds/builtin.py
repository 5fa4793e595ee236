"""The kinds that ship with looped_lm: four language models and the paper's three supporting modules.

    gpt        Llama-style decoder, end-to-end next-token CE (the baseline)
    db_ar      DiffusionBlocks AR LM: B untied two-stream blocks, one trained per step
    looped_db  recurrent depth: prelude -> one weight-tied two-stream core -> coda, one forward per step
    huginn     recurrent depth trained with truncated BPTT (the looped baseline)
    vit / dit / mdm   ViT classifier, DiT image denoiser, MD4 masked diffusion over characters
"""

from __future__ import annotations

from looped_lm import cost
from looped_lm.errors import UserError
from looped_lm.kinds.base import IterationLimits, Kind, ensure
from looped_lm.kinds.sections import (DbArDiffusion, DbArSection, DitDiffusion, DitSection, GptSection, HuginnSection,
                                      LoopedDbSection, MdmDiffusion, MdmSection, TokenDiffusion, VitDiffusion,
                                      VitSection)


# --- the cost model's shapes of a config (MFU on the log line) ------------------------------------------
def _cost_shape(cfg, vocab_size: int, batch: int):
    m = cfg.model
    return cost.Shape(d=m.d_model, layers=m.n_layers, heads=m.n_heads, vocab=vocab_size, seq=m.seq_len, batch=batch,
                      ffn=m.ffn_hidden, prelude=getattr(m, "n_prelude", 0), coda=getattr(m, "n_coda", 0))


def _db_layout(cfg, blocks: int):
    m, d = cfg.model, cfg.diffusion
    return cost.DBLayout(
        blocks=blocks, denoise=d.denoise_weight > 0, target_fraction=d.target_fraction,
        parameterization=d.parameterization,
        noisy_self=d.noisy_self, loss_chunk=m.loss_chunk, clean_lm=d.clean_lm_weight > 0,
        fold_likelihood=d.head == "cosine" and d.parameterization == "likelihood",
        posterior={"full": "full", "detached": "no_grad", "topk": "topk"}[d.posterior_input], topk=d.posterior_topk,
        layers_per_block=tuple(d.layers_per_block) if isinstance(d, DbArDiffusion) and isinstance(d.layers_per_block,
                                                                                                   list) else (),
        stack_order=_stack_order(cfg, blocks))


def _stack_order(cfg, blocks: int) -> tuple[int, ...]:
    """context stacked: the blocks in the order the clean stream runs through them; () otherwise."""
    d = cfg.diffusion
    if not isinstance(d, DbArDiffusion) or d.context != "stacked" or blocks < 2:
        return ()
    return tuple(range(blocks))[::-1] if d.stack_order == "low_noise_first" else tuple(range(blocks))


def _compile_block_loss(model, backend: str) -> bool:
    """DB kinds: the loss of the block the host chose (`BlockObjective.block_loss`): one graph per block, and
    the step number never enters it."""
    from looped_lm.compile import compile_graphs  # imports torch: seconds at start-up

    model.objective.block_loss = compile_graphs(model.objective.block_loss, len(model.objective.net.train_ranges), backend)
    return True


# --- kinds -------------------------------------------------------------------------------------------
_LM = frozenset({"language_model", "init_from", "lora"})


class Gpt(Kind):
    name, section, builder = "gpt", GptSection, "looped_lm.models.gpt:build"
    args = "looped_lm.models.args:GPTArgs"
    summary = "Llama-style decoder (RMSNorm, RoPE, SwiGLU, tied head), end-to-end next-token CE"
    capabilities = _LM | {"activation_checkpointing", "export_llama", "export_native", "vllm"}

    def source_n_layers(self, model: dict, n_source: int) -> int | None:
        return n_source

    def source_layers(self, cfg, n_source: int) -> dict[str, list]:
        if cfg.model.n_layers != n_source:
            raise UserError(f"model.n_layers is {cfg.model.n_layers} but model.init_from has {n_source} layers (gpt "
                            "takes all of them)")
        return {"layers": list(range(n_source))}

    def lora_layers(self, cfg) -> tuple[list[str], bool]:
        return [r"layers"], True

    def step_flops(self, cfg, vocab_size: int, batch: int, key=None, frozen=()) -> float:
        return cost.gpt_train(_cost_shape(cfg, vocab_size, batch), cfg.model.loss_chunk).total(frozen=frozen)

    def compile_for_training(self, model, backend: str) -> bool:
        import torch  # torch: seconds at start-up

        model.training_loss = torch.compile(model.training_loss, backend=backend, dynamic=False)
        return True


class DbAr(Kind):
    name, section, diffusion, builder = "db_ar", DbArSection, DbArDiffusion, "looped_lm.models.db:build"
    args = "looped_lm.models.args:DBArgs"
    summary = "DiffusionBlocks AR LM: B untied two-stream blocks, one trained per step (docs/method.md)"
    capabilities = _LM | {"activation_checkpointing", "iterative", "block_jobs", "merge", "block_parallel",
                          "stacked_context", "layer_split",
                          "partition_edges", "export_native", "vllm", "estimated_ppl"}

    def num_blocks(self, cfg) -> int:
        return cfg.diffusion.num_blocks

    def block_layers(self, cfg) -> list[int]:
        m, d = cfg.model, cfg.diffusion
        if isinstance(d.layers_per_block, list) and d.layers_per_block:
            return list(d.layers_per_block)
        per = d.layers_per_block or m.n_layers // d.num_blocks
        return [per] * (m.n_layers // per)

    def iteration_limits(self, cfg) -> IterationLimits:
        return _db_limits(cfg, self.num_blocks(cfg))

    def resolve(self, cfg) -> dict:
        blocks = _blocks_of_layers_per_block(cfg)  # checks num_blocks and layers_per_block against n_layers
        return {"diffusion": {"num_blocks": blocks}} if cfg.diffusion.layers_per_block not in (0, []) else {}

    def validate(self, cfg) -> None:
        _check_prelude_coda(cfg)
        d = cfg.diffusion
        ensure(d.denoise_weight > 0 or d.context == "stacked" or d.num_blocks == 1,
               "diffusion.denoise_weight 0 needs diffusion.context stacked: each block continues the frozen blocks "
               "before it, and the whole stack's clean stream is the model a clean readout scores")
        ensure(cfg.diffusion.context != "stacked" or not cfg.diffusion.blocks_to_train,
               "diffusion.context stacked cannot train independent block jobs (diffusion.blocks_to_train): block "
               "b's clean stream runs blocks < b's current weights, so a block trained apart would read stale "
               "ones; train every block in one run (train.mode data_parallel or block_parallel)")

    def source_n_layers(self, model: dict, n_source: int) -> int | None:
        return n_source - int(model.get("n_prelude") or 0) - int(model.get("n_coda") or 0)

    def source_layers(self, cfg, n_source: int) -> dict[str, list]:
        m, d = cfg.model, cfg.diffusion
        if m.n_prelude + m.n_layers + m.n_coda != n_source:
            raise UserError(f"model.init_from has {n_source} layers, but db_ar's model.n_prelude ({m.n_prelude}) + "
                            f"model.n_layers ({m.n_layers}) + model.n_coda ({m.n_coda}) = "
                            f"{m.n_prelude + m.n_layers + m.n_coda}: every source layer needs a place")
        # the blocks take the source's layers in the order the clean stream runs through them: block 0
        # first, unless context stacked with stack_order low_noise_first (block B-1 first, block 0 last)
        depths = self.block_layers(cfg)
        order = list(range(len(depths)))
        if d.context == "stacked" and d.stack_order == "low_noise_first" and len(depths) > 1:
            order.reverse()
        blocks, start = [[] for _ in depths], m.n_prelude
        for b in order:
            blocks[b] = list(range(start, start + depths[b]))
            start += depths[b]
        return {"prelude": list(range(m.n_prelude)), "blocks": blocks,
                "coda": list(range(n_source - m.n_coda, n_source))}

    def lora_layers(self, cfg) -> tuple[list[str], bool]:
        return _block_lora_layers(cfg, self.num_blocks(cfg))

    def step_flops(self, cfg, vocab_size: int, batch: int, key=None, frozen=()) -> float:
        return cost.db_train(_cost_shape(cfg, vocab_size, batch), _db_layout(cfg, self.num_blocks(cfg)), key or 0).total(frozen=frozen)

    def curve_flops(self, cfg, vocab_size: int, batch: int) -> float:
        return cost.db_curve(_cost_shape(cfg, vocab_size, batch), _db_layout(cfg, self.num_blocks(cfg))).total()

    def compile_for_training(self, model, backend: str) -> bool:
        return _compile_block_loss(model, backend)


class LoopedDb(Kind):
    name, section, diffusion, builder = "looped_db", LoopedDbSection, TokenDiffusion, "looped_lm.models.db:build"
    args = "looped_lm.models.args:DBArgs"
    summary = "recurrent depth: prelude -> one weight-tied two-stream core -> coda, one forward pass per step"
    capabilities = _LM | {"activation_checkpointing", "iterative", "partition_edges", "export_native", "vllm",
                          "estimated_ppl"}

    def iteration_limits(self, cfg) -> IterationLimits:
        return _db_limits(cfg, 1)

    def validate(self, cfg) -> None:
        _check_prelude_coda(cfg)
        ensure(cfg.diffusion.num_blocks == 1, f"looped_db has one weight-tied core: diffusion.num_blocks must be 1 "
                                              f"(got {cfg.diffusion.num_blocks})")

    def source_layers(self, cfg, n_source: int) -> dict[str, list]:
        prelude, core, coda = _retrofit(cfg, n_source)
        return {"prelude": prelude, "blocks": [core], "coda": coda}

    def lora_layers(self, cfg) -> tuple[list[str], bool]:
        return _block_lora_layers(cfg, 1)

    def step_flops(self, cfg, vocab_size: int, batch: int, key=None, frozen=()) -> float:
        return cost.db_train(_cost_shape(cfg, vocab_size, batch), _db_layout(cfg, 1), 0).total(frozen=frozen)

    def curve_flops(self, cfg, vocab_size: int, batch: int) -> float:
        return cost.db_curve(_cost_shape(cfg, vocab_size, batch), _db_layout(cfg, 1)).total()

    def compile_for_training(self, model, backend: str) -> bool:
        return _compile_block_loss(model, backend)


class Huginn(Kind):
    name, section, builder = "huginn", HuginnSection, "looped_lm.models.huginn:build"
    args = "looped_lm.models.args:HuginnArgs"
    summary = "recurrent depth, Huginn-style: prelude -> core x r -> coda, truncated BPTT (r = 32, k = 8)"
    capabilities = _LM | {"activation_checkpointing", "iterative"}

    def iteration_limits(self, cfg) -> IterationLimits:
        m = cfg.model  # K defaults to the recurrence it trained at
        return IterationLimits(default_iterations=m.num_iterations or m.mean_recurrence,
                               max_iterations=m.max_iterations, num_blocks=1, default_bridge=None, adaptive_exit=False)

    def validate(self, cfg) -> None:
        m = cfg.model
        _check_prelude_coda(cfg)
        ensure(m.mean_recurrence >= 1, f"model.mean_recurrence must be >= 1 (got {m.mean_recurrence})")
        ensure(m.backprop_depth >= 1, f"model.backprop_depth must be >= 1 (got {m.backprop_depth})")
        ensure(m.backprop_depth <= m.mean_recurrence or m.allow_full_backprop,
               f"model.backprop_depth ({m.backprop_depth}) exceeds model.mean_recurrence ({m.mean_recurrence});"
               " set model.allow_full_backprop: true if that is intended")
        ensure(0 <= m.num_iterations <= m.max_iterations, f"model.num_iterations must be in 0..model.max_iterations "
               f"({m.max_iterations}) (got {m.num_iterations})")

    def source_layers(self, cfg, n_source: int) -> dict[str, list]:
        prelude, core, coda = _retrofit(cfg, n_source)
        return {"prelude": prelude, "core": core, "coda": coda}

    def step_flops(self, cfg, vocab_size: int, batch: int, key=None, frozen=()) -> float:
        """key: the step's recurrence r (drawn on the host; the mean before it is known)."""
        r = key or cfg.model.mean_recurrence
        return cost.huginn_train(_cost_shape(cfg, vocab_size, batch), r, cfg.model.backprop_depth).total(frozen=frozen)

    def compile_for_training(self, model, backend: str) -> bool:
        """Each layer: the loss loops over a recurrence r drawn on the host each step (a whole-loss graph
        would be one graph per r); the core layer is one graph every iteration reuses."""
        for stack in (model.prelude, model.core, model.coda):
            for layer in stack:
                layer.compile(backend=backend, dynamic=False)
        return True

    def lora_layers(self, cfg) -> tuple[list[str], bool]:
        return [r"prelude", r"core", r"coda"], True


def _db_limits(cfg, num_blocks: int) -> IterationLimits:
    """DiffusionBlocks LMs: K defaults to diffusion.num_iterations, else one call per block."""
    d = cfg.diffusion
    return IterationLimits(default_iterations=d.num_iterations or num_blocks, max_iterations=cfg.model.max_iterations,
                           num_blocks=num_blocks, default_bridge=d.bridge, adaptive_exit=True,
                           extra_calls=d.extra_calls)


def _retrofit(cfg, n_source: int) -> tuple[list[int], list[int], list[int]]:
    """Retrofitted recurrence: the source's first n_prelude layers, a core of n_layers from
    model.init_core_start (default: right after the prelude) and its last n_coda layers."""
    m = cfg.model
    start = m.n_prelude if m.init_core_start < 0 else m.init_core_start
    core = list(range(start, start + m.n_layers))
    if m.n_prelude + m.n_coda + m.n_layers > n_source or start < m.n_prelude or core[-1] >= n_source - m.n_coda:
        raise UserError(f"model.init_from has {n_source} layers: prelude 0..{m.n_prelude - 1}, core {start}.."
                        f"{start + m.n_layers - 1} (model.init_core_start, model.n_layers) and the last "
                        f"{m.n_coda} as coda do not fit in it without overlap")
    return list(range(m.n_prelude)), core, list(range(n_source - m.n_coda, n_source))


def _block_lora_layers(cfg, num_blocks: int) -> tuple[list[str], bool]:
    """The owned blocks' layers; the prelude and coda only for a job that owns every block."""
    owned = cfg.diffusion.trained_blocks()
    shared = not cfg.diffusion.blocks_to_train
    return [rf"blocks\.{b}" for b in owned] + ([r"prelude", r"coda"] if shared else []), shared


def _check_prelude_coda(cfg) -> None:
    m = cfg.model
    for key in ("n_prelude", "n_coda"):
        ensure(getattr(m, key) >= 0, f"model.{key} must be >= 0 (got {getattr(m, key)})")
    ensure(m.max_iterations >= 1, f"model.max_iterations must be >= 1 (got {m.max_iterations})")


def _blocks_of_layers_per_block(cfg) -> int:
    """db_ar: diffusion.layers_per_block checked against model.n_layers, and the block count it implies (a
    num_blocks given in the same config must agree)."""
    m, d = cfg.model, cfg.diffusion
    lpb = d.layers_per_block
    if lpb in (0, []):
        ensure(m.n_layers % d.num_blocks == 0,
               f"diffusion.num_blocks ({d.num_blocks}) must divide model.n_layers ({m.n_layers})")
        return d.num_blocks
    if isinstance(lpb, list):
        ensure(all(n >= 1 for n in lpb), f"diffusion.layers_per_block must list counts >= 1 (got {lpb})")
        ensure(sum(lpb) == m.n_layers, f"diffusion.layers_per_block {lpb} sums to {sum(lpb)}, but model.n_layers "
                                       f"is {m.n_layers}")
        blocks = len(lpb)
    else:
        ensure(lpb >= 1, f"diffusion.layers_per_block must be >= 1, a list, or 0 for n_layers / num_blocks (got {lpb})")
        ensure(m.n_layers % lpb == 0, f"diffusion.layers_per_block ({lpb}) must divide model.n_layers ({m.n_layers})")
        blocks = m.n_layers // lpb
    if "num_blocks" in d.model_fields_set and d.num_blocks != blocks:
        raise UserError(f"diffusion.num_blocks ({d.num_blocks}) contradicts diffusion.layers_per_block {lpb!r} "
                        f"({blocks} blocks); give one of them")
    return blocks


IMAGE_SOURCES = {"digits": "", "cifar10": "the python-pickle archive or its folder",
                 "cifar100": "the python-pickle archive or its folder"}


class _Module(Kind):
    """The supporting modules (method.md §7): blocks over their own noise (or masking) range, their own
    data, evaluated by accuracy, Fréchet distance or bits per character; not language models."""

    capabilities = frozenset({"block_jobs", "autocast"})
    prepare = "looped_lm.data.batches:prepare_module_data"
    step_fields: tuple[str, ...] = ()  # its diffusion section's default step counts (vit: K, dit / mdm: steps)

    def num_blocks(self, cfg) -> int:
        return 1 if cfg.model.end_to_end else cfg.diffusion.num_blocks

    def validate(self, cfg) -> None:
        m, d = cfg.model, cfg.diffusion
        if not m.end_to_end:
            ensure(d.num_blocks <= m.n_layers, f"diffusion.num_blocks ({d.num_blocks}) is larger than model.n_layers "
                   f"({m.n_layers}): every block needs at least one layer")
            ensure(m.n_layers % d.num_blocks == 0,
                   f"diffusion.num_blocks ({d.num_blocks}) must divide model.n_layers ({m.n_layers})")
        blocks = self.num_blocks(cfg)
        for key in self.step_fields:  # a default step count: at least one step per block
            steps = getattr(d, key)
            ensure(not steps or steps >= blocks, f"diffusion.{key} ({steps}) must be >= the number of blocks "
                   f"({blocks}): {self.name} runs at least one step per block")


class _ImageModule(_Module):
    batches = "looped_lm.data.batches:image_batches"

    def vocab(self, cfg) -> tuple[int, str]:
        return cfg.model.num_classes, "none"

    def validate(self, cfg) -> None:
        super().validate(cfg)
        m = cfg.model
        for key in ("image_size", "channels", "patch"):
            ensure(getattr(m, key) >= 1, f"model.{key} must be >= 1 (got {getattr(m, key)})")
        ensure(m.image_size % m.patch == 0, f"model.image_size ({m.image_size}) is not divisible by model.patch "
               f"({m.patch})")


class Vit(_ImageModule):
    name, section, diffusion, builder = "vit", VitSection, VitDiffusion, "looped_lm.models.vit:build"
    args = "looped_lm.models.args:VitArgs"
    summary = "supporting module: ViT classifier (the noisy label denoised block by block)"
    data_sources = IMAGE_SOURCES
    step_fields = ("num_iterations",)

    def validate(self, cfg) -> None:
        super().validate(cfg)
        ensure(cfg.model.num_classes >= 2, f"model.num_classes must be >= 2 for vit (got {cfg.model.num_classes})")


class Dit(_ImageModule):
    name, section, diffusion, builder = "dit", DitSection, DitDiffusion, "looped_lm.models.dit:build"
    args = "looped_lm.models.args:DitArgs"
    summary = "supporting module: DiT image / latent denoiser with classifier-free guidance"
    data_sources = {**IMAGE_SOURCES, "latents": "the directory `looped_lm prepare --vae` wrote"}
    step_fields = ("sample_steps",)
    unconditional = True  # model.num_classes 0 is allowed: the data's labels are ignored

    def validate(self, cfg) -> None:
        super().validate(cfg)
        ensure(cfg.model.num_classes >= 0, f"model.num_classes must be >= 0 for dit, 0 = unconditional (got "
               f"{cfg.model.num_classes})")


class Mdm(_Module):
    name, section, diffusion, builder = "mdm", MdmSection, MdmDiffusion, "looped_lm.models.mdm:build"
    args = "looped_lm.models.args:MdmArgs"
    summary = "supporting module: MD4 masked diffusion over characters (text8's alphabet)"
    data_sources = {"bible": "", "text8": "the text8 file"}
    step_fields = ("sample_steps",)
    batches = "looped_lm.data.batches:char_batches"

    def vocab(self, cfg) -> tuple[int, str]:
        return 27, "text8"  # text8's alphabet: a-z and space (looped_lm.data.text8.VOCAB_SIZE)


BUILTIN = (Gpt(), DbAr(), LoopedDb(), Huginn(), Vit(), Dit(), Mdm())
