"""bench/gpu_check.sh, the script a lent GPU runs first, runs here on CPU at a tiny width (`--dry-run`): every step
through the same commands and code paths, so what would crash it on a GPU for a reason that is not the GPU's
(a missing import, a renamed flag, a moved file) crashes here first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # every trainer check, eval and generate, and the speed rows: a few minutes on 2 cores
def test_the_gpu_check_runs_each_step_on_cpu(tmp_path, clean_env):
    env = {**clean_env, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{clean_env['PATH']}",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    for step in ("== train quickstart_db (cpu", "== train quickstart_looped (cpu", "== train quickstart (cpu",
                 "== train huginn (cpu", "== train quickstart_db in block-parallel mode (cpu"):
        assert step in out, out[-4000:]
    assert "skipped" not in out and "failed" not in out and "Traceback" not in out, out[-6000:]
    assert (tmp_path / "gpu_speed.json").exists() and (tmp_path / "gpu_decode.json").exists()
    for run in ("quickstart_db", "quickstart_looped", "quickstart", "huginn", "bp"):
        assert (tmp_path / "runs" / run / "step_0000002" / "manifest.json").exists(), run
