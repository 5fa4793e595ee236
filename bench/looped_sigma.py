"""looped_db's training noise law on text: the looped quickstart with the EDM law (ln sigma ~ N(-1.2, 1.2^2),
the default) against the law moved up (p_mean 1.0), the change that made looped_db learn to copy
(bench/results/depth_synthetic/round3, plan.md item 11).

    python bench/looped_sigma.py            # ~10 CPU-min; writes bench/results/looped_sigma.json

Each variant: `looped_lm train --config configs/quickstart_looped.yaml` (seed 0, its own schedule, the same
steps and so the same training FLOPs), then `looped_lm eval --max-tokens 8192 --num-iterations 1,4,16
--draws 16 --seed 0` on the held-out books. One seed per variant: a lead, not a verdict.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"edm_law_default": [], "p_mean_1.0": ["--set", "diffusion.p_mean=1.0"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "work" / "looped_sigma"))
    args = ap.parse_args()
    out, cli = {"config": "configs/quickstart_looped.yaml", "runs": {}}, [sys.executable, "-m", "looped_lm"]
    for name, extra in VARIANTS.items():
        run_dir, scores = Path(args.out_dir) / name, Path(args.out_dir) / f"{name}_eval.json"
        subprocess.run(cli + ["train", "--config", "configs/quickstart_looped.yaml", "--set", f"train.out_dir={run_dir}",
                              *extra], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(cli + ["eval", "--checkpoint", str(run_dir), "--max-tokens", "8192", "--num-iterations", "1,4,16",
                              "--draws", "16", "--seed", "0", "--no-progress", "--json", str(scores)],
                       cwd=ROOT, check=True, capture_output=True)
        out["runs"][name] = {"overrides": extra, "eval": json.loads(scores.read_text())}
        print(name, out["runs"][name]["eval"]["ppl_at_k"], flush=True)
    (ROOT / "bench" / "results" / "looped_sigma.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
