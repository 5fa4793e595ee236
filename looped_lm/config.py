"""Typed run configuration, loaded from YAML and validated before anything is built.

One YAML file per run, with the sections below. Every field has a type, a default and a one-line
reason (its pydantic `description`, printed by `looped_lm train --help-config` and pasted into
configs/README.md by `python -m looped_lm.config`). Unknown keys, wrong types, repeated keys and
impossible values raise `UserError` naming the key, so a bad run fails in its first second.

    model:      what network to build: `model.kind` names a registered kind (looped_lm/kinds), whose own
                typed section this is (gpt, db_ar, looped_db, huginn; vit / dit / mdm: the supporting modules)
    diffusion:  the kind's own DiffusionBlocks section (noise schedule, partition, training and sampling
                knobs; looped_lm/kinds/sections.py); gpt and huginn have none
    data:       where tokens (images, characters) come from
    train:      optimisation, logging, checkpoints
    deepspeed:  ZeRO stage and precision
    eval:       perplexity protocol
"""

from __future__ import annotations

import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError

from looped_lm.errors import UserError
from looped_lm.fields import DEFAULT_KIND, MAX_DRAWS, MAX_ITERATIONS, SEED_MAX, Float, Str, Switch  # noqa: F401 (re-exported)
from looped_lm.fields import Section as _Section
from looped_lm.fields import field as _f
from looped_lm.kinds import (BlockDiffusion, DiffusionSection, LanguageModelSection, ModelSection, ensure, get_kind,
                             kind_of, registered, require)
from looped_lm.kinds.builtin import BUILTIN
from looped_lm.source_fields import with_source_shape  # noqa: F401 (re-exported: the tests and docs name it here)
from looped_lm.yaml_file import refuse_duplicate_keys, safe_load, yaml_problem

LORA_TARGETS = ("qkv", "proj", "gate_up", "down")  # the Linears of a layer that train.lora_targets may name
# the choices of each choice field (the diffusion: section's are its kind's: looped_lm/kinds/sections.py)
Tokenizer = Literal["gpt2", "byte"]
ResumeChanges = Literal["refuse", "allow"]
TrainMode = Literal["data_parallel", "block_parallel"]
LoraAda = Literal["lora", "full"]  # train.lora_ada

COUNT_MAX = 2 ** 31 - 1  # steps, sequences, micro-batches: DeepSpeed and torch take them as 32/64-bit ints
BUILTIN_NAMES = tuple(kind.name for kind in BUILTIN)  # what configs/README.md documents
# The model section of configs written before kinds owned their sections held every kind's fields. A
# manifest (or an export) of that era carries the other kinds' fields at these defaults: loading it drops
# them. A field of another kind at any other value is refused, as in a user's YAML.
FLAT_ERA_DEFAULTS = {
    "seq_len": 256, "vocab_size": 0, "ffn_hidden": 0, "rope_theta": 10000.0, "n_prelude": 0, "n_coda": 0,
    "mean_recurrence": 32, "backprop_depth": 8, "allow_full_backprop": False, "loss_chunk": 0,
    "activation_checkpointing": False, "max_iterations": 64, "end_to_end": False, "image_size": 32, "channels": 3,
    "patch": 4, "num_classes": 10, "init_from": "", "init_core_start": -1,
}


class DataConfig(_Section):
    source: Str = _f("bible", "one of the kind's data sources: bible / shakespeare (embedded corpora), files, hf, or "
                     "bin; vit / dit: digits (bundled), cifar10, cifar100, latents (dit); mdm: bible (in text8's "
                     "alphabet), text8; a plugin kind may bring its own")
    path: Str = _f("", "files: .txt/.jsonl/.parquet path; hf: dataset name; bin: dir with train.bin/val.bin; "
                   "cifar10 / cifar100: the python-pickle archive or its folder; text8: the text8 file; "
                   "latents: the directory `looped_lm prepare --vae` wrote (each source's `Kind.data_sources`)")
    tokenizer: Str = _f("gpt2", "gpt2 (byte-level BPE, 50257), byte (257, for tiny tests), or a path to a "
                        "tokenizer.json (or a directory holding one); with model.init_from the default is its "
                        "directory's")
    val_fraction: Float = _f(0.05, "share of documents held out for validation")
    test_fraction: Float = _f(0.0, "share of documents held out as a test split (test.bin), apart from validation "
                              "and never read in training: choose settings on val, report on test "
                              "(`looped_lm eval --split test`); 0 = no test split")
    split_seed: int = _f(-1, "seed of the train / validation document split; -1 = train.seed (so a seed sweep "
                         "that must score on the same held-out documents sets this once)")
    cache_dir: Str = _f("data_cache", "where tokenized corpora are cached as train.bin / val.bin")
    augment: bool = _f(True, "vit / dit on images: random crop (padding 1/8 of the side) and horizontal flip of "
                       "training images (digits: never flipped)")

    def check(self) -> None:
        ensure(0 < self.val_fraction < 1, f"data.val_fraction must be in (0, 1) (got {self.val_fraction})")
        ensure(0 <= self.test_fraction < 1 - self.val_fraction,
               f"data.test_fraction must be in [0, 1 - data.val_fraction) = [0, {1 - self.val_fraction:g}) "
                 f"(got {self.test_fraction})")
        ensure(-1 <= self.split_seed <= SEED_MAX, f"data.split_seed must be -1 (train.seed) or in 0..2**62 - 1 "
                                                f"(got {self.split_seed})")


class TrainConfig(_Section):
    mode: TrainMode = _f("data_parallel", "data_parallel: every rank trains the step's block on its own batch, "
                         "gradients averaged; block_parallel (db_ar, ZeRO 0): each rank trains its own block every "
                         "step, keeps optimiser state for it only, and exchanges only the shared parameters' gradients")
    max_steps: int = _f(1000, "optimiser steps; 0 = write the model as built (model.init_from's conversion, or the "
                              "init) as a weights-only step-0 checkpoint that every verb reads and a run resumes from")
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
    log_every: int = _f(10, "metrics.jsonl / TensorBoard / the progress bar's loss every N steps (the only steps that "
                               "read the loss back from the device)")
    compile: Switch = _f("auto", "torch.compile the training loss (gpt, db_ar, looped_db) or huginn's layers: "
                                         "auto = on CUDA, off elsewhere (looped_lm/devices.py); on / off also as true / false, yes / no")
    peak_tflops: float = _f(0.0, "the hardware's dense matmul peak per device for MFU; 0 = known GPUs' table (A100, "
                                 "H100, H200), a measured fp32 matmul on CPU, none elsewhere")
    resume: Str = _f("auto", "auto (latest complete checkpoint in out_dir), never, or a checkpoint dir")
    resume_changes: ResumeChanges = _f("refuse", "a resume that changes the seed, global batch, grad_accum, data or "
                             "tokenizer: refuse (list the differences) or allow (log them and go on)")
    progress: bool = _f(True, "show a tqdm progress bar on rank 0")
    skip_nonfinite: int = _f(0, "optimiser steps whose loss or gradient norm is NaN / Inf that may be skipped (no "
                             "update, counted and logged) before the run stops; 0 = stop at the first, naming the "
                             "step (a non-finite state is never saved)")
    lora_rank: int = _f(0, "LoRA rank of the adapters (peft) on a frozen model.init_from base; 0 = full fine-tuning "
                        "(docs/pretrained.md)")
    lora_alpha: Float = _f(16.0, "LoRA scale numerator: the update is (alpha / rank) B A")
    lora_dropout: Float = _f(0.0, "dropout on the LoRA input")
    lora_targets: list[str] = _f(["qkv", "proj", "gate_up", "down"], "the Linears that get adapters, in the layers "
                                 "the job owns (diffusion.blocks_to_train): qkv, proj, gate_up, down")
    lora_ada: LoraAda = _f("full", "with train.lora_rank, how the adaLN modulation `ada` (d -> 6d in every two-stream "
                           "layer; 60 M of SmolLM2-135M's parameters) trains: full = the whole Linear trains and is "
                           "saved; lora = its zero-initialised weight stays frozen and unsaved (the init rebuilds it), "
                           "a rank-lora_rank adapter (B = 0 keeps adaLN-Zero's start) learns it, the bias trains "
                           "fully: SmolLM2-135M's rank-8 job then saves 16 MB, not 251 MB. full by default: on the "
                           "tiny source lora measured 3.3 +- 1.3 % worse ppl@0 after 200 steps, equal after 1000 "
                           "(docs/pretrained.md)")

    def check(self) -> None:
        ensure(0 <= self.max_steps <= COUNT_MAX, f"train.max_steps must be in 0..{COUNT_MAX} (got {self.max_steps}; "
                                                 "0 writes the model as built, without training)")
        for key in ("batch_size", "grad_accum"):
            ensure(1 <= getattr(self, key) <= COUNT_MAX, f"train.{key} must be in 1..{COUNT_MAX} (got "
                                                         f"{getattr(self, key)})")
        for key in ("warmup_steps", "save_every", "eval_every", "eval_batches", "log_every", "keep_last",
                    "skip_nonfinite"):
            ensure(getattr(self, key) <= COUNT_MAX, f"train.{key} must be <= {COUNT_MAX} (got {getattr(self, key)})")
        ensure(self.lr > 0, f"train.lr must be > 0 (got {self.lr})")
        ensure(0 <= self.min_lr <= self.lr, f"train.min_lr must be in [0, train.lr] (got {self.min_lr})")
        for key in ("warmup_steps", "save_every", "eval_every", "weight_decay", "grad_clip", "skip_nonfinite"):
            ensure(getattr(self, key) >= 0, f"train.{key} must be >= 0 (got {getattr(self, key)})")
        ensure(self.eval_batches >= 1, f"train.eval_batches must be >= 1 (got {self.eval_batches}); "
                                       "train.eval_every: 0 turns validation off")
        # the seed and its offsets (seed + rank, seed + batch) must fit torch's and the data hash's 64-bit seeds
        ensure(0 <= self.seed <= SEED_MAX, f"train.seed must be in 0..2**62 - 1 (got {self.seed})")
        ensure(self.log_every >= 1 and self.keep_last >= 1, "train.log_every and train.keep_last must be >= 1")
        ensure(math.isfinite(self.peak_tflops) and self.peak_tflops >= 0,
               f"train.peak_tflops must be >= 0 (got {self.peak_tflops})")
        ensure(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
        ensure(self.out_dir != "", "train.out_dir must not be empty")
        ensure(self.lora_rank >= 0, f"train.lora_rank must be >= 0 (got {self.lora_rank})")
        if self.lora_rank:
            ensure(self.lora_alpha > 0 and 0 <= self.lora_dropout < 1,
                   "train.lora_alpha must be > 0 and train.lora_dropout in [0, 1)")
            ensure(bool(self.lora_targets), f"train.lora_targets is empty: name at least one of "
                                            f"{', '.join(LORA_TARGETS)}")
        # checked with or without train.lora_rank: a misspelt target is refused, not kept until a LoRA run reads it
        bad = [name for name in self.lora_targets if name not in LORA_TARGETS]
        ensure(not bad, f"train.lora_targets has {bad[0]!r}: no such module (have: {', '.join(LORA_TARGETS)})"
               if bad else "")


class DeepSpeedConfig(_Section):
    zero_stage: int = _f(0, "ZeRO stage 0, 1 or 2")
    bf16: bool = _f(False, "bf16 mixed precision (GPUs); fp32 when false. ZeRO 0: DeepSpeed's bf16 weights and "
                    "Adam state; ZeRO 1/2: fp32 master copies; train.mode block_parallel: bf16 compute under autocast, "
                    "fp32 weights and optimizer state")

    def check(self) -> None:
        ensure(self.zero_stage in (0, 1, 2), f"deepspeed.zero_stage must be 0, 1 or 2 (got {self.zero_stage})")


class EvalConfig(_Section):
    block_size: int = _f(0, "perplexity window; 0 = model.seq_len")

    def check(self) -> None:
        ensure(self.block_size >= 0, f"eval.block_size must be >= 0 (got {self.block_size})")


class Config(BaseModel):
    """The run. `model` and `diffusion` are the sections of `model.kind`'s plugin (a discriminated union
    over the registry, resolved by `config_from_dict`: out-of-tree kinds join it by registering)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: SerializeAsAny[ModelSection] = Field(default_factory=lambda: get_kind(DEFAULT_KIND).section())
    diffusion: SerializeAsAny[DiffusionSection] = Field(default_factory=lambda: get_kind(DEFAULT_KIND).diffusion())
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return self.model_dump()


SECTIONS = {name: f.annotation for name, f in Config.model_fields.items()}
SECTIONS["model"], SECTIONS["diffusion"] = ModelSection, DiffusionSection
KIND_SECTIONS = ("model", "diffusion")  # the sections whose class the kind chooses


# ---------------------------------------------------------------------------------------------
# loading


def load_config(path: str | None, overrides: list[str] = (), source_shape=None) -> Config:
    """Read YAML at `path` (None = defaults), apply `section.key=value` overrides, take the shape fields left
    unset from model.init_from's source (`source_shape(path) -> {field: value, "n_source_layers": n}`, given by
    the verbs that start runs: looped_lm/pretrained.py's), validate."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise UserError(f"config file {path} is a directory; give a YAML file (e.g. configs/quickstart_db.yaml)")
        if not p.is_file():
            raise UserError(f"config file not found: {path}")
        try:
            text = p.read_text()
            refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
            raw = safe_load(text, f"config file {path}") or {}
        except OSError as e:
            raise UserError(f"cannot read config file {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise UserError(f"config file {path} is not UTF-8 text (bad byte at offset {e.start})") from None
        except yaml.YAMLError as e:
            raise UserError(f"config file {path} is not valid YAML{yaml_problem(e)}") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        _apply_override(raw, item)
    if source_shape is not None:
        raw = with_source_shape(raw, source_shape)
    return config_from_dict(raw, flat_era=False)


def config_from_dict(raw: dict, flat_era: bool = True) -> Config:
    """Validate a {section: {key: value}} dict (a parsed YAML file, a manifest's config) into a Config.
    `flat_era`: a manifest written before kinds owned their sections carries other kinds' fields (model:
    at the defaults of FLAT_ERA_DEFAULTS, diffusion: any, and fields since removed): loading it drops them.
    A user's YAML (load_config) gets no such leniency."""
    raw = {section: values for section, values in raw.items() if values is not None}  # `model:` alone
    if flat_era:
        raw = _drop_removed(raw)
    if "model" in raw:
        raw["model"] = model_section(raw["model"], flat_era)
    name = raw["model"].kind if "model" in raw else DEFAULT_KIND
    if "diffusion" in raw:
        raw["diffusion"] = kind_section("diffusion", raw["diffusion"], name, flat_era)
    else:
        raw["diffusion"] = get_kind(name).diffusion()
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise UserError(_message(e.errors()[0])) from None
    return validate(cfg)


def model_section(values, flat_era: bool = False) -> ModelSection:
    """The `model:` mapping -> the section of its kind (the union's discriminator is `kind`)."""
    if isinstance(values, ModelSection):
        return values
    if not isinstance(values, dict):
        raise UserError(f"config section 'model' must be a mapping, got {type(values).__name__}")
    name = values.get("kind", DEFAULT_KIND)
    if not isinstance(name, str):
        raise UserError(f"model.kind must be a string naming a kind, got {name!r}")
    return kind_section("model", values, name, flat_era)


def kind_section(section: str, values, name: str, flat_era: bool = False):
    """`model:` or `diffusion:` -> model.kind `name`'s class for it. A field of another kind's section is
    refused naming the kinds that have it; `flat_era`: dropped instead (model: only at the old defaults)."""
    cls = _section_class(get_kind(name), section)
    if isinstance(values, cls):
        return values
    if not isinstance(values, dict):
        raise UserError(f"config section '{section}' must be a mapping, got {type(values).__name__}")
    kept = {}
    for key, value in values.items():
        if key in cls.model_fields:
            kept[key] = value
            continue
        if f"{section}.{key}" in REMOVED:  # a removed option that changed what a model computed: never dropped
            raise UserError(f"{section}.{key} was removed: {REMOVED[f'{section}.{key}']}; delete it from the config")
        if flat_era and (section == "diffusion" or FLAT_ERA_DEFAULTS.get(key, object()) == value):
            continue
        owners = [k.name for k in registered().values() if key in _section_class(k, section).model_fields]
        if owners:
            raise UserError(f"{section}.{key} is a field of model.kind {' / '.join(owners)}, not of {name}; delete "
                            f"it (`looped_lm train --help-config {name}` lists {name}'s fields)")
        known = list(cls.model_fields)
        if not known:
            raise UserError(f"unknown config key '{section}.{key}': model.kind {name} has no {section} field; delete "
                            f"the section")
        raise UserError(f"unknown config key '{section}.{key}' for model.kind {name}{_suggest(key, known)}")
    try:
        return cls.model_validate(kept)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(_message({**err, "loc": (section, *err["loc"])}, {section: cls})) from None


def _section_class(kind, section: str) -> type:
    return kind.section if section == "model" else kind.diffusion


def _drop_removed(raw: dict) -> dict:
    """A manifest's fields that have since been removed and did nothing (NEVER_READ) are dropped."""
    out = dict(raw)
    for key in NEVER_READ:
        section, _, name = key.partition(".")
        if isinstance(out.get(section), dict) and name in out[section]:
            out[section] = {k: v for k, v in out[section].items() if k != name}
    return out


NEVER_READ = {  # removed fields that did nothing: a manifest that carries one loads without it
    "eval.stride": "it was never read; pass `looped_lm eval --stride`",
    "eval.max_tokens": "it was never read; pass `looped_lm eval --max-tokens`",
    "eval.draws": "it was never read; pass `looped_lm eval --draws`",
}
REMOVED = {  # removed options, with what replaced them
    "diffusion.noise": "noise: adaptive lost every measurement (docs/studies/results-history.md)",
    **NEVER_READ,
}


def _message(err: dict, sections: dict | None = None) -> str:
    """pydantic's first error as one line naming the key (`train.lr must be a number, got 'fast'`)."""
    sections = {**SECTIONS, **(sections or {})}
    loc, kind, value = err["loc"], err["type"], err.get("input")
    key = ".".join(str(p) for p in loc[:2]) + "".join(f"[{p}]" for p in loc[2:])
    if kind == "extra_forbidden":
        if key in REMOVED:
            return f"{key} was removed: {REMOVED[key]}; delete it from the config"
        if len(loc) == 1:
            return f"unknown config section '{loc[0]}'{_suggest(str(loc[0]), sections)}"
        return f"unknown config key '{key}'{_suggest(str(loc[1]), sections[loc[0]].model_fields)}"
    if len(loc) == 1:  # the section itself
        return f"config section '{loc[0]}' must be a mapping, got {type(value).__name__}"
    if len(loc) > 2 and loc[2] in ("int", "list[int]"):  # a field that takes an integer or a list of them
        return f"{'.'.join(str(p) for p in loc[:2])} must be an integer or a list of integers, got {value!r}"
    if kind == "literal_error":
        field = sections[loc[0]].model_fields[loc[1]]
        return f"{key} must be one of {', '.join(typing.get_args(field.annotation))} (got '{value}')"
    if kind == "list_type":
        return f"{key} must be a list of int, got {value!r}"
    what = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
            "finite": "finite"}
    for prefix, text in what.items():
        if kind.startswith(prefix):
            return f"{key} must be {text}, got {value!r}"
    return f"{key}: {err['msg']} (got {value!r})"


# how a trained model is run, never what it computes: a resume may change these freely, and generate / eval /
# serve / export may set them on a checkpoint they load (`--set`)
INFERENCE_KEYS = {"model": {"num_iterations", "max_iterations"},
                  "diffusion": {"num_iterations", "bridge", "last_call", "extra_calls", "sample_top_quantile"}}


def with_inference_overrides(raw: dict, overrides) -> dict:
    """A copy of a checkpoint's config dict with `section.key=value` items applied, each one of INFERENCE_KEYS
    (anything else would change what the weights compute, or how they were trained: refused, named)."""
    raw = {section: dict(values) if isinstance(values, dict) else values for section, values in raw.items()}
    for item in overrides:
        key = item.partition("=")[0]
        section, _, name = key.partition(".")
        if name not in INFERENCE_KEYS.get(section, ()):
            allowed = ", ".join(f"{s}.{n}" for s, names in INFERENCE_KEYS.items() for n in sorted(names))
            raise UserError(f"--set {key}: a loaded checkpoint may change only how it is run ({allowed})")
        _apply_override(raw, item)
    return raw


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise UserError(f"--set expects section.key=value, got '{item}' (no '=')")
    key, _, text = item.partition("=")
    if key.count(".") != 1 or not all(key.split(".")):
        raise UserError(f"--set key must look like section.key, got '{key}'")
    section, name = key.split(".")
    try:
        value = safe_load(text, f"--set {key}") if text != "" else ""
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


def validate(cfg: Config) -> Config:
    """The checked and resolved config, a new one (`cfg` is not written): each section's own checks
    (`Section.check`), the values left to work out (the tokenizer of model.init_from, the kind's `resolve`:
    db_ar's block count), then what reads several sections: the kind's own checks (`Kind.validate`), the
    blocks a run trains, the training mode, LoRA and the data source against the kind, the default K under
    its bound."""
    kind = kind_of(cfg)
    for section in (cfg.model, cfg.diffusion, cfg.data, cfg.train, cfg.deepspeed, cfg.eval):
        section.check()
    updates: dict[str, dict] = {}
    if isinstance(cfg.model, LanguageModelSection) and cfg.model.init_from:
        require(kind, "init_from", "model.init_from")
        if "tokenizer" not in cfg.data.model_fields_set:
            # the checkpoint's own tokenizer.json, absolute: the manifest's name must not depend on the cwd
            updates["data"] = {"tokenizer": str(Path(cfg.model.init_from).expanduser().absolute())}
    for name, values in kind.resolve(cfg).items():
        updates.setdefault(name, {}).update(values)
    cfg = with_updates(cfg, updates)
    kind.validate(cfg)
    if isinstance(cfg.diffusion, BlockDiffusion):
        _check_blocks(cfg.diffusion, kind.num_blocks(cfg))
    _check_training(cfg, kind)
    _check_data(cfg, kind)
    _check_iteration_bounds(cfg, kind)
    return cfg


def with_updates(cfg: Config, updates: dict[str, dict]) -> Config:
    """A copy of `cfg` with {section: {field: value}} set (values already checked); `cfg` is unchanged."""
    if not updates:
        return cfg
    return cfg.model_copy(update={name: getattr(cfg, name).model_copy(update=values) for name, values in updates.items()})


def _check_blocks(d: BlockDiffusion, n_blocks: int) -> None:
    if d.block_sampling == "fixed":
        ensure(len(d.block_weights) == n_blocks and all(w > 0 for w in d.block_weights),
               f"diffusion.block_sampling fixed needs diffusion.block_weights: {n_blocks} weights > 0, one per "
               f"block (got {d.block_weights})")
    else:
        ensure(not d.block_weights, f"diffusion.block_weights applies to block_sampling fixed (got "
                                    f"{d.block_sampling})")
    for b in d.blocks_to_train:
        ensure(0 <= b < n_blocks, f"diffusion.blocks_to_train has {b}, outside 0..{n_blocks - 1}")


def _check_training(cfg: Config, kind) -> None:
    t = cfg.train
    if t.mode == "block_parallel":
        require(kind, "block_parallel", "train.mode block_parallel")
        ensure(cfg.deepspeed.zero_stage == 0,
               f"train.mode block_parallel needs deepspeed.zero_stage 0 (got {cfg.deepspeed.zero_stage}): each rank "
               "already keeps optimiser state for its own block only, and ZeRO would partition it over ranks that "
               "train other blocks")
        # diffusion.block_sampling matters only when a rank owns several blocks: checked with the world size
        # (parallel.check_world)
    if t.lora_rank:
        require(kind, "lora", "train.lora_rank")
        ensure(bool(init_source(cfg)), "train.lora_rank needs model.init_from: adapters train on a pretrained base")


def _check_data(cfg: Config, kind) -> None:
    data = cfg.data
    ensure(data.source in kind.data_sources, f"model.kind {kind.name} reads data.source "
           f"{' / '.join(kind.data_sources)} (got {data.source})")
    if kind.data_sources[data.source]:
        ensure(data.path != "", f"data.path is required when data.source is {data.source} "
                                f"({kind.data_sources[data.source]})")
    ensure(data.test_fraction == 0 or kind.offers("language_model"),
           f"data.test_fraction splits a language model's token corpus; model.kind {kind.name} scores its own "
           "held-out split (`looped_lm eval --split`)")
    ensure(data.test_fraction == 0 or data.source != "bin",
           "data.test_fraction splits a corpus looped_lm tokenizes; a bin directory brings its own splits (score "
           "a held-out test.bin with `looped_lm eval --data`)")


def _check_iteration_bounds(cfg: Config, kind) -> None:
    """K at inference has one ceiling: model.max_iterations (itself at most MAX_ITERATIONS, so it cannot
    cancel the bound); the kind's default K must lie under it, and any other default step count under
    MAX_ITERATIONS."""
    top = getattr(cfg.model, "max_iterations", None)
    if top is not None:
        ensure(top <= MAX_ITERATIONS, f"model.max_iterations must be in 1..{MAX_ITERATIONS} (got {top})")
    limits = kind.iteration_limits(cfg)
    if limits is not None:
        where = "model.num_iterations" if "num_iterations" in type(cfg.model).model_fields else "diffusion.num_iterations"
        ensure(limits.default_iterations <= limits.max_iterations, f"{where} must be <= model.max_iterations "
               f"({limits.max_iterations}) (got {limits.default_iterations})")
    for key in ("num_iterations", "sample_steps"):
        steps = cfg.diffusion.model_dump().get(key, 0)
        ensure(steps <= MAX_ITERATIONS, f"diffusion.{key} must be <= {MAX_ITERATIONS} (got {steps})")
    recurrence = getattr(cfg.model, "mean_recurrence", None)  # huginn's training recurrence (a default K too)
    if recurrence is not None:
        ensure(recurrence <= MAX_ITERATIONS, f"model.mean_recurrence must be <= {MAX_ITERATIONS} (got {recurrence})")


def init_source(cfg: Config) -> str:
    """model.init_from, or '' for a kind whose section has none (only language models start from one)."""
    return cfg.model.init_from if isinstance(cfg.model, LanguageModelSection) else ""


def block_layers(cfg: Config) -> list[int]:
    """The layers of each block, block 0 (highest noise) first (the kind's layout: db_ar's split of
    model.n_layers, looped_db's one weight-tied core)."""
    return kind_of(cfg).block_layers(cfg)


def describe_fields(builtin_only: bool = False, kind: str | None = None) -> str:
    """Every config field with its type, default and doc: the text of `--help-config` (`kind`: only that
    kind's fields). The model and diffusion sections list the fields their base class gives every kind,
    then each group of kinds' own (a section class and the kinds whose section derives from it), so a
    shared field is listed once."""
    kinds = [get_kind(kind)] if kind is not None else [
        k for k in registered().values() if not builtin_only or k.name in BUILTIN_NAMES]
    lines = []
    for section, base in (("model", ModelSection), ("diffusion", DiffusionSection)):
        users: dict[type, list[str]] = {}
        for k in kinds:
            for cls in _section_class(k, section).__mro__:
                if isinstance(cls, type) and issubclass(cls, base) and cls is not base:
                    users.setdefault(cls, []).append(k.name)
        lines += [f"{section}:"] + _describe(base, base.model_fields)
        listed: dict[str, int] = {}  # one kind: a field a subclass redefines is listed once, as the kind has it
        for cls, names in sorted(users.items(), key=lambda item: len(item[0].__mro__)):
            own = [n for n in cls.__annotations__ if n != "kind" and n in cls.model_fields]
            if own:
                if kind is None:
                    lines.append(f"  # model.kind {' / '.join(names)}:")
                for name, line in zip(own, _describe(cls, own)):
                    if kind is not None and name in listed:
                        lines[listed[name]] = line
                    else:
                        listed[name] = len(lines)
                        lines.append(line)
        if section == "diffusion" and not users:
            lines.append(f"  # (none: model.kind {kinds[0].name} trains end to end)")
    for section, typ in SECTIONS.items():
        if section not in KIND_SECTIONS:
            lines.append(f"{section}:")
            lines += _describe(typ, typ.model_fields)
    return "\n".join(lines)


def _describe(section, names, indent: str = "  ") -> list[str]:
    lines = []
    for name in names:
        f = section.model_fields[name]
        default = f.get_default(call_default_factory=True)
        kinds = typing.get_args(f.annotation) if isinstance(f.annotation, types.UnionType) else ()
        typ = " or ".join(getattr(k, "__name__", str(k)) for k in kinds) or type(default).__name__
        lines.append(f"{indent}{name} ({typ}, default {default!r}): {f.description}")
    return lines


def write_reference(readme: Path) -> None:
    """Replace the fenced field list of configs/README.md with `describe_fields()`."""
    text = readme.read_text()
    start = text.index("```\n") + 4
    end = text.index("\n```", start)
    readme.write_text(text[:start] + describe_fields(builtin_only=True) + text[end:])


if __name__ == "__main__":  # python -m looped_lm.config: regenerate configs/README.md's field list
    write_reference(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "configs" / "README.md")
