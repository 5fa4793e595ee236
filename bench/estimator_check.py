"""ppl@k's estimator (`model.score`, per boost and draw count) against plain Monte-Carlo of the chain
`generate` runs, and the naive mean of 2 / 4 chains, per K and `last_call` (docs/method.md §6).

    python bench/estimator_check.py --checkpoint out/quickstart_db/step_0001000    # -> estimator_check.json
    python bench/estimator_check.py --checkpoint CKPT --ks 4 --bridge soft --draws 16,64 --last-calls edge

The soft-chain check of bench/results/quality/estimator/ ran on a quality-study checkpoint through `--run`
(bench/quality.py's loader), at commit a2d4a89.
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
    cfg = cfg.model_copy(deep=True)
    cfg.diffusion.last_call = last_call
    other = build_model(cfg, manifest["vocab_size"], manifest.get("model_state"))
    other.load_state_dict(model.state_dict())
    return other.eval()


@torch.no_grad()
def plain_chains(model, x, y, K, chains, seed, group=256, bridge="sample"):
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
        settings = [InferenceSettings(num_iterations=K, bridge=bridge)] * xs.shape[0]
        logits = run_chain(window.denoise, model.grid(), settings, z, random, model.targets,
                           model.target_table).logits
        p = logits.double().softmax(-1).gather(-1, ys[..., None])[..., 0].view(reps, *y.shape)
        total += p.sum(0)
        square += (p * p).sum(0)
        done += reps
    mean = total / chains
    return mean, (square / chains - mean ** 2).clamp_min(0) / chains, p


def per_token_agreement(mc_mean, mc_var, scores, precise=0.05) -> dict:
    """Token by token, on the targets whose plain Monte-Carlo probability is precise (relative standard
    error < `precise`): the estimator's probability exp(-nll) against it, z = difference over both
    standard errors. The aggregate ppl of plain Monte-Carlo is not a reference where some target is rare
    (a handful of chains decide its log), so this is the check of unbiasedness."""
    p_mc, se_mc = mc_mean, mc_var.sqrt()
    p_est = (-scores.nll.double()).exp()
    se_est = p_est * scores.nll_var.double().clamp_min(0).sqrt()
    keep = se_mc < precise * p_mc
    z = (p_est - p_mc)[keep] / (se_mc[keep] ** 2 + se_est[keep] ** 2).sqrt()
    rel = ((p_est - p_mc) / p_mc)[keep]
    return {"precise_tokens": int(keep.sum()), "tokens": int(keep.numel()),
            "mean_rel_diff": float(rel.mean()), "mean_abs_rel_diff": float(rel.abs().mean()),
            "max_abs_z": float(z.abs().max()) if keep.any() else None,
            "share_abs_z_over_3": float((z.abs() > 3).double().mean()) if keep.any() else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a trainer checkpoint directory")
    ap.add_argument("--boosts", default="0.5", help="estimator boosts to compare")
    ap.add_argument("--draws", default="4,16", help="estimator draw counts to compare")
    ap.add_argument("--last-calls", default="edge,sigma_min")
    ap.add_argument("--chains", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=128, help="held-out targets scored (windows of 64)")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--bridge", default="sample", choices=["sample", "soft", "hard"],
                    help="the chain's bridge, in plain Monte-Carlo and in the estimator alike")
    ap.add_argument("--out", default=str(RESULTS / "estimator_check.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, cfg, manifest = load_checkpoint(args.checkpoint)
    stream = TokenStream(str(Path(manifest["data"]["dir"]) / "val.bin"), 64)
    config, step = manifest["config"]["diffusion"], manifest["step"]
    windows = list(stream.iter_blocks(64, None, args.tokens))
    x = torch.stack([w[0] for w in windows])
    y = torch.stack([w[1] for w in windows])
    B = len(model.blocks)
    boosts = [float(b) for b in args.boosts.split(",")]
    draw_counts = [int(d) for d in args.draws.split(",")]
    rows, out = [], {"checkpoint": str(args.checkpoint), "step": step, "tokens": int(y.numel()),
                     "chains": args.chains, "blocks": B, "bridge": args.bridge, "config": config, "results": []}
    for last_call in args.last_calls.split(","):
        m = with_last_call(model, cfg, manifest, last_call)
        for K in [int(k) for k in args.ks.split(",")]:
            t = time.perf_counter()
            mean, var, _ = plain_chains(m, x, y, K, args.chains, seed=1, bridge=args.bridge)
            mc_nll = float(-mean.clamp_min(1e-300).log().mean())
            mc_se = float((var / mean.clamp_min(1e-300) ** 2).sum().sqrt()) / y.numel()
            mc_time = time.perf_counter() - t
            naive = {}
            for n in (2, 4):
                nm, _, _ = plain_chains(m, x, y, K, n, seed=2, bridge=args.bridge)
                naive[n] = math.exp(float(-nm.clamp_min(1e-300).log().mean()))
            row = {"last_call": last_call, "K": K, "mc_ppl": math.exp(mc_nll), "mc_se": math.exp(mc_nll) * mc_se,
                   "mc_seconds": mc_time, "naive_2": naive[2], "naive_4": naive[4], "estimator": {}}
            for boost in boosts:
                for draws in draw_counts:
                    t = time.perf_counter()
                    s = m.score(x, y, ScoreSettings(k_grid=(K,), draws=draws, boost=boost, bridge=args.bridge),
                                torch.Generator().manual_seed(3))[K]
                    nll = float(s.nll.mean())
                    se = float(s.nll_var.sum().sqrt()) / y.numel() if s.nll_var is not None else 0.0
                    row["estimator"][f"{boost}/{draws}"] = {"boost": boost, "draws": draws, "ppl": math.exp(nll),
                                                            "se": math.exp(nll) * se, "seconds": time.perf_counter() - t,
                                                            "per_token": per_token_agreement(mean, var, s)}
            out["results"].append(row)
            est = " | ".join(f"{e['ppl']:.3f} ± {e['se']:.3f} ({e['per_token']['precise_tokens']} tok: "
                             f"{100 * e['per_token']['mean_rel_diff']:+.1f}%, max|z| {e['per_token']['max_abs_z']:.1f})"
                             for e in row["estimator"].values())
            rows.append(f"| {last_call} | {K} | {row['mc_ppl']:.3f} ± {row['mc_se']:.3f} | {est} | "
                        f"{naive[2]:.2f} / {naive[4]:.2f} | {mc_time:.0f} s |")
            print(rows[-1], flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    labels = [f"estimator, boost {b}, {d} draws (per token where MC is precise: n, mean rel. diff, max |z|)"
              for b in boosts for d in draw_counts]
    head = ["| last_call | K | plain Monte-Carlo (± se) | " + " | ".join(labels) +
            " | naive mean of 2 / 4 chains | time MC |", "|---|---|---|" + "---|" * len(labels) + "---|---|"]
    print("\n".join(head + rows))


if __name__ == "__main__":
    main()
