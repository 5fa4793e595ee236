"""What the command line prints besides results: warnings as one plain line each.

Python's default shows a warning as `path:line: UserWarning: message` plus the source line. A user of the
CLI needs the message. Deprecation notices raised inside libraries (torch, DeepSpeed) are nothing the user
can act on: hidden unless `--verbose`.
"""

from __future__ import annotations

import sys
import warnings



def _show(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=file or sys.stderr)


def plain_warnings(verbose: bool = False) -> None:
    warnings.showwarning = _show
    if not verbose:
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category)
            warnings.filterwarnings("default", category=category, module=r"looped_lm(\.|$)")
