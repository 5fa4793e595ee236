"""ppl@k's estimator against plain Monte-Carlo of the real sampler, on a trained checkpoint.

    python bench/estimator_check.py --checkpoint out/quickstart_db/step_0000400 [--chains 2048] [--tokens 128]

For each K and each `last_call` (`edge`, `sigma_min`; the checkpoint's weights with that setting):
  mc         plain Monte-Carlo: `--chains` runs per token of the very chain `generate` runs (temperature 1),
             p(y) = mean of the last call's softmax at y, its standard error from the chains' spread
  estimator  `model.score` (looped_lm/diffusion/estimator.py) at the eval defaults and at more draws,
             with its own standard error, and its cost in network calls
  naive      -log of the plain mean of 2 and 4 chains (what ppl@k used to be at K > B)

Writes bench/results/estimator_check.json and prints a markdown table. One thread.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from looped_lm.checkpoint import load_checkpoint
from looped_lm.data.bin_dataset import TokenStream
from looped_lm.diffusion.chain import run_chain
from looped_lm.models import build_model
from looped_lm.models.db.contexts import WindowContext
from looped_lm.sampling import SharedGenerator
from looped_lm.settings import InferenceSettings, ScoreSettings

RESULTS = Path(__file__).resolve().parent / "results"


def with_last_call(model, cfg, manifest, last_call):
    cfg = cfg.model_copy(deep=True) if hasattr(cfg, "model_copy") else cfg
    cfg.diffusion.last_call = last_call
    other = build_model(cfg, manifest["vocab_size"], manifest.get("model_state"))
    other.load_state_dict(model.state_dict())
    return other.eval()


@torch.no_grad()
def plain_chains(model, x, y, K, chains, seed, group=256):
    """Per-token mean and variance of softmax(last call)[y] over `chains` runs of the real chain."""
    total = torch.zeros(y.shape, dtype=torch.float64)
    square = torch.zeros_like(total)
    random = SharedGenerator(torch.Generator().manual_seed(seed))
    done = 0
    while done < chains:
        reps = min(group, chains - done)
        xs, ys = x.repeat(reps, 1), y.repeat(reps, 1)
        window = WindowContext(model, xs)
        z = model.initial_noise(xs.shape[0], xs.shape[1], random)
        settings = [InferenceSettings(num_iterations=K, bridge="sample")] * xs.shape[0]
        logits = run_chain(window.denoise, model.grid(), settings, z, random, model.targets,
                           model.target_table).logits
        p = logits.double().softmax(-1).gather(-1, ys[..., None])[..., 0].view(reps, *y.shape)
        total += p.sum(0)
        square += (p * p).sum(0)
        done += reps
    mean = total / chains
    return mean, (square / chains - mean ** 2).clamp_min(0) / chains, p


def ppl(nll_mean):
    return math.exp(nll_mean)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--chains", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=128, help="held-out targets scored (windows of 64)")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--out", default=str(RESULTS / "estimator_check.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, cfg, manifest = load_checkpoint(args.checkpoint)
    stream = TokenStream(str(Path(manifest["data"]["dir"]) / "val.bin"), 64)
    windows = list(stream.iter_blocks(64, None, args.tokens))
    x = torch.stack([w[0] for w in windows])
    y = torch.stack([w[1] for w in windows])
    B = len(model.blocks)
    rows, out = [], {"checkpoint": str(args.checkpoint), "step": manifest["step"], "tokens": int(y.numel()),
                     "chains": args.chains, "blocks": B, "config": manifest["config"]["diffusion"], "results": []}
    for last_call in ("edge", "sigma_min"):
        m = with_last_call(model, cfg, manifest, last_call)
        for K in [int(k) for k in args.ks.split(",")]:
            t = time.perf_counter()
            mean, var, _ = plain_chains(m, x, y, K, args.chains, seed=1)
            mc_nll = float(-mean.clamp_min(1e-300).log().mean())
            mc_se = float((var / mean.clamp_min(1e-300) ** 2).sum().sqrt()) / y.numel()
            mc_time = time.perf_counter() - t
            naive = {}
            for n in (2, 4):
                nm, _, _ = plain_chains(m, x, y, K, n, seed=2)
                naive[n] = ppl(float(-nm.clamp_min(1e-300).log().mean()))
            row = {"last_call": last_call, "K": K, "mc_ppl": ppl(mc_nll), "mc_se": ppl(mc_nll) * mc_se,
                   "mc_seconds": mc_time, "naive_2": naive[2], "naive_4": naive[4], "estimator": {}}
            for draws in (4, 16):
                t = time.perf_counter()
                s = m.score(x, y, ScoreSettings(k_grid=(K,), draws=draws), torch.Generator().manual_seed(3))[K]
                nll = float(s.nll.mean())
                se = float(s.nll_var.sum().sqrt()) / y.numel() if s.nll_var is not None else 0.0
                row["estimator"][draws] = {"ppl": ppl(nll), "se": ppl(nll) * se, "seconds": time.perf_counter() - t}
            out["results"].append(row)
            e4, e16 = row["estimator"][4], row["estimator"][16]
            rows.append(f"| {last_call} | {K} | {row['mc_ppl']:.3f} ± {row['mc_se']:.3f} | {e4['ppl']:.3f} ± {e4['se']:.3f} | "
                        f"{e16['ppl']:.3f} ± {e16['se']:.3f} | {naive[2]:.2f} / {naive[4]:.2f} | "
                        f"{mc_time:.0f} s / {e4['seconds']:.1f} s |")
            print(rows[-1], flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    head = ["| last_call | K | plain Monte-Carlo (± se) | estimator, 4 draws | estimator, 16 draws | "
            "naive mean of 2 / 4 chains | time MC / est. (4) |", "|---|---|---|---|---|---|---|"]
    print("\n".join(head + rows))


if __name__ == "__main__":
    main()
