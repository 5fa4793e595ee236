"""Which block a step trains (docs/results.md "Which block a step trains"; the allocation study's one driver):
`block_sampling` loss_share vs network_gain on the DB quickstart's layout (4 layers, d 128, the Bible in bytes,
1000 steps of 16 x 128 tokens), each rule's learning rate tuned on held-out data no reported number is measured
on; then `diffusion.clean_lm_weight` on the network_gain recipe. Every run trains with `looped_lm.train` and is
scored with `looped_lm eval`; equal steps and equal block costs, so the rules compare at equal FLOPs.

    python bench/allocation.py --protocol --blocks 2 --lrs 1e-3 3e-3 1e-2 --seeds 0   # the dev sweep
    python bench/allocation.py --protocol --blocks 2 --seeds 1 2                      # chosen lr per rule
    python bench/allocation.py --protocol-report

`--protocol`: the held-out books are fixed across seeds (`data.split_seed`, `--split-seed`); the run's val.bin
is cut into halves, dev (the first) and test (the second), written once as dev.bin / test.bin under the work
dir. A sweep (`--lrs`, train.min_lr = lr / 10) scores ppl@0 on dev; each rule's rate is the one with the lowest
dev ppl@0 at `--sweep-seed`; runs without `--lrs` train at it. Every run reports on test: ppl@0 (the whole test
half), ppl@B (the K = B chain, the first 8,192 test tokens, 16 draws, with its standard error) and the block
shares of its steps. One JSON per run in bench/results/allocation/protocol/; `--protocol-report` writes
report.md there (dev sweep, chosen rates, test table, paired per-seed ratios with a t 95 % interval on the logs).

`--clean-lm-report`: clean_lm_weight on the B = 2 network_gain recipe at lr 1e-3 (its runs made with
`--protocol --set diffusion.clean_lm_weight=<w> --out bench/results/allocation/clean_lm_<w>`): the weight with
the lowest seed-0 dev ppl@0, then its paired per-seed ratios against weight 0 on test, at equal steps and
against an equal-FLOPs control (`--protocol --set train.max_steps=1288 --out .../eqflops_w0`), with the plan's
rule for the quickstart. The earlier comparison at one learning rate (results/allocation/report.md, B*_s*.json)
and the chain re-scoring of the kept checkpoints were run by this script at commit de182fb.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

ROOT = common.ROOT
OUT = ROOT / "bench" / "results" / "allocation"
RULES = ("loss_share", "network_gain")


# The studies train configs/quickstart_db.yaml; these pin what the quickstart changed after they ran, so a
# rerun reproduces them (clean_lm_weight became 1.0 from their own verdict; extra_sets can still set it).
STUDY_PINS = ["diffusion.clean_lm_weight=0", "train.warmup_steps=50"]
PROTOCOL_OUT = OUT / "protocol"


def protocol_name(blocks: int, rule: str, lr: float, seed: int) -> str:
    return f"B{blocks}_{rule}_lr{lr:.0e}_s{seed}"


def protocol_split(work: Path, split_seed: int) -> dict:
    """Tokenize the corpus with the runs' settings (the same cache directory they use, so the same val.bin)
    and cut its val.bin into dev.bin (first half) and test.bin (second half), once."""
    import numpy as np

    from looped_lm.config import load_config
    from looped_lm.data.batches import data_source_string, split_seed as cfg_split_seed
    from looped_lm.data.prepare import ensure_prepared

    cfg = load_config(str(ROOT / "configs/quickstart_db.yaml"),
                      [f"data.split_seed={split_seed}", f"data.cache_dir={work / 'cache'}"])
    data_dir = Path(ensure_prepared(data_source_string(cfg), cfg.data.cache_dir, cfg.data.tokenizer,
                                    cfg.data.val_fraction, cfg_split_seed(cfg), progress=False)).resolve()
    meta = json.loads((data_dir / "meta.json").read_text())
    dtype = np.dtype(meta.get("dtype", "uint16"))
    val = np.fromfile(data_dir / "val.bin", dtype=dtype)
    half = len(val) // 2
    split_dir = work / f"split{split_seed}"
    split_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("dev", val[:half]), ("test", val[half:])):
        path = split_dir / f"{name}.bin"
        if not path.exists() or path.stat().st_size != part.nbytes:
            part.tofile(path)
    (split_dir / "meta.json").write_text((data_dir / "meta.json").read_text())  # the tokenizer check of eval
    info = {"val": str(data_dir / "val.bin"), "val_tokens": int(len(val)), "dtype": str(dtype),
            "dev": str(split_dir / "dev.bin"), "dev_tokens": int(half),
            "test": str(split_dir / "test.bin"), "test_tokens": int(len(val) - half), "split_seed": split_seed}
    if info["dev_tokens"] <= 0 or info["test_tokens"] <= 0:
        raise SystemExit(f"empty dev or test half: {info}")
    return info


def eval_json(ckpt: Path, data: str, out: Path, extra: list[str]) -> dict:
    common.python("-m", "looped_lm", "eval", "--checkpoint", ckpt, "--data", data, "--json", out, "--no-progress", *extra)
    return json.loads(out.read_text())


def run_sets(lr: float, seed: int, split: dict, out_dir: Path, work: Path) -> list[str]:
    """The train overrides every protocol run shares (bench/decision.py's too): seed, lr (min_lr = lr / 10), the
    held-out split, its own output folder, one log line per step and no checkpoints or evals on the way."""
    return [f"train.seed={seed}", f"train.lr={lr}", f"train.min_lr={lr / 10}", f"data.split_seed={split['split_seed']}",
            f"train.out_dir={out_dir}", "train.save_every=0", "train.progress=false", "train.eval_every=0",
            "train.log_every=1", f"data.cache_dir={work / 'cache'}"]


def train_on_split(config: Path, sets: list[str], out_dir: Path, split: dict, name: str) -> Path:
    """Train one run (`looped_lm.train`, one thread) -> its last checkpoint, once its val.bin is known to be
    the one `split` cut into dev and test."""
    common.python("-m", "looped_lm.train", "--config", config, *[a for s in sets for a in ("--set", s)])
    ckpt = sorted(out_dir.glob("step_*"))[-1]
    run_val = Path(json.loads((ckpt / "manifest.json").read_text())["data"]["dir"]).resolve() / "val.bin"
    if run_val != Path(split["val"]):
        raise SystemExit(f"{name}: the run's val.bin {run_val} is not the one split into dev/test {split['val']}")
    return ckpt


def block_steps(out_dir: Path, blocks: int) -> list[int]:
    """How many steps trained each block, from the run's metrics.jsonl (one line per step names its block)."""
    log = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [sum(1 for r in log if r.get("block") == b) for b in range(blocks)]


def protocol_run(blocks: int, rule: str, lr: float, seed: int, work: Path, split: dict, out_root: Path,
                 extra_sets: list[str]) -> dict:
    name = protocol_name(blocks, rule, lr, seed)
    out_dir = work / name
    sets = [*STUDY_PINS, f"diffusion.num_blocks={blocks}", f"diffusion.block_sampling={rule}",
            *run_sets(lr, seed, split, out_dir, work), *extra_sets]
    c0, t0 = common.children_cpu_s(), time.time()
    ckpt = train_on_split(ROOT / "configs/quickstart_db.yaml", sets, out_dir, split, name)
    t_train = time.time()
    dev = eval_json(ckpt, split["dev"], work / f"{name}_dev.json", ["--num-iterations", "0"])
    test = eval_json(ckpt, split["test"], work / f"{name}_test.json", ["--num-iterations", "0"])
    rep = eval_json(ckpt, split["test"], work / f"{name}_test_chain.json", chain_args(blocks))
    cpu_s = round(common.children_cpu_s() - c0, 1)
    counts = block_steps(out_dir, blocks)
    result = {
        "protocol": "dev/test halves of the held-out split; lr chosen on dev ppl@0", "blocks": blocks, "rule": rule,
        "lr": lr, "min_lr": lr / 10, "seed": seed, "split_seed": split["split_seed"], "steps": int(ckpt.name.split("_")[1]),
        "extra_sets": extra_sets, "split": {key: split[key] for key in ("val_tokens", "dev_tokens", "test_tokens", "dtype")},
        "dev": {"ppl0": dev["ppl"], "nll0": dev["nll"], "tokens_scored": dev["tokens"]},
        "test": {"ppl0": test["ppl"], "nll0": test["nll"], "tokens_scored": test["tokens"]},
        "test_chain": {**chain_of(rep, blocks), "tilt_gate": True},
        "logged_block_share": [c / max(sum(counts), 1) for c in counts], "logged_block_steps": counts,
        "curve": json.loads((ckpt / "manifest.json").read_text())["model_state"].get("curve") or {}, "cpu_s": cpu_s,
        "wall_s": round(time.time() - t0, 1), "train_wall_s": round(t_train - t0, 1), "load": os.getloadavg()[0],
        "finished_utc": common.utc_now(),
    }
    common.write_json(out_root / f"{name}.json", result)
    return result


CHAIN_DRAWS = 16  # the estimator's draws for ppl@B on the test half


def chain_of(rep: dict, blocks: int) -> dict:
    k = str(blocks)
    return {"k": blocks, "ppl": rep["ppl_at_k"][k], "se": rep["ppl_se"][k], "tokens": rep["tokens"], "draws": CHAIN_DRAWS,
            "ppl0_same_tokens": rep["ppl_at_k"].get("0"), "unresolved": rep.get("unresolved", [])}


def chain_args(blocks: int) -> list[str]:
    return ["--num-iterations", str(blocks), "--max-tokens", "8192", "--draws", str(CHAIN_DRAWS)]


def protocol_runs(out_root: Path) -> list[dict]:
    return common.read_jsons(out_root, "B*_lr*_s*.json")


def chosen_lrs(runs: list[dict], blocks: int, sweep_seed: int) -> dict:
    """Each rule's learning rate: the lowest dev ppl@0 among its sweep runs (seed sweep_seed) at this B."""
    sweep = [r for r in runs if r["blocks"] == blocks and r["seed"] == sweep_seed]
    return {rule: min((r for r in sweep if r["rule"] == rule), key=lambda r: r["dev"]["ppl0"])["lr"]
            for rule in {r["rule"] for r in sweep}}


def protocol_report(out_root: Path, sweep_seed: int) -> str:
    runs = protocol_runs(out_root)
    lines = ["# block_sampling: loss_share vs network_gain, learning rate tuned per rule on dev, scored on test",
             "", "bench/allocation.py --protocol: DB quickstart layout (4 layers, d 128, the Bible in bytes, 1000 steps "
             "of 16 x 128 tokens, warmup 50, train.min_lr = lr / 10). Held-out books fixed across seeds "
             "(data.split_seed). The held-out tokens (val.bin) are cut in two halves: dev (first half) chooses each "
             "rule's lr (lowest dev ppl@0 at the sweep seed), test (second half) gives every number below except the "
             "dev column. ppl@0: exact, whole half. ppl@B: the K = B chain on the first 8,192 test tokens, 16 draws "
             "(standard error in brackets). Plan and deviations: plan.md.", ""]
    if runs:
        s = runs[0]["split"]
        lines += [f"Held-out split (split_seed {runs[0]['split_seed']}): {s['val_tokens']} tokens; dev "
                  f"{s['dev_tokens']}, test {s['test_tokens']}.", ""]
    for B in sorted({r["blocks"] for r in runs}):
        chosen = chosen_lrs(runs, B, sweep_seed)
        lines += [f"## B = {B}", "", f"### Dev sweep (seed {sweep_seed})", "",
                  "| rule | lr | dev ppl@0 | chosen |", "|---|---|---|---|"]
        for r in sorted((r for r in runs if r["blocks"] == B and r["seed"] == sweep_seed), key=lambda r: (r["rule"], r["lr"])):
            lines.append(f"| {r['rule']} | {r['lr']:g} | {r['dev']['ppl0']:.3f} | {'yes' if chosen.get(r['rule']) == r['lr'] else ''} |")
        lines += ["", "Chosen lr: " + ", ".join(f"{rule} {lr:g}" for rule, lr in sorted(chosen.items())), "",
                  "### Test, each rule at its chosen lr", "",
                  "| seed | rule | lr | test ppl@0 | test ppl@B (se) | block shares of the steps (block 0 first) | CPU-s |",
                  "|---|---|---|---|---|---|---|"]
        at = {(r["rule"], r["seed"]): r for r in runs if r["blocks"] == B and chosen.get(r["rule"]) == r["lr"]}
        for (rule, seed), r in sorted(at.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            c = r["test_chain"]
            chain = f"{c['ppl']:.3f} ({c['se']:.3f})" if c.get("ppl") is not None else "unresolved"
            chain += "" if c.get("tilt_gate") else " (estimator before its tilt gate)"
            shares = ", ".join(f"{x:.2f}" for x in r["logged_block_share"])
            lines.append(f"| {seed} | {rule} | {r['lr']:g} | {r['test']['ppl0']:.3f} | {chain} | {shares} | {r['cpu_s']} |")
        seeds = sorted(s for (rule, s) in at if rule == "loss_share" and ("network_gain", s) in at)
        lines += ["", "### Paired ratios network_gain / loss_share (same seed, test)", ""]
        if not seeds:
            lines.append("No seed has both rules yet.")
        for label, get in (("ppl@0", lambda r: r["test"]["ppl0"]), (f"ppl@{B}", lambda r: r["test_chain"]["ppl"])):
            pairs = [(s, get(at[("network_gain", s)]), get(at[("loss_share", s)])) for s in seeds]
            pairs = [(s, a, b) for s, a, b in pairs if a is not None and b is not None]
            if not pairs:
                continue
            lines.append(f"- {label}: {common.paired([s for s, _, _ in pairs], [a / b for _, a, b in pairs])} "
                         f"(n = {len(pairs)} seeds, t on the log ratios, {len(pairs) - 1} df)")
        lines.append("")
    return common.write_lines(out_root / "report.md", lines)


CLEAN_LM_RECIPE = {"blocks": 2, "rule": "network_gain", "lr": 1e-3}  # the recipe protocol/plan.md tunes the weight on


def clean_lm_runs(out_root: Path = OUT, protocol_root: Path = PROTOCOL_OUT) -> dict:
    """{weight: {seed: run}} for the clean-LM recipe: weight w from out_root/clean_lm_<w>/, weight 0 from the
    protocol's own runs (they are the same recipe without the clean next-token CE)."""
    name = lambda seed: protocol_name(CLEAN_LM_RECIPE["blocks"], CLEAN_LM_RECIPE["rule"], CLEAN_LM_RECIPE["lr"], seed)  # noqa: E731
    by: dict = {}
    for folder in [protocol_root, *sorted(p for p in out_root.glob("clean_lm_*") if p.is_dir())]:
        weight = 0.0 if folder == protocol_root else float(folder.name.removeprefix("clean_lm_"))
        for path in sorted(folder.glob(name("*") + ".json")):
            r = json.loads(path.read_text())
            by.setdefault(weight, {})[r["seed"]] = r
    return by


def clean_lm_flops_share(run: dict) -> float:
    """The clean CE's extra matmul FLOPs per step, as a share of the same step without it, averaged over the
    blocks by the share of the steps each block got in this run (looped_lm.cost, the quickstart's shape)."""
    from looped_lm import cost

    shape = cost.Shape(d=128, layers=4, heads=4, vocab=257, seq=128, batch=16)
    shares = run["logged_block_share"]
    without = sum(w * cost.db_train(shape, cost.DBLayout(blocks=len(shares)), b).total() for b, w in enumerate(shares))
    with_ = sum(w * cost.db_train(shape, cost.DBLayout(blocks=len(shares), clean_lm=True), b).total()
                for b, w in enumerate(shares))
    return with_ / without - 1


def clean_lm_report(out_root: Path = OUT, protocol_root: Path = PROTOCOL_OUT, sweep_seed: int = 0) -> str:
    """protocol/plan.md's clean_lm_weight study: the weight chosen on seed-0 dev ppl@0, then the paired
    per-seed ratios chosen weight / weight 0 on test, at equal steps and against weight 0 given the same FLOPs
    (out_root/eqflops_w0/), and the plan's rule for the quickstart default (stated only once both exist)."""
    by = clean_lm_runs(out_root, protocol_root)
    B = CLEAN_LM_RECIPE["blocks"]
    swept = {w: runs[sweep_seed] for w, runs in by.items() if sweep_seed in runs}
    lines = ["# clean_lm_weight on the B = 2 network_gain recipe (lr 1e-3): chosen on dev, scored on test", "",
             "bench/allocation.py --clean-lm-report. The protocol's layout and dev/test halves (protocol/report.md); "
             "each weight's runs in clean_lm_<w>/, weight 0 is the protocol's own run. Plan and rule: "
             "protocol/plan.md (written before the runs).", "",
             f"## Dev sweep (seed {sweep_seed})", "", "| weight | dev ppl@0 | extra matmul FLOPs per step |", "|---|---|---|"]
    chosen = min(swept, key=lambda w: swept[w]["dev"]["ppl0"]) if swept else None
    for w in sorted(swept):
        extra = f"+{100 * clean_lm_flops_share(swept[w]):.1f} %" if w else "0"
        lines.append(f"| {w:g}{' (chosen)' if w == chosen else ''} | {swept[w]['dev']['ppl0']:.3f} | {extra} |")
    if chosen is None or chosen == 0:
        lines += ["", "Weight 0 is chosen: nothing to pair." if chosen == 0 else "No sweep run yet."]
        return common.write_lines(out_root / "clean_lm_report.md", lines)
    edge = " (the grid's top edge)" if chosen == max(swept) else ""
    lines += ["", f"Chosen weight: {chosen:g}{edge}.", "", f"## Test, weight {chosen:g} against weight 0", "",
              f"| seed | weight | steps | test ppl@0 | test ppl@{B} (se) |", "|---|---|---|---|---|"]
    control = {r["seed"]: r for r in protocol_runs(out_root / "eqflops_w0")}
    for seed in sorted(set(by[chosen]) | set(control)):
        for w, r in ((0.0, by[0.0].get(seed)), (0.0, control.get(seed)), (chosen, by[chosen].get(seed))):
            if r is None:
                continue
            c = r["test_chain"]
            gate = "" if c.get("tilt_gate") else " (estimator before its tilt gate)"
            lines.append(f"| {seed} | {w:g} | {r['steps']} | {r['test']['ppl0']:.3f} | {c['ppl']:.3f} ({c['se']:.3f}){gate} |")
    verdicts = []
    for title, base in ((f"weight {chosen:g} / weight 0 (same seed, same steps)", by[0.0]),
                        (f"weight {chosen:g} / weight 0 given its FLOPs (eqflops_w0/: more steps, same seed)", control)):
        paired = sorted(set(by[chosen]) & set(base))
        if not paired:
            continue
        steps = sorted({base[s]["steps"] for s in paired})
        lines += ["", f"## Paired ratios {title}, test", "", f"Weight 0 trained {', '.join(map(str, steps))} steps."]
        interval = {}  # label -> (geometric mean, lower, upper)
        for label, get in (("ppl@0", lambda r: r["test"]["ppl0"]), (f"ppl@{B}", lambda r: r["test_chain"]["ppl"])):
            ratios = [get(by[chosen][s]) / get(base[s]) for s in paired]
            interval[label] = common.ratio_ci(ratios)
            lines.append(f"- {label}: {common.paired(paired, ratios)} (n = {len(paired)} seeds)")
        if len(paired) > 1:
            verdicts.append(interval["ppl@0"][2] < 1 and interval[f"ppl@{B}"][0] < 1)
    if len(verdicts) == 2:
        met = all(verdicts)
        lines += ["", f"Plan's rule (ppl@0's upper bound < 1 and ppl@{B}'s geometric mean < 1, at equal steps and "
                  f"against the equal-FLOPs control): **{'met: the weight becomes the DB quickstart default' if met else 'not met: the default stays 0'}**."]
    return common.write_lines(out_root / "clean_lm_report.md", lines)


def protocol_main(args) -> None:
    split = protocol_split(args.work, args.split_seed)
    print(f"split: {split}", flush=True)
    for seed in args.seeds:
        for B in args.blocks:
            if args.lrs:
                plan = [(lr, rule) for lr in args.lrs for rule in args.rules]
            else:
                chosen = chosen_lrs(protocol_runs(args.out), B, args.sweep_seed)
                missing = [rule for rule in args.rules if rule not in chosen]
                if missing:
                    raise SystemExit(f"B = {B}: no dev sweep for {missing} at seed {args.sweep_seed}: run --lrs first")
                plan = [(chosen[rule], rule) for rule in args.rules]
            for lr, rule in plan:
                if (args.out / f"{protocol_name(B, rule, lr, seed)}.json").exists():
                    continue
                r = protocol_run(B, rule, lr, seed, args.work, split, args.out, args.set)
                c = r["test_chain"]
                print(f"B{B} {rule} lr {lr:g} s{seed}: dev ppl@0 {r['dev']['ppl0']:.3f}, test ppl@0 "
                      f"{r['test']['ppl0']:.3f}, test ppl@{B} {c['ppl']} (se {c['se']:.4f}), shares "
                      f"{[round(x, 3) for x in r['logged_block_share']]} ({r['cpu_s']} CPU-s, {r['wall_s']} s)", flush=True)
    print(protocol_report(args.out, args.sweep_seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[2])
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/looped_lm_allocation_protocol"))
    ap.add_argument("--protocol", action="store_true", help="dev/test halves of a fixed held-out split, lr per rule")
    ap.add_argument("--protocol-report", action="store_true", help="write the protocol's report.md")
    ap.add_argument("--lrs", type=float, nargs="+", default=None,
                    help="protocol: the sweep's learning rates (min_lr = lr / 10); omitted: each rule's dev-chosen lr")
    ap.add_argument("--split-seed", type=int, default=0, help="protocol: data.split_seed of every run")
    ap.add_argument("--sweep-seed", type=int, default=0, help="protocol: the seed whose dev ppl@0 chooses the lr")
    ap.add_argument("--out", type=Path, default=PROTOCOL_OUT, help="protocol: where the JSONs and report.md go")
    ap.add_argument("--set", action="append", default=[], help="protocol: extra train overrides (a smoke test)")
    ap.add_argument("--clean-lm-report", action="store_true",
                    help="write clean_lm_report.md: clean_lm_weight chosen on dev, paired against weight 0 on test")
    args = ap.parse_args()
    if args.clean_lm_report:
        print(clean_lm_report(OUT, PROTOCOL_OUT, args.sweep_seed))
    elif args.protocol:
        protocol_main(args)
    else:
        print(protocol_report(args.out, args.sweep_seed))


if __name__ == "__main__":
    main()
