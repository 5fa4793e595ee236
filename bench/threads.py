"""Threads per CPU rank: the README's quickstart training, on a quiet machine and on one loaded by other jobs.

    python bench/threads.py                     # quickstart_db, 100 steps per run; ~15 min here
    python bench/threads.py --steps 50 --load 2

Each run is `looped_lm train --config configs/quickstart_db.yaml --set train.max_steps=N` (a fresh out_dir),
timed whole (launcher, DeepSpeed start-up, the steps, the save), under each thread setting:
    launcher      nothing set: the threads `looped_lm train` chooses for each CPU rank (launch.cpu_thread_env)
    1 thread      OMP_NUM_THREADS=1
    2 threads     OMP_NUM_THREADS=2 OMP_WAIT_POLICY=ACTIVE (torch's default on this 2-core machine, before the
                  launcher chose: every thread of the OpenMP pool spins while it waits)
    2 passive     OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE (the pool's threads sleep while they wait)
"loaded": `--load` busy processes (pure-Python loops, one per core by default) run beside the training, as the
other jobs of a shared machine do. The losses of each run are recorded: the thread count must not change them.
Writes bench/results/threads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

ROOT = common.ROOT
SETTINGS = {
    "launcher": {},
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "2 threads": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"},
    "2 passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")


def train(out: Path, steps: int, extra_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(extra_env)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "looped_lm", "train", "--config", "configs/quickstart_db.yaml",
                    "--set", f"train.out_dir={out}", "--set", f"train.max_steps={steps}", "--set", "train.progress=false",
                    "--set", f"train.save_every={steps}"], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return {"wall_s": round(wall, 1), "losses": losses}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--load", type=int, default=os.cpu_count(), help="busy processes beside the loaded runs")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "threads.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for loaded in (False, True):
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load if loaded else 0)]
            try:
                time.sleep(5 if loaded else 0)
                for name, env in SETTINGS.items():
                    load = os.getloadavg()[0]
                    row = train(Path(tmp) / f"{name.replace(' ', '_')}_{loaded}", args.steps, env)
                    rows.append({"machine": "loaded" if loaded else "quiet", "setting": name, "env": env,
                                 "load_average_before": load, **row})
                    print(f"{rows[-1]['machine']:6s} {name:10s} {row['wall_s']:7.1f} s", flush=True)
            finally:
                for h in hogs:
                    h.kill()
    by = {(r["machine"], r["setting"]): r for r in rows}
    ratios = {m: {s: round(by[(m, s)]["wall_s"] / by[(m, "1 thread")]["wall_s"], 3) for s in SETTINGS}
              for m in ("quiet", "loaded")}
    same_losses = all(r["losses"] == rows[0]["losses"] for r in rows)
    common.write_json(args.out, {
        "what": "looped_lm train of configs/quickstart_db.yaml, whole-command wall time per thread setting, "
                "on a quiet machine and beside busy processes",
        "command": "python bench/threads.py " + " ".join(sys.argv[1:]), "commit": common.git_commit(),
        "date": common.utc_now(), "cores": os.cpu_count(), "steps": args.steps, "load_processes": args.load,
        "wall_over_one_thread": ratios, "losses_identical_across_settings": same_losses,
        "rows": rows})
    print(json.dumps(ratios), "losses identical:", same_losses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
