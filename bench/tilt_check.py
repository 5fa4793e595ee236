"""The estimator's tilted starting noise, gated vs ungated vs off, against plain Monte-Carlo of the chain.

    python bench/tilt_check.py        # ~4 CPU-min; writes bench/results/tilt_check.json

On the test suite's tiny trained db_ar model (B = 2, a Markov language whose targets have p between 0.003
and 0.76), for K = 2, 4, 8: plain Monte-Carlo of the real chain (8,000 chains per window) gives each
target's p; the estimator at 4 and 32 draws, over 12 estimator seeds, gives the mean NLL's offset from
plain Monte-Carlo's and its spread, for three tilt rules: `gated` (the product: only toward targets a
pilot call gives < 0.5), `ungated` (every target, the rule before), `off` (tilt = 0). The near-certain
case (where the gate matters) is checked in tests/test_estimator.py and bench/depth_synthetic.py
chain-check; this checks the gate costs nothing where targets are uncertain.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import looped_lm.models.db.model as db_model  # noqa: E402
from looped_lm.settings import ScoreSettings  # noqa: E402
from test_estimator import plain_monte_carlo  # noqa: E402
from tiny_models import markov_batch, trained_tiny_db  # noqa: E402


@torch.no_grad()
def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    model = trained_tiny_db(last_call="sigma_min")
    x, y = markov_batch(torch.Generator().manual_seed(3), batch=4, T=6)
    gate = db_model.TILT_BELOW
    rules = {"gated": (1.0, gate), "ungated": (1.0, 2.0), "off": (0.0, gate)}
    out = {"model": "tests/tiny_models.py trained_tiny_db(last_call='sigma_min')", "targets": y.numel(),
           "mc_chains": 8000, "estimator_seeds": 12, "tilt_below": gate, "by_K": {}}
    for K in (2, 4, 8):
        p_mc, se_mc = plain_monte_carlo(model, x, y, K, 8000, seed=2)
        ref = float(-p_mc.log().mean())
        row = {"plain_mc_nll": ref, "p_range": [float(p_mc.min()), float(p_mc.max())]}
        for rule, (tilt, below) in rules.items():
            db_model.TILT_BELOW = below
            for draws in (4, 32):
                vals = [float(model.score(x, y, ScoreSettings(k_grid=(K,), draws=draws, tilt=tilt),
                                          torch.Generator().manual_seed(s))[K].nll.mean()) for s in range(12)]
                row[f"{rule}_{draws}draws"] = {"offset_mean": statistics.fmean(vals) - ref,
                                               "offset_rmse": statistics.fmean((v - ref) ** 2 for v in vals) ** 0.5,
                                               "spread_sd": statistics.stdev(vals)}
            db_model.TILT_BELOW = gate
        out["by_K"][str(K)] = row
        print(K, json.dumps(row), flush=True)
    path = ROOT / "bench" / "results" / "tilt_check.json"
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
