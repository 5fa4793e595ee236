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
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from looped_lm import checkpoint as ckpt_io
from looped_lm.config import block_layers
from looped_lm.errors import UserError

# settings a job may choose for itself: how it trains (not what a block computes) and inference defaults
PER_JOB = {"model": {"num_iterations", "bridge", "max_iterations", "loss_chunk"},
           "diffusion": {"blocks_to_train", "block_sampling", "curve_every", "curve_until", "loss_weight",
                         "target_fraction", "clean_lm_weight", "num_iterations", "bridge", "last_call",
                         "sample_top_quantile"}}


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
        self.manifest = ckpt_io.read_manifest(self.path, verify)
        ckpt_io.verify_files(self.path, self.manifest, [ckpt_io.WEIGHTS], verify)
        self.cfg = ckpt_io.check_checkpoint_agrees(self.path, self.manifest)  # kind, tokens, ownership, edges
        self.kind = self.cfg.model.kind
        if self.kind != "db_ar":
            raise UserError(f"cannot merge {self.path}: it is model.kind {self.kind}; merge joins the block jobs of "
                            "a db_ar model")
        if self.cfg.train.lora_rank:  # its file holds adapters over a base, not the block's weights
            raise UserError(f"cannot merge {self.path}: it is a LoRA job (train.lora_rank {self.cfg.train.lora_rank}); "
                            "merge joins full-weight block jobs (docs/pretrained.md)")
        d = self.cfg.diffusion
        if d.context == "stacked":  # a block reads the blocks before it: there are no independent block jobs
            raise UserError(f"cannot merge {self.path}: it has diffusion.context stacked, where each block continues "
                            "from the clean states of the blocks before it, so blocks are not trained apart "
                            "(docs/method.md §4)")
        owned = self.manifest.get("ownership", {}).get("blocks", d.blocks_to_train or list(range(d.num_blocks)))
        self.blocks = sorted(owned)
        self.edges = [float(e) for e in self.manifest.get("model_state", {}).get("edges", [])]

    def shapes(self) -> dict:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path / ckpt_io.WEIGHTS), "pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {self.path / ckpt_io.WEIGHTS}: {e}") from None


def check_compatible(jobs: list[_Job]) -> None:
    """Every job against the first: the same model, block for block (one line naming the first difference)."""
    for job in jobs[1:]:
        _check_pair(job, jobs[0])


def _check_pair(job: _Job, first: _Job) -> None:
    def differ(what: str, mine, theirs) -> UserError:
        return UserError(f"cannot merge: {job.path} has {what} {mine}, {first.path} {theirs}")

    tokens = (job.manifest["tokenizer"], job.manifest["vocab_size"])
    if tokens != (first.manifest["tokenizer"], first.manifest["vocab_size"]):
        raise differ("tokenizer", "{} ({} tokens)".format(*tokens),
                     "{} ({} tokens)".format(first.manifest["tokenizer"], first.manifest["vocab_size"]))
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
    out = Path(out)
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
    return _write(out, shared, owner, jobs)


def _write(out: Path, shared: _Job, owner: dict, jobs: list[_Job]) -> Path:
    import torch
    from safetensors import safe_open

    from looped_lm.models import build_model

    cfg = shared.cfg.model_copy(deep=True)
    cfg.diffusion.blocks_to_train = []
    model = build_model(cfg, shared.manifest["vocab_size"], shared.manifest.get("model_state"))
    ckpt_io.load_weights(model, shared.path / ckpt_io.WEIGHTS)
    with torch.no_grad():
        for b, job in sorted(owner.items()):
            with safe_open(str(job.path / ckpt_io.WEIGHTS), "pt") as f:
                for name, p in model.named_parameters():
                    if name.startswith(f"blocks.{b}."):
                        p.copy_(f.get_tensor(name))
    manifest = {"config": cfg.to_dict(), "model_kind": cfg.model.kind, "vocab_size": shared.manifest["vocab_size"],
                "tokenizer": shared.manifest["tokenizer"], "model_state": shared.manifest.get("model_state", {}),
                "data": shared.manifest.get("data", {}), "world_size": 1,
                "ownership": {"blocks": sorted(owner)},
                "merged_from": [{"checkpoint": str(j.path), "step": j.manifest["step"], "blocks": j.blocks,
                                 "shared": j is shared, "manifest_sha256": j.manifest.get("manifest_sha256")}
                                for j in jobs + ([shared] if shared not in jobs else [])]}
    step = max(j.manifest["step"] for j in jobs)
    named = ckpt_io.step_of(out)
    if named is not None and named != step:
        raise UserError(f"--out {out} names step {named}, but the merged checkpoint is at step {step} (the "
                        "newest input's); choose another name")
    tmp = out.parent / f".tmp-merge-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        ckpt_io.save_weights(model, tmp / ckpt_io.WEIGHTS)
        ckpt_io.write_manifest(tmp, {**manifest, "step": step})
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except OSError as e:
        raise UserError(f"cannot write the merged checkpoint {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; what a failure left otherwise
    return out
