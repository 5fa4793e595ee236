"""bench/results/depth/report.md from the depth study's JSON (bench/depth.py): the criterion, the
learning-rate sweep, the main comparison with paired per-seed ratios and 95 % intervals."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # Student t, 2-sided


def load(results: Path, study: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((results / study).glob("*.json"))]


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % interval over seeds); 0 width for one value."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, float("nan")
    return m, T95[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))


def fmt(m: float, h: float, digits: int = 3) -> str:
    return f"{m:.{digits}f}" + ("" if math.isnan(h) else f" ± {h:.{digits}f}")


def by_run(rows: list[dict]) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        out[r["run"]][r["seed"]] = r
    return out


def criterion_section(rows: list[dict]) -> tuple[list[str], bool]:
    runs = by_run(rows)
    lines = ["## 1. The regime: does end-to-end gpt improve with depth at equal FLOPs?", "",
             "Criterion, fixed before any DiffusionBlocks run: test NLL of gpt at 2, 4 and 8 layers, equal "
             "training FLOPs, 3 seeds; each step deeper must lower the mean with non-overlapping 95 % intervals.",
             "", "| gpt | steps | test NLL (nats/token, 95 % CI) | PPL | CPU-s per run | seeds |", "|---|---|---|---|---|---|"]
    means = {}
    for name in ("gpt_L2", "gpt_L4", "gpt_L8"):
        seeds = runs.get(name, {})
        if not seeds:
            continue
        m, h = interval([r["test"]["nll"] for r in seeds.values()])
        means[name] = (m, h)
        any_r = next(iter(seeds.values()))
        cpu = statistics.fmean(r["train_cpu_s"] for r in seeds.values())
        lines.append(f"| {name.split('_L')[1]} layers | {any_r['steps']} | {fmt(m, h)} | {math.exp(m):.2f} | {cpu:.0f} | "
                     f"{sorted(seeds)} |")
    pairs = [(a, b) for a, b in (("gpt_L2", "gpt_L4"), ("gpt_L4", "gpt_L8")) if a in means and b in means]
    better = {(a, b): means[a][0] - means[a][1] > means[b][0] + means[b][1] for a, b in pairs}
    met = len(pairs) == 2 and all(better.values())
    worse = [(a, b) for a, b in pairs if means[b][0] > means[a][0]]
    why = "" if met else (" ".join(f"{b.split('_L')[1]} layers are WORSE than {a.split('_L')[1]} at equal FLOPs "
                                   f"({means[b][0]:.3f} vs {means[a][0]:.3f})" for a, b in worse)
                          or "some runs are missing")
    lines += ["", f"**Criterion {'met' if met else 'NOT met'}**" + (f": {why}." if why else "."), ""]
    return lines, met


def lr_section(rows: list[dict]) -> list[str]:
    lines = ["## 2. Learning rates (dev half, seed 0, half the budget with its own schedule)", "",
             "| run | lr | dev NLL | diverged |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["run"], r["lr"])):
        lines.append(f"| {r['run']} | {r['lr']:g} | {r['dev']['nll']:.4f} | {r['diverged']} |")
    return lines + [""]


def paired(a: dict[int, dict], b: dict[int, dict], key=lambda r: r["test"]["nll"]) -> tuple[float, float, list[int]]:
    """exp(mean over shared seeds of (nll_a - nll_b)): the PPL ratio a / b, with its 95 % interval."""
    seeds = sorted(set(a) & set(b))
    diffs = [key(a[s]) - key(b[s]) for s in seeds]
    if not diffs:
        return float("nan"), float("nan"), []
    m, h = interval(diffs)
    return m, h, seeds


def main_section(rows: list[dict]) -> list[str]:
    runs = by_run(rows)
    lines = ["## 3. DiffusionBlocks at equal FLOPs: independent vs stacked blocks", "",
             "ppl@0 for db_ar (one call at the top of the noise range; every test window); exact PPL for gpt. "
             "Ratios are PPL ratios from paired per-seed NLL differences (same seed: same init stream and data "
             "order), with 95 % intervals over seeds.", "",
             "| run | lr | steps | test NLL (95 % CI) | PPL | vs gpt of the same depth | seeds |", "|---|---|---|---|---|---|---|"]
    for name in ("gpt_L4", "db_L4_B2_independent", "db_L4_B2_stacked", "gpt_L8", "db_L8_B4_independent",
                 "db_L8_B4_stacked"):
        seeds = runs.get(name, {})
        if not seeds:
            continue
        m, h = interval([r["test"]["nll"] for r in seeds.values()])
        gpt = runs.get("gpt_" + name.split("_")[1], {})
        ratio = ""
        if not name.startswith("gpt"):
            dm, dh, shared = paired(seeds, gpt)
            ratio = f"{math.exp(dm):.3f} [{math.exp(dm - dh):.3f}, {math.exp(dm + dh):.3f}]" if shared and not math.isnan(dh) \
                else (f"{math.exp(dm):.3f}" if shared else "")
        r0 = next(iter(seeds.values()))
        lines.append(f"| {name} | {r0['lr']:g} | {r0['steps']} | {fmt(m, h)} | {math.exp(m):.2f} | {ratio} | {sorted(seeds)} |")
    lines += ["", "Stacked against independent, same B and depth (paired PPL ratio, 95 % CI):", ""]
    for L, B in ((4, 2), (8, 4)):
        a, b = runs.get(f"db_L{L}_B{B}_stacked", {}), runs.get(f"db_L{L}_B{B}_independent", {})
        dm, dh, shared = paired(a, b)
        if shared:
            ci = "" if math.isnan(dh) else f" [{math.exp(dm - dh):.3f}, {math.exp(dm + dh):.3f}]"
            lines.append(f"- L = {L}, B = {B}: {math.exp(dm):.3f}{ci} (seeds {shared})")
    lines += ["", "Chains (K = B, the unbiased estimator, 16 test windows, 4 draws; the estimator's standard error):", "",
              "| run | seed | ppl@0 (same windows) | ppl@B | se of the NLL |", "|---|---|---|---|---|"]
    for name, seeds in sorted(runs.items()):
        for s, r in sorted(seeds.items()):
            chain = next((v for k, v in r["test"].items() if k.startswith("chain_K")), None)
            if chain:
                lines.append(f"| {name} | {s} | {math.exp(chain['nll_at0_same_windows']):.2f} | {math.exp(chain['nll']):.2f} | "
                             f"{chain['est_se']:.3f} |")
    return lines + [""]


def write_report(results: Path) -> None:
    crit, met = criterion_section(load(results, "criterion"))
    lines = ["# The depth study (bench/depth.py)", "", "Every number below is read from the JSON beside this file.", ""]
    main = load(results, "main")
    have = {r["run"] for r in main}
    # gpt rows at the tuned learning rate come from the criterion runs when that rate is the criterion's
    shared = [r for r in load(results, "criterion") if r["run"] not in have and r["run"] in ("gpt_L4", "gpt_L8")]
    lines += crit
    if not met:
        lines += ["The DiffusionBlocks rows were not run in this regime: where depth buys nothing a method whose "
                  "weakness is depth cannot show it. See bench/results/depth_synthetic/report.md for a regime "
                  "where it does.", ""]
    if load(results, "lr"):
        lines += lr_section(load(results, "lr"))
    if main:
        lines += main_section(main + shared)
    (results / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
