"""Typed run configuration, loaded from YAML and validated before anything is built.

One YAML file per run, with the sections below. Every field has a type, a default and a one-line
reason (the `doc` metadata, printed by `looped_lm train --help-config`). Unknown keys, wrong types and
impossible values raise `UserError` naming the key, so a bad run fails in its first second.

    model:      what network to build
    diffusion:  DiffusionBlocks noise schedule, partition, training and sampling knobs
    data:       where tokens come from
    train:      optimisation, logging, checkpoints
    deepspeed:  ZeRO stage and precision
    eval:       perplexity protocol
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from looped_lm.errors import UserError


def _f(default, doc: str, **kw):
    """A dataclass field with a one-line doc string kept in its metadata."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})


MODEL_KINDS = ("gpt", "db_ar", "looped_db", "huginn")


@dataclass
class ModelConfig:
    kind: str = _f("gpt", "gpt (end-to-end), db_ar (DiffusionBlocks AR), looped_db, huginn", choices=MODEL_KINDS)
    n_layers: int = _f(4, "decoder layers (db_ar: split into diffusion.num_blocks blocks; looped: the core)")
    d_model: int = _f(128, "residual width")
    n_heads: int = _f(4, "attention heads (d_model must divide by it)")
    seq_len: int = _f(256, "training context length in tokens")
    vocab_size: int = _f(0, "0 = the tokenizer's size; larger pads the embedding (e.g. 50304 for speed)")
    ffn_hidden: int = _f(0, "SwiGLU hidden width; 0 = 8/3 * d_model rounded up to a multiple of 64")
    rope_theta: float = _f(10000.0, "RoPE base")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon")
    init_std: float = _f(0.02, "std of the normal init of linear and embedding weights")
    n_prelude: int = _f(0, "shared clean-stream layers before the blocks / core (looped models: 2)")
    n_coda: int = _f(0, "shared layers after the blocks / core (looped models: 2)")
    mean_recurrence: int = _f(32, "huginn: mean of the Poisson-log-normal iteration count r")
    backprop_depth: int = _f(8, "huginn: gradients flow through the last k iterations only")
    allow_full_backprop: bool = _f(False, "huginn: allow backprop_depth > mean_recurrence")
    loss_chunk: int = _f(0, "training: head + CE in chunks of this many positions, recomputed in backward, so "
                         "the (tokens, vocab) logits are never stored (0 = off; e.g. 128 with a 50257 vocab)")
    max_iterations: int = _f(64, "looped models: the largest K accepted at inference")


@dataclass
class DiffusionConfig:
    num_blocks: int = _f(4, "B: blocks that each own one interval of noise levels")
    partition: str = _f("equi_probability", "block edges: equal noise mass, equal ln-width, or equal shares of "
                        "the held-out CE drop re-estimated in training (equi_entropy)",
                        choices=("equi_probability", "uniform", "equi_entropy"))
    noise: str = _f("lognormal", "training sigma within a block: the log-normal (paper) or adaptive (the "
                    "learned CDF of CE(sigma), CDCD-style time warping)", choices=("lognormal", "adaptive"))
    curve_every: int = _f(200, "re-measure held-out CE(sigma) every N steps (equi_entropy, adaptive, loss_share)")
    curve_until: int = _f(0, "stop re-measuring (freeze edges) after this step; 0 = never")
    parameterization: str = _f("likelihood", "how a noisy slot reads z: edm (paper: c_in*z in, c_skip*z skip) or likelihood "
                               "(z's exact token log-likelihood <z,y_v>/sigma^2 added to the logits, and its "
                               "posterior-mean embedding as input: the network models only what context adds)",
                               choices=("edm", "likelihood"))
    noisy_self: bool = _f(False, "a noisy slot attends its own key besides the clean keys (paper); false: clean "
                          "keys only, plain causal attention (flash), and servable by vLLM's paged attention")
    noisy_input: str = _f("prev_token", "noisy slot input: what it reads of z alone (noise), or that + E[previous token] (prev_token)",
                          choices=("noise", "prev_token"))
    context: str = _f("independent", "block b's clean stream starts from the embeddings (independent, paper) or "
                      "from blocks < b's clean output, without gradient (stacked)",
                      choices=("independent", "stacked"))
    clean_lm_weight: float = _f(0.0, "weight of a next-token CE on each block's clean stream, added to the loss")
    overlap: float = _f(0.1, "gamma: each block trains on its interval widened by this share of its ln-width")
    p_mean: float = _f(-1.2, "mean of ln(sigma) for training noise")
    p_std: float = _f(1.2, "std of ln(sigma) for training noise")
    sigma_min: float = _f(0.002, "lowest noise level")
    sigma_max: float = _f(80.0, "highest noise level")
    sigma_data: float = _f(0.5, "EDM sigma_data")
    loss_weight: str = _f("none", "CE weight per sample: none, edm (normalised w(sigma)) or batch_mean",
                          choices=("none", "edm", "batch_mean"))
    target_scale: str = _f("unit", "noisy targets are unit-norm embeddings (unit) or per-dim RMS sigma_data",
                           choices=("unit", "sigma_data"))
    target_fraction: float = _f(1.0, "share of noisy slots trained per sequence (clean stream stays whole)")
    blocks_to_train: list[int] = _f([], "train only these blocks (others frozen, no optimiser state); [] = all")
    block_sampling: str = _f("loss_share", "which block a step trains: uniform (paper), round_robin, or loss_share "
                             "(in proportion to each block's share of the CE drop)",
                             choices=("uniform", "round_robin", "loss_share"))
    bridge: str = _f("sample", "logits -> denoised embedding between steps: soft (expectation), hard (argmax), "
                     "or sample (a token drawn from the logits)",
                     choices=("soft", "hard", "sample"))
    num_iterations: int = _f(0, "default K denoising steps per token at inference; 0 = num_blocks")
    last_call: str = _f("edge", "where a K-step chain's last call runs: the last Euler grid point above sigma_min "
                        "(edge, paper) or sigma_min itself (with parameterization likelihood an exact read-back "
                        "of the last bridge's token, so K = B samples what block 0 drew)",
                        choices=("edge", "sigma_min"))
    sample_top_quantile: float = _f(0.999, "chains start at this quantile of block 0's training sigma law "
                                    "instead of sigma_max, where block 0 never trains; 1 = sigma_max (paper)")


@dataclass
class DataConfig:
    source: str = _f("bible", "bible / shakespeare (embedded corpora), files, hf, or bin",
                     choices=("bible", "shakespeare", "files", "hf", "bin"))
    path: str = _f("", "files: .txt/.jsonl/.parquet path; hf: dataset name; bin: dir with train.bin/val.bin")
    tokenizer: str = _f("gpt2", "gpt2 (byte-level BPE, 50257) or byte (257, for tiny tests)",
                        choices=("gpt2", "byte"))
    val_fraction: float = _f(0.05, "share of documents held out for validation")
    cache_dir: str = _f("data_cache", "where tokenized corpora are cached as train.bin / val.bin")


@dataclass
class TrainConfig:
    max_steps: int = _f(1000, "optimiser steps")
    batch_size: int = _f(8, "sequences per micro-batch per rank")
    grad_accum: int = _f(1, "micro-batches per optimiser step")
    lr: float = _f(1e-3, "peak learning rate")
    min_lr: float = _f(1e-4, "cosine floor")
    warmup_steps: int = _f(100, "linear warm-up steps")
    weight_decay: float = _f(0.1, "AdamW weight decay (not on norms and biases)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "global grad-norm clip; 0 = off")
    seed: int = _f(1337, "seed for init, data order, blocks and noise")
    out_dir: str = _f("out", "checkpoints, metrics.jsonl and TensorBoard logs")
    save_every: int = _f(500, "checkpoint every N steps (and at the end); 0 = only at the end")
    keep_last: int = _f(2, "checkpoints kept on disk")
    eval_every: int = _f(250, "validation loss every N steps; 0 = off")
    eval_batches: int = _f(8, "validation micro-batches per evaluation")
    log_every: int = _f(10, "metrics.jsonl / TensorBoard every N steps")
    resume: str = _f("auto", "auto (latest complete checkpoint in out_dir), never, or a checkpoint dir")
    resume_changes: str = _f("refuse", "a resume that changes the seed, global batch, grad_accum, data or "
                             "tokenizer: refuse (list the differences) or allow (log them and go on)",
                             choices=("refuse", "allow"))
    progress: bool = _f(True, "show a tqdm progress bar on rank 0")


@dataclass
class DeepSpeedConfig:
    zero_stage: int = _f(0, "ZeRO stage 0, 1 or 2")
    bf16: bool = _f(False, "bf16 mixed precision (GPUs); fp32 when false")


@dataclass
class EvalConfig:
    block_size: int = _f(0, "perplexity window; 0 = model.seq_len")
    stride: int = _f(0, "0 = disjoint blocks (primary); S = sliding windows scoring the last S tokens")
    max_tokens: int = _f(0, "score at most this many tokens; 0 = all")
    draws: int = _f(4, "DB models: chains averaged per ppl@k")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_TYPES = typing.get_type_hints(Config)


# ---------------------------------------------------------------------------------------------
# loading


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read YAML at `path` (None = defaults), apply `section.key=value` overrides, validate."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
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
    cfg = Config()
    for section, values in raw.items():
        if section not in SECTIONS:
            raise UserError(f"unknown config section '{section}'{_suggest(section, SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise UserError(f"config section '{section}' must be a mapping, got {type(values).__name__}")
        target = getattr(cfg, section)
        hints = typing.get_type_hints(type(target))
        names = {f.name: f for f in dataclasses.fields(target)}
        for key, value in values.items():
            if key not in names:
                raise UserError(f"unknown config key '{section}.{key}'{_suggest(key, names)}")
            setattr(target, key, _coerce(f"{section}.{key}", value, hints[key]))
            choices = names[key].metadata.get("choices")
            if choices and getattr(target, key) not in choices:
                raise UserError(f"{section}.{key} must be one of {', '.join(choices)} (got '{value}')")
    validate(cfg)
    return cfg


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


def _coerce(key: str, value, typ):
    """Check `value` against the field type; ints are accepted where floats are expected."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item_type,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise UserError(f"{key} must be a list of {item_type.__name__}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    if typ is bool:
        if not isinstance(value, bool):
            raise UserError(f"{key} must be true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{key} must be an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise UserError(f"{key} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise UserError(f"{key} must be finite, got {value!r}")
        return float(value)
    if typ is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. --set train.out_dir=2024
        if not isinstance(value, str):
            raise UserError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {typ} for {key}")


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

    _require(d.num_blocks >= 1, f"diffusion.num_blocks must be >= 1 (got {d.num_blocks})")
    if m.kind == "db_ar":
        _require(m.n_layers % d.num_blocks == 0,
                 f"diffusion.num_blocks ({d.num_blocks}) must divide model.n_layers ({m.n_layers})")
    _require(0.0 <= d.overlap <= 0.5, f"diffusion.overlap must be in [0, 0.5] (got {d.overlap})")
    _require(0 < d.sigma_min < d.sigma_max,
             f"diffusion.sigma_min ({d.sigma_min}) must be > 0 and below diffusion.sigma_max ({d.sigma_max})")
    _require(d.p_std > 0, f"diffusion.p_std must be > 0 (got {d.p_std})")
    _require(d.sigma_data > 0, f"diffusion.sigma_data must be > 0 (got {d.sigma_data})")
    _require(0 < d.target_fraction <= 1, f"diffusion.target_fraction must be in (0, 1] (got {d.target_fraction})")
    _require(d.curve_every >= 1 and d.curve_until >= 0, "diffusion.curve_every must be >= 1 and curve_until >= 0")
    _require(d.clean_lm_weight >= 0, f"diffusion.clean_lm_weight must be >= 0 (got {d.clean_lm_weight})")
    _require(0 < d.sample_top_quantile <= 1,
             f"diffusion.sample_top_quantile must be in (0, 1] (got {d.sample_top_quantile})")
    _require(d.num_iterations >= 0, f"diffusion.num_iterations must be >= 1, or 0 for num_blocks (got {d.num_iterations})")
    if m.kind == "looped_db":
        _require(d.num_blocks == 1, f"looped_db has one weight-tied core: diffusion.num_blocks must be 1 "
                                    f"(got {d.num_blocks})")
    n_blocks = d.num_blocks if m.kind == "db_ar" else 1
    for b in d.blocks_to_train:
        _require(0 <= b < n_blocks, f"diffusion.blocks_to_train has {b}, outside 0..{n_blocks - 1}")
    _require(len(set(d.blocks_to_train)) == len(d.blocks_to_train),
             f"diffusion.blocks_to_train has duplicates: {d.blocks_to_train}")

    for key in ("max_steps", "batch_size", "grad_accum"):
        _require(getattr(t, key) >= 1, f"train.{key} must be >= 1 (got {getattr(t, key)})")
    _require(t.lr > 0, f"train.lr must be > 0 (got {t.lr})")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr must be in [0, train.lr] (got {t.min_lr})")
    for key in ("warmup_steps", "save_every", "eval_every", "eval_batches", "weight_decay", "grad_clip"):
        _require(getattr(t, key) >= 0, f"train.{key} must be >= 0 (got {getattr(t, key)})")
    _require(t.log_every >= 1 and t.keep_last >= 1, "train.log_every and train.keep_last must be >= 1")
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
    _require(t.out_dir != "", "train.out_dir must not be empty")

    _require(cfg.deepspeed.zero_stage in (0, 1, 2), f"deepspeed.zero_stage must be 0, 1 or 2 (got {cfg.deepspeed.zero_stage})")
    if cfg.data.source in ("files", "hf", "bin"):
        _require(cfg.data.path != "", f"data.path is required when data.source is {cfg.data.source}")
    _require(0 < cfg.data.val_fraction < 1, f"data.val_fraction must be in (0, 1) (got {cfg.data.val_fraction})")
    e = cfg.eval
    for key in ("block_size", "stride", "max_tokens"):
        _require(getattr(e, key) >= 0, f"eval.{key} must be >= 0 (got {getattr(e, key)})")
    _require(e.draws >= 1, f"eval.draws must be >= 1 (got {e.draws})")


def describe_fields() -> str:
    """Every config field with its type, default and doc: the text of `--help-config`."""
    lines = []
    for section, typ in _SECTION_TYPES.items():
        lines.append(f"{section}:")
        hints = typing.get_type_hints(typ)
        for f in dataclasses.fields(typ):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tname = getattr(hints[f.name], "__name__", str(hints[f.name]))
            lines.append(f"  {f.name} ({tname}, default {default!r}): {f.metadata.get('doc', '')}")
    return "\n".join(lines)
