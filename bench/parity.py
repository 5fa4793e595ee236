"""FLOPs to parity (docs/results.md, first table): how much of the budget end-to-end gpt needs to reach each
DiffusionBlocks run's final held-out NLL, read off gpt's probe curve of the same seed in the powered study
(bench/results/quality/powered/, the probes every tenth of a run, on the same probe windows).

    python bench/parity.py      # writes bench/results/quality/parity.json

A probe sits mid-schedule (the learning rate has not decayed yet), so gpt would do at least as well with
a full schedule at that budget: the fraction is an upper bound, and its inverse (the compute DB needs for
gpt's result) a lower bound. Interpolated linearly in log FLOPs between probes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "results" / "quality"
RUNS = {"db_ar_b2": "0", "db_ar_b4": "0", "huginn": "8", "looped_db": "0"}


def curve(run: dict, key: str) -> list[tuple[float, float]]:
    return [(p["flops"], p["val"][key]) for p in run["probes"] if key in p["val"]]


def flops_to_reach(points: list[tuple[float, float]], target: float) -> float | None:
    for (f0, v0), (f1, v1) in zip(points, points[1:]):
        if v0 >= target >= v1:
            w = (v0 - target) / (v0 - v1) if v0 != v1 else 0.0
            return math.exp(math.log(f0) + w * (math.log(f1) - math.log(f0)))
    return None  # gpt never reaches it (beyond the budget), or already at its first probe (below)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    out = {}
    for name, key in RUNS.items():
        rows = []
        for seed in (0, 1, 2):
            db = json.loads((ROOT / "powered" / f"{name}__s{seed}.json").read_text())
            gpt = json.loads((ROOT / "powered" / f"gpt__s{seed}.json").read_text())
            target = db["probes"][-1]["val"][key]
            points = curve(gpt, "exact")
            f = flops_to_reach(points, target)
            first = target >= points[0][1]  # gpt's first probe (a tenth of the budget) is already better
            rows.append({"seed": seed, "db_probe_nll": target, "gpt_flops_to_reach": f, "budget": db["flops"],
                         "fraction": points[0][0] / db["flops"] if first else (None if f is None else f / db["flops"]),
                         "bound": "at most (gpt's first probe already better)" if first else "interpolated"})
        fr = [r["fraction"] for r in rows if r["fraction"] is not None]
        out[name] = {"per_seed": rows, "fraction_mean": statistics.fmean(fr) if fr else None,
                     "compute_for_parity_at_least": 1 / max(fr) if fr else None}
        print(name, [None if r["fraction"] is None else round(r["fraction"], 3) for r in rows])
    (ROOT / "parity.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
