"""`looped_lm verify CKPT`: check a checkpoint as a resume would, and print what was checked
(checkpoint.verify_report: every file, hash and manifest field)."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="checkpoint directory, or a run directory (its newest complete checkpoint)")


def run(args) -> int:
    """Every file, hash and manifest field a resume checks (checkpoint.verify_report); exit 0 or 2."""
    from looped_lm.checkpoint import verify_report

    for line in verify_report(args.checkpoint):
        print(line)
    return 0
