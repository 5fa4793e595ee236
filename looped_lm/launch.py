"""`looped_lm train` -> `deepspeed --num_gpus N --module looped_lm.train ...`: find the launcher, start it,
and pass on what the user reads.

The launcher is the one installed beside the running Python (a venv's bin/, which need not be on PATH),
else the one on PATH. Its own log lines (hostfile search, world info, CUDA_VISIBLE_DEVICES, the command
it ran, exit codes) and DeepSpeed's INFO lines are dropped unless `--verbose`: what remains is the
trainer's own output and real warnings.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from looped_lm.errors import UserError

# DeepSpeed's log format: "[2026-01-01 12:00:00,123] [INFO] [launch.py:152:main] ..."
_DS_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(?P<level>[A-Z]+)\] \[(?P<file>[\w.]+):\d+:")


def find_launcher() -> str:
    beside = Path(sys.executable).parent / "deepspeed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("deepspeed")
    if found is None:
        raise UserError(f"the `deepspeed` launcher is neither beside this Python ({beside.parent}) nor on PATH; "
                        "pip install deepspeed")
    return found


def command(nproc: int, port: int, trainer_argv: list[str], verbose: bool) -> list[str]:
    return [find_launcher(), "--num_gpus", str(nproc), "--master_port", str(port),
            "--log_level", "info" if verbose else "error", "--module", "looped_lm.train", *trainer_argv]


def is_noise(line: str) -> bool:
    """A launcher line the user does not need: the launcher's own logging, or DeepSpeed INFO/DEBUG."""
    m = _DS_LOG.match(line)
    return bool(m) and (m["file"] in ("runner.py", "launch.py") or m["level"] in ("INFO", "DEBUG"))


def run(cmd: list[str], env: dict, verbose: bool = False) -> int:
    """Run the launcher; its stdout goes through the noise filter, stderr (the progress bar, errors)
    straight to the terminal. Returns its exit code."""
    if verbose:
        return subprocess.run(cmd, env=env).returncode
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        for line in proc.stdout:
            if not is_noise(line):
                sys.stdout.write(line)
                sys.stdout.flush()
    except KeyboardInterrupt:  # the launcher got the same SIGINT and stops its ranks
        proc.wait()
        raise
    return proc.wait()
