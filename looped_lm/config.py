"""Typed run configuration, loaded from YAML and validated before anything is built.

One YAML file per run, with the sections below. Every field has a type, a default and a one-line
reason (its pydantic `description`, printed by `looped_lm train --help-config` and pasted into
configs/README.md by `python -m looped_lm.config`). Unknown keys, wrong types, repeated keys and
impossible values raise `UserError` naming the key, so a bad run fails in its first second.

    model:      what network to build: `model.kind` names a registered kind (looped_lm/kinds), whose own
                typed section this is (gpt, db_ar, looped_db, huginn; vit / dit / mdm: the supporting modules)
    diffusion:  DiffusionBlocks noise schedule, partition, training and sampling knobs
    data:       where tokens (images, characters) come from
    train:      optimisation, logging, checkpoints
    deepspeed:  ZeRO stage and precision
    eval:       perplexity protocol
"""

from __future__ import annotations

import math
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError

from looped_lm.errors import UserError
from looped_lm.fields import Float, Str
from looped_lm.fields import Section as _Section
from looped_lm.fields import field as _f
from looped_lm.kinds import LanguageModelSection, ModelSection, SequenceSection, get_kind, kind_of, registered, require
from looped_lm.kinds.builtin import BUILTIN

LORA_TARGETS = ("qkv", "proj", "gate_up", "down")  # the Linears of a layer that train.lora_targets may name
# the choices of each choice field
Partition = Literal["equi_probability", "uniform"]
Parameterization = Literal["edm", "likelihood"]
NoisyInput = Literal["noise", "prev_token"]
PosteriorInput = Literal["full", "detached", "topk"]
Head = Literal["tied", "cosine"]
CompileSetting = Literal["auto", "on", "off"]
LossWeight = Literal["none", "edm", "batch_mean"]
TargetScale = Literal["unit", "sigma_data"]
BlockSampling = Literal["uniform", "round_robin", "loss_share", "network_gain", "fixed"]
Bridge = Literal["soft", "hard", "sample"]
LastCall = Literal["edge", "sigma_min"]
Context = Literal["independent", "stacked"]
StackOrder = Literal["high_noise_first", "low_noise_first"]
Source = Literal["bible", "shakespeare", "files", "hf", "bin", "digits", "cifar10", "cifar100", "text8", "latents"]
MaskSchedule = Literal["linear", "cosine"]
Tokenizer = Literal["gpt2", "byte"]
ResumeChanges = Literal["refuse", "allow"]
TrainMode = Literal["data_parallel", "block_parallel"]

DEFAULT_KIND = "gpt"
COUNT_MAX = 2 ** 31 - 1  # steps, sequences, micro-batches: DeepSpeed and torch take them as 32/64-bit ints
MAX_ITERATIONS = 4096  # the hard ceiling of model.max_iterations (K at inference) and of any K or draw count
MAX_DRAWS = 4096  # eval's chains per ppl@k (`--draws`, eval.draws): each costs a full pass over the data
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


class DiffusionConfig(_Section):
    num_blocks: int = _f(4, "B: blocks that each own one interval of noise levels")
    layers_per_block: int | list[int] = _f(0, "db_ar: the layers of each block, instead of num_blocks: N (every block N "
                                           "deep, num_blocks = n_layers / N) or one count per block from block 0 "
                                           "(highest noise) down, e.g. [3, 1]; 0 = n_layers / num_blocks each")
    partition: Partition = _f("equi_probability", "block edges: equal noise mass (equi_probability) or equal ln-width")
    curve_every: int = _f(200, "block_sampling loss_share / network_gain: re-measure held-out CE(sigma) every N steps")
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
    p_mean: Float = _f(-1.2, "mean of ln(sigma) for training noise (EDM's; looped_db: set 1.0, docs/method.md §8)")
    p_std: Float = _f(1.2, "std of ln(sigma) for training noise")
    sigma_min: Float = _f(0.002, "lowest noise level")
    sigma_max: Float = _f(80.0, "highest noise level")
    sigma_data: Float = _f(0.5, "EDM sigma_data")
    loss_weight: LossWeight = _f("none", "CE weight per sample: none, edm (normalised w(sigma)) or batch_mean")
    target_scale: TargetScale = _f("unit", "noisy targets are unit-norm embeddings (unit) or per-dim RMS sigma_data")
    target_fraction: Float = _f(1.0, "share of noisy slots trained per sequence (clean stream stays whole)")
    blocks_to_train: list[int] = _f([], "train only these blocks (others frozen, no optimiser state; the checkpoint "
                                    "records them, and `looped_lm merge` joins such jobs); [] = all")
    block_sampling: BlockSampling = _f("network_gain", "which block a step trains: uniform (paper), round_robin, "
                             "network_gain (in proportion to what the network adds to z's own likelihood in each "
                             "block's interval: block 0 learns the whole context prior; uniform until the first "
                             "curve), loss_share (to each block's share of the CE drop, which counts what z gives "
                             "for free) or fixed (diffusion.block_weights); train.mode block_parallel: "
                             "which of its own blocks a rank trains (uniform, round_robin or fixed)")
    block_weights: list[Float] = _f([], "block_sampling fixed: one weight per block, block 0 (highest noise) first, "
                                    "e.g. [3, 1, 1]: block 0 gets 60 % of the steps; normalised")
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
    test_fraction: Float = _f(0.0, "share of documents held out as a test split (test.bin), apart from validation "
                              "and never read in training: choose settings on val, report on test "
                              "(`looped_lm eval --split test`); 0 = no test split")
    split_seed: int = _f(-1, "seed of the train / validation document split; -1 = train.seed (so a seed sweep "
                         "that must score on the same held-out documents sets this once)")
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
    log_every: int = _f(10, "metrics.jsonl / TensorBoard / the progress bar's loss every N steps (the only steps that "
                               "read the loss back from the device)")
    compile: CompileSetting = _f("auto", "torch.compile the training loss (gpt, db_ar, looped_db) or huginn's layers: "
                                         "auto = on CUDA, off elsewhere (looped_lm/compile.py)")
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


class DeepSpeedConfig(_Section):
    zero_stage: int = _f(0, "ZeRO stage 0, 1 or 2")
    bf16: bool = _f(False, "bf16 mixed precision (GPUs); fp32 when false. ZeRO 0: DeepSpeed's bf16 weights and "
                    "Adam state; ZeRO 1/2: fp32 master copies; train.mode block_parallel: bf16 compute under autocast, "
                    "fp32 weights and optimizer state")


class EvalConfig(_Section):
    block_size: int = _f(0, "perplexity window; 0 = model.seq_len")
    stride: int = _f(0, "0 = disjoint blocks (primary); S = sliding windows scoring the last S tokens")
    max_tokens: int = _f(0, "score at most this many tokens; 0 = all")
    draws: int = _f(4, "DB models: chains averaged per ppl@k (at most 4096: each is a full pass over the data)")


class Config(BaseModel):
    """The run. `model` is the section of `model.kind`'s plugin (a discriminated union over the registry,
    resolved by `config_from_dict`: out-of-tree kinds join it by registering)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: SerializeAsAny[ModelSection] = Field(default_factory=lambda: get_kind(DEFAULT_KIND).section())
    diffusion: DiffusionConfig = Field(default_factory=DiffusionConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return self.model_dump()


SECTIONS = {name: f.annotation for name, f in Config.model_fields.items()}
SECTIONS["model"] = ModelSection


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
            raw = _safe_load(text, f"config file {path}") or {}
        except OSError as e:
            raise UserError(f"cannot read config file {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise UserError(f"config file {path} is not UTF-8 text (bad byte at offset {e.start})") from None
        except yaml.YAMLError as e:
            raise UserError(f"config file {path} is not valid YAML{_yaml_problem(e)}") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        _apply_override(raw, item)
    return config_from_dict(raw, flat_era=False)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """' at line L, column C: <problem>' on one line (PyYAML's own text spans several)."""
    if isinstance(e, yaml.reader.ReaderError):  # a NUL or control byte: its offset, not PyYAML's two lines
        code = e.character if isinstance(e.character, int) else ord(e.character[:1] or "\0")
        return f": character #x{code:04x} at offset {e.position} is not allowed in YAML ({e.reason})"
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"{where}: {problem}"


def _safe_load(text: str, what: str):
    """yaml.safe_load, with what it raises besides YAMLError named in one line: an integer too long for
    Python's int-from-text limit (ValueError), or an alias nested in itself (a recursive structure)."""
    try:
        value = yaml.safe_load(text)
    except ValueError:  # int("9" * 5000): "Exceeds the limit (4300 digits) for integer string conversion"
        raise UserError(f"{what}: an integer has more than {sys.get_int_max_str_digits()} digits (Python's limit "
                        "for reading one); no config value needs that many") from None
    _refuse_recursion(value, what)
    return value


def _refuse_recursion(value, what: str, inside: tuple = ()) -> None:
    """`a: &x [*x]` makes a list that contains itself: refused (validation would recurse forever)."""
    if isinstance(value, (list, dict)):
        if any(value is seen for seen in inside):
            raise UserError(f"{what}: a YAML alias refers to a node that contains it (a self-referencing anchor)")
        for item in value.values() if isinstance(value, dict) else value:
            _refuse_recursion(item, what, inside + (value,))


def _refuse_duplicate_keys(node, path: str, where: str = "", inside: tuple = ()) -> None:
    """YAML lets a repeated key silently take the last value; a config must not."""
    if any(node is seen for seen in inside):  # an anchor aliased inside itself: _safe_load names it
        return
    inside = inside + (node,)
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
            _refuse_duplicate_keys(value_node, path, f"{where}{key}." if key is not None else where, inside)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path, where, inside)


def config_from_dict(raw: dict, flat_era: bool = True) -> Config:
    """Validate a {section: {key: value}} dict (a parsed YAML file, a manifest's config) into a Config.
    `flat_era`: drop other kinds' model fields at the defaults older manifests wrote (FLAT_ERA_DEFAULTS);
    a user's YAML (load_config) gets no such leniency."""
    raw = {section: values for section, values in raw.items() if values is not None}  # `model:` alone
    if "model" in raw:
        raw["model"] = model_section(raw["model"], flat_era)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise UserError(_message(e.errors()[0])) from None
    validate(cfg)
    return cfg


def model_section(values, flat_era: bool = False) -> ModelSection:
    """The `model:` mapping -> the section of its kind (the union's discriminator is `kind`)."""
    if isinstance(values, ModelSection):
        return values
    if not isinstance(values, dict):
        raise UserError(f"config section 'model' must be a mapping, got {type(values).__name__}")
    name = values.get("kind", DEFAULT_KIND)
    if not isinstance(name, str):
        raise UserError(f"model.kind must be a string naming a kind, got {name!r}")
    section = get_kind(name).section
    kept = {}
    for key, value in values.items():
        if key in section.model_fields:
            kept[key] = value
            continue
        owners = [k.name for k in registered().values() if key in k.section.model_fields]
        if flat_era and key in FLAT_ERA_DEFAULTS and value == FLAT_ERA_DEFAULTS[key]:
            continue
        if owners:
            raise UserError(f"model.{key} is a field of model.kind {' / '.join(owners)}, not of {name}; delete it "
                            f"(`looped_lm train --help-config` lists each kind's fields)")
        known = list(section.model_fields)
        raise UserError(f"unknown config key 'model.{key}' for model.kind {name}{_suggest(key, known)}")
    try:
        return section.model_validate(kept)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(_message({**err, "loc": ("model", *err["loc"])}, {"model": section})) from None


REMOVED = {  # options the quality study measured worse everywhere (docs/results.md)
    "diffusion.noise": "noise: adaptive lost every measurement",
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


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise UserError(f"--set expects section.key=value, got '{item}' (no '=')")
    key, _, text = item.partition("=")
    if key.count(".") != 1 or not all(key.split(".")):
        raise UserError(f"--set key must look like section.key, got '{key}'")
    section, name = key.split(".")
    try:
        value = _safe_load(text, f"--set {key}") if text != "" else ""
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
    """The checks of every run; then the kind's own (`Kind.validate`)."""
    m, d, t = cfg.model, cfg.diffusion, cfg.train
    kind = kind_of(cfg)
    for key in ("n_layers", "d_model", "n_heads"):
        _require(getattr(m, key) >= 1, f"model.{key} must be >= 1 (got {getattr(m, key)})")
    _require(m.d_model % m.n_heads == 0, f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    _require((m.d_model // m.n_heads) % 2 == 0, "model.d_model / model.n_heads must be even (RoPE rotates pairs)")
    _require(m.ffn_hidden >= 0, f"model.ffn_hidden must be >= 0 (got {m.ffn_hidden})")
    _require(m.init_std > 0 and m.norm_eps > 0, "model.init_std and norm_eps must be > 0")
    if isinstance(m, SequenceSection):
        _require(m.seq_len >= 1, f"model.seq_len must be >= 1 (got {m.seq_len})")
        _require(m.rope_theta > 0, f"model.rope_theta must be > 0 (got {m.rope_theta})")
    if isinstance(m, LanguageModelSection):
        _require(m.vocab_size >= 0, f"model.vocab_size must be >= 0 (got {m.vocab_size})")
        _require(m.loss_chunk >= 0, f"model.loss_chunk must be >= 0 (got {m.loss_chunk})")
        if m.init_from:
            require(kind, "init_from", "model.init_from")
            if "tokenizer" not in cfg.data.model_fields_set:
                # the checkpoint's own tokenizer.json, absolute: the manifest's name must not depend on the cwd
                cfg.data.tokenizer = str(Path(m.init_from).expanduser().absolute())

    _require(d.num_blocks >= 1, f"diffusion.num_blocks must be >= 1 (got {d.num_blocks})")
    if not kind.offers("layer_split"):
        _require(d.layers_per_block in (0, []), f"diffusion.layers_per_block applies to kinds with a layer split "
                 f"(db_ar), not {kind.name} (got {d.layers_per_block!r})")
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
    _check_iteration_bounds(cfg)
    kind.validate(cfg)  # before the block checks: db_ar's layers_per_block sets num_blocks
    n_blocks = kind.num_blocks(cfg)
    if d.block_sampling == "fixed":
        _require(len(d.block_weights) == n_blocks and all(w > 0 for w in d.block_weights),
                 f"diffusion.block_sampling fixed needs diffusion.block_weights: {n_blocks} weights > 0, one per "
                 f"block (got {d.block_weights})")
    else:
        _require(not d.block_weights, f"diffusion.block_weights applies to block_sampling fixed (got "
                                      f"{d.block_sampling})")
    for b in d.blocks_to_train:
        _require(0 <= b < n_blocks, f"diffusion.blocks_to_train has {b}, outside 0..{n_blocks - 1}")
    _require(len(set(d.blocks_to_train)) == len(d.blocks_to_train),
             f"diffusion.blocks_to_train has duplicates: {d.blocks_to_train}")
    if d.context == "stacked":
        require(kind, "stacked_context", "diffusion.context stacked")
        _require(not d.blocks_to_train, "diffusion.context stacked cannot train independent block jobs "
                 "(diffusion.blocks_to_train): block b's clean stream runs blocks < b's current weights, so a "
                 "block trained apart would read stale ones; train every block in one run (train.mode "
                 "data_parallel or block_parallel)")

    if t.mode == "block_parallel":
        require(kind, "block_parallel", "train.mode block_parallel")
        _require(cfg.deepspeed.zero_stage == 0,
                 f"train.mode block_parallel needs deepspeed.zero_stage 0 (got {cfg.deepspeed.zero_stage}): each rank "
                 "already keeps optimiser state for its own block only, and ZeRO would partition it over ranks that "
                 "train other blocks")
        # diffusion.block_sampling matters only when a rank owns several blocks: checked with the world size
        # (parallel.check_world)

    for key in ("max_steps", "batch_size", "grad_accum"):
        _require(1 <= getattr(t, key) <= COUNT_MAX, f"train.{key} must be in 1..{COUNT_MAX} (got {getattr(t, key)})")
    for key in ("warmup_steps", "save_every", "eval_every", "eval_batches", "log_every", "keep_last", "skip_nonfinite"):
        _require(getattr(t, key) <= COUNT_MAX, f"train.{key} must be <= {COUNT_MAX} (got {getattr(t, key)})")
    _require(t.lr > 0, f"train.lr must be > 0 (got {t.lr})")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr must be in [0, train.lr] (got {t.min_lr})")
    for key in ("warmup_steps", "save_every", "eval_every", "weight_decay", "grad_clip", "skip_nonfinite"):
        _require(getattr(t, key) >= 0, f"train.{key} must be >= 0 (got {getattr(t, key)})")
    _require(t.eval_batches >= 1, f"train.eval_batches must be >= 1 (got {t.eval_batches}); train.eval_every: 0 "
                                  "turns validation off")
    # the seed and its offsets (seed + rank, seed + batch) must fit torch's and the data hash's 64-bit seeds
    _require(0 <= t.seed < 2 ** 62, f"train.seed must be in 0..2**62 - 1 (got {t.seed})")
    _require(t.log_every >= 1 and t.keep_last >= 1, "train.log_every and train.keep_last must be >= 1")
    _require(math.isfinite(t.peak_tflops) and t.peak_tflops >= 0, f"train.peak_tflops must be >= 0 (got {t.peak_tflops})")
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
    _require(t.out_dir != "", "train.out_dir must not be empty")
    _require(t.lora_rank >= 0, f"train.lora_rank must be >= 0 (got {t.lora_rank})")
    if t.lora_rank:
        require(kind, "lora", "train.lora_rank")
        _require(bool(m.init_from), "train.lora_rank needs model.init_from: adapters train on a pretrained base")
        _require(t.lora_alpha > 0 and 0 <= t.lora_dropout < 1,
                 "train.lora_alpha must be > 0 and train.lora_dropout in [0, 1)")
        _require(bool(t.lora_targets), f"train.lora_targets is empty: name at least one of {', '.join(LORA_TARGETS)}")
    # checked with or without train.lora_rank: a misspelt target is refused, not kept until a LoRA run reads it
    bad = [name for name in t.lora_targets if name not in LORA_TARGETS]
    _require(not bad, f"train.lora_targets has {bad[0]!r}: no such module (have: {', '.join(LORA_TARGETS)})"
             if bad else "")

    _require(cfg.deepspeed.zero_stage in (0, 1, 2), f"deepspeed.zero_stage must be 0, 1 or 2 (got {cfg.deepspeed.zero_stage})")
    if cfg.data.source in ("files", "hf", "bin", "cifar10", "cifar100", "text8", "latents"):
        _require(cfg.data.path != "", f"data.path is required when data.source is {cfg.data.source}")
    _require(cfg.data.test_fraction == 0 or kind.offers("language_model"),
             f"data.test_fraction splits a language model's token corpus; model.kind {kind.name} scores its own "
             "held-out split (`looped_lm eval --split`)")
    _require(cfg.data.test_fraction == 0 or cfg.data.source != "bin",
             "data.test_fraction splits a corpus looped_lm tokenizes; a bin directory brings its own splits (score "
             "a held-out test.bin with `looped_lm eval --data`)")
    _require(cfg.data.source in kind.data_sources, f"model.kind {kind.name} reads data.source "
             f"{' / '.join(kind.data_sources)} (got {cfg.data.source})")
    _require(0 < cfg.data.val_fraction < 1, f"data.val_fraction must be in (0, 1) (got {cfg.data.val_fraction})")
    _require(0 <= cfg.data.test_fraction < 1 - cfg.data.val_fraction,
             f"data.test_fraction must be in [0, 1 - data.val_fraction) = [0, {1 - cfg.data.val_fraction:g}) "
             f"(got {cfg.data.test_fraction})")
    _require(-1 <= cfg.data.split_seed < 2 ** 62, f"data.split_seed must be -1 (train.seed) or in 0..2**62 - 1 "
                                                 f"(got {cfg.data.split_seed})")
    e = cfg.eval
    for key in ("block_size", "stride", "max_tokens"):
        _require(getattr(e, key) >= 0, f"eval.{key} must be >= 0 (got {getattr(e, key)})")
    _require(1 <= e.draws <= MAX_DRAWS, f"eval.draws must be in 1..{MAX_DRAWS} (got {e.draws})")


def _check_iteration_bounds(cfg: Config) -> None:
    """K at inference has one ceiling: model.max_iterations (itself at most MAX_ITERATIONS, so it cannot
    cancel the bound); a default K (diffusion.num_iterations, sampler steps) must lie under it."""
    m, d = cfg.model, cfg.diffusion
    top = getattr(m, "max_iterations", None)
    if top is not None:
        _require(top <= MAX_ITERATIONS, f"model.max_iterations must be in 1..{MAX_ITERATIONS} (got {top})")
    ceiling = f"model.max_iterations ({top})" if top is not None else str(MAX_ITERATIONS)
    _require(d.num_iterations <= (top or MAX_ITERATIONS), f"diffusion.num_iterations must be <= {ceiling} (got "
                                                          f"{d.num_iterations})")
    _require(d.sample_steps <= MAX_ITERATIONS, f"diffusion.sample_steps must be <= {MAX_ITERATIONS} (got "
                                               f"{d.sample_steps})")
    recurrence = getattr(m, "mean_recurrence", None)  # huginn's training recurrence (a default K too)
    if recurrence is not None:
        _require(recurrence <= MAX_ITERATIONS, f"model.mean_recurrence must be <= {MAX_ITERATIONS} (got {recurrence})")


def init_source(cfg: Config) -> str:
    """model.init_from, or '' for a kind whose section has none (only language models start from one)."""
    return cfg.model.init_from if isinstance(cfg.model, LanguageModelSection) else ""


def block_layers(cfg: Config) -> list[int]:
    """The layers of each block, block 0 (highest noise) first (the kind's layout: db_ar's split of
    model.n_layers, looped_db's one weight-tied core)."""
    return kind_of(cfg).block_layers(cfg)


def describe_fields(builtin_only: bool = False) -> str:
    """Every config field with its type, default and doc: the text of `--help-config`. The model section
    lists the fields every kind has, then each group of kinds' own (a section class and the kinds whose
    section derives from it), so a shared field is listed once."""
    users: dict[type, list[str]] = {}
    for kind in registered().values():
        if builtin_only and kind.name not in BUILTIN_NAMES:
            continue
        for cls in kind.section.__mro__:
            if isinstance(cls, type) and issubclass(cls, ModelSection) and cls is not ModelSection:
                users.setdefault(cls, []).append(kind.name)
    lines = ["model:"] + _describe(ModelSection, ModelSection.model_fields)
    for cls, names in sorted(users.items(), key=lambda item: len(item[0].__mro__)):
        own = [n for n in cls.__annotations__ if n != "kind" and n in cls.model_fields]
        if own:
            lines.append(f"  # model.kind {' / '.join(names)}:")
            lines += _describe(cls, own)
    for section, typ in SECTIONS.items():
        if section != "model":
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
