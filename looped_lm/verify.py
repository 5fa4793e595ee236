"""`looped_lm verify CKPT`: check a checkpoint as a resume would, and print what was checked
(every file, hash and manifest field)."""

from __future__ import annotations

from pathlib import Path

from looped_lm import checkpoint as ckpt_io
from looped_lm.manifest import Manifest


def add_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="checkpoint directory, or a run directory (its newest complete checkpoint)")


def run(args) -> int:
    """Every file, hash and manifest field a resume checks (verify_report); exit 0 or 2."""
    for line in verify_report(args.checkpoint):
        print(line)
    return 0


def verify_report(path: str | Path) -> list[str]:
    """`looped_lm verify CKPT`: every check a resume makes (a merge of block jobs: all but the optimizer
    and RNG files it never had), then what the checkpoint holds, as lines to print."""
    ckpt = ckpt_io.resolve_checkpoint(path)
    raw = ckpt_io.read_manifest(ckpt, verify=True)
    ckpt_io.verify_checkpoint(ckpt, verify=True)  # weights only: every listed file and no other
    cfg = ckpt_io.check_checkpoint_agrees(ckpt, raw)
    manifest = Manifest.from_dict(raw)
    files = manifest.files
    lines = [f"{ckpt}: ok",
             f"  step {manifest.step}, model.kind {cfg.model.kind}, tokenizer {manifest.tokenizer} "
             f"({manifest.vocab_size} tokens), world size {manifest.world_size}",
             f"  {len(files)} files, {sum(r['size'] for r in files.values()):,} bytes: every size and sha256 "
             "matches its manifest, whose own hash matches; no unlisted file",
             "  manifest agrees with its config and tensors: model_kind, tokenizer, vocab_size, world_size, tensor "
             "names, shapes and dtypes" + (", ownership" if manifest.ownership is not None else "")
             + (", edges" if "edges" in manifest.state else ""),
             "  every weight is finite (no NaN or Inf)"]
    if manifest.ownership is not None:
        lines.append(f"  trained blocks {manifest.ownership['blocks']}")
    if manifest.merged_from is not None:
        lines.append("  a merge of block jobs: eval, generate, serve and export load it; it does not resume")
    elif manifest.weights_only:
        lines.append(f"  {manifest.weights_only}: weights only; eval, generate, serve and export load it, and a run "
                     "resumes from it with a fresh optimizer")
    else:
        lines.append("  a resume accepts it (weights, optimizer state, RNG state of every rank); eval, generate, "
                     "serve and export load it")
    return lines
