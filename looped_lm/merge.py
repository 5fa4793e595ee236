"""`looped_lm merge CKPT... --out DIR [--shared-from CKPT]`: join independently trained block jobs.

DiffusionBlocks blocks train apart, so B jobs, each with `diffusion.blocks_to_train: [b]` on a machine of
its own, can train the B blocks of one model; each checkpoint records the blocks it trained (`ownership`
in its manifest). Every job also trains the shared parameters (embedding, prelude, coda, noise embedding,
final norm): the merged model takes those from one of them, `--shared-from` (default: the first CKPT).

Before anything is written, every input is verified (its manifest and weights, as `eval` does) and
they must agree on the model kind (db_ar), tokenizer and vocabulary, B, the layer split, the edges, the
shape of every tensor, and every setting that changes what a block computes; the blocks they own must
cover 0..B-1 exactly once. Any disagreement is one line, exit 2, and nothing is written. The result is
weights plus a manifest naming its sources (`merged_from`), no optimizer state: a model that `eval`,
`generate`, `serve` and `export` load, not a run to resume. It is written to a temp directory beside
--out and renamed into place.

LoRA block jobs (train.lora_rank, docs/pretrained.md) merge the same way, by ownership: every job must
hold adapters over the same base (the sha256 its manifest's `base` records) with the same rank, alpha
and targets, and, since a block job trains none of the shared part, the same frozen shared tensors
(the noise embedding, ...: equal when the jobs share train.seed). The result is again an adapter
checkpoint over that base: block b's adapters and adaLN from the job that owns it, the rest from
--shared-from, and zero updates (lora_B = 0) on the prelude and coda, which no block job adapts. A load
verifies the base's hash as for any adapter checkpoint; `export` folds the adapters into plain weights.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from safetensors import SafetensorError, safe_open

from looped_lm import checkpoint as ckpt_io
from looped_lm.config import INFERENCE_KEYS, block_layers
from looped_lm.errors import UserError
from looped_lm.kinds import kind_of
from looped_lm.manifest import Manifest
from looped_lm.preflight import check_output_path
from looped_lm.pretrained import load_base

# settings a job may choose for itself: how it trains (not what a block computes) and inference defaults
# (model.init_from: where a job started; an adapter job's base is checked by its sha256 instead)
PER_JOB = {"model": INFERENCE_KEYS["model"] | {"loss_chunk", "init_from"},
           "diffusion": INFERENCE_KEYS["diffusion"] | {"blocks_to_train", "block_sampling", "curve_every",
                                                       "curve_until", "loss_weight", "target_fraction",
                                                       "clean_lm_weight"}}
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "lora_ada")  # what an adapter computes (dropout only trains)


def add_arguments(p) -> None:
    p.add_argument("checkpoints", nargs="+", metavar="CKPT",
                   help="block jobs' checkpoints (or run directories: their newest complete checkpoint)")
    p.add_argument("--out", required=True, help="directory of the merged checkpoint (must not exist, or be empty)")
    p.add_argument("--shared-from", default=None, metavar="CKPT",
                   help="the checkpoint whose shared parameters (embedding, prelude, coda, noise embedding, norm) "
                        "the merged model takes; default: the first CKPT")
    ckpt_io.add_verify_argument(p)


def run(args) -> int:
    if args.no_verify:
        print(ckpt_io.no_verify_note(), file=sys.stderr)
    out = merge(args.checkpoints, args.out, args.shared_from, verify=not args.no_verify)
    print(f"merged {len(args.checkpoints)} checkpoints -> {out}")
    return 0


class _Job:
    """One input: its checked manifest, config, blocks and tensor shapes."""

    def __init__(self, path, verify: bool):
        self.path = ckpt_io.resolve_checkpoint(path)
        raw = ckpt_io.read_manifest(self.path, verify)
        ckpt_io.verify_files(self.path, raw, [ckpt_io.WEIGHTS], verify)
        self.cfg = ckpt_io.check_checkpoint_agrees(self.path, raw)  # kind, tokens, ownership, edges
        self.manifest = Manifest.from_dict(raw)
        self.kind = self.cfg.model.kind
        if not kind_of(self.cfg).offers("merge"):
            raise UserError(f"cannot merge {self.path}: model.kind {self.kind} does not offer merge (merge joins the "
                            "block jobs of a db_ar model)")
        self.lora = bool(self.cfg.train.lora_rank)  # its file holds adapters over a base, not the block's weights
        self.base = self.manifest.base if self.lora else None
        if self.lora and not (isinstance(self.base, dict) and self.base.get("sha256") and self.base.get("path")):
            raise UserError(f"cannot merge {self.path}: it is a LoRA job without a 'base' record (path and sha256 "
                            "of the weights its adapters were trained on) in its manifest")
        d = self.cfg.diffusion
        if d.model_dump().get("context") == "stacked":  # a block reads the blocks before it: there are no independent block jobs
            raise UserError(f"cannot merge {self.path}: it has diffusion.context stacked, where each block continues "
                            "from the clean states of the blocks before it, so blocks are not trained apart "
                            "(docs/method.md §4)")
        owned = self.manifest.owned_blocks
        self.blocks = owned if owned is not None else d.trained_blocks()
        self.edges = self.manifest.edges

    def shapes(self) -> dict:
        """Tensor name -> shape (an adapter job's LoRA tensors and `ada` weights left out: each job has its own
        blocks', and a frozen `ada` weight is rebuilt, not saved; peft's `base_layer.` dropped: an adapted
        `ada`'s bias is the plain one of a layer the job does not own)."""
        from looped_lm.lora import ADA_WEIGHT  # imports torch: seconds at start-up

        try:
            with safe_open(str(self.path / ckpt_io.WEIGHTS), "pt") as f:
                return {k.replace(".base_layer.", "."): tuple(f.get_slice(k).get_shape()) for k in f.keys()
                        if not (self.lora and ("lora_" in k or ADA_WEIGHT.search(k)))}
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {self.path / ckpt_io.WEIGHTS}: {e}") from None

    def tensors(self) -> dict:
        from safetensors.torch import load_file  # imports torch: seconds at start-up

        return load_file(str(self.path / ckpt_io.WEIGHTS))


def check_compatible(jobs: list[_Job]) -> None:
    """Every job against the first: the same model, block for block (one line naming the first difference)."""
    for job in jobs[1:]:
        _check_pair(job, jobs[0])


def _check_pair(job: _Job, first: _Job) -> None:
    def differ(what: str, mine, theirs) -> UserError:
        return UserError(f"cannot merge: {job.path} has {what} {mine}, {first.path} {theirs}")

    if job.lora != first.lora:
        lora, full = (job, first) if job.lora else (first, job)
        raise UserError(f"cannot merge: {lora.path} is a LoRA job (train.lora_rank {lora.cfg.train.lora_rank}), "
                        f"{full.path} holds full weights; merge joins jobs of one kind")
    if job.lora:
        if job.base["sha256"] != first.base["sha256"]:
            raise UserError(f"cannot merge: {job.path} holds adapters over base {job.base['sha256'][:16]}... "
                            f"({job.base['path']}), {first.path} over {first.base['sha256'][:16]}... "
                            f"({first.base['path']}): a different base")
        for key in LORA_FIELDS:
            if getattr(job.cfg.train, key) != getattr(first.cfg.train, key):
                raise differ(f"train.{key}", repr(getattr(job.cfg.train, key)), repr(getattr(first.cfg.train, key)))
    tokens = (job.manifest.tokenizer, job.manifest.vocab_size)
    if tokens != (first.manifest.tokenizer, first.manifest.vocab_size):
        raise differ("tokenizer", "{} ({} tokens)".format(*tokens),
                     "{} ({} tokens)".format(first.manifest.tokenizer, first.manifest.vocab_size))
    if job.cfg.diffusion.num_blocks != first.cfg.diffusion.num_blocks:
        raise differ("B =", job.cfg.diffusion.num_blocks, first.cfg.diffusion.num_blocks)
    if block_layers(job.cfg) != block_layers(first.cfg):
        raise differ("the layer split", block_layers(job.cfg), block_layers(first.cfg))
    if job.edges != first.edges:
        raise differ("edges", job.edges, first.edges)
    mine, theirs = job.shapes(), first.shapes()
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            raise differ(f"tensor {name} of shape", _shape(mine.get(name)), _shape(theirs.get(name)))
    for section in ("model", "diffusion"):
        a, b = getattr(job.cfg, section).model_dump(), getattr(first.cfg, section).model_dump()
        for key in sorted(k for k in a if k not in PER_JOB[section] and a[k] != b[k]):
            raise differ(f"{section}.{key}", repr(a[key]), repr(b[key]))


def _shape(shape) -> str:
    return "(absent)" if shape is None else str(list(shape))


def check_ownership(jobs: list[_Job], num_blocks: int) -> dict[int, _Job]:
    """{block: the job that trained it}: each block exactly once."""
    owner: dict[int, _Job] = {}
    for job in jobs:
        for b in job.blocks:
            if not 0 <= b < num_blocks:
                raise UserError(f"cannot merge: {job.path} claims block {b}, but the model has blocks 0..{num_blocks - 1}")
            if b in owner:
                raise UserError(f"cannot merge: block {b} is owned by both {owner[b].path} and {job.path} "
                                "(diffusion.blocks_to_train overlap)")
            owner[b] = job
    missing = [b for b in range(num_blocks) if b not in owner]
    if missing:
        raise UserError(f"cannot merge: no checkpoint owns block{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing))} (of 0..{num_blocks - 1})")
    return owner


def merge(checkpoints: list, out, shared_from=None, verify: bool = True) -> Path:
    out = check_output_path(out, "--out", kind="dir")  # a symlink loop, /proc: before any input is read
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty directory; nothing was written")
    jobs = [_Job(p, verify) for p in checkpoints]
    paths = [j.path.resolve() for j in jobs]
    if len(set(paths)) != len(paths):
        raise UserError("cannot merge: the same checkpoint is given twice")
    shared = jobs[0]
    if shared_from is not None:
        wanted = ckpt_io.resolve_checkpoint(shared_from).resolve()
        shared = next((j for j in jobs if j.path.resolve() == wanted), None) or _Job(shared_from, verify)
    check_compatible(jobs + ([shared] if shared not in jobs else []))
    owner = check_ownership(jobs, shared.cfg.diffusion.num_blocks)
    if shared.lora:
        check_frozen_shared(jobs + ([shared] if shared not in jobs else []))
    return _write(out, shared, owner, jobs)


def check_frozen_shared(jobs: list[_Job]) -> None:
    """LoRA block jobs train none of the shared part (lora.attach): what they hold of it is its frozen
    init, which every job's blocks were trained against, so it must be the same tensor in all of them."""
    import torch  # torch: seconds at start-up

    if len(jobs) < 2:
        return
    first = {k: v for k, v in jobs[0].tensors().items() if not k.startswith("blocks.")}
    for job in jobs[1:]:
        mine = job.tensors()
        for name in sorted(first):
            if name in mine and not torch.equal(mine[name], first[name]):
                raise UserError(f"cannot merge: {job.path} has another {name} than {jobs[0].path}: a LoRA block job "
                                "keeps the shared parameters at their init, and these jobs' inits differ (another "
                                "train.seed?), so their blocks were trained against different ones")


def _write(out: Path, shared: _Job, owner: dict, jobs: list[_Job]) -> Path:
    # torch, the models and the tensor files: seconds at start-up (`looped_lm merge --help` imports none)
    import torch

    from looped_lm import tensor_files
    from looped_lm.models import build_model

    cfg = shared.cfg.model_copy(deep=True)
    cfg.diffusion.blocks_to_train = []
    model = build_model(cfg, shared.manifest.vocab_size, shared.manifest.model_state)
    if shared.lora:
        _fill_adapters(model, cfg, shared, owner)
    else:
        tensor_files.load_weights(model, shared.path / ckpt_io.WEIGHTS,
                             recorded_dtypes=shared.manifest.weights_dtypes)
        with torch.no_grad():
            for b, job in sorted(owner.items()):
                with safe_open(str(job.path / ckpt_io.WEIGHTS), "pt") as f:
                    for name, p in model.named_parameters():
                        if name.startswith(f"blocks.{b}."):
                            p.copy_(f.get_tensor(name))
    step = max(j.manifest.step for j in jobs)
    sources = [{"checkpoint": str(j.path), "step": j.manifest.step, "blocks": j.blocks, "shared": j is shared,
                "manifest_sha256": j.manifest.manifest_sha256} for j in jobs + ([shared] if shared not in jobs else [])]
    # its ownership: every block (the merged config trains them all: blocks_to_train [] above)
    manifest = Manifest.of(cfg, vocab_size=shared.manifest.vocab_size, tokenizer=shared.manifest.tokenizer,
                           model_state=shared.manifest.model_state or {}, data=shared.manifest.data or {},
                           world_size=1, step=step, merged_from=sources,
                           # an adapter checkpoint: every load reads this base and checks its hash
                           base=shared.base if shared.lora else None)
    named = ckpt_io.step_of(out)
    if named is not None and named != step:
        raise UserError(f"--out {out} names step {named}, but the merged checkpoint is at step {step} (the "
                        "newest input's); choose another name")
    tmp = out.parent / f".tmp-merge-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensor_files.save_weights(model, tmp / ckpt_io.WEIGHTS)
        ckpt_io.write_manifest(tmp, manifest)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except OSError as e:
        raise UserError(f"cannot write the merged checkpoint {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; what a failure left otherwise
    return out


def _fill_adapters(model, cfg, shared: _Job, owner: dict) -> None:
    """The merged adapter model: the base (its hash checked), then every adapter tensor from the job that
    owns its block, the rest from `shared`; the prelude's and coda's adapters, which no block job has,
    keep lora_B = 0 (peft's init: no update)."""
    import torch  # torch: seconds at start-up

    from looped_lm.lora import ADA_WEIGHT, adapter_names  # imports torch: seconds at start-up

    load_base(model, cfg, shared.base)
    params = dict(model.named_parameters())
    files: dict[int, dict] = {}  # id(job) -> its tensors, each file read once
    with torch.no_grad():
        for name in adapter_names(model):
            job = owner[int(name.split(".")[1])] if name.startswith("blocks.") else shared
            if id(job) not in files:
                files[id(job)] = job.tensors()
            held = files[id(job)]  # an adapted `ada`'s bias is the plain `ada.bias` of a layer the job does not own
            tensor = held.get(name, held.get(name.replace(".base_layer.", ".")))
            if tensor is None:
                if ADA_WEIGHT.search(name) and not name.startswith("blocks."):
                    continue  # the shared part's `ada` weight: frozen in every block job, zero from the init
                if "lora_" not in name or name.startswith("blocks."):
                    raise UserError(f"cannot merge: {job.path / ckpt_io.WEIGHTS} does not hold {name}, which its "
                                    "blocks' adapters need")
                if "lora_B" in name:
                    params[name].zero_()
                continue
            params[name].copy_(tensor)
