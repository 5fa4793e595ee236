"""The README's quickstart table, measured: train each CPU quickstart with the README's command, then
score it with `looped_lm eval` and sample it with `looped_lm generate`, exactly as a user would.

    python bench/quickstart.py                       # quickstart_db and quickstart (gpt); ~10 min here
    python bench/quickstart.py --configs quickstart_looped --out-dir /tmp/qs

Per config: wall time of `looped_lm train` (the launcher, DeepSpeed start-up and the whole run), the
held-out numbers of `looped_lm eval --max-tokens 8192` (gpt: exact PPL; DiffusionBlocks: ppl@0 and
ppl@k with the estimator's standard error, 16 draws, seed 0) and the text of `looped_lm generate` from
"And God said" (seed 0, the generate defaults). Writes bench/results/quickstart.json. Wall times
depend on the machine's load; the JSON records the load average beside them. `--rescore` (score trained
runs again after an estimator change, keeping the earlier scorings) is this script at commit 4c5951d.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

ROOT = common.ROOT
RESULTS = ROOT / "bench" / "results"
K_OF = {"quickstart_db": "1,2,4", "quickstart_looped": "1,4,16", "quickstart": ""}
GEN_K = {"quickstart_db": 2, "quickstart_looped": 16}


def run(*args: str) -> tuple[str, float, float]:
    """`looped_lm ARGS` in the caller's environment -> (stdout, wall seconds, CPU seconds of the command and
    every process it started)."""
    t0, c0 = time.perf_counter(), common.children_cpu_s()
    out = common.python("-m", "looped_lm", *args, threads=None)
    return out, time.perf_counter() - t0, common.children_cpu_s() - c0


def measure(name: str, out_dir: Path) -> dict:
    """Train configs/<name>.yaml into out_dir, score it with `looped_lm eval`, sample it with `looped_lm generate`."""
    run_dir, scores = out_dir / name, out_dir / f"{name}_eval.json"
    load_before = os.getloadavg()[0]
    _, train_s, train_cpu = run("train", "--config", f"configs/{name}.yaml", "--set", f"train.out_dir={run_dir}")
    run("eval", "--checkpoint", str(run_dir), "--max-tokens", "8192", "--json", str(scores), "--no-progress", "--seed",
        "0", *(["--num-iterations", K_OF[name], "--draws", "16"] if K_OF[name] else []))
    text, _, _ = run("generate", "--checkpoint", str(run_dir), "--prompt", "And God said", "--seed", "0",
                     *(["--num-iterations", str(GEN_K[name])] if name in GEN_K else []))
    return {"config": f"configs/{name}.yaml", "train_wall_s": round(train_s, 1), "train_cpu_s": round(train_cpu, 1),
            "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),  # set: one thread per process (a shared machine)
            "eval": json.loads(scores.read_text()), "generate_k": GEN_K.get(name), "generated": text.strip()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="quickstart_db,quickstart")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "work" / "quickstart"))
    ap.add_argument("--out", default=str(RESULTS / "quickstart.json"))
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"cpu_count": os.cpu_count(), "runs": {}}
    if Path(args.out).is_file():  # re-measuring some configs keeps the others' rows
        results["runs"] = json.loads(Path(args.out).read_text()).get("runs", {})
    for name in args.configs.split(","):
        results["runs"][name] = measure(name, out_dir)
        print(json.dumps({name: results["runs"][name]}, indent=1))
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
