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


def command(nproc: int, port: int, trainer_argv: list[str], verbose: bool, hostfile: str | None = None) -> list[str]:
    """The launcher's command: `nproc` processes on this node, or with a hostfile one process per slot on
    every node it lists (`nproc` > 0 caps the processes per node), reached over ssh by DeepSpeed."""
    where = (["--hostfile", hostfile] if hostfile else []) + (["--num_gpus", str(nproc)] if nproc or not hostfile else [])
    return [find_launcher(), *where, "--master_port", str(port), "--log_level", "info" if verbose else "error",
            "--module", "looped_lm.train", *trainer_argv]


def hostfile_slots(path: str, per_node: int = 0) -> int:
    """Processes a DeepSpeed hostfile asks for: the sum of its `host slots=N` lines (# starts a comment),
    each capped at `per_node` (the launcher's --num_gpus) if given."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read hostfile {path}: {e.strerror}") from None
    total = 0
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"\S+\s+slots=(\d+)", line)
        if m is None:
            raise UserError(f"hostfile {path} line {n}: expected `hostname slots=N`, got {line!r}")
        total += min(int(m.group(1)), per_node) if per_node else int(m.group(1))
    if total == 0:
        raise UserError(f"hostfile {path} lists no slots")
    return total


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
