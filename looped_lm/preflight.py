"""What a run checks before a process group, a model or a launcher exists (no torch needed).

`preflight(cfg)` checks what the run reads and writes: the tokenizer, the data (tokenized once into the
cache, both token files checked against the model; a module's images or characters loaded and checked
against model.*), train.out_dir (created, writable), and the
checkpoint a resume continues from: every file verified, its model and optimizer layout the same, and
a changed seed, global batch, grad_accum, data or tokenizer refused with the list of differences unless
train.resume_changes: allow (world size, ZeRO stage and train.mode may change: the optimizer state is
stored by parameter name). It never starts over silently: step directories it cannot use are named.
Then it removes what interrupted saves left, and says so. `looped_lm train` runs it before starting the
launcher, and the trainer's rank 0 again, so a bad run fails in seconds with one line.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat as stat_
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from looped_lm import checkpoint as ckpt_io
from looped_lm.config import INFERENCE_KEYS, Config, block_layers, init_source
from looped_lm.data.batches import prepare_data
from looped_lm.data.tokenizer import run_vocab
from looped_lm.errors import UserError
from looped_lm.manifest import OPTIMIZER_BY_DEEPSPEED, Manifest
from looped_lm.parallel import check_world
from looped_lm.pretrained import check_path, check_source

RESUMING_WITH = "resuming with changes (train.resume_changes: allow)"


@dataclass
class Plan:
    """What preflight found: the run's vocabulary, prepared data and the checkpoint it resumes from."""

    vocab_size: int
    tokenizer: str
    data_dir: str
    resume: str | None = None
    manifest: Manifest | None = None  # the checkpoint resumed, read and checked
    notes: list[str] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)  # what a resume allowed to change


def preflight(cfg: Config, verify: bool = True, world_size: int | None = None) -> Plan:
    """Check the run (world_size None: the checks that depend on it wait for the launcher's count)."""
    source = init_source(cfg)
    if source and Path(cfg.data.tokenizer) == Path(source).expanduser().absolute():
        check_path(source)  # the tokenizer is the source's: a missing or wrong source is named as model.init_from
    vocab_size, tokenizer = run_vocab(cfg)
    out_dir = Path(cfg.train.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"train.out_dir {out_dir} is a file, not a directory")
    # where the run writes, before anything is prepared or built: a loop, /proc, a file in the way
    check_output_path(out_dir, "train.out_dir", kind="dir", must_write=False)
    check_output_path(cfg.data.cache_dir, "data.cache_dir", kind="dir", must_write=False)
    if world_size is not None:
        check_world(cfg, world_size)
    check_memory(cfg, vocab_size, world_size or 1)
    plan = Plan(vocab_size, tokenizer, "")
    resume = find_resume(cfg, out_dir)
    if resume is None and init_source(cfg):  # before anything is written: the source must map
        source = check_source(cfg, vocab_size)
        if not cfg.model.max_positions:  # the context the source was trained for, kept for serving
            cfg.model.max_positions = max(source.positions, cfg.model.seq_len)
    elif resume is not None and init_source(cfg) and not cfg.model.max_positions:  # as the run's start found it
        saved = ckpt_io.read_manifest(resume, verify=False)["config"].get("model", {})
        cfg.model.max_positions = saved.get("max_positions", 0)
    try:  # cheap checks first (the manifest against this config), the files' hashes after the data
        if resume is not None:
            raw = ckpt_io.read_manifest(resume, verify)
            plan.resume, plan.manifest = str(resume), Manifest.from_dict(raw)
            notes = check_resume(plan.manifest, cfg, vocab_size, world_size, resume)
            plan.notes += notes
            plan.changes = [c for n in notes if n.startswith(RESUMING_WITH)
                            for c in n.removeprefix(f"{RESUMING_WITH}: ").split("; ")]
        plan.data_dir = prepare_data(cfg, vocab_size)
        if resume is not None:
            ckpt_io.verify_checkpoint(resume, verify, ranks=world_size)
            ckpt_io.check_checkpoint_agrees(resume, raw)  # its fields against its own files
    except UserError as e:
        if resume is None or str(e).startswith("cannot resume"):
            raise
        raise UserError(f"cannot resume: {e}{_older_hint(out_dir, resume)}") from None
    ensure_writable(out_dir)
    plan.notes += tidy_out_dir(out_dir)
    return plan


# bytes per parameter a run holds at least: weights + gradients + AdamW's two moments, fp32 (16), or
# DeepSpeed's bf16 weights, gradients and Adam state at ZeRO 0 (8); a frozen parameter: its weight (4)
TRAINED_BYTES = {False: 16, True: 8}
FROZEN_BYTES = 4
LAYER_PARAMS = 12  # a transformer layer holds at least ~12 d_model^2 parameters (attention 4, MLP 8)


def memory_limit() -> tuple[int, str]:
    """(bytes, what) the run's memory is measured against: the smallest GPU's memory on a CUDA machine,
    else this machine's RAM (or its cgroup's limit, if lower)."""
    import torch  # torch: seconds at start-up

    if torch.cuda.is_available():
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())), \
            "memory of one GPU"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            ram = min(ram, int(Path(limit).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max": no cgroup limit
            continue
    return ram, "RAM of this machine"


def check_memory(cfg: Config, vocab_size: int, world_size: int = 1) -> None:
    """Refuse a model whose weights, gradients and optimizer state alone cannot fit (before it is built,
    which would die allocating or be killed): a lower bound first, from the config's widths (so a config
    too large even to describe costs nothing), then the exact parameter count of the model built on
    torch's meta device (nothing allocated). On CPU every rank of this machine holds its own copy."""
    import torch  # torch: seconds at start-up

    limit, what = memory_limit()
    ranks = 1 if torch.cuda.is_available() else world_size  # GPUs: one rank per device
    per_param = TRAINED_BYTES[cfg.deepspeed.bf16 and cfg.deepspeed.zero_stage == 0]
    m = cfg.model
    rough = (vocab_size * m.d_model + m.n_layers * LAYER_PARAMS * m.d_model ** 2) * \
        (FROZEN_BYTES if cfg.train.lora_rank else per_param) * ranks
    if rough <= limit:
        trained, frozen = _parameter_count(cfg, vocab_size)
        need = (trained * per_param + frozen * FROZEN_BYTES) * ranks
        count = f"{trained + frozen:,} parameters"
    else:
        need, count = rough, f"at least {rough // per_param // ranks:,} parameters"
    if need > limit:
        on = f" x {ranks} ranks" if ranks > 1 else ""
        raise UserError(f"the model needs about {_gib(need)} for its weights, gradients and AdamW state alone "
                        f"({count}{on}, before activations), more than the {_gib(limit)} {what}: reduce "
                        f"model.vocab_size ({vocab_size:,}), model.d_model or model.n_layers")


def _parameter_count(cfg: Config, vocab_size: int) -> tuple[int, int]:
    """(trained, frozen) parameters of the model `cfg` builds, counted on the meta device."""
    import torch  # torch: seconds at start-up

    from looped_lm.models import build_model  # imports torch: seconds at start-up

    with torch.device("meta"):
        model = build_model(cfg, vocab_size)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trained, sum(p.numel() for p in model.parameters()) - trained


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:,.1f} GiB"


def find_resume(cfg: Config, out_dir: Path) -> Path | None:
    """The checkpoint to continue from; never a silent fresh start over step directories it cannot use."""
    r = cfg.train.resume
    if r == "never":
        return None
    if r != "auto":
        return ckpt_io.resolve_checkpoint(r)
    steps = ckpt_io.step_dirs(out_dir)
    if not steps:
        return None
    complete = ckpt_io.list_checkpoints(out_dir)
    if not complete or steps[-1] != complete[-1]:
        older = f"; the newest complete one is {complete[-1]} (train.resume={complete[-1]})" if complete else ""
        raise UserError(f"cannot resume: {steps[-1]} has no {ckpt_io.MANIFEST} (not a complete checkpoint){older}; "
                        "delete it, or set train.resume: never to start over")
    return complete[-1]


def _older_hint(out_dir: Path, refused: Path) -> str:
    older = [p for p in ckpt_io.list_checkpoints(out_dir) if p.resolve() != Path(refused).resolve()
             and ckpt_io.step_of(p) < (ckpt_io.step_of(Path(refused)) or 0)]
    return f" (an older checkpoint: train.resume={older[-1]})" if older else ""


# settings that a resume may change without notice (inference-time or logging)
_FREE_TO_CHANGE = INFERENCE_KEYS


def check_resume(manifest: Manifest, cfg: Config, vocab_size: int, world_size: int | None,
                 path: Path) -> list[str]:
    """Refuse a checkpoint this run cannot continue exactly; return notes on allowed changes.

    The model (layer split included), vocabulary and precision must match. A changed seed, global batch,
    grad_accum, data or tokenizer is refused unless train.resume_changes is allow. World size, ZeRO stage
    and train.mode may change: the optimizer state is stored by parameter name (checkpoints from before
    that layout: same stage, data parallel, and at ZeRO >= 1 the same world size). world_size None: the
    caller does not know it yet (checked again by the trainer)."""
    if manifest.merged_from is not None:
        raise UserError(f"cannot resume from {path}: it is a merge of block jobs (`looped_lm merge`): weights only, "
                        "no optimizer state")
    # the saved config as this version reads it (fields another kind's section had then are dropped)
    saved, mine = ckpt_io.config_of(manifest, path).to_dict(), cfg.to_dict()
    saved_world = manifest.world_size or 1
    layout = manifest.layout
    for section in ("model", "diffusion"):
        for key, value in saved.get(section, {}).items():
            if key not in _FREE_TO_CHANGE[section] and mine[section].get(key) != value:
                raise UserError(f"cannot resume from checkpoint: {section}.{key} is {value!r} there but "
                                f"{mine[section].get(key)!r} in this config")
    was, now = saved.get("train", {}).get("lora_ada"), mine["train"]["lora_ada"]
    if saved.get("train", {}).get("lora_rank") and was != now:  # another set of tensors: its weights do not load
        raise UserError(f"cannot resume from checkpoint: train.lora_ada is {was!r} there but {now!r} in this config "
                        f"(how its adaLN trains; set train.lora_ada: {was} to continue it)")
    split = block_layers(ckpt_io.config_of(manifest, path))
    if split != block_layers(cfg):
        raise UserError(f"cannot resume from checkpoint: its blocks have {split} layers, this config "
                        f"{block_layers(cfg)} (diffusion.layers_per_block)")
    if manifest.vocab_size != vocab_size:
        raise UserError(f"cannot resume: the checkpoint's vocab_size {manifest.vocab_size} differs from this "
                        f"run's {vocab_size}")
    # optimizer state by parameter name (layout units) resumes at any ZeRO stage and world size; DeepSpeed's
    # own files (older checkpoints) only at their own stage, and at ZeRO >= 1 their own world size
    for key, why in (("zero_stage", "their optimizer files differ"), ("bf16", "its optimizer keeps other state")):
        was, now = saved.get("deepspeed", {}).get(key), mine["deepspeed"][key]
        if was != now and (key == "bf16" or layout == OPTIMIZER_BY_DEEPSPEED):
            raise UserError(f"cannot resume: the checkpoint was written with deepspeed.{key} {was}, this run uses "
                            f"{now} ({why})")
    if layout == OPTIMIZER_BY_DEEPSPEED and mine["train"]["mode"] != "data_parallel":
        raise UserError(f"cannot resume {path} in train.mode {mine['train']['mode']}: it holds DeepSpeed's own "
                        "optimizer files, which only resume in data_parallel mode at the same ZeRO stage")
    if world_size is not None and layout == OPTIMIZER_BY_DEEPSPEED and mine["deepspeed"]["zero_stage"] > 0 \
            and saved_world != world_size:
        raise UserError(f"cannot resume: the checkpoint's ZeRO optimizer state is partitioned over {saved_world} "
                        f"ranks, this run has world size {world_size}")
    st, t = saved.get("train", {}), cfg.train
    world = world_size or saved_world
    changes = []
    if st.get("seed") != t.seed:
        changes.append(f"train.seed {st.get('seed')} -> {t.seed}")
    before = st.get("batch_size", 0) * st.get("grad_accum", 0) * saved_world
    after = t.batch_size * t.grad_accum * world
    if before != after:
        changes.append(f"global batch {before} -> {after} sequences (batch_size x grad_accum x world size)")
    if st.get("grad_accum") != t.grad_accum:
        changes.append(f"train.grad_accum {st.get('grad_accum')} -> {t.grad_accum}")
    for key in ("source", "path", "tokenizer", "val_fraction"):
        was, now = saved.get("data", {}).get(key), mine["data"][key]
        if was != now:
            changes.append(f"data.{key} {was!r} -> {now!r}")
    if changes and t.resume_changes != "allow":
        raise UserError(f"cannot resume from {path}: this run changes {'; '.join(changes)}; set "
                        "train.resume_changes: allow to go on with them, or train.resume: never to start over")
    notes = [f"{RESUMING_WITH}: {'; '.join(changes)}"] if changes else []
    switched = []
    if world_size is not None and world_size != saved_world:
        switched.append(f"world size {saved_world} -> {world_size}")
    for key in ("zero_stage",):
        if saved.get("deepspeed", {}).get(key) != mine["deepspeed"][key]:
            switched.append(f"deepspeed.{key} {saved.get('deepspeed', {}).get(key)} -> {mine['deepspeed'][key]}")
    if st.get("mode", "data_parallel") != t.mode:
        switched.append(f"train.mode {st.get('mode', 'data_parallel')} -> {t.mode}")
    if switched:
        whole = "re-sharded by parameter name" if layout == "units" else "whole (ZeRO 0)"
        notes.append(f"{', '.join(switched)}: the optimizer state is {whole}; ranks without a saved RNG state "
                     "start theirs from the seed")
    return notes


def check_output_path(path: str | Path, flag: str, kind: str = "file", must_write: bool = True) -> Path:
    """An output path every verb that writes checks before its work starts (exit 2, one line naming
    `flag`): no part of it is a symlink loop, a dangling symlink or a file where a directory must be;
    the path itself is not a directory when a file is written (kind "file") nor a file when a directory
    is (kind "dir"); and the nearest existing directory accepts a new file (a probe, removed at once:
    /proc, /sys, a read-only mount or a full inode table answer here). `must_write` False: an existing
    directory is taken as it is (a read-only cache that is already prepared)."""
    path = Path(path)
    if str(path) == "":
        raise UserError(f"{flag} must not be empty")
    existing = None
    for p in [path, *path.parents]:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if os.path.lexists(p):  # a symlink whose target does not exist: mkdir would say "File exists"
                raise UserError(f"{flag} {path}: {p} is a dangling symlink (to {os.readlink(p)})") from None
            continue
        except OSError as e:
            if e.errno == errno.ELOOP:  # name the first component that loops, not the whole path
                loop = next((q for q in reversed([p, *p.parents]) if _loops(q)), p)
                raise UserError(f"{flag} {path}: {loop} is a symlink loop") from None
            if e.errno == errno.ENOTDIR:  # a file where a directory must be
                file = next((q for q in reversed(p.parents) if q.is_file()), p)
                raise UserError(f"{flag} {path} is not writable: Not a directory ({file} is a file)") from None
            raise UserError(f"{flag} {path}: cannot reach {p} ({e.strerror or e})") from None
        existing = (p, st)
        break
    p, st = existing if existing is not None else (Path("."), os.stat("."))

    is_dir = stat_.S_ISDIR(st.st_mode)
    if p == path:
        if kind == "file" and is_dir:
            raise UserError(f"{flag} {path} is a directory; give a file path")
        if kind == "dir" and not is_dir:
            raise UserError(f"{flag} {path} is a file, not a directory")
        if kind == "dir" and not must_write:
            return path
        p = p if is_dir else p.parent
    elif not is_dir:
        raise UserError(f"{flag} {path}: {p} is a file, not a directory")
    try:  # the directory the first new entry goes into accepts one
        fd, probe = tempfile.mkstemp(prefix=".looped_lm-write-test-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write into {p} ({e.strerror or e})") from None
    return path


def _loops(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def ensure_writable(out_dir: Path) -> None:
    probe = out_dir / f".write-test-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"train.out_dir {out_dir} is not writable: {describe_os_error(e, out_dir)}") from None


def tidy_out_dir(out_dir: Path) -> list[str]:
    """Remove what interrupted saves left (temp dirs; step dirs without a manifest that are older than
    the newest complete checkpoint) and say so."""
    notes = []
    for tmp in sorted(out_dir.glob(".tmp-step_*")) + sorted(out_dir.glob(".old-step_*")):
        shutil.rmtree(tmp, ignore_errors=True)
        notes.append(f"removed {tmp} (left by an interrupted save)")
    newest = ckpt_io.latest_checkpoint(out_dir)
    for orphan in ckpt_io.step_dirs(out_dir):
        if newest is not None and ckpt_io.step_of(orphan) < ckpt_io.step_of(newest) \
                and not (orphan / ckpt_io.MANIFEST).is_file():
            shutil.rmtree(orphan, ignore_errors=True)
            notes.append(f"removed {orphan}: no {ckpt_io.MANIFEST} (an interrupted save or prune), and {newest} "
                         "is newer")
    return notes


def describe_os_error(e: BaseException, subject: Path | None = None) -> str:
    if isinstance(e, OSError) and e.strerror:
        other = e.filename is not None and (subject is None or Path(e.filename) != Path(subject))
        return f"{e.strerror} ({e.filename})" if other else e.strerror
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def nothing_to_train(plan: Plan, cfg: Config) -> str | None:
    """The line to print when the checkpoint resumed is already at train.max_steps (or past it)."""
    if plan.manifest is None or plan.manifest.step < cfg.train.max_steps:
        return None
    return (f"nothing to train: {plan.resume} is at step {plan.manifest.step} and train.max_steps is "
            f"{cfg.train.max_steps}")
