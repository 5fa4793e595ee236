"""Checkpoints: `model.safetensors` + `optimizer/` + `rng/` + `manifest.json`.

Layout of one checkpoint, `out_dir/step_0000500/`:
    model.safetensors   full model weights (what eval, generate, serve and export read)
    optimizer/<unit>.safetensors   AdamW moments by parameter name and the step count of each optimiser
                        unit ("shared", "block0", ...; optim.state_by_name), for resume only: whole
                        tensors, so any ZeRO stage, world size or train.mode resumes them (the LR follows
                        from the step). Checkpoints written before this layout hold DeepSpeed's own files
                        (`optimizer/ds/`, `optimizer_layout` absent): those resume at their own stage.
    rng/rank{r}.pt      torch / numpy / python RNG states of each rank
    manifest.json       (manifest.Manifest) config, tokenizer, step, data position, model metadata (edges...), the blocks this
                        run trained (`ownership`: what `looped_lm merge` joins), and the integrity record:
                        every other file with its size and sha256, then the sha256 of the manifest's own
                        content (`manifest_sha256`); written LAST

Every rank writes into `out_dir/.tmp-step_0000500/`, then rank 0 writes the manifest and renames the
directory. A step directory without a manifest is not a checkpoint. Reading verifies: resume checks
every file, inference the files it loads (`verify=False` checks presence and sizes only). Anything
missing, edited or corrupted is refused with one line naming the file.

The tensor files themselves (weights, RNG states) are read and written by tensor_files.py. This module imports
torch, safetensors.torch and the models only inside the functions that touch tensors (each says so): the CLI reads
manifests before deciding to start anything heavy, and torch costs seconds at start-up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

from safetensors import safe_open

from looped_lm import __version__
from looped_lm.config import Config, config_from_dict, with_inference_overrides
from looped_lm.data.tokenizer import run_vocab
from looped_lm.errors import UserError
from looped_lm.kinds import kind_of
from looped_lm.manifest import OPTIMIZER_BY_UNIT, Manifest
from looped_lm.pretrained import load_base

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
OPTIMIZER_DIR = "optimizer"
FORMAT_VERSION = 2  # 1: a hash of the weights only (read for inference; resumed only without verification)
NO_VERIFY_HELP = ("skip the sha256 of the checkpoint's files and of its manifest (slow on big checkpoints); "
                  "presence, sizes, step and shapes are still checked")
_STEP_DIR = re.compile(r"step_(\d+)")


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def step_of(path: Path) -> int | None:
    """The step a directory name stands for (`step_0000500` -> 500), else None."""
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's content without its own hash (canonical JSON: sorted keys)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def add_verify_argument(p) -> None:
    p.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)


def add_set_argument(p) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="run the checkpoint with another inference setting (repeatable): diffusion.extra_calls, "
                        "last_call, sample_top_quantile, bridge, num_iterations, or model.max_iterations")


def no_verify_note() -> str:
    return f"note: --no-verify: {NO_VERIFY_HELP}"


# ---------------------------------------------------------------------------------------------
# writing (the trainer calls these; see train.save)


def tmp_dir_for(out_dir: Path, step: int) -> Path:
    return out_dir / f".tmp-{step_dir_name(step)}"


def unit_path(root: Path, unit: str) -> Path:
    """optimizer/<unit>.safetensors: one optimiser unit's state by parameter name (optim.state_by_name)."""
    return Path(root) / OPTIMIZER_DIR / f"{unit}.safetensors"


def write_unit_state(tmp: Path, unit: str, step: int, tensors: dict) -> None:
    """The state of one unit ("shared", "block0", ...): AdamW moments per parameter name, its step count."""
    from safetensors.torch import save_file  # torch: seconds at start-up (see the module's docstring)

    path = unit_path(tmp, unit)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path),
              metadata={"unit": unit, "step": str(step)})


def read_unit_state(ckpt: Path, unit: str) -> tuple[int, dict]:
    """(step, tensors) of one unit of a verified checkpoint (`optimizer_layout` units)."""
    path = unit_path(ckpt, unit)
    if not path.is_file():
        raise UserError(f"cannot resume from {ckpt}: it holds no optimizer state for {unit} ({OPTIMIZER_DIR}/"
                        f"{path.name}): the run that wrote it did not train {unit}")
    with safe_open(str(path), "pt") as f:
        step = int((f.metadata() or {}).get("step", 0))
        return step, {k: f.get_tensor(k) for k in f.keys()}


def optimizer_layout(manifest: dict) -> str:
    """units: optimiser state by parameter name (any ZeRO stage, world size or mode resumes it);
    deepspeed: DeepSpeed's own engine files (older checkpoints: same stage and, at ZeRO >= 1, world size)."""
    return Manifest.from_dict(manifest).layout


def file_records(root: Path) -> dict:
    """{relative path: {"size", "sha256"}} of every file under root except the manifest."""
    return {rel: {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}
            for rel in sorted(_names_on_disk(root))}


def write_manifest(ckpt: Path, manifest: Manifest | dict) -> Manifest:
    """Complete `manifest` (a dict: one written by hand, as tests and tools do) with the integrity record of
    `ckpt`'s files and its own hash; write it."""
    if isinstance(manifest, dict):
        manifest = Manifest.from_dict(manifest)
    manifest = manifest.replace(format_version=FORMAT_VERSION, looped_lm_version=__version__,
                                files=file_records(ckpt))
    if (ckpt / WEIGHTS).is_file():  # each tensor's dtype, which a load checks like its name and shape
        from looped_lm.tensor_files import weights_header  # torch: seconds at start-up (see the module's docstring)

        manifest = manifest.replace(weights_dtypes=weights_header(ckpt / WEIGHTS)[1])
    manifest = manifest.replace(manifest_sha256=manifest_digest(manifest.to_dict()))
    with open(ckpt / MANIFEST, "w") as f:
        json.dump(manifest.to_dict(), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def finalize(out_dir: Path, step: int, model, manifest: Manifest | dict, keep_last: int) -> Path:
    """Rank 0, after every rank has written its part: weights, manifest, atomic rename, pruning."""
    from looped_lm.tensor_files import save_weights  # torch: seconds at start-up (see the module's docstring)

    tmp = tmp_dir_for(out_dir, step)
    save_weights(model, tmp / WEIGHTS)
    if isinstance(manifest, dict):
        manifest = Manifest.from_dict(manifest)
    write_manifest(tmp, manifest.replace(step=step))
    final = out_dir / step_dir_name(step)
    old = out_dir / f".old-{final.name}"
    if final.exists():  # an older save of the same step (e.g. a run started over): replace it
        remove_checkpoint(old)
        os.replace(final, old)
    os.replace(tmp, final)
    remove_checkpoint(old)
    # keep_last counts this run's line of checkpoints: steps beyond this one (an earlier run in the same
    # out_dir, started over with resume: never) are not this save's to prune. This checkpoint is the newest
    # of that line and its weights are finite (save_weights refuses NaN / Inf), so pruning never removes
    # the newest finite checkpoint; it is kept explicitly all the same.
    for stale in [p for p in list_checkpoints(out_dir) if step_of(p) <= step][:-keep_last]:
        if stale.resolve() != final.resolve():
            remove_checkpoint(stale)
    return final


def remove_checkpoint(path: Path) -> None:
    """Manifest first: an interrupted removal leaves an incomplete directory, never a checkpoint
    that claims files it no longer has."""
    if not path.exists():
        return
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path)


# ---------------------------------------------------------------------------------------------
# finding


def step_dirs(out_dir: Path) -> list[Path]:
    """Every `step_N` directory in out_dir, complete or not, by step."""
    if not out_dir.is_dir():
        return []
    found = [p for p in out_dir.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints (a manifest is present), oldest first."""
    return [p for p in step_dirs(out_dir) if (p / MANIFEST).is_file()]


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory as given, or for a run directory (train.out_dir) its newest complete
    checkpoint, announced on stderr."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint directory not found: {path}")
    if not path.is_dir():
        raise UserError(f"checkpoint path is not a directory: {path}")
    if (path / MANIFEST).exists() or step_of(path) is not None or not step_dirs(path):
        return path  # a checkpoint (read_manifest says what is wrong with it, if anything)
    complete = list_checkpoints(path)
    newest = step_dirs(path)[-1]
    if not complete:
        raise UserError(f"{path} holds no complete checkpoint ({newest.name} has no {MANIFEST})")
    skipped = f"; {newest.name} has no {MANIFEST} and was skipped" if newest != complete[-1] else ""
    print(f"checkpoint: {complete[-1]} (the newest complete one in {path}{skipped})", file=sys.stderr)
    return complete[-1]


# ---------------------------------------------------------------------------------------------
# reading and verifying


def _fail(path: Path, what: str) -> UserError:
    return UserError(f"{path}: {what}")


def read_manifest(ckpt: str | Path, verify: bool = True) -> dict:
    """The checked manifest of `ckpt`: its own hash (if verify), field types, and its step against the
    directory name. The files it lists are checked by `verify_files`."""
    ckpt = Path(ckpt)
    if not ckpt.exists():
        raise UserError(f"checkpoint directory not found: {ckpt}")
    if not ckpt.is_dir():
        raise UserError(f"checkpoint path is not a directory: {ckpt}")
    path = ckpt / MANIFEST
    if not path.is_file():
        raise UserError(f"{ckpt} is not a complete checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _fail(path, f"corrupted ({e})") from None
    if not isinstance(manifest, dict):
        raise _fail(path, "corrupted (not a JSON object)")
    version = manifest.get("format_version")
    if version not in (1, FORMAT_VERSION):
        raise _fail(path, f"format_version {version!r} is not one this looped_lm ({__version__}) reads (1, 2)")
    if version >= 2 and verify and manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise _fail(path, "modified after it was written (its content does not match its manifest_sha256); "
                          "refusing it (--no-verify skips this check)")
    fields = {"config": dict, "step": int, "vocab_size": int, "tokenizer": str}
    fields.update({"files": dict, "world_size": int} if version >= 2 else {"weights_sha256": str})
    for key, typ in fields.items():
        if key not in manifest:
            raise _fail(path, f"incomplete: no '{key}'")
        value = manifest[key]
        if not isinstance(value, typ) or isinstance(value, bool) or (typ is int and value < 0):
            raise _fail(path, f"'{key}' must be {'a non-negative integer' if typ is int else typ.__name__}, "
                              f"got {value!r}")
    if not isinstance(manifest.get("model_state", {}), dict):
        raise _fail(path, f"'model_state' must be an object, got {manifest['model_state']!r}")
    dtypes = manifest.get("weights_dtypes", {})
    if not isinstance(dtypes, dict) or not all(isinstance(v, str) for v in dtypes.values()):
        raise _fail(path, f"'weights_dtypes' must be an object of tensor name -> dtype, got {dtypes!r}")
    named = step_of(ckpt)
    if named is not None and named != manifest["step"]:
        raise _fail(path, f"says step {manifest['step']}, but the directory is {ckpt.name}")
    if version >= 2:
        _check_file_records(path, manifest["files"])
        _check_world_size(path, manifest["world_size"], manifest["files"])
    return manifest


def _check_world_size(path: Path, world: int, files: dict) -> None:
    """world_size against the RNG states on record: a save writes rng/rank{r}.pt for every rank r (a merge
    writes none, world size 1). A resume on another world size is allowed and said (preflight.check_resume's
    note); a world_size that disagrees with the files is refused here, before anything reads it."""
    if world < 1:
        raise _fail(path, f"'world_size' must be >= 1, got {world}")
    ranks = sorted(int(m.group(1)) for rel in files if (m := re.fullmatch(r"rng/rank(\d+)\.pt", rel)))
    if ranks and ranks != list(range(world)):
        raise _fail(path, f"'world_size' is {world}, but it holds the RNG state of {len(ranks)} rank(s) "
                          f"(rng/rank{ranks[0]}.pt..rng/rank{ranks[-1]}.pt)")


def _check_file_records(path: Path, files: dict) -> None:
    for rel, rec in files.items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts:
            raise _fail(path, f"lists a path outside the checkpoint: {rel!r}")
        ok = isinstance(rec, dict) and isinstance(rec.get("size"), int) and not isinstance(rec.get("size"), bool) \
            and isinstance(rec.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", rec["sha256"])
        if not ok:
            raise _fail(path, f"the record of {rel} must be {{\"size\": bytes, \"sha256\": hex}}, got {rec!r}")
    if WEIGHTS not in files:
        raise _fail(path, f"does not list {WEIGHTS}")


def verify_files(ckpt: Path, manifest: dict, names=None, verify: bool = True) -> None:
    """The listed files `names` (None = all) exist with the recorded size and, if verify, sha256."""
    ckpt = Path(ckpt)
    if manifest["format_version"] == 1:  # weights hash only
        names = [WEIGHTS] if names is None else names
        files = {WEIGHTS: {"sha256": manifest["weights_sha256"]}}
    else:
        files = manifest["files"]
    for rel in files if names is None else names:
        if rel not in files:
            raise _fail(ckpt / MANIFEST, f"does not list {rel}")
        rec, p = files[rel], ckpt / rel
        if not p.is_file():
            raise UserError(f"{p} is missing (its manifest lists it): the checkpoint is incomplete")
        size = p.stat().st_size
        if "size" in rec and size != rec["size"]:
            raise UserError(f"{p} has {size} bytes but its manifest records {rec['size']}: the file is "
                            "truncated or was replaced")
        if verify and sha256_file(p) != rec["sha256"]:
            raise UserError(f"{p} does not match the sha256 in its manifest: the file is corrupted")


def weights_only(manifest: dict) -> str | None:
    """What a checkpoint without optimizer and RNG state is (Manifest.weights_only), None: a training checkpoint."""
    return Manifest.from_dict(manifest).weights_only


def verify_checkpoint(ckpt: str | Path, verify: bool = True, ranks: int | None = None) -> dict:
    """Everything a resume reads: the manifest, every listed file, no unlisted file, and the RNG state
    of each of `ranks` (default: the manifest's world size). Returns the manifest."""
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt, verify)
    if manifest["format_version"] == 1:
        if verify:
            raise _fail(ckpt / MANIFEST, "format_version 1 records the weights only, not the optimizer and RNG "
                                         "files a resume reads; pass --no-verify to resume from it anyway")
        verify_files(ckpt, manifest, None, verify)
        return manifest
    files = manifest["files"]
    if weights_only(manifest) is None:
        _require_resume_files(ckpt, manifest, ranks)
    verify_files(ckpt, manifest, None, verify)
    extra = sorted(set(_names_on_disk(ckpt)) - set(files))
    if extra:
        raise UserError(f"{ckpt / extra[0]} is not in its checkpoint's manifest (added after the save?)")
    return manifest


def _require_resume_files(ckpt: Path, manifest: dict, ranks: int | None) -> None:
    files = manifest["files"]
    for r in range(manifest["world_size"] if ranks is None else min(ranks, manifest["world_size"])):
        if f"rng/rank{r}.pt" not in files:
            raise _fail(ckpt / MANIFEST, f"does not list rng/rank{r}.pt (the RNG state of rank {r})")
    if not any(rel.startswith("optimizer/") for rel in files):
        raise _fail(ckpt / MANIFEST, "lists no optimizer/ files (the optimizer state a resume loads)")


def _names_on_disk(root: Path) -> list[str]:
    return [rel for rel in (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
            if rel != MANIFEST]


def config_of(manifest: Manifest | dict, ckpt: Path | None = None, overrides=()) -> Config:
    """The checkpoint's run config, with inference `overrides` (`--set section.key=value`) applied."""
    raw = manifest.config if isinstance(manifest, Manifest) else manifest["config"]
    train = raw.get("train") if isinstance(raw, dict) else None
    if isinstance(train, dict) and train.get("lora_rank") and "lora_ada" not in train:
        # an adapter checkpoint from before train.lora_ada: its `ada` trained fully, whatever the default
        raw = {**raw, "train": {**train, "lora_ada": "full"}}
    try:
        cfg = config_from_dict(raw)
    except UserError as e:
        where = f"{Path(ckpt) / MANIFEST}: " if ckpt is not None else ""
        raise UserError(f"{where}its config is invalid: {e}") from None
    if not overrides:
        return cfg
    try:
        return config_from_dict(with_inference_overrides(raw, overrides))
    except UserError as e:
        raise UserError(str(e) if str(e).startswith("--set") else f"--set: {e}") from None


def load_checkpoint(ckpt: str | Path, device="cpu", verify: bool = True, overrides=()):
    """Verified (model, config, manifest) from a checkpoint directory, in eval mode; `overrides`: inference
    settings to run it with (`--set`, config.INFERENCE_KEYS)."""
    # torch and the models: seconds at start-up (see the module's docstring)
    from looped_lm.models import build_model
    from looped_lm.tensor_files import load_weights

    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt, verify)
    verify_files(ckpt, manifest, [WEIGHTS], verify)
    cfg = config_of(manifest, ckpt, overrides)
    check_agreement(ckpt, manifest, cfg)
    try:
        model = build_model(cfg, manifest["vocab_size"], manifest.get("model_state"))
    except (UserError, ValueError, TypeError) as e:  # model_state (edges...) that does not fit the model
        raise UserError(f"{ckpt / MANIFEST}: its model_state does not fit model.kind {cfg.model.kind}: {e}") from None
    if cfg.train.lora_rank:  # an adapter checkpoint: its base first, verified by sha256
        load_base(model, cfg, manifest.get("base") or {"path": cfg.model.init_from, "sha256": "(not recorded)"})
    load_weights(model, ckpt / WEIGHTS, device, manifest.get("weights_dtypes"))
    return model.to(device).eval(), cfg, manifest


# ---------------------------------------------------------------------------------------------
# agreement: the manifest's fields against its config, its file list and its tensors
#
# The hash proves the manifest is the one written; it does not prove a hand- or tool-written manifest
# tells the truth. Every load (resume, eval, generate, serve, export, merge, verify) checks, in one line
# naming the field: model_kind against config.model.kind; tokenizer and vocab_size against the config
# and the tokenizer; ownership against the config's trained blocks and the optimizer state on record;
# model_state.edges against their invariants and the config's partition; the tensors' names and shapes
# against the model the manifest builds (check_weights_fit).


def check_agreement(ckpt: str | Path, manifest: dict, cfg: Config) -> None:
    """The manifest's model_kind, tokenizer, vocab_size, ownership and edges agree with its config and
    file list (no tensor is read; see check_tensors). One line naming the field."""
    where = Path(ckpt) / MANIFEST

    def bad(field: str, text: str) -> UserError:
        return UserError(f"{where}: '{field}' {text}")

    kind = manifest.get("model_kind", cfg.model.kind)
    if kind != cfg.model.kind:
        raise bad("model_kind", f"is {kind!r}, but its config's model.kind is {cfg.model.kind!r}")
    try:
        vocab, tokenizer = run_vocab(cfg)
    except UserError as e:
        raise UserError(f"{where}: its config is invalid: {e}") from None
    if manifest["tokenizer"] != tokenizer:
        source = "data.tokenizer" if kind_of(cfg).vocab(cfg) is None else f"model.kind {cfg.model.kind}"
        raise bad("tokenizer", f"is {manifest['tokenizer']!r}, but its config's {source} gives {tokenizer!r}")
    if manifest["vocab_size"] != vocab:
        raise bad("vocab_size", f"is {manifest['vocab_size']}, but its config and tokenizer ({tokenizer}) give {vocab}")
    _check_ownership(manifest, cfg, bad)
    _check_edges(manifest, cfg, bad)


def _check_ownership(manifest: dict, cfg: Config, bad) -> None:
    if "ownership" not in manifest or not kind_of(cfg).offers("merge"):
        return
    own = manifest["ownership"]
    blocks = own.get("blocks") if isinstance(own, dict) else None
    B = cfg.diffusion.num_blocks
    if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks) \
            or len(set(blocks)) != len(blocks) or not all(0 <= b < B for b in blocks):
        raise bad("ownership", f"must be {{\"blocks\": [distinct block ids in 0..{B - 1}]}}, got {own!r}")
    if sorted(blocks) != cfg.diffusion.trained_blocks():
        raise bad("ownership", f"lists blocks {sorted(blocks)}, but its config trains blocks {cfg.diffusion.trained_blocks()} "
                               "(diffusion.blocks_to_train)")
    if optimizer_layout(manifest) == OPTIMIZER_BY_UNIT and weights_only(manifest) is None and "files" in manifest:
        stored = sorted(int(m.group(1)) for rel in manifest["files"]
                        if (m := re.fullmatch(rf"{OPTIMIZER_DIR}/block(\d+)\.safetensors", rel)))
        if stored != sorted(blocks):
            raise bad("ownership", f"lists blocks {sorted(blocks)}, but it holds optimizer state for blocks {stored}")


def _check_edges(manifest: dict, cfg: Config, bad) -> None:
    """model_state.edges: finite, ascending, one more than the blocks, and the config's partition."""
    state = manifest.get("model_state") or {}
    if "edges" not in state:
        return
    edges = state["edges"]
    numbers = isinstance(edges, list) and all(isinstance(e, (int, float)) and not isinstance(e, bool)
                                             and math.isfinite(e) for e in edges)
    if not numbers or len(edges) < 2 or any(a >= b for a, b in zip(edges, edges[1:])):
        raise bad("model_state.edges", f"must be at least 2 finite, strictly ascending numbers, got {edges!r}")
    partitioned = kind_of(cfg).offers("partition_edges")
    if partitioned:
        blocks = kind_of(cfg).num_blocks(cfg)
    else:
        blocks = state.get("num_blocks", len(edges) - 1)
    if state.get("num_blocks", blocks) != blocks:
        raise bad("model_state.num_blocks", f"is {state['num_blocks']!r}, but its config has {blocks} blocks")
    if len(edges) != blocks + 1:
        raise bad("model_state.edges", f"has {len(edges)} edges ({len(edges) - 1} blocks), but the model has "
                                       f"{blocks} blocks: {blocks + 1} edges")
    if partitioned:  # the edges follow from the config alone
        # the diffusion package imports torch: seconds at start-up (see the module's docstring)
        from looped_lm.diffusion.noise import NoiseSchedule
        from looped_lm.diffusion.partition import make_edges

        d = cfg.diffusion
        want = make_edges(d.partition, blocks, NoiseSchedule(d.p_mean, d.p_std, d.sigma_min, d.sigma_max,
                                                             d.sigma_data))
        if not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(edges, want)):
            raise bad("model_state.edges", f"are {edges}, but its config's diffusion.partition "
                                           f"({d.partition}) gives {[round(e, 6) for e in want]}")


def check_tensors(ckpt: str | Path, manifest: dict, cfg: Config) -> None:
    """The names, shapes and dtypes in model.safetensors against the model the manifest builds (on the
    meta device: nothing is allocated), then its values: NaN or Inf is refused (one tensor read at a time)."""
    import torch  # torch and the models: seconds at start-up (see the module's docstring)

    from looped_lm.models import build_model
    from looped_lm.tensor_files import check_finite_file, check_weights_fit

    ckpt = Path(ckpt)
    try:
        with torch.device("meta"):
            model = build_model(cfg, manifest["vocab_size"], manifest.get("model_state"))
    except (UserError, ValueError, TypeError) as e:
        raise UserError(f"{ckpt / MANIFEST}: its model_state does not fit model.kind {cfg.model.kind}: {e}") from None
    check_weights_fit(ckpt / WEIGHTS, model, manifest.get("weights_dtypes"))
    check_finite_file(ckpt / WEIGHTS)


def check_checkpoint_agrees(ckpt: str | Path, manifest: dict) -> Config:
    """check_agreement and check_tensors of a read manifest; returns its config."""
    cfg = config_of(manifest, ckpt)
    check_agreement(ckpt, manifest, cfg)
    check_tensors(ckpt, manifest, cfg)
    return cfg
