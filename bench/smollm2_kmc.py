"""Is the K > B chain of a DB model worse, or only its likelihood estimate? Plain Monte-Carlo of the real
thing against `looped_lm eval`'s estimator, on one held-out window (docs/pretrained.md, "More iterations").

    python bench/smollm2_kmc.py --checkpoint RUN/step_X --k 2,4 --chains 256 --json OUT.json

For each K: `--chains` independent runs of the served chain itself (`run_chain`: z_0 ~ N(0, sigma_top^2 I),
a token drawn from the model's own distribution at every bridge, temperature 1) over every slot of the window
at once; a chain's final call gives p_final(y) at each slot, and their plain mean is an unbiased estimate of the
sampler's p_K(y), with a standard error from their spread and no importance weights. Beside it, on the same
window, the estimator `looped_lm eval` uses (`model.score`, `--draws` estimates). Reported per K:
- `mean_p`: the plain mean over slots of p_K(y), a linear statistic both the sampler's quality and plain MC
  resolve (no log of a noisy number), with its se;
- per slot, both estimates of log p_K(y) and their se; `plain_ppl` over the slots plain MC resolves
  (se of log p below 0.25 nats) and the estimator's ppl over the same slots.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

from looped_lm.checkpoint import load_checkpoint  # noqa: E402
from looped_lm.data.bin_dataset import load_tokens  # noqa: E402
from looped_lm.diffusion.chain import euler_to, run_chain  # noqa: E402
from looped_lm.diffusion.sampler import inference_sigmas  # noqa: E402
from looped_lm.models.db.contexts import WindowContext  # noqa: E402
from looped_lm.sampling import PLAIN, SharedGenerator  # noqa: E402
from looped_lm.settings import InferenceSettings, ScoreSettings  # noqa: E402

RESOLVED_SE = 0.25  # nats: a slot's plain-MC log p counts as resolved below this se ...
MIN_HITS = 10  # ... and where p x chains >= 10: a rare path no chain took leaves a tiny p with a tiny se
OUT = common.ROOT / "bench" / "results" / "smollm2" / "kmc"


def variant_plan(model, K: int, step: str) -> tuple[list[float], list[int]]:
    """(sigmas, blocks) of a chain variant. `fresh`: the served K-step grid. `mid0` / `mid1`: K = 3, the
    K = 2 chain plus one call in the middle of block 0's / block 1's interval (the K = 4 grid's second /
    third point), to find which extra call costs. `block0`: every call beyond B inside block 0's interval
    (the block the levers train), block 1 only reading back at sigma_min; K = 2 is the served chain."""
    grid = model.grid()
    if step == "fresh":
        return grid.sigmas(K), grid.blocks(K)
    if step == "block0":  # B = 2: K - 1 calls equally in block 0's CDF from sigma_top, then the read-back at sigma_min
        inside = inference_sigmas(K - 1, grid.sched, lo=grid.edges[1], hi=grid.sigma_top)[:-1]
        inside[0] = grid.sigma_top
        return inside + [grid.edges[0], grid.edges[0]], [0] * len(inside) + [1]
    sigmas, blocks = grid.sigmas(4), grid.blocks(4)
    keep = 1 if step == "mid0" else 2
    return [sigmas[0], sigmas[keep], sigmas[3], sigmas[4]], [blocks[0], blocks[keep], blocks[3]]


def chain_variant(model, denoise, K: int, z, random, step: str):
    """The sample-bridge chain with another move between calls or another grid (`step`): `fresh` puts the
    drawn token's target under new noise at the next sigma (z = target + sigma' eps', the law block training
    saw) instead of the Euler step, which carries the old noise and the earlier draws' targets along;
    `mid0` / `mid1` keep the Euler step on variant_plan's grid."""
    sigmas, blocks = variant_plan(model, K, step)
    rows = torch.zeros(z.shape[0], dtype=torch.long)
    for k in range(len(blocks)):
        logits = denoise(blocks[k], z, torch.full((z.shape[0],), sigmas[k]), rows).float()
        if k + 1 == len(blocks):
            return logits
        v = torch.multinomial(logits.softmax(-1).flatten(0, 1), 1, generator=random.generator).view(z.shape[:2])
        if step == "fresh":
            z = model.targets(v) + sigmas[k + 1] * random.normal(rows, z.shape[1:], z.device)
        else:
            z = euler_to(z, model.targets(v), sigmas[k], sigmas[k + 1])


@torch.no_grad()
def plain_mc(model, x, y, K: int, chains: int, batch: int, seed: int, step: str = "euler") -> np.ndarray:
    """(chains, T) p_final(y) of independent runs of the K-step chain over the window x (1, T)."""
    context = WindowContext(model, x)
    random = SharedGenerator(torch.Generator().manual_seed(seed))
    settings = InferenceSettings(sampling=PLAIN, num_iterations=K, bridge="sample")
    out = []
    for start in range(0, chains, batch):
        R = min(batch, chains - start)
        denoise = lambda b, z, sigma, rows: context.denoise(b, z, sigma, torch.zeros_like(rows))  # noqa: E731
        z = model.initial_noise(R, x.shape[1], random)
        if step == "euler":  # the served chain
            logits = run_chain(denoise, model.grid(), [settings] * R, z, random, model.targets,
                               model.target_table).logits
        else:
            logits = chain_variant(model, denoise, K, z, random, step)
        out.append(logits.softmax(-1).gather(-1, y.expand(R, -1)[..., None])[..., 0].double().numpy())
    return np.concatenate(out)


def resolved_slots(mean: np.ndarray, se: np.ndarray, chains: int) -> np.ndarray:
    log_se = np.where(mean > 0, se / np.maximum(mean, 1e-300), np.inf)  # the delta method
    return (log_se < RESOLVED_SE) & (mean * chains >= MIN_HITS)


def summarize(p: np.ndarray, est_nll: np.ndarray, est_var: np.ndarray | None) -> dict:
    mean, se = p.mean(0), p.std(0, ddof=1) / math.sqrt(p.shape[0])
    resolved = resolved_slots(mean, se, p.shape[0])
    slots = {"plain_p": mean.tolist(), "plain_p_se": se.tolist(), "estimator_nll": est_nll.tolist(),
             "estimator_nll_se": None if est_var is None else np.sqrt(est_var).tolist()}
    n = int(resolved.sum())
    return {"mean_p": float(mean.mean()), "mean_p_se": float(p.mean(1).std(ddof=1) / math.sqrt(p.shape[0])),
            "resolved_slots": n, "slots": len(mean),
            "plain_ppl_resolved": math.exp(-np.log(mean[resolved]).mean()) if n else None,
            "estimator_ppl_same_slots": math.exp(est_nll[resolved].mean()) if n and not np.isnan(est_nll).any() else None,
            "estimator_ppl_all": None if np.isnan(est_nll).any() else math.exp(est_nll.mean()),
            "per_slot": slots}


def report(out: Path = OUT) -> str:
    """report.md from every JSON in `out` (default: the SmolLM2 runs'): per run and K, the mean p_K(y) over
    slots, and over the slots plain Monte-Carlo resolves, its ppl and the estimator's NLL minus plain MC's
    (mean over those slots, se)."""
    title = "SmolLM2 conversions" if out == OUT else f"the checkpoints of {out.name}/"
    lines = [f"# Plain Monte-Carlo of the K-step chain on {title} (one held-out window)", "",
             "Written by `bench/smollm2_kmc.py --report` from the JSONs beside it. mean p: the mean over the "
             "window's slots of p_K(y), the chain's chance of the held-out token (plain MC over the chains, se "
             f"beside). Resolved slots: plain MC's log p has se < {RESOLVED_SE} nats and p x chains >= {MIN_HITS}. "
             "estimator - plain: `looped_lm eval`'s NLL minus plain MC's, mean over the resolved slots (se).", "",
             "| run | step | chains | K | mean p | resolved slots | plain ppl there | estimator - plain (nats) |",
             "|---|---|---|---|---|---|---|---|"]
    for path in sorted(out.glob("*.json")):
        d = json.loads(path.read_text())
        for K, r in d["by_k"].items():
            s = r["per_slot"]
            mean, se = np.array(s["plain_p"]), np.array(s["plain_p_se"])
            res = resolved_slots(mean, se, d["chains"])
            nll = -np.log(np.maximum(mean[res], 1e-300))
            gap = "-"
            if s["estimator_nll_se"] is not None and res.any():
                diff = np.array(s["estimator_nll"])[res] - nll
                var = np.array(s["estimator_nll_se"])[res] ** 2 + (se[res] / mean[res]) ** 2
                gap = f"{diff.mean():+.3f} ± {math.sqrt(var.sum()) / res.sum():.3f}"
            lines.append(f"| {path.stem} | {d.get('step', 'euler')} | {d['chains']} | {K} | {r['mean_p']:.4f} ± "
                         f"{r['mean_p_se']:.4f} | {int(res.sum())} / {len(mean)} | "
                         f"{math.exp(nll.mean()) if res.any() else float('nan'):.3f} | {gap} |")
    return common.write_lines(out / "report.md", lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", nargs="?", const=str(OUT), metavar="DIR",
                    help="write DIR/report.md from the JSONs in DIR (default: the SmolLM2 runs') and stop")
    ap.add_argument("--checkpoint")
    ap.add_argument("--split", default="test", choices=["val", "test"])
    ap.add_argument("--offset", type=int, default=0, help="the window's first token in the split")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--chains", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32, help="chains per forward")
    ap.add_argument("--draws", type=int, default=8, help="the estimator's draws")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", default="euler", choices=["euler", "fresh", "mid0", "mid1", "block0"],
                    help="the served chain (euler), fresh noise between calls, or K = 3 with one extra call inside "
                    "block 0's / block 1's interval (mid0 / mid1; pass --k 3), or every extra call in block 0's (block0): experiments")
    ap.add_argument("--no-estimator", action="store_true", help="plain Monte-Carlo only")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.report:
        print(report(Path(args.report)))
        return
    if not args.checkpoint or not args.json:
        ap.error("--checkpoint and --json are needed (or --report)")
    torch.set_num_threads(1)
    model, cfg, manifest = load_checkpoint(Path(args.checkpoint), verify=False)
    model.eval()
    tokens = load_tokens(str(Path(manifest["data"]["dir"]) / f"{args.split}.bin"))
    window = torch.from_numpy(tokens[args.offset:args.offset + args.seq + 1].astype(np.int64))
    x, y = window[:-1][None], window[1:][None]
    result = {"checkpoint": str(args.checkpoint), "split": args.split, "offset": args.offset, "seq": args.seq,
              "chains": args.chains, "draws": None if args.no_estimator else args.draws, "step": args.step, "seed": args.seed, "num_blocks": len(model.blocks),
              "by_k": {}, "commit": common.git_commit()}
    for K in [int(k) for k in args.k.split(",")]:
        t0 = time.time()
        p = plain_mc(model, x, y, K, args.chains, args.batch, args.seed + K, args.step)
        t_mc = time.time() - t0
        nll, var = np.full(p.shape[1], np.nan), None
        if not args.no_estimator:
            est = model.score(x, y, ScoreSettings(k_grid=(K,), draws=args.draws), torch.Generator().manual_seed(args.seed))[K]
            nll = est.nll[0].double().numpy()
            var = None if est.nll_var is None else est.nll_var[0].double().numpy()
        result["by_k"][str(K)] = {**summarize(p, nll, var), "plain_s": round(t_mc, 1),
                                  "estimator_s": round(time.time() - t0 - t_mc, 1)}
        r = result["by_k"][str(K)]
        print(f"K={K}: mean p {r['mean_p']:.4f} ± {r['mean_p_se']:.4f}; plain ppl over {r['resolved_slots']} "
              f"resolved slots {r['plain_ppl_resolved']}, estimator there {r['estimator_ppl_same_slots']}, "
              f"estimator all {r['estimator_ppl_all']}", flush=True)
        common.write_json(Path(args.json), {**result, "finished_utc": common.utc_now()})


if __name__ == "__main__":
    main()
