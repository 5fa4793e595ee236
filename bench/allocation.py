"""Which block a step trains: `block_sampling` loss_share (the default) vs network_gain, on the DB
quickstart's layout (4 layers, d 128, the Bible in bytes, 1000 steps of 16 x 128 tokens, lr 3e-3), at
B = 4 (1-layer blocks, where loss_share gives block 0, which ppl@0 and every chain's first draw rest on,
the fewest steps) and B = 2.

Every run has the same steps, and every block step costs the same FLOPs (equal blocks), so the rules are
compared at equal training FLOPs. Per run: the share of the steps each block got (counted from the
rule's draws, `choose_block` over the run's steps with the curves it measured as it went: read from
metrics.jsonl's per-block loss lines), the final curve's shares under both rules, and held-out ppl@0 over
the WHOLE validation split (one call per token: exact, cheap). One JSON per run in
bench/results/allocation/; `--report` writes report.md with paired per-seed ratios.

    python bench/allocation.py --blocks 4 --seeds 0 1          # ~6 CPU-min per run on a quiet machine
    python bench/allocation.py --report
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "allocation"
RULES = ("loss_share", "network_gain")


def run_one(blocks: int, rule: str, seed: int, work: Path) -> dict:
    name = f"B{blocks}_{rule}_s{seed}"
    out_dir = work / name
    sets = [f"diffusion.num_blocks={blocks}", f"diffusion.block_sampling={rule}", f"train.seed={seed}",
            f"train.out_dir={out_dir}", "train.save_every=0", "train.progress=false", "train.eval_every=0", "train.log_every=1",
            f"data.cache_dir={work / 'cache'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    c0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    cmd = [sys.executable, "-m", "looped_lm.train", "--config", str(ROOT / "configs/quickstart_db.yaml")]
    subprocess.run(cmd + [a for s in sets for a in ("--set", s)], check=True, env=env, cwd=ROOT,
                   capture_output=True, text=True)
    ckpt = out_dir / "step_0001000"
    ppl_json = work / f"{name}_ppl.json"
    subprocess.run([sys.executable, "-m", "looped_lm", "eval", "--checkpoint", str(ckpt), "--num-iterations", "0",
                    "--json", str(ppl_json), "--no-progress"], check=True, env=env, cwd=ROOT, capture_output=True)
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    ppl = json.loads(ppl_json.read_text())
    chain = chain_ppl(ckpt, blocks, work / f"{name}_chain.json", env)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    curve = manifest["model_state"].get("curve") or {}
    from looped_lm.diffusion import ce_curve

    edges = manifest["model_state"]["edges"]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    counts = [0] * blocks
    for r in rows:
        if "block" in r:
            counts[int(r["block"])] += 1
    result = {
        "blocks": blocks, "rule": rule, "seed": seed, "steps": 1000, "ppl0": ppl["ppl"], "nll0": ppl["nll"],
        "tokens_scored": ppl["tokens"], "chain": chain, "logged_block_share": [c / max(sum(counts), 1) for c in counts],
        "final_shares": {"loss_share": ce_curve.block_shares(edges, curve["sigmas"], curve["ce"]) if curve else None,
                         "network_gain": ce_curve.gain_shares(edges, curve["sigmas"], curve["ce"], curve["ce_z"])
                         if curve.get("ce_z") else None},
        "curve": curve, "cpu_s": round((c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime), 1),
        "wall_s": round(time.time() - t0, 1), "load": os.getloadavg()[0],
    }
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


def chain_ppl(ckpt: Path, blocks: int, out: Path, env: dict) -> dict:
    """ppl@B (the K = B chain every block runs in, the default sampler's) on the first 8,192 held-out
    tokens, 16 draws, with the estimator's standard error."""
    subprocess.run([sys.executable, "-m", "looped_lm", "eval", "--checkpoint", str(ckpt), "--num-iterations",
                    str(blocks), "--max-tokens", "8192", "--draws", "16", "--json", str(out), "--no-progress"],
                   check=True, env=env, cwd=ROOT, capture_output=True)
    rep = json.loads(out.read_text())
    k = str(blocks)
    return {"k": blocks, "ppl": rep["ppl_at_k"][k], "se": rep["ppl_se"][k], "tokens": rep["tokens"], "draws": 16}


def report() -> str:
    runs = [json.loads(p.read_text()) for p in sorted(OUT.glob("B*_s*.json"))]
    lines = ["# block_sampling: loss_share vs network_gain (bench/allocation.py)", "",
             "DB quickstart layout, 1000 steps each (equal FLOPs within a B), held-out ppl@0 over the whole "
             "validation split; one learning rate (the quickstart's 3e-3, not tuned per rule).", "",
             "| B | rule | seed | ppl@0 (whole val) | ppl@B (8,192 tokens, 16 draws; se) | block shares of the steps (block 0 first) | CPU-s |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["blocks"], r["rule"], r["seed"])):
        shares = ", ".join(f"{s:.2f}" for s in r["logged_block_share"])
        c = r.get("chain") or {}
        chain = f"{c['ppl']:.3f} ({c['se']:.3f})" if c.get("ppl") else "unresolved" if c else ""
        lines.append(f"| {r['blocks']} | {r['rule']} | {r['seed']} | {r['ppl0']:.3f} | {chain} | {shares} | {r['cpu_s']} |")
    lines += ["", "Paired per-seed ratio ppl@0(network_gain) / ppl@0(loss_share):", ""]
    for B in sorted({r["blocks"] for r in runs}):
        by = {(r["rule"], r["seed"]): r["ppl0"] for r in runs if r["blocks"] == B}
        ratios = [by[("network_gain", s)] / by[("loss_share", s)] for (rule, s) in by if rule == "loss_share"
                  and ("network_gain", s) in by]
        if ratios:
            mean = sum(ratios) / len(ratios)
            sd = math.sqrt(sum((x - mean) ** 2 for x in ratios) / (len(ratios) - 1)) if len(ratios) > 1 else float("nan")
            lines.append(f"- B = {B}: {', '.join(f'{x:.3f}' for x in ratios)} (mean {mean:.3f}, sd {sd:.3f}, "
                         f"{len(ratios)} seeds)")
    text = "\n".join(lines) + "\n"
    (OUT / "report.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[4])
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--work", type=Path, default=Path("/tmp/looped_lm_allocation"))
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--backfill-chain", action="store_true", help="add ppl@B to runs measured without it")
    args = ap.parse_args()
    if args.backfill_chain:
        for path in sorted(OUT.glob("B*_s*.json")):
            r = json.loads(path.read_text())
            if "chain" not in r:
                name = path.stem
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                r["chain"] = chain_ppl(args.work / name / "step_0001000", r["blocks"], args.work / f"{name}_chain.json", env)
                path.write_text(json.dumps(r, indent=1))
    if args.report:
        print(report())
        return
    OUT.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for B in args.blocks:
            for rule in args.rules:
                if (OUT / f"B{B}_{rule}_s{seed}.json").exists():
                    continue
                r = run_one(B, rule, seed, args.work)
                print(f"B{B} {rule} s{seed}: ppl@0 {r['ppl0']:.3f} shares {r['logged_block_share']} ({r['cpu_s']} CPU-s)",
                      flush=True)
    print(report())


if __name__ == "__main__":
    main()
