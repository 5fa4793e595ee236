"""What the launcher and the ranks agree on: the trainer's flags and the run config they make (shared by `looped_lm
train`, looped_lm/launch.py, and `deepspeed looped_lm/train.py`), the environment names between them, a free
port. Imports nothing heavy: `looped_lm train --help` stays fast."""

from __future__ import annotations

import argparse
import socket

from looped_lm import checkpoint as ckpt_io
from looped_lm.config import Config, load_config
from looped_lm.errors import UserError
from looped_lm.pretrained import source_shape

PREFLIGHT_DONE = "LOOPED_LM_PREFLIGHT_DONE"  # set by `looped_lm train`: its process printed the notes
# set by `looped_lm train` on one node: the ranks meet through this file (torch's FileStore), so no
# rendezvous port listens on the machine's interfaces (torch's TCPStore binds all of them)
RENDEZVOUS_FILE = "LOOPED_LM_RENDEZVOUS_FILE"
DESCRIPTION = """Train a model: `looped_lm train --config X.yaml` (through the DeepSpeed launcher), or
`deepspeed looped_lm/train.py --config X.yaml`, or one process: `python -m looped_lm.train --config X.yaml`."""


def add_arguments(p) -> None:
    """The trainer's flags, shared by `looped_lm train` and `deepspeed looped_lm/train.py`."""
    p.add_argument("--config", help="YAML run config (see configs/README.md)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable)")
    p.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="save and exit after N steps of this launch (preemptible jobs); 0 = run to max_steps")
    p.add_argument("--help-config", nargs="?", const="", default=None, metavar="KIND",
                   help="list every config field and exit (KIND: only that model.kind's fields)")
    ckpt_io.add_verify_argument(p)
    p.add_argument("--verbose", action="store_true",
                   help="also show the DeepSpeed launcher's own log, library deprecation warnings and tracebacks")


def forward_args(args) -> list[str]:
    """The trainer's own flags of a parsed `looped_lm train`, as the argv the launcher hands each rank."""
    argv = ["--config", args.config] if args.config else []
    for item in args.set:
        argv += ["--set", item]
    if args.stop_after:
        argv += ["--stop-after", str(args.stop_after)]
    return argv + ["--no-verify"] * args.no_verify + ["--verbose"] * args.verbose


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="looped_lm train", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_from_args(args) -> Config:
    if args.config is None and not args.set:
        raise UserError("give --config FILE (and/or --set section.key=value overrides)")
    if args.stop_after < 0:
        raise UserError(f"--stop-after must be >= 0 (got {args.stop_after})")
    return load_config(args.config, args.set, source_shape=source_shape)


def free_port() -> int:
    """A free TCP port on loopback (the launcher's rendezvous, and a lone process's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
