"""The trainer's command: flags -> config -> run; bad input is one line and exit 2, a failure mid-run (a full
disk, a lost rank, a non-finite step) one line and exit 1."""

from __future__ import annotations

import os
import sys
import traceback
import warnings

from looped_lm import checkpoint as ckpt_io
from looped_lm.config import describe_fields
from looped_lm.console import plain_warnings
from looped_lm.errors import RunFailure, UserError
from looped_lm.trainer.args import PREFLIGHT_DONE, config_from_args, parse_args
from looped_lm.trainer.distributed import lost_peer
from looped_lm.trainer.run import train


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.help_config is not None:
        try:
            print(describe_fields(kind=args.help_config or None))
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    first_rank = os.environ.get("RANK", "0") == "0"

    plain_warnings(args.verbose)
    if not first_rank:
        warnings.simplefilter("ignore")  # every rank runs the same code: rank 0 says it once
    try:
        cfg = config_from_args(args)
        if args.no_verify and first_rank and not os.environ.get(PREFLIGHT_DONE):
            print(ckpt_io.no_verify_note(), file=sys.stderr)
        train(cfg, stop_after=args.stop_after, verify=not args.no_verify)
    except UserError as e:
        if not getattr(e, "quiet", False):
            _traceback(args.verbose)
            print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailure as e:
        if not getattr(e, "quiet", False):
            _traceback(args.verbose)
            print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # mid-run I/O (metrics, logs) outside a save
        _traceback(args.verbose)
        where = f" on {e.filename}" if e.filename else ""
        print(f"error: I/O failure{where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        reason = lost_peer(e)
        if reason is None:
            raise
        _traceback(args.verbose)
        print(f"error: rank {os.environ.get('RANK', '0')} lost contact with another rank mid-run (it stopped or was "
              f"killed; its own output says why): {reason}", file=sys.stderr)
        return 1
    return 0


def _traceback(verbose: bool) -> None:
    if verbose:
        traceback.print_exc()
