"""A refactor changes no behaviour: the three CPU quickstarts trained for a few steps at two commits give the
same losses and the same weights (sha256), generate the same tokens at K = 1, 2 and 4, and the newer code
loads the older commit's checkpoints and generates the same tokens from them.

    python bench/house_identity.py --before d33637d --after HEAD [--steps 30] [--json bench/results/house_identity.json]

Each commit runs from its own git worktree (its own code), one thread; the data cache is shared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

CONFIGS = {"gpt": "configs/quickstart.yaml", "db_ar": "configs/quickstart_db.yaml",
           "looped_db": "configs/quickstart_looped.yaml"}
KS = {"gpt": [None], "db_ar": [1, 2, 4], "looped_db": [1, 2, 4]}
PROMPT = "And God said"


def run(tree: Path, *args: str) -> str:
    """`python -m looped_lm ARGS` with `tree`'s code (its folder first on the path), one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-m", "looped_lm", *args], cwd=tree, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[:3])} at {tree} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def generated(tree: Path, ckpt: Path, k: int | None) -> str:
    extra = ["--num-iterations", str(k)] if k is not None else []
    return run(tree, "generate", "--checkpoint", str(ckpt), "--prompt", PROMPT, "--max-tokens", "24",
               "--seed", "0", "--no-verify", *extra)


def train(tree: Path, name: str, out: Path, cache: Path, steps: int) -> dict:
    run(tree, "train", "--config", CONFIGS[name], "--set", f"train.out_dir={out}", "--set", f"train.max_steps={steps}",
        "--set", f"train.save_every={steps}", "--set", "train.eval_every=0", "--set", "train.log_every=1",
        "--set", "train.progress=false", "--set", f"data.cache_dir={cache}")
    ckpt = sorted(out.glob("step_*"))[-1]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if line.strip() and "loss" in json.loads(line)]
    weights = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    return {"ckpt": ckpt, "losses": losses, "weights_sha256": weights,
            "tokens": {str(k): generated(tree, ckpt, k) for k in KS[name]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", default="HEAD")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", default=str(common.ROOT / "bench" / "results" / "house_identity.json"))
    args = p.parse_args(argv)
    commits = {side: subprocess.run(["git", "rev-parse", ref], cwd=common.ROOT, capture_output=True, text=True,
                                    check=True).stdout.strip() for side, ref in (("before", args.before),
                                                                                 ("after", args.after))}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        trees = {}
        for side, sha in commits.items():
            trees[side] = work / side
            subprocess.run(["git", "worktree", "add", "--detach", "-f", str(trees[side]), sha], cwd=common.ROOT,
                           check=True, capture_output=True)
        try:
            result = {"commits": commits, "steps": args.steps, "prompt": PROMPT, "runs": {}}
            for name in CONFIGS:
                sides = {side: train(trees[side], name, work / f"{side}_{name}", work / "cache", args.steps)
                         for side in commits}
                b, a = sides["before"], sides["after"]
                # the newer code reading the older commit's checkpoint
                cross = {str(k): generated(trees["after"], b["ckpt"], k) for k in KS[name]}
                row = {"losses_equal": b["losses"] == a["losses"], "weights_equal": b["weights_sha256"] == a["weights_sha256"],
                       "tokens_equal": b["tokens"] == a["tokens"], "old_checkpoint_same_tokens": cross == b["tokens"],
                       "final_loss": a["losses"][-1], "weights_sha256": a["weights_sha256"], "tokens": a["tokens"]}
                result["runs"][name] = row
                print(name, {k: v for k, v in row.items() if k.endswith(("equal", "tokens")) and k != "tokens"}, flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=common.ROOT, capture_output=True)
    result["all_equal"] = all(all(v for k, v in r.items() if k.endswith(("equal", "same_tokens"))) for r in result["runs"].values())
    result["finished_utc"] = common.utc_now()
    common.write_json(Path(args.json), result)
    print("all equal:", result["all_equal"])
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
