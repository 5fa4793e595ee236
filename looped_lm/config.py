"""Typed run configuration, loaded from YAML and validated before anything is built.

One YAML file per run, with the sections below. Every field has a type, a default and a one-line
reason (its pydantic `description`, printed by `looped_lm train --help-config` and pasted into
configs/README.md by `python -m looped_lm.config`). Unknown keys, wrong types, repeated keys and
impossible values raise `UserError` naming the key, so a bad run fails in its first second.

    model:      what network to build (language models; vit / dit / mdm: the supporting modules)
    diffusion:  DiffusionBlocks noise schedule, partition, training and sampling knobs
    data:       where tokens (images, characters) come from
    train:      optimisation, logging, checkpoints
    deepspeed:  ZeRO stage and precision
    eval:       perplexity protocol
"""

from __future__ import annotations

import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from looped_lm.errors import UserError


def _number_from_text(value):
    """YAML 1.1 reads `3e-4` (no dot) as a string: accept it where a number is expected."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _text_from_number(value):
    """`--set train.out_dir=2024` arrives as an int: a string field takes it as written."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


Float = Annotated[float, BeforeValidator(_number_from_text)]
Str = Annotated[str, BeforeValidator(_text_from_number)]


def _f(default, doc: str):
    """A field with a one-line doc (its description)."""
    if isinstance(default, list):
        return Field(default_factory=lambda: list(default), description=doc)
    return Field(default, description=doc)


class _Section(BaseModel):
    # strict: no silent int->bool or "1"->1; ints are still taken where floats are expected
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


MODEL_KINDS = ("gpt", "db_ar", "looped_db", "huginn", "vit", "dit", "mdm")
LORA_TARGETS = ("qkv", "proj", "gate_up", "down")  # the Linears of a layer that train.lora_targets may name
MODULE_KINDS = ("vit", "dit", "mdm")  # the supporting modules: not language models (method.md §7)
# which data.source each module reads (the language models read the others)
MODULE_SOURCES = {"vit": ("digits", "cifar10", "cifar100"), "dit": ("digits", "cifar10", "cifar100", "latents"),
                  "mdm": ("bible", "text8")}
# the choices of each choice field
ModelKind = Literal["gpt", "db_ar", "looped_db", "huginn", "vit", "dit", "mdm"]
Partition = Literal["equi_probability", "uniform"]
Parameterization = Literal["edm", "likelihood"]
NoisyInput = Literal["noise", "prev_token"]
PosteriorInput = Literal["full", "detached", "topk"]
Head = Literal["tied", "cosine"]
LossWeight = Literal["none", "edm", "batch_mean"]
TargetScale = Literal["unit", "sigma_data"]
BlockSampling = Literal["uniform", "round_robin", "loss_share"]
Bridge = Literal["soft", "hard", "sample"]
LastCall = Literal["edge", "sigma_min"]
Context = Literal["independent", "stacked"]
StackOrder = Literal["high_noise_first", "low_noise_first"]
Source = Literal["bible", "shakespeare", "files", "hf", "bin", "digits", "cifar10", "cifar100", "text8", "latents"]
MaskSchedule = Literal["linear", "cosine"]
Tokenizer = Literal["gpt2", "byte"]
ResumeChanges = Literal["refuse", "allow"]
TrainMode = Literal["data_parallel", "block_parallel"]


class ModelConfig(_Section):
    kind: ModelKind = _f("gpt", "gpt (end-to-end), db_ar (DiffusionBlocks AR), looped_db, huginn; supporting "
                         "modules: vit (classifier), dit (image denoiser), mdm (masked diffusion over characters)")
    n_layers: int = _f(4, "decoder layers (db_ar: split into diffusion.num_blocks blocks; looped: the core)")
    d_model: int = _f(128, "residual width")
    n_heads: int = _f(4, "attention heads (d_model must divide by it)")
    seq_len: int = _f(256, "training context length in tokens")
    vocab_size: int = _f(0, "0 = the tokenizer's size; larger pads the embedding (e.g. 50304 for speed)")
    ffn_hidden: int = _f(0, "SwiGLU hidden width; 0 = 8/3 * d_model rounded up to a multiple of 64")
    rope_theta: Float = _f(10000.0, "RoPE base")
    norm_eps: Float = _f(1e-5, "RMSNorm epsilon")
    init_std: Float = _f(0.02, "std of the normal init of linear and embedding weights")
    n_prelude: int = _f(0, "shared clean-stream layers before the blocks / core (looped models: 2)")
    n_coda: int = _f(0, "shared layers after the blocks / core (looped models: 2)")
    mean_recurrence: int = _f(32, "huginn: mean of the Poisson-log-normal iteration count r")
    backprop_depth: int = _f(8, "huginn: gradients flow through the last k iterations only")
    allow_full_backprop: bool = _f(False, "huginn: allow backprop_depth > mean_recurrence")
    loss_chunk: int = _f(0, "training: head + CE in chunks of this many positions, recomputed in backward, so "
                         "the (tokens, vocab) logits are never stored (0 = off; e.g. 128 with a 50257 vocab)")
    activation_checkpointing: bool = _f(False, "gpt: recompute each layer in backward instead of storing its "
                                        "activations (the end-to-end alternative to DiffusionBlocks' memory)")
    max_iterations: int = _f(64, "looped models: the largest K accepted at inference")
    end_to_end: bool = _f(False, "vit / dit / mdm: the same network trained end-to-end over the whole noise range "
                          "(the baseline), instead of diffusion.num_blocks blocks")
    image_size: int = _f(32, "vit / dit: side of the (square) images or latents; must match the data")
    channels: int = _f(3, "vit / dit: image (or latent) channels; must match the data")
    patch: int = _f(4, "vit / dit: patch side; image_size must divide by it (the paper: vit 4, dit 2)")
    num_classes: int = _f(10, "vit: classes; dit: classes it is conditioned on (0 = unconditional); must match "
                          "the data")
    init_from: Str = _f("", "a local Hugging Face directory (config.json + safetensors) of LlamaForCausalLM / "
                        "MistralForCausalLM, or a `looped_lm export` of a gpt: a fresh run starts from its weights "
                        "(docs/pretrained.md); '' = random init")
    init_core_start: int = _f(-1, "init_from, looped_db / huginn: the first source layer of the core; -1 = right "
                              "after the prelude")


class DiffusionConfig(_Section):
    num_blocks: int = _f(4, "B: blocks that each own one interval of noise levels")
    layers_per_block: int | list[int] = _f(0, "db_ar: the layers of each block, instead of num_blocks: N (every block N "
                                           "deep, num_blocks = n_layers / N) or one count per block from block 0 "
                                           "(highest noise) down, e.g. [3, 1]; 0 = n_layers / num_blocks each")
    partition: Partition = _f("equi_probability", "block edges: equal noise mass (equi_probability) or equal ln-width")
    curve_every: int = _f(200, "block_sampling loss_share: re-measure held-out CE(sigma) every N steps")
    curve_until: int = _f(0, "stop re-measuring (freeze the block shares) after this step; 0 = never")
    context: Context = _f("independent", "db_ar: where block b's clean stream starts: the embedding (independent, the "
                          "paper: a prediction has the context depth of one block) or the clean states of "
                          "blocks < b, run forward without gradient (stacked: the depth of every block up to "
                          "b; a step still backpropagates through one block; no independent block jobs)")
    stack_order: StackOrder = _f("high_noise_first", "context stacked: the order the clean stream runs through the "
                                 "blocks: block 0 (highest noise, the first call of every chain) first and so "
                                 "shallowest, or the lowest-noise block first, so block 0 has the depth of all")
    parameterization: Parameterization = _f("likelihood", "how a noisy slot reads z: edm (paper: c_in*z in, c_skip*z skip) or likelihood "
                               "(z's exact token log-likelihood <z,y_v>/sigma^2 added to the logits, and its "
                               "posterior-mean embedding as input: the network models only what context adds)")
    noisy_self: bool = _f(False, "a noisy slot attends its own key besides the clean keys (paper); false: clean "
                          "keys only, plain causal attention (flash), and servable by vLLM's paged attention")
    noisy_input: NoisyInput = _f("prev_token", "noisy slot input: what it reads of z alone (noise), or that + E[previous token] (prev_token)")
    posterior_input: PosteriorInput = _f("full", "likelihood: the slot's input embedding softmax(<z,y>/sigma^2) @ E "
                                         "with a gradient into E (full), without one (detached: one V-sized "
                                         "product less in backward), or from its top posterior_topk tokens "
                                         "plus the rest's mass on the other rows' mean (topk, also forward-only)")
    posterior_topk: int = _f(64, "posterior_input topk: tokens whose embeddings enter exactly")
    head: Head = _f("tied", "output head: tied (RMSNorm then the embedding table) or cosine (a learned scale times "
                    "the cosine to the unit-norm targets; with the likelihood layout its log-likelihood term is "
                    "folded into the same product)")
    clean_lm_weight: Float = _f(0.0, "weight of a next-token CE on each block's clean stream, added to the loss")
    overlap: Float = _f(0.1, "gamma: each block trains on its interval widened by this share of its ln-width")
    p_mean: Float = _f(-1.2, "mean of ln(sigma) for training noise")
    p_std: Float = _f(1.2, "std of ln(sigma) for training noise")
    sigma_min: Float = _f(0.002, "lowest noise level")
    sigma_max: Float = _f(80.0, "highest noise level")
    sigma_data: Float = _f(0.5, "EDM sigma_data")
    loss_weight: LossWeight = _f("none", "CE weight per sample: none, edm (normalised w(sigma)) or batch_mean")
    target_scale: TargetScale = _f("unit", "noisy targets are unit-norm embeddings (unit) or per-dim RMS sigma_data")
    target_fraction: Float = _f(1.0, "share of noisy slots trained per sequence (clean stream stays whole)")
    blocks_to_train: list[int] = _f([], "train only these blocks (others frozen, no optimiser state; the checkpoint "
                                    "records them, and `looped_lm merge` joins such jobs); [] = all")
    block_sampling: BlockSampling = _f("loss_share", "which block a step trains: uniform (paper), round_robin, or loss_share "
                             "(in proportion to each block's share of the CE drop); train.mode block_parallel: "
                             "which of its own blocks a rank trains (uniform or round_robin)")
    bridge: Bridge = _f("sample", "logits -> denoised embedding between steps: soft (expectation), hard (argmax), "
                     "or sample (a token drawn from the logits)")
    num_iterations: int = _f(0, "default K denoising steps per token at inference; 0 = num_blocks")
    last_call: LastCall = _f("sigma_min", "where a K-step chain's last call runs: the last Euler grid point above sigma_min "
                        "(edge, paper) or sigma_min itself (with parameterization likelihood an exact read-back "
                        "of the last bridge's token, so K = B samples what block 0 drew)")
    sample_top_quantile: Float = _f(0.999, "chains start at this quantile of block 0's training sigma law "
                                    "instead of sigma_max, where block 0 never trains; 1 = sigma_max (paper and "
                                    "official code); every kind's chain (vit, dit too) starts here")
    label_dropout: Float = _f(0.1, "dit: share of training labels replaced by the null class (classifier-free "
                              "guidance)")
    cfg_scale: Float = _f(2.0, "dit: default classifier-free guidance scale of generate and eval (1 = none)")
    sample_steps: int = _f(0, "dit: default Euler steps of generate / eval (0 = 50, the paper's); mdm: unmasking "
                           "steps (0 = model.seq_len)")
    schedule: MaskSchedule = _f("linear", "mdm: the masking schedule alpha(t) (linear: 1 - t; cosine); its "
                                "partition is t_b = alpha^-1(1 - b/B)")


class DataConfig(_Section):
    source: Source = _f("bible", "bible / shakespeare (embedded corpora), files, hf, or bin; vit / dit: digits "
                        "(bundled), cifar10, cifar100, latents (dit); mdm: bible (in text8's alphabet), text8")
    path: Str = _f("", "files: .txt/.jsonl/.parquet path; hf: dataset name; bin: dir with train.bin/val.bin; "
                   "cifar10 / cifar100: the python-pickle archive or its folder; text8: the text8 file; "
                   "latents: the directory `looped_lm prepare --vae` wrote")
    tokenizer: Str = _f("gpt2", "gpt2 (byte-level BPE, 50257), byte (257, for tiny tests), or a path to a "
                        "tokenizer.json (or a directory holding one); with model.init_from the default is its "
                        "directory's")
    val_fraction: Float = _f(0.05, "share of documents held out for validation")
    cache_dir: Str = _f("data_cache", "where tokenized corpora are cached as train.bin / val.bin")
    augment: bool = _f(True, "vit / dit on images: random crop (padding 1/8 of the side) and horizontal flip of "
                       "training images (digits: never flipped)")


class TrainConfig(_Section):
    mode: TrainMode = _f("data_parallel", "data_parallel: every rank trains the step's block on its own batch, "
                         "gradients averaged; block_parallel (db_ar, ZeRO 0): each rank trains its own block every "
                         "step, keeps optimiser state for it only, and exchanges only the shared parameters' gradients")
    max_steps: int = _f(1000, "optimiser steps")
    batch_size: int = _f(8, "sequences per micro-batch per rank")
    grad_accum: int = _f(1, "micro-batches per optimiser step")
    lr: Float = _f(1e-3, "peak learning rate")
    min_lr: Float = _f(1e-4, "cosine floor")
    warmup_steps: int = _f(100, "linear warm-up steps")
    weight_decay: Float = _f(0.1, "AdamW weight decay (not on norms and biases)")
    beta1: Float = _f(0.9, "AdamW beta1")
    beta2: Float = _f(0.95, "AdamW beta2")
    grad_clip: Float = _f(1.0, "global grad-norm clip; 0 = off")
    seed: int = _f(1337, "seed for init, data order, blocks and noise")
    out_dir: Str = _f("out", "checkpoints, metrics.jsonl and TensorBoard logs")
    save_every: int = _f(500, "checkpoint every N steps (and at the end); 0 = only at the end")
    keep_last: int = _f(2, "checkpoints kept on disk")
    eval_every: int = _f(250, "validation loss every N steps; 0 = off")
    eval_batches: int = _f(8, "validation micro-batches per evaluation")
    log_every: int = _f(10, "metrics.jsonl / TensorBoard every N steps")
    resume: Str = _f("auto", "auto (latest complete checkpoint in out_dir), never, or a checkpoint dir")
    resume_changes: ResumeChanges = _f("refuse", "a resume that changes the seed, global batch, grad_accum, data or "
                             "tokenizer: refuse (list the differences) or allow (log them and go on)")
    progress: bool = _f(True, "show a tqdm progress bar on rank 0")
    lora_rank: int = _f(0, "LoRA rank of the adapters (peft) on a frozen model.init_from base; 0 = full fine-tuning "
                        "(docs/pretrained.md)")
    lora_alpha: Float = _f(16.0, "LoRA scale numerator: the update is (alpha / rank) B A")
    lora_dropout: Float = _f(0.0, "dropout on the LoRA input")
    lora_targets: list[str] = _f(["qkv", "proj", "gate_up", "down"], "the Linears that get adapters, in the layers "
                                 "the job owns (diffusion.blocks_to_train): qkv, proj, gate_up, down")


class DeepSpeedConfig(_Section):
    zero_stage: int = _f(0, "ZeRO stage 0, 1 or 2")
    bf16: bool = _f(False, "bf16 mixed precision (GPUs); fp32 when false. ZeRO 0: DeepSpeed's bf16 weights and "
                    "Adam state; ZeRO 1/2: fp32 master copies; train.mode block_parallel: bf16 compute under autocast, "
                    "fp32 weights and optimizer state")


class EvalConfig(_Section):
    block_size: int = _f(0, "perplexity window; 0 = model.seq_len")
    stride: int = _f(0, "0 = disjoint blocks (primary); S = sliding windows scoring the last S tokens")
    max_tokens: int = _f(0, "score at most this many tokens; 0 = all")
    draws: int = _f(4, "DB models: chains averaged per ppl@k")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = Field(default_factory=DiffusionConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return self.model_dump()


SECTIONS = {name: f.annotation for name, f in Config.model_fields.items()}


# ---------------------------------------------------------------------------------------------
# loading


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read YAML at `path` (None = defaults), apply `section.key=value` overrides, validate."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise UserError(f"config file {path} is a directory; give a YAML file (e.g. configs/quickstart_db.yaml)")
        if not p.is_file():
            raise UserError(f"config file not found: {path}")
        try:
            text = p.read_text()
            _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
            raw = yaml.safe_load(text) or {}
        except OSError as e:
            raise UserError(f"cannot read config file {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise UserError(f"config file {path} is not UTF-8 text (bad byte at offset {e.start})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise UserError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        _apply_override(raw, item)
    return config_from_dict(raw)


def _refuse_duplicate_keys(node, path: str, where: str = "") -> None:
    """YAML lets a repeated key silently take the last value; a config must not."""
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            if key is not None and key in seen:
                raise UserError(f"config file {path}: key '{where}{key}' appears twice (lines {seen[key]} and "
                                f"{line}); keep one")
            if key is not None:
                seen[key] = line
            _refuse_duplicate_keys(value_node, path, f"{where}{key}." if key is not None else where)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path, where)


def config_from_dict(raw: dict) -> Config:
    """Validate a {section: {key: value}} dict (a parsed YAML file, a manifest's config) into a Config."""
    raw = {section: values for section, values in raw.items() if values is not None}  # `model:` alone
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise UserError(_message(e.errors()[0])) from None
    validate(cfg)
    return cfg


REMOVED = {  # options the quality study measured worse everywhere (docs/results.md)
    "diffusion.noise": "noise: adaptive lost every measurement",
}


def _message(err: dict) -> str:
    """pydantic's first error as one line naming the key (`train.lr must be a number, got 'fast'`)."""
    loc, kind, value = err["loc"], err["type"], err.get("input")
    key = ".".join(str(p) for p in loc[:2]) + "".join(f"[{p}]" for p in loc[2:])
    if kind == "extra_forbidden":
        if key in REMOVED:
            return f"{key} was removed: {REMOVED[key]}; delete it from the config"
        if len(loc) == 1:
            return f"unknown config section '{loc[0]}'{_suggest(str(loc[0]), SECTIONS)}"
        return f"unknown config key '{key}'{_suggest(str(loc[1]), SECTIONS[loc[0]].model_fields)}"
    if len(loc) == 1:  # the section itself
        return f"config section '{loc[0]}' must be a mapping, got {type(value).__name__}"
    if len(loc) > 2 and loc[2] in ("int", "list[int]"):  # a field that takes an integer or a list of them
        return f"{'.'.join(str(p) for p in loc[:2])} must be an integer or a list of integers, got {value!r}"
    if kind == "literal_error":
        field = SECTIONS[loc[0]].model_fields[loc[1]]
        return f"{key} must be one of {', '.join(typing.get_args(field.annotation))} (got '{value}')"
    if kind == "list_type":
        return f"{key} must be a list of int, got {value!r}"
    what = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
            "finite": "finite"}
    for prefix, text in what.items():
        if kind.startswith(prefix):
            return f"{key} must be {text}, got {value!r}"
    return f"{key}: {err['msg']} (got {value!r})"


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise UserError(f"--set expects section.key=value, got '{item}' (no '=')")
    key, _, text = item.partition("=")
    if key.count(".") != 1 or not all(key.split(".")):
        raise UserError(f"--set key must look like section.key, got '{key}'")
    section, name = key.split(".")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    raw.setdefault(section, {})
    if not isinstance(raw[section], dict):
        raise UserError(f"config section '{section}' must be a mapping")
    raw[section][name] = value


def _suggest(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(known)})"


# ---------------------------------------------------------------------------------------------
# validation: impossible values, named


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def validate(cfg: Config) -> None:
    m, d, t = cfg.model, cfg.diffusion, cfg.train
    for key in ("n_layers", "d_model", "n_heads", "seq_len"):
        _require(getattr(m, key) >= 1, f"model.{key} must be >= 1 (got {getattr(m, key)})")
    _require(m.d_model % m.n_heads == 0, f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    _require((m.d_model // m.n_heads) % 2 == 0, "model.d_model / model.n_heads must be even (RoPE rotates pairs)")
    for key in ("vocab_size", "ffn_hidden", "n_prelude", "n_coda"):
        _require(getattr(m, key) >= 0, f"model.{key} must be >= 0 (got {getattr(m, key)})")
    _require(m.init_std > 0 and m.norm_eps > 0 and m.rope_theta > 0, "model.init_std, norm_eps and rope_theta must be > 0")
    _require(m.mean_recurrence >= 1, f"model.mean_recurrence must be >= 1 (got {m.mean_recurrence})")
    _require(m.backprop_depth >= 1, f"model.backprop_depth must be >= 1 (got {m.backprop_depth})")
    _require(m.backprop_depth <= m.mean_recurrence or m.allow_full_backprop,
             f"model.backprop_depth ({m.backprop_depth}) exceeds model.mean_recurrence ({m.mean_recurrence});"
             " set model.allow_full_backprop: true if that is intended")
    _require(m.max_iterations >= 1, f"model.max_iterations must be >= 1 (got {m.max_iterations})")
    if m.init_from and "tokenizer" not in cfg.data.model_fields_set:
        # the checkpoint's own tokenizer.json, absolute: the manifest's name must not depend on the cwd
        cfg.data.tokenizer = str(Path(m.init_from).expanduser().absolute())

    _require(d.num_blocks >= 1, f"diffusion.num_blocks must be >= 1 (got {d.num_blocks})")
    if m.kind == "db_ar":
        _resolve_layers_per_block(cfg)
    else:
        _require(d.layers_per_block in (0, []), f"diffusion.layers_per_block applies to model.kind db_ar only "
                                                f"(got {d.layers_per_block!r} with {m.kind})")
    _require(0.0 <= d.overlap <= 0.5, f"diffusion.overlap must be in [0, 0.5] (got {d.overlap})")
    _require(0 < d.sigma_min < d.sigma_max,
             f"diffusion.sigma_min ({d.sigma_min}) must be > 0 and below diffusion.sigma_max ({d.sigma_max})")
    _require(d.p_std > 0, f"diffusion.p_std must be > 0 (got {d.p_std})")
    _require(d.sigma_data > 0, f"diffusion.sigma_data must be > 0 (got {d.sigma_data})")
    _require(0 < d.target_fraction <= 1, f"diffusion.target_fraction must be in (0, 1] (got {d.target_fraction})")
    _require(d.curve_every >= 1 and d.curve_until >= 0, "diffusion.curve_every must be >= 1 and curve_until >= 0")
    _require(d.clean_lm_weight >= 0, f"diffusion.clean_lm_weight must be >= 0 (got {d.clean_lm_weight})")
    _require(d.posterior_topk >= 1, f"diffusion.posterior_topk must be >= 1 (got {d.posterior_topk})")
    _require(0 < d.sample_top_quantile <= 1,
             f"diffusion.sample_top_quantile must be in (0, 1] (got {d.sample_top_quantile})")
    _require(d.num_iterations >= 0, f"diffusion.num_iterations must be >= 1, or 0 for num_blocks (got {d.num_iterations})")
    if m.kind == "looped_db":
        _require(d.num_blocks == 1, f"looped_db has one weight-tied core: diffusion.num_blocks must be 1 "
                                    f"(got {d.num_blocks})")
    n_blocks = d.num_blocks if m.kind == "db_ar" or (m.kind in MODULE_KINDS and not m.end_to_end) else 1
    for b in d.blocks_to_train:
        _require(0 <= b < n_blocks, f"diffusion.blocks_to_train has {b}, outside 0..{n_blocks - 1}")
    _require(len(set(d.blocks_to_train)) == len(d.blocks_to_train),
             f"diffusion.blocks_to_train has duplicates: {d.blocks_to_train}")

    _require(not m.activation_checkpointing or m.kind == "gpt", f"model.activation_checkpointing is for model.kind "
             f"gpt (got {m.kind}): a DiffusionBlocks step already holds one block's activations")
    if d.context == "stacked":
        _require(m.kind == "db_ar", f"diffusion.context stacked chains the blocks of a db_ar model (got model.kind "
                                    f"{m.kind})")
        _require(not d.blocks_to_train, "diffusion.context stacked cannot train independent block jobs "
                 "(diffusion.blocks_to_train): block b's clean stream runs blocks < b's current weights, so a "
                 "block trained apart would read stale ones; train every block in one run (train.mode "
                 "data_parallel or block_parallel)")

    if t.mode == "block_parallel":
        _require(m.kind == "db_ar", f"train.mode block_parallel trains DiffusionBlocks blocks apart: it needs model.kind "
                                    f"db_ar (got {m.kind})")
        _require(cfg.deepspeed.zero_stage == 0,
                 f"train.mode block_parallel needs deepspeed.zero_stage 0 (got {cfg.deepspeed.zero_stage}): each rank "
                 "already keeps optimiser state for its own block only, and ZeRO would partition it over ranks that "
                 "train other blocks")
        # diffusion.block_sampling matters only when a rank owns several blocks: checked with the world size
        # (parallel.check_world)

    for key in ("max_steps", "batch_size", "grad_accum"):
        _require(getattr(t, key) >= 1, f"train.{key} must be >= 1 (got {getattr(t, key)})")
    _require(t.lr > 0, f"train.lr must be > 0 (got {t.lr})")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr must be in [0, train.lr] (got {t.min_lr})")
    for key in ("warmup_steps", "save_every", "eval_every", "weight_decay", "grad_clip"):
        _require(getattr(t, key) >= 0, f"train.{key} must be >= 0 (got {getattr(t, key)})")
    _require(t.eval_batches >= 1, f"train.eval_batches must be >= 1 (got {t.eval_batches}); train.eval_every: 0 "
                                  "turns validation off")
    # the seed and its offsets (seed + rank, seed + batch) must fit torch's and the data hash's 64-bit seeds
    _require(0 <= t.seed < 2 ** 62, f"train.seed must be in 0..2**62 - 1 (got {t.seed})")
    _require(t.log_every >= 1 and t.keep_last >= 1, "train.log_every and train.keep_last must be >= 1")
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
    _require(t.out_dir != "", "train.out_dir must not be empty")
    _require(t.lora_rank >= 0, f"train.lora_rank must be >= 0 (got {t.lora_rank})")
    if t.lora_rank:
        _require(bool(m.init_from), "train.lora_rank needs model.init_from: adapters train on a pretrained base")
        _require(t.lora_alpha > 0 and 0 <= t.lora_dropout < 1,
                 "train.lora_alpha must be > 0 and train.lora_dropout in [0, 1)")
        bad = [name for name in t.lora_targets if name not in LORA_TARGETS]
        _require(not bad, f"train.lora_targets has {bad[0]!r}: no such module (have: {', '.join(LORA_TARGETS)})"
                 if bad else "")
        _require(bool(t.lora_targets), f"train.lora_targets is empty: name at least one of {', '.join(LORA_TARGETS)}")

    _require(cfg.deepspeed.zero_stage in (0, 1, 2), f"deepspeed.zero_stage must be 0, 1 or 2 (got {cfg.deepspeed.zero_stage})")
    if cfg.data.source in ("files", "hf", "bin", "cifar10", "cifar100", "text8", "latents"):
        _require(cfg.data.path != "", f"data.path is required when data.source is {cfg.data.source}")
    validate_module(cfg)
    _require(0 < cfg.data.val_fraction < 1, f"data.val_fraction must be in (0, 1) (got {cfg.data.val_fraction})")
    e = cfg.eval
    for key in ("block_size", "stride", "max_tokens"):
        _require(getattr(e, key) >= 0, f"eval.{key} must be >= 0 (got {getattr(e, key)})")
    _require(e.draws >= 1, f"eval.draws must be >= 1 (got {e.draws})")


def validate_module(cfg: Config) -> None:
    """The supporting modules (vit / dit / mdm): their data source, block layout and the options they
    implement; a language model may not name a module's data source."""
    m, d, source = cfg.model, cfg.diffusion, cfg.data.source
    if m.kind not in MODULE_KINDS:
        readers = [k for k, sources in MODULE_SOURCES.items() if source in sources]
        _require(source == "bible" or not readers, f"data.source {source} is read by model.kind "
                 f"{' / '.join(readers)}, not {m.kind}")
        return
    _require(source in MODULE_SOURCES[m.kind], f"model.kind {m.kind} reads data.source "
             f"{' / '.join(MODULE_SOURCES[m.kind])} (got {source})")
    if not m.end_to_end:
        _require(d.num_blocks <= m.n_layers, f"diffusion.num_blocks ({d.num_blocks}) is larger than model.n_layers "
                 f"({m.n_layers}): every block needs at least one layer")
        _require(m.n_layers % d.num_blocks == 0,
                 f"diffusion.num_blocks ({d.num_blocks}) must divide model.n_layers ({m.n_layers})")
    _require(d.block_sampling in ("uniform", "round_robin"), f"diffusion.block_sampling {d.block_sampling} (the "
             f"default) is for the language models; set diffusion.block_sampling: uniform (the paper) or round_robin "
             f"for {m.kind}")
    blocks = 1 if m.end_to_end else d.num_blocks
    if d.num_iterations:
        _require(d.num_iterations >= blocks, f"diffusion.num_iterations ({d.num_iterations}) must be >= the number of "
                 f"blocks ({blocks}): {m.kind} runs at least one step per block")
    if d.sample_steps:
        _require(d.sample_steps >= blocks, f"diffusion.sample_steps ({d.sample_steps}) must be >= the number of "
                 f"blocks ({blocks}): {m.kind} runs at least one step per block")
    _require(d.sample_steps >= 0, f"diffusion.sample_steps must be >= 0 (got {d.sample_steps})")
    if m.kind == "mdm":
        return
    for key in ("image_size", "channels", "patch"):
        _require(getattr(m, key) >= 1, f"model.{key} must be >= 1 (got {getattr(m, key)})")
    _require(m.image_size % m.patch == 0, f"model.image_size ({m.image_size}) is not divisible by model.patch "
             f"({m.patch})")
    if m.kind == "vit":
        _require(m.num_classes >= 2, f"model.num_classes must be >= 2 for vit (got {m.num_classes})")
    else:
        _require(m.num_classes >= 0, f"model.num_classes must be >= 0 for dit, 0 = unconditional (got "
                 f"{m.num_classes})")
        _require(0 <= d.label_dropout < 1, f"diffusion.label_dropout must be in [0, 1) (got {d.label_dropout})")
        _require(d.cfg_scale >= 0, f"diffusion.cfg_scale must be >= 0 (got {d.cfg_scale})")


def _resolve_layers_per_block(cfg: Config) -> None:
    """db_ar: check diffusion.layers_per_block against model.n_layers, and set num_blocks from it (a
    num_blocks given in the same config must agree)."""
    m, d = cfg.model, cfg.diffusion
    lpb = d.layers_per_block
    if lpb in (0, []):
        _require(m.n_layers % d.num_blocks == 0,
                 f"diffusion.num_blocks ({d.num_blocks}) must divide model.n_layers ({m.n_layers})")
        return
    if isinstance(lpb, list):
        _require(all(n >= 1 for n in lpb), f"diffusion.layers_per_block must list counts >= 1 (got {lpb})")
        _require(sum(lpb) == m.n_layers, f"diffusion.layers_per_block {lpb} sums to {sum(lpb)}, but model.n_layers "
                                         f"is {m.n_layers}")
        blocks = len(lpb)
    else:
        _require(lpb >= 1, f"diffusion.layers_per_block must be >= 1, a list, or 0 for n_layers / num_blocks (got {lpb})")
        _require(m.n_layers % lpb == 0, f"diffusion.layers_per_block ({lpb}) must divide model.n_layers ({m.n_layers})")
        blocks = m.n_layers // lpb
    if "num_blocks" in d.model_fields_set and d.num_blocks != blocks:
        raise UserError(f"diffusion.num_blocks ({d.num_blocks}) contradicts diffusion.layers_per_block {lpb!r} "
                        f"({blocks} blocks); give one of them")
    d.num_blocks = blocks


def block_layers(cfg: Config) -> list[int]:
    """The layers of each block, block 0 (highest noise) first: db_ar's split of model.n_layers;
    looped_db's one weight-tied core."""
    m, d = cfg.model, cfg.diffusion
    if m.kind != "db_ar":
        return [m.n_layers]
    if isinstance(d.layers_per_block, list) and d.layers_per_block:
        return list(d.layers_per_block)
    per = d.layers_per_block or m.n_layers // d.num_blocks
    return [per] * (m.n_layers // per)


def describe_fields() -> str:
    """Every config field with its type, default and doc: the text of `--help-config`."""
    lines = []
    for section, typ in SECTIONS.items():
        lines.append(f"{section}:")
        for name, f in typ.model_fields.items():
            default = f.get_default(call_default_factory=True)
            kinds = typing.get_args(f.annotation) if isinstance(f.annotation, types.UnionType) else ()
            typ = " or ".join(getattr(k, "__name__", str(k)) for k in kinds) or type(default).__name__
            lines.append(f"  {name} ({typ}, default {default!r}): {f.description}")
    return "\n".join(lines)


def write_reference(readme: Path) -> None:
    """Replace the fenced field list of configs/README.md with `describe_fields()`."""
    text = readme.read_text()
    start = text.index("```\n") + 4
    end = text.index("\n```", start)
    readme.write_text(text[:start] + describe_fields() + text[end:])


if __name__ == "__main__":  # python -m looped_lm.config: regenerate configs/README.md's field list
    write_reference(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "configs" / "README.md")
