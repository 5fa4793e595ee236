"""The decision row (docs/results.md): the recommended DiffusionBlocks recipe against end-to-end gpt models
at equal training FLOPs, every arm's learning rate and warm-up tuned alike on dev, 5 paired seeds scored on
test. The plan, its statistic and its rules are bench/results/decision/plan.md (written before the runs).

    python bench/decision.py run --workers 2      # every stage the plan names, in order; resumable
    python bench/decision.py report               # bench/results/decision/report.md from the JSONs

Arms (ARMS): the DB recipe (configs/quickstart_db.yaml as shipped: db_ar, 4 layers in B = 2 blocks,
network_gain, clean_lm_weight 1.0, 1000 steps), gpt with 4 layers and gpt with 2 layers (one block's
depth), configs/quickstart.yaml otherwise. A gpt arm trains for as many steps as the DB recipe's FLOPs buy
(looped_lm.cost: DB's 1000 steps plus its 10 CE(sigma) curve refreshes, gpt's step at its depth). Held-out
data, dev/test halves and scoring are bench/allocation.py's protocol (`protocol_split`, `eval_json`).

Stages per arm: (1) lr in LRS at warm-up 50, seed 0; an edge optimum adds the next rate out, once;
(2) warm-up in WARMUPS (20, 50, 200) at the chosen lr; an edge optimum adds the next warm-up out, once; (3) seeds 1-4
at the chosen (lr, warm-up), seed 0 being the sweep's run there. One JSON per run in
bench/results/decision/<arm>/.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import allocation  # noqa: E402  (bench/ is not a package)
import common  # noqa: E402

ROOT = common.ROOT
OUT = ROOT / "bench" / "results" / "decision"
WORK = Path("/tmp/looped_lm_decision")
DB_STEPS = 1000

# the control arms (controls_plan.md): the same 4 layers in B = 2 blocks, context stacked (each block continues
# the frozen blocks before it), blocks in turn; ctl_clean trains each block on the clean next-token loss alone,
# ctl_both adds the denoising term. Both are scored by their clean readout (eval's ppl_clean), exact.
CONTROL = ["diffusion.context=stacked", "diffusion.block_sampling=round_robin"]
ARMS = {
    "db_b2": {"config": "configs/quickstart_db.yaml", "sets": [], "blocks": 2},
    "gpt_4l": {"config": "configs/quickstart.yaml", "sets": ["model.n_layers=4"], "blocks": 0},
    "gpt_2l": {"config": "configs/quickstart.yaml", "sets": ["model.n_layers=2"], "blocks": 0},
    "ctl_clean": {"config": "configs/quickstart_db.yaml", "sets": [*CONTROL, "diffusion.denoise_weight=0"],
                  "blocks": 2, "clean": True},
    "ctl_both": {"config": "configs/quickstart_db.yaml", "sets": CONTROL, "blocks": 2, "clean": True},
    # the B = 4 row (b4_plan.md): 4 blocks of 1 layer (clean_lm_weight 0: the recipe's rule for 1-layer blocks)
    # at the same budget, against gpt 4L (the runs above) and gpt 1L (one block's depth)
    "db_b4": {"config": "configs/quickstart_db.yaml", "sets": ["diffusion.num_blocks=4", "diffusion.clean_lm_weight=0"],
              "blocks": 4},
    "gpt_1l": {"config": "configs/quickstart.yaml", "sets": ["model.n_layers=1"], "blocks": 0},
    # looped_db against huginn (looped_plan.md): the looped quickstart as shipped (scored at ppl@0, its K = 4 chain
    # on seeds 1-4), and its shape trained by truncated BPTT (r ~ mean 8, the last 4 iterations backpropagated)
    "looped_db": {"config": "configs/quickstart_looped.yaml", "sets": [], "blocks": 1, "chain_k": 4},
    "huginn": {"config": "configs/quickstart_looped.yaml", "kind": "huginn", "blocks": 0,
               "sets": ["model.mean_recurrence=8", "model.backprop_depth=4"]},
}
DECISION_ARMS = ["db_b2", "gpt_4l", "gpt_2l"]
CONTROL_ARMS = ["ctl_clean", "ctl_both"]
B4_ARMS = ["db_b4", "gpt_1l"]
LOOPED_ARMS = ["looped_db", "huginn"]
LRS = [3e-4, 1e-3, 3e-3, 1e-2]
LR_OUT = {3e-4: 1e-4, 1e-2: 3e-2}  # the next rate out from an edge
WARMUP0 = 50
WARMUPS = [20, 50, 200]
WARMUP_OUT = {20: 5, 200: 500}
SEEDS = [0, 1, 2, 3, 4]


def config_path(arm: str) -> Path:
    """The arm's YAML; an arm of another kind than its file's (huginn) gets a copy with that kind and without
    the diffusion section, which that kind does not own."""
    path, kind = ROOT / ARMS[arm]["config"], ARMS[arm].get("kind")
    if not kind:
        return path
    import yaml

    raw = yaml.safe_load(path.read_text())
    raw.pop("diffusion", None)
    raw["model"]["kind"] = kind
    WORK.mkdir(parents=True, exist_ok=True)
    derived, text = WORK / f"{arm}.yaml", yaml.safe_dump(raw)
    if not derived.exists() or derived.read_text() != text:  # atomically: a run in another worker may be reading it
        tmp = derived.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, derived)
    return derived


def load(arm: str):
    from looped_lm.config import load_config

    return load_config(str(config_path(arm)), ARMS[arm]["sets"])


def huginn_steps(arm: str, vocab: int, total: float) -> dict:
    """{seed: the most steps whose FLOPs, each at the recurrence r the trainer draws for it, fit `total`}."""
    import torch

    from looped_lm.kinds import get_kind
    from looped_lm.models.huginn import sample_recurrence

    cfg, kind = load(arm), get_kind("huginn")
    out = {}
    for seed in SEEDS:
        spent, step = 0.0, 0
        while True:
            g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # as HuginnLM.training_loss draws r
            cost = kind.step_flops(cfg, vocab, cfg.train.batch_size, key=sample_recurrence(cfg.model.mean_recurrence, g))
            if spent + cost > total:
                break
            spent, step = spent + cost, step + 1
        out[str(seed)] = step
    return out


def budget(vocab: int) -> dict:
    """The DB recipe's training FLOPs (matmuls, looped_lm.cost) and the steps each other arm gets for them."""
    from looped_lm.kinds import get_kind

    db, kind = load("db_b2"), get_kind("db_ar")
    block_mean = lambda cfg: sum(kind.step_flops(cfg, vocab, cfg.train.batch_size, key=b) for b in range(2)) / 2  # noqa: E731
    steps, curve, refreshes = block_mean(db), kind.curve_flops(db, vocab, db.train.batch_size), DB_STEPS // db.diffusion.curve_every
    total = DB_STEPS * steps + refreshes * curve
    out = {"vocab": vocab, "db_step_flops": steps, "db_curve_flops": curve, "db_refreshes": refreshes,
           "db_total_flops": total, "arm_steps": {"db_b2": DB_STEPS}}
    for arm in ARMS:
        cfg = load(arm)
        if arm.startswith("gpt"):
            f = get_kind("gpt").step_flops(cfg, vocab, cfg.train.batch_size)
        elif arm in CONTROL_ARMS:  # blocks in turn: the mean of the blocks' steps (block 1 also runs frozen block 0)
            f = block_mean(cfg)
        elif arm == "looped_db":  # the looped row's budget: its shipped 1000 steps (one block, no curve)
            f = get_kind("looped_db").step_flops(cfg, vocab, cfg.train.batch_size)
            out["arm_steps"][arm], out["looped_total_flops"] = cfg.train.max_steps, cfg.train.max_steps * f
            out["huginn_steps_by_seed"] = out["arm_steps"]["huginn"] = huginn_steps("huginn", vocab, out["looped_total_flops"])
            continue
        elif arm == "db_b4":  # the most steps whose cost, curve refreshes included, fits the budget
            f = kind.step_flops(cfg, vocab, cfg.train.batch_size, key=0)  # equal blocks: the same cost each
            refresh, every = kind.curve_flops(cfg, vocab, cfg.train.batch_size), cfg.diffusion.curve_every
            n = int(total // (f + refresh / every))  # a lower bound: refreshes (at 100, 200, ...) are floored
            while (n + 1) * f + (n + 1) // every * refresh <= total:
                n += 1
            out["arm_steps"][arm], out[f"{arm}_step_flops"], out[f"{arm}_curve_flops"] = n, f, refresh
            continue
        else:
            continue
        out["arm_steps"][arm] = round(total / f)
        out[f"{arm}_step_flops"] = f
    return out


def name(arm: str, lr: float, warmup: int, seed: int) -> str:
    return f"{arm}_lr{lr:.0e}_wu{warmup}_s{seed}"


def run_one(arm: str, lr: float, warmup: int, seed: int, steps: int, split: dict, extra: list[str]) -> dict:
    """Train one arm (1 thread), score dev and test ppl (exact) and, for DB, the K = B chain on test."""
    tag = name(arm, lr, warmup, seed)
    out_dir = WORK / tag
    shutil.rmtree(out_dir, ignore_errors=True)  # a run without its JSON starts fresh (train.resume is auto)
    c0, t0 = common.children_cpu_s(), time.time()
    sets = [*ARMS[arm]["sets"], f"train.max_steps={steps}", f"train.warmup_steps={warmup}",
            *allocation.run_sets(lr, seed, split, out_dir, WORK), *extra]
    ckpt = allocation.train_on_split(config_path(arm), sets, out_dir, split, tag)
    blocks, clean = ARMS[arm]["blocks"], ARMS[arm].get("clean", False)
    exact = ["--num-iterations", "0"] if blocks else []

    def score(split_name: str) -> dict:
        """An arm's score ("ppl", what the sweep chooses on and the ratios use): ppl@0 for the DB recipe, the
        clean readout for a control arm (ctl_both's ppl@0 is kept beside it as "ppl0"), ppl for gpt."""
        rep = allocation.eval_json(ckpt, split[split_name], WORK / f"{tag}_{split_name}.json", exact)
        if not clean:
            return {"ppl": rep["ppl"], "nll": rep["nll"], "tokens": rep["tokens"]}
        return {"ppl": rep["ppl_clean"], "nll": rep["nll_clean"], "tokens": rep["tokens"],
                **({"ppl0": rep["ppl"]} if rep.get("primary") != "clean" else {})}

    result = {"arm": arm, "lr": lr, "min_lr": lr / 10, "warmup": warmup, "seed": seed, "steps": int(ckpt.name[5:]),
              "extra_sets": extra, "split": {k: split[k] for k in ("split_seed", "val_tokens", "dev_tokens", "test_tokens")},
              "dev": score("dev"), "test": score("test")}
    if blocks and (clean or seed != 0):
        if not clean:  # the chain (sensitivity only) on the seed runs; the sweep chooses on exact ppl@0
            k = ARMS[arm].get("chain_k", blocks)
            rep = allocation.eval_json(ckpt, split["test"], WORK / f"{tag}_chain.json", allocation.chain_args(k))
            result["test_chain"] = allocation.chain_of(rep, k)
        result["block_steps"] = allocation.block_steps(out_dir, blocks)
    result.update(cpu_s=round(common.children_cpu_s() - c0, 1), wall_s=round(time.time() - t0, 1),
                  commit=common.git_commit(), finished_utc=common.utc_now())
    common.write_json(OUT / arm / f"{tag}.json", result)
    return result


def runs(arm: str) -> list[dict]:
    return common.read_jsons(OUT / arm)


def best(rows: list[dict]) -> dict | None:
    return min(rows, key=lambda r: r["dev"]["ppl"]) if rows else None


def next_jobs(arm: str, have: list[dict]) -> tuple[list[tuple], str]:
    """The runs this arm's next stage needs (lr, warm-up, seed), given the runs it has; and the stage's name."""
    sweep = [r for r in have if r["seed"] == 0]
    lr_rows = [r for r in sweep if r["warmup"] == WARMUP0]
    lrs = sorted({*LRS, *(r["lr"] for r in lr_rows)})
    missing = [(lr, WARMUP0, 0) for lr in LRS if not any(math.isclose(r["lr"], lr) for r in lr_rows)]
    if missing:
        return missing, "lr"
    lr = best(lr_rows)["lr"]
    for edge, out in LR_OUT.items():  # an edge optimum adds the next rate out, once
        if math.isclose(lr, edge) and edge == (lrs[0] if out < edge else lrs[-1]):
            return [(out, WARMUP0, 0)], "lr edge"
    wu_rows = [r for r in sweep if math.isclose(r["lr"], lr)]
    wus = sorted({r["warmup"] for r in wu_rows})
    missing = [(lr, w, 0) for w in WARMUPS if w not in wus]
    if missing:
        return missing, "warm-up"
    wu = best(wu_rows)["warmup"]
    if wu in WARMUP_OUT and wu == (wus[0] if WARMUP_OUT[wu] < wu else wus[-1]):
        return [(lr, WARMUP_OUT[wu], 0)], "warm-up edge"
    done = {r["seed"] for r in have if math.isclose(r["lr"], lr) and r["warmup"] == wu}
    return [(lr, wu, s) for s in SEEDS if s not in done], "seeds"


def run_all(workers: int, arms: list[str], extra: list[str]) -> None:
    split = allocation.protocol_split(WORK, 0)
    b = budget(json.loads((Path(split["val"]).parent / "meta.json").read_text())["vocab_size"])
    common.write_json(OUT / "budget.json", b)
    print(f"budget: {b}", flush=True)

    def ready() -> list[tuple]:
        """One job per arm in turn, the arm with the fewest finished runs first, so every arm advances."""
        jobs = {arm: next_jobs(arm, runs(arm)) for arm in sorted(arms, key=lambda a: len(runs(a)))}
        queue = [(arm, job, stage) for i in range(len(LRS) + len(SEEDS))
                 for arm, (todo, stage) in jobs.items() if i < len(todo) for job in [todo[i]]]
        return [((arm, *job), run_one, (arm, *job, steps(arm, job[2]), split, extra)) for arm, job, _ in queue]

    def steps(arm: str, seed: int) -> int:
        n = b["arm_steps"][arm]
        return n[str(seed)] if isinstance(n, dict) else n  # huginn's: by seed

    common.run_pool(workers, ready, lambda key, r: print(f"done {key}: dev {r['dev']['ppl']:.3f} test "
                                                         f"{r['test']['ppl']:.3f} ({r['cpu_s']} CPU-s)", flush=True))
    print(report())


def chosen(arm: str) -> tuple[float, int] | None:
    have = runs(arm)
    if next_jobs(arm, have)[1] != "seeds":
        return None
    sweep = [r for r in have if r["seed"] == 0]
    lr = best([r for r in sweep if r["warmup"] == WARMUP0])["lr"]
    return lr, best([r for r in sweep if math.isclose(r["lr"], lr)])["warmup"]


def arm_table(arm: str) -> list[str]:
    """One arm's runs, its choice on dev and whether that choice sits at the edge of the swept grid."""
    have, c = runs(arm), chosen(arm)
    ppl0 = any("ppl0" in r["test"] for r in have)
    lines = [f"## {arm}", "", "| lr | warm-up | seed | dev ppl | test ppl | " + ("test ppl@0 | " if ppl0 else "")
             + "chain test ppl@B (se) | CPU-s |", "|---|---|---|---|---|---|---|" + ("---|" if ppl0 else "")]
    for r in sorted(have, key=lambda r: (r["seed"], r["lr"], r["warmup"])):
        ch = r.get("test_chain")
        chain = f"{ch['ppl']:.3f} ({ch['se']:.3f})" if ch and ch.get("ppl") is not None else "-"
        mark = " (chosen)" if c and math.isclose(r["lr"], c[0]) and r["warmup"] == c[1] else ""
        lines.append(f"| {r['lr']:g} | {r['warmup']}{mark} | {r['seed']} | {r['dev']['ppl']:.3f} | "
                     f"{r['test']['ppl']:.3f} | " + (f"{r['test'].get('ppl0', 0):.3f} | " if ppl0 else "")
                     + f"{chain} | {r['cpu_s']} |")
    edge = ""
    if c:
        sweep = [r for r in have if r["seed"] == 0]
        lrs, wus = sorted({r["lr"] for r in sweep}), sorted({r["warmup"] for r in sweep if math.isclose(r["lr"], c[0])})
        edges = [what for what, v, grid in (("lr", c[0], lrs), ("warm-up", c[1], wus)) if v in (grid[0], grid[-1])]
        edge = (f" ({' and '.join(edges)} at the edge of the swept grid after its one extension: reported as an "
                f"edge, as the plan says)") if edges else " (both inside the swept grid)"
    return lines + ["", f"Chosen on dev: {'lr %g, warm-up %d' % c if c else 'sweep not finished'}{edge}", ""]


def at_choice(arm: str) -> dict:
    """{seed: run} at the arm's dev-chosen (lr, warm-up)."""
    c = chosen(arm)
    return {r["seed"]: r for r in runs(arm) if c and math.isclose(r["lr"], c[0]) and r["warmup"] == c[1]}


def paired_row(num: str, den: str, lower: tuple[str, str]) -> str:
    """The plan's statistic: paired per-seed test ratios num / den, geometric mean and t 95 % interval."""
    a, b = at_choice(num), at_choice(den)
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return f"- {num} / {den}: {len(seeds)} paired seed(s); no interval yet"
    ratios = [a[s]["test"]["ppl"] / b[s]["test"]["ppl"] for s in seeds]
    _, lo, hi = common.ratio_ci(ratios)
    verdict = f"{lower[0]} lower" if hi < 1 else f"{lower[1]} lower" if lo > 1 else "not separated"
    return (f"- {num} / {den}: {common.paired(seeds, ratios)} (n = {len(seeds)}): **{verdict}**"
            + ("" if len(seeds) == len(SEEDS) else " (fewer seeds than planned: no verdict)"))


def sensitivity(arm: str, what: str, tail=lambda chain: "") -> list[str]:
    """The arm's served chain against its ppl@0 on the chain's own first 8,192 test tokens, per seed (gpt was not
    scored on those tokens, so the chain enters through this ratio, not through a mixed one)."""
    chain = [r["test_chain"] for _, r in sorted(at_choice(arm).items()) if r.get("test_chain", {}).get("ppl")]
    return [f"- sensitivity, {what} on the same first 8,192 test tokens: "
            + ", ".join(f"{c['ppl'] / c['ppl0_same_tokens']:.4f}" for c in chain) + tail(chain)] if chain else []


def write_report(file: str, title: str, intro: list[str], arms: list[str], ratios: str, rows: list[str]) -> str:
    lines = [f"# {title}", "", *intro, ""]
    for arm in arms:
        lines += arm_table(arm)
    return common.write_lines(OUT / file, [*lines, f"## {ratios}", "", *rows])


def written(plan: str, s: str = "") -> str:
    return f"Written by `bench/decision.py report`; plan, statistic{s} and rules: {plan} (written before the runs)."


def steps_of(b: dict, arms: list[str]) -> str:
    return ", ".join(f"{a} {b['arm_steps'][a]}" for a in arms)


def report() -> str:
    b = json.loads((OUT / "budget.json").read_text())
    served = lambda chain: (f" ({len(chain)} seeds; se of ppl@2 {max(c['se'] for c in chain):.4f} at most): the "  # noqa: E731
                            "chain scores ppl@0, so the rows above hold for the served model")
    text = write_report(
        "report.md", "The decision row: the DB recipe against tuned end-to-end gpt at equal training FLOPs",
        [written("plan.md"), f"Budget: DB {b['arm_steps']['db_b2']} steps + {b['db_refreshes']} curve "
         f"refreshes = {b['db_total_flops']:.3e} matmul FLOPs; gpt steps for it: {steps_of(b, DECISION_ARMS[1:])}."],
        DECISION_ARMS, "Paired test ratios, DB recipe ppl@0 / gpt ppl (same seed)",
        [*(paired_row("db_b2", gpt, ("DB", "gpt")) for gpt in ("gpt_4l", "gpt_2l")),
         *sensitivity("db_b2", "DB ppl@2 (the K = B chain, 16 draws) / DB ppl@0", served)])
    if any(runs(arm) for arm in CONTROL_ARMS):
        text += "\n" + write_report(
            "controls_report.md", "The control arms: what the denoising term adds, at equal training FLOPs",
            [written("controls_plan.md", "s") + f" Budget: the DB recipe's "
             f"{b['db_total_flops']:.3e} matmul FLOPs; steps for it: {steps_of(b, CONTROL_ARMS)}. Each control arm's "
             "score is its clean readout (eval's ppl_clean, exact); ctl_both's ppl@0 is shown beside it."],
            CONTROL_ARMS, "Paired test ratios (same seed)",
            [paired_row("ctl_both", "ctl_clean", ("with denoising", "without denoising")),
             paired_row("db_b2", "ctl_clean", ("DB recipe", "ctl_clean")),
             *(paired_row(ctl, gpt, (ctl, gpt)) for ctl in CONTROL_ARMS for gpt in ("gpt_4l", "gpt_2l")),
             *(["- sensitivity, ctl_both's ppl@0 (its denoiser's one call) / its ppl_clean on test: " + ", ".join(
                 f"s{s} {r['test']['ppl0'] / r['test']['ppl']:.3f}" for s, r in sorted(at_choice("ctl_both").items()))]
               if at_choice("ctl_both") else [])])
    if any(runs(arm) for arm in B4_ARMS):
        text += "\n" + write_report(
            "b4_report.md", "The decision row at B = 4: 4 blocks of 1 layer against gpt 4L and gpt 1L at equal training "
            "FLOPs", [written("b4_plan.md") + f" Budget: {b['db_total_flops']:.3e} matmul FLOPs (the "
                      f"B = 2 row's); steps for it: {steps_of(b, [*B4_ARMS, 'gpt_4l'])} (gpt_4l: the B = 2 row's runs)."],
            B4_ARMS, "Paired test ratios, DB B = 4 ppl@0 / gpt ppl (same seed)",
            [*(paired_row("db_b4", gpt, ("DB", "gpt")) for gpt in ("gpt_4l", "gpt_1l")),
             *sensitivity("db_b4", "DB ppl@4 (the K = B chain, 16 draws) / DB ppl@0")])
    if any(runs(arm) for arm in LOOPED_ARMS):
        text += "\n" + write_report(
            "looped_report.md", "looped_db against huginn on text at equal training FLOPs",
            [written("looped_plan.md") + f" Budget: looped_db's {b['arm_steps']['looped_db']} steps = "
             f"{b['looped_total_flops']:.3e} matmul FLOPs; huginn's steps for it, by seed (its r is drawn per step): "
             + ", ".join(f"s{s} {n}" for s, n in b["huginn_steps_by_seed"].items()) + "."],
            LOOPED_ARMS, "Paired test ratios, looped_db ppl@0 / huginn ppl at K = 8 (same seed)",
            [paired_row("looped_db", "huginn", ("looped_db", "huginn")),
             *sensitivity("looped_db", "looped_db ppl@4 (its configured K, 16 draws) / its ppl@0")])
    return text


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=DECISION_ARMS, choices=list(ARMS),
                    help=f"the decision row (default), the control arms (--arms {' '.join(CONTROL_ARMS)}), the B = 4 row "
                         f"(--arms {' '.join(B4_ARMS)}) or looped_db against huginn (--arms {' '.join(LOOPED_ARMS)})")
    ap.add_argument("--set", action="append", default=[], help="extra train overrides (a smoke test)")
    ap.add_argument("--out", type=Path, default=OUT, help="where the JSONs and report.md go")
    args = ap.parse_args()
    OUT = args.out
    if args.what == "run":
        run_all(args.workers, args.arms, args.set)
    else:
        print(report())


if __name__ == "__main__":
    main()
