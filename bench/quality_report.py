"""Tables and plots of the quality study, from the JSON that bench/quality.py writes (one file per run and seed).

    python bench/quality.py report                 # every study directory under bench/results/quality/
    python bench/quality.py report powered         # one

Writes <study>/report.md and <study>/*.png. Every number is a mean over the seeds a run has, with the
spread (sample standard deviation over seeds, "sd") and, for estimated DiffusionBlocks numbers, the
estimator's own standard error ("se", the mean over seeds). Ratios are taken per seed (every seed sees
its own data order, shared by all runs) and then averaged.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "quality"
NEW_STUDIES = ("powered", "ablations", "scorer", "generation")
UNRESOLVED = 0.25  # nats: an estimate whose standard error is this large ranks nothing


# ------------------------------------------------------------------------------------------------
# reading


def load(study_dir: Path) -> dict[str, dict[int, dict]]:
    """{run: {seed: result}} of the training runs, with their decode-variant results attached."""
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(study_dir.glob("*__s*.json")):
        if path.name.endswith(".decode.json"):
            continue
        r = json.loads(path.read_text())
        decode = path.with_name(path.name.replace(".json", ".decode.json"))
        if decode.exists():
            r["decode"] = json.loads(decode.read_text())["variants"]
        runs.setdefault(r["run"], {})[r["seed"]] = r
    return runs


def kind(r: dict) -> str:
    return r["config"]["model"]["kind"]


def blocks(r: dict) -> int:
    return r["config"]["diffusion"]["num_blocks"] if kind(r) in ("db_ar", "looped_db") else 1


def primary_label(r: dict) -> str:
    """The label of a run's headline number: gpt exact, huginn at its mean recurrence, DB ppl@0."""
    k = kind(r)
    if k == "gpt":
        return "exact"
    if k == "huginn":
        return str(r["config"]["model"]["mean_recurrence"])
    return "0"


def scores(r: dict, where: str = "final") -> dict:
    """final (the final windows), looped (the looped K grid's windows) or a decode variant's scores."""
    if where in ("final", "looped", "k4b"):
        return r.get(where, {})
    return r.get("decode", {}).get(where, {}).get("final", {})


def nll(r: dict, label: str | None = None, where: str = "final") -> float | None:
    entry = scores(r, where).get(label or primary_label(r))
    return None if entry is None else entry["nll"]


def se(r: dict, label: str | None = None, where: str = "final") -> float:
    entry = scores(r, where).get(label or primary_label(r))
    return entry.get("se", 0.0) if entry else 0.0


def nll_on(r: dict, label: str, n_windows: int, where: str = "final") -> float | None:
    """Mean nll over the first `n_windows`-window set, read from a score kept on a larger set of the
    same spacing (val_windows(val, n) is every (N/n)-th window of val_windows(val, N))."""
    entry = scores(r, where).get(label)
    if entry is None or "per_window" not in entry or len(entry["per_window"]) % n_windows:
        return None
    step = len(entry["per_window"]) // n_windows
    return statistics.fmean(entry["per_window"][::step])


def window_se(r: dict, label: str | None = None, where: str = "final") -> float:
    entry = scores(r, where).get(label or primary_label(r))
    return entry.get("window_se", 0.0) if entry else 0.0


def mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))


def fmt_ppl(values: list[float], ses: list[float] | None = None, digits: int = 2) -> str:
    """PPL of mean NLL over seeds, its spread as sd over seeds of the PPL, and the mean se in PPL."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    ppls = [math.exp(v) for v in values]
    m = math.exp(statistics.fmean(values))
    text = f"{m:.{digits}f}"
    if len(ppls) > 1:
        text += f" ± {statistics.stdev(ppls):.{digits}f}"
    if ses and any(ses):
        text += f" (se {m * statistics.fmean(ses):.{digits}f})"
    return text


def fmt_ratio(ratios: list[float]) -> str:
    m, s = mean_sd(ratios)
    if math.isnan(m):
        return "-"
    return f"{m:.3f}" + (f" ± {s:.3f}" if not math.isnan(s) else "")


def paired_interval(ratios: list[float]) -> str:
    """Geometric mean of per-seed ratios with a Student-t 95 % interval on their logs."""
    from scipy.stats import t

    logs = [math.log(x) for x in ratios]
    n = len(logs)
    if n == 0:
        return "-"
    mean = sum(logs) / n
    if n < 2:
        return f"{math.exp(mean):.3f} (one seed, no interval)"
    half = float(t.ppf(0.975, n - 1)) * statistics.stdev(logs) / math.sqrt(n)
    return f"{math.exp(mean):.3f} [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}] (n = {n} seeds)"


def ratio_per_seed(runs: dict, a: str, b: str, label_a: str | None = None, label_b: str | None = None) -> list[float]:
    """PPL(a) / PPL(b) for every seed both have."""
    out = []
    for seed, ra in runs.get(a, {}).items():
        rb = runs.get(b, {}).get(seed)
        if rb is None:
            continue
        na, nb = nll(ra, label_a), nll(rb, label_b)
        wa, wb = ra.get("final_windows", 32), rb.get("final_windows", 32)
        if wa != wb:  # compare on the smaller set, which the larger one contains
            n = min(wa, wb)
            na, nb = nll_on(ra, label_a or primary_label(ra), n), nll_on(rb, label_b or primary_label(rb), n)
        if na is not None and nb is not None:
            out.append(math.exp(na - nb))
    return out


def seeds_text(seeds) -> str:
    return ",".join(str(s) for s in sorted(seeds))


# ------------------------------------------------------------------------------------------------
# tables


def main_table(runs: dict, ref: str = "gpt") -> list[str]:
    lines = ["| run | what | seeds | params | steps | TFLOPs | train CPU-s | PPL at equal FLOPs | windows (se) | × gpt |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, by_seed in runs.items():
        rs = list(by_seed.values())
        r0 = rs[0]
        label = primary_label(r0)
        metric = {"exact": "", "0": " (ppl@0)"}.get(label, f" (K = {label})")
        lines.append(
            f"| `{name}` | {r0['what']}{metric} | {seeds_text(by_seed)} | {r0['params'] / 1e6:.2f} M | "
            f"{statistics.fmean(r['steps'] for r in rs):.0f} | {statistics.fmean(r['flops'] for r in rs) / 1e12:.1f} | "
            f"{statistics.fmean(r['cpu_s'] for r in rs):.0f} | {fmt_ppl([nll(r) for r in rs], [se(r) for r in rs])} | "
            f"{r0.get('final_windows', '-')} ({math.exp(statistics.fmean(nll(r) for r in rs)) * statistics.fmean(window_se(r) for r in rs):.2f}) | "
            f"{fmt_ratio(ratio_per_seed(runs, name, ref)) if name != ref else '1'} |")
    return lines


def chain_table(runs: dict, variant: str | None = None) -> list[str]:
    """ppl@k of every DiffusionBlocks run: K = 0 (one call), 1, B, 2B, 4B, and chain / ppl@0 at K = B."""
    lines = ["| run | seeds | ppl@0 | K = 1 | K = B | K = 2B | K = B / ppl@0 | few windows: ppl@0 / K = B / 2B / 4B | "
             "K = 2B / K = B | K = 4B / K = B |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name, by_seed in runs.items():
        rs = [r for r in by_seed.values() if kind(r) == "db_ar" and (variant is None or variant in r.get("decode", {}))]
        if not rs:
            continue
        B = blocks(rs[0])
        where = variant or "final"

        def unresolved(k, at=where) -> float | None:
            ses = [se(r, str(k), at) for r in rs if nll(r, str(k), at) is not None]
            return statistics.fmean(ses) if ses and statistics.fmean(ses) > UNRESOLVED else None

        def col(k):
            if unresolved(k) is not None:
                return f"unresolved (se {unresolved(k):.2f} nats)"
            return fmt_ppl([nll(r, str(k), where) for r in rs], [se(r, str(k), where) for r in rs])

        def rel(k1, k0, at=where):
            if unresolved(k1, at) is not None or unresolved(k0, at) is not None:
                return "-"
            out = []
            for r in rs:
                a, b = nll(r, str(k1), at), nll(r, str(k0), at)
                if a is not None and b is not None:
                    out.append(math.exp(a - b))
            return fmt_ratio(out)

        few = "-"
        if variant is None and any("k4b" in r for r in rs):
            few = f"{rs[0].get('k4b_windows')} windows: " + " / ".join(
                fmt_ppl([nll(r, str(k), "k4b") for r in rs], [se(r, str(k), "k4b") for r in rs])
                for k in (0, B, 2 * B, 4 * B))
        trend = (rel(2 * B, B, "k4b"), rel(4 * B, B, "k4b")) if few != "-" else (rel(2 * B, B), rel(4 * B, B))
        if variant is not None:  # the run's own setting (edge, sample bridge) on the variant's windows
            n = len(scores(rs[0], where)["0"]["per_window"])
            own = [nll_on(r, str(B), n) for r in rs]
            few = f"{n} windows: run's own K = B {fmt_ppl(own)}" if None not in own else "-"
        ratio = rel(B, 0)
        lines.append(f"| `{name}` (B = {B}) | {seeds_text(s for s, r in by_seed.items() if r in rs)} | {col(0)} | "
                     f"{col(1)} | {col(B)} | {col(2 * B)} | {ratio} | {few} | {trend[0]} | {trend[1]} |")
    return lines


def looped_table(runs: dict) -> list[str]:
    ks = ["1", "2", "4", "8", "16", "32"]
    lines = ["| run | seeds | ppl@0 | " + " | ".join(f"K = {k}" for k in ks) + " | KV bytes/token at K = 1 / 32 |",
             "|---|---|---:|" + "---:|" * len(ks) + "---|"]
    for name, by_seed in runs.items():
        rs = list(by_seed.values())
        if kind(rs[0]) not in ("huginn", "looped_db") or "looped" not in rs[0]:
            continue
        zero = fmt_ppl([nll(r, "0", "looped") for r in rs], [se(r, "0", "looped") for r in rs]) \
            if kind(rs[0]) == "looped_db" else "-"
        cols = [fmt_ppl([nll(r, k, "looped") for r in rs], [se(r, k, "looped") for r in rs]) for k in ks]
        kv = rs[0].get("kv_bytes_per_token", {})
        lines.append(f"| `{name}` | {seeds_text(by_seed)} | {zero} | " + " | ".join(cols) +
                     f" | {kv.get('1', '-')} / {kv.get('32', '-')} |")
    exits = [(n, r) for n, bs in runs.items() for r in bs.values() if "adaptive_exit" in r]
    if exits:
        lines += ["", "Adaptive exit (looped_db, K up to 32, a token stops once KL(p_k || p_k-1) < eps):", "",
                  "| run | eps | seeds | PPL | mean iterations |", "|---|---:|---|---:|---:|"]
        names = sorted({n for n, _ in exits})
        for name in names:
            rs = [r for n, r in exits if n == name]
            for eps in rs[0]["adaptive_exit"]:
                vals = [r["adaptive_exit"][eps] for r in rs]
                its = mean_sd([v["mean_iterations"] for v in vals])
                lines.append(f"| `{name}` | {eps} | {seeds_text(r['seed'] for r in rs)} | "
                             f"{fmt_ppl([v['nll'] for v in vals], [v['se'] for v in vals])} | {its[0]:.1f} |")
    return lines


def probe_at(r: dict, axis: str, value: float) -> float | None:
    """The probe metric (primary label) at `axis` = value, linear between probes; None past the run."""
    label = primary_label(r)
    xs = [p[axis] for p in r["probes"]]
    ys = [p["val"][label] for p in r["probes"]]
    if value > xs[-1] * 1.0001:
        return None
    if value <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if xs[i] >= value:
            f = (value - xs[i - 1]) / max(xs[i] - xs[i - 1], 1e-12)
            return ys[i - 1] + f * (ys[i] - ys[i - 1])
    return ys[-1]


def wallclock_table(runs: dict, names: list[str]) -> list[str]:
    """The probe metric of `names` at the shortest run's training CPU time (per seed)."""
    present = [n for n in names if n in runs]
    if len(present) < 2:
        return []
    lines = ["| run | seeds | train CPU-s (mean) | probe PPL at t* (mean over seeds) | probe PPL at its end |",
             "|---|---|---:|---:|---:|"]
    seeds = set.intersection(*(set(runs[n]) for n in present))
    for name in present:
        vals, ends = [], []
        for s in seeds:
            t_star = min(runs[n][s]["cpu_s"] for n in present)
            vals.append(probe_at(runs[name][s], "cpu_s", t_star))
            ends.append(runs[name][s]["probes"][-1]["val"][primary_label(runs[name][s])])
        lines.append(f"| `{name}` | {seeds_text(seeds)} | {statistics.fmean(runs[name][s]['cpu_s'] for s in seeds):.0f} | "
                     f"{fmt_ppl(vals)} | {fmt_ppl(ends)} |")
    return lines


def updates_table(runs: dict, db: str, ref: str) -> list[str]:
    """Block 0's ppl@0 against the depth-matched gpt trained for as many steps as block 0 got updates."""
    if db not in runs or ref not in runs:
        return []
    lines = ["| seed | block 0 updates | gpt_depth2 steps | block-0 ppl@0 | gpt_depth2 PPL | ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    ratios = []
    for seed, r in sorted(runs[db].items()):
        g = runs[ref].get(seed)
        if g is None:
            continue
        ratio = math.exp(nll(r) - nll(g))
        ratios.append(ratio)
        lines.append(f"| {seed} | {r['block_updates'].get('0', 0)} | {g['steps']} | {math.exp(nll(r)):.3f} | "
                     f"{math.exp(nll(g)):.3f} | {ratio:.3f} |")
    lines.append(f"| mean | | | | | {fmt_ratio(ratios)} |")
    return lines


def tax_from_probes(runs: dict, db: str = "db_ar_b2", ref: str = "gpt_depth2") -> list[str]:
    """Block 0 (db's ppl@0 at its last probe) against the depth-matched gpt's probe at the step equal
    to block 0's updates, both on the probe windows. The gpt's value is read mid-schedule (higher lr than
    at the end of a run that length), so the ratio flatters the DiffusionBlocks run."""
    if db not in runs or ref not in runs:
        return []
    lines = ["| seed | block 0 updates (of steps) | block-0 ppl@0 (probe) | gpt_depth2 probe PPL at that step | ratio |",
             "|---|---:|---:|---:|---:|"]
    ratios = []
    for seed, r in sorted(runs[db].items()):
        g = runs[ref].get(seed)
        if g is None:
            continue
        updates = r["block_updates"].get("0", 0)
        a, b = r["probes"][-1]["val"]["0"], probe_at(g, "step", updates)
        if b is None:
            continue
        ratios.append(math.exp(a - b))
        lines.append(f"| {seed} | {updates} ({r['steps']}) | {math.exp(a):.3f} | {math.exp(b):.3f} | {ratios[-1]:.3f} |")
    lines.append(f"| mean ± sd | | | | {fmt_ratio(ratios)} |")
    return lines


def gap_vs_flops(runs: dict, ref: str = "gpt") -> list[str]:
    """PPL / ref's PPL at each probe (a tenth of the budget apart: equal FLOPs at every probe), mean over
    the seeds both have: does the gap grow or shrink with training?"""
    if ref not in runs:
        return []
    n = min(len(r["probes"]) for bs in runs.values() for r in bs.values())
    cols = list(range(0, n, max(1, n // 5))) + ([n - 1] if (n - 1) % max(1, n // 5) else [])
    lines = ["| run | seeds | " + " | ".join(f"{(i + 1) / n:.0%} of budget" for i in cols) + " |",
             "|---|---|" + "---:|" * len(cols)]
    for name, by_seed in runs.items():
        if name == ref:
            continue
        seeds = [s for s in by_seed if s in runs[ref]]
        if not seeds:
            continue
        cells = []
        for i in cols:
            ratios = [math.exp(by_seed[s]["probes"][i]["val"][primary_label(by_seed[s])] -
                               runs[ref][s]["probes"][i]["val"]["exact"]) for s in seeds]
            cells.append(fmt_ratio(ratios))
        lines.append(f"| `{name}` | {seeds_text(seeds)} | " + " | ".join(cells) + " |")
    return lines


def ablation_table(runs: dict, ref_runs: dict) -> list[str]:
    """Each ablation against the powered study's db_ar of the same B and against gpt, per seed on shared
    windows: ppl@0 and the K = B chain (the run's own last call and bridge), and the chain / ppl@0 of each."""
    lines = ["| ablation | what | seeds | steps | ppl@0 | × db_ar, same B (ppl@0) | × gpt (ppl@0) | K = B / ppl@0 | "
             "db_ar's K = B / ppl@0 (same seeds) | K = 2B / K = B |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, by_seed in runs.items():
        rs = list(by_seed.values())
        B = blocks(rs[0])
        ref = f"db_ar_b{B}"
        both = {**ref_runs, name: by_seed}
        seeds = [s for s in by_seed if s in ref_runs.get(ref, {})]

        def chain(r, k1, k0):
            a, b = nll(r, str(k1)), nll(r, str(k0))
            return None if a is None or b is None else math.exp(a - b)

        own = [c for c in (chain(r, B, 0) for r in rs) if c is not None]
        theirs = [c for c in (chain(ref_runs[ref][s], blocks(ref_runs[ref][s]), 0) for s in seeds) if c is not None]
        trend = [c for c in (chain(r, 2 * B, B) for r in rs) if c is not None]
        lines.append(f"| `{name}` | {rs[0]['what']} | {seeds_text(by_seed)} | "
                     f"{statistics.fmean(r['steps'] for r in rs):.0f} | "
                     f"{fmt_ppl([nll(r, '0') for r in rs], [se(r, '0') for r in rs], 3)} | "
                     f"{fmt_ratio(ratio_per_seed(both, name, ref, '0', '0'))} | "
                     f"{fmt_ratio(ratio_per_seed(both, name, 'gpt', '0'))} | {fmt_ratio(own)} | "
                     f"{fmt_ratio(theirs)} | {fmt_ratio(trend)} |")
    return lines


def looped_equal_flops(runs: dict, looped: str = "looped_db") -> list[str]:
    """A looped_db run's final ppl@k against huginn's final PPL at K = its mean recurrence, on the windows
    both scored (looped_db's final set is a subset of huginn's). `looped` names the looped_db run (the
    full-budget one, or the one at a quarter of the FLOPs)."""
    if "huginn" not in runs or looped not in runs:
        return []
    lines = [f"| seed | windows | huginn K = 8 | {looped} ppl@0 | K = 1 | K = 2 | K = 4 | best {looped} / huginn |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    ratios, at0 = [], []
    for seed, r in sorted(runs[looped].items()):
        h = runs["huginn"].get(seed)
        if h is None:
            continue
        n = r.get("final_windows", 16)
        hv = nll_on(h, primary_label(h), n)
        vals = {k: nll(r, k) for k in ("0", "1", "2", "4")}
        if hv is None:
            continue
        best = min(v for v in vals.values() if v is not None)
        ratios.append(math.exp(best - hv))
        at0.append(math.exp(vals["0"] - hv))
        lines.append(f"| {seed} | {n} | {math.exp(hv):.3f} | " +
                     " | ".join(f"{math.exp(v):.3f}" if v is not None else "-" for v in vals.values()) +
                     f" | {ratios[-1]:.3f} |")
    lines.append(f"| mean ± sd | | | | | | | {fmt_ratio(ratios)} |")
    lines += ["", f"Paired per seed, geometric mean [Student-t 95 % on the log ratios]: {looped} ppl@0 / huginn "
              f"{paired_interval(at0)} (one call, no choice); best of ppl@0 and K = 1, 2, 4 / huginn "
              f"{paired_interval(ratios)} (K chosen on the same windows: optimistic)."]
    return lines


def sigma_law_table(runs: dict, base: str = "looped_db", moved: str = "looped_db_sigma_up") -> list[str]:
    """depth_synthetic plan item 15: the looped_db row with its sigma law moved up against the default one,
    seed by seed: probe PPL@0 along the run (does it leave the PPL ~ 10 plateau earlier?) and the final ppl@0
    and K = 1 (neither depends on the estimator's tilt, so runs scored before and after its gate compare)."""
    if base not in runs or moved not in runs:
        return []
    lines = ["| seed | row | probe ppl@0 at 10 / 40 / 70 / 100 % of the budget | final ppl@0 | final K = 1 |",
             "|---|---|---|---|---|"]
    ratios = {"0": [], "1": []}
    for seed in sorted(set(runs[base]) & set(runs[moved])):
        for name in (base, moved):
            r = runs[name][seed]
            probes = r["probes"]
            at = [probes[min(len(probes) - 1, round(f * len(probes)) - 1)]["val"]["0"] for f in (0.1, 0.4, 0.7, 1.0)]
            lines.append(f"| {seed} | {name} | " + " / ".join(f"{math.exp(v):.2f}" for v in at) +
                         f" | {math.exp(nll(r, '0')):.3f} | {math.exp(nll(r, '1')):.3f} |")
        for k in ratios:
            ratios[k].append(math.exp(nll(runs[moved][seed], k) - nll(runs[base][seed], k)))
    lines += ["", f"{moved} / {base}, paired per seed: ppl@0 " + ", ".join(f"{x:.3f}" for x in ratios["0"]) +
              f" (mean ± sd {fmt_ratio(ratios['0'])}); K = 1 " + ", ".join(f"{x:.3f}" for x in ratios["1"]) +
              f" ({fmt_ratio(ratios['1'])})."]
    return lines


# ------------------------------------------------------------------------------------------------
# plots


def plot_curves(runs: dict, path: Path, names: list[str] | None = None) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for name, by_seed in runs.items():
        if names and name not in names:
            continue
        rs = list(by_seed.values())
        for ax, axis, scale in zip(axes, ("flops", "cpu_s"), (1e12, 1)):
            n = min(len(r["probes"]) for r in rs)
            xs = [statistics.fmean(r["probes"][i][axis] for r in rs) / scale for i in range(n)]
            per = [[r["probes"][i]["val"][primary_label(r)] for r in rs] for i in range(n)]
            ax.plot(xs, [math.exp(statistics.fmean(v)) for v in per], marker=".", label=name)
            if len(rs) > 1:
                ax.fill_between(xs, [math.exp(min(v)) for v in per], [math.exp(max(v)) for v in per], alpha=0.2)
    for ax, label in zip(axes, ("training FLOPs (T, cost model)", "training CPU seconds (one thread)")):
        ax.set_xlabel(label)
        ax.set_ylabel("held-out PPL (DB: ppl@0; huginn: K = 8)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle("probe windows; line = mean over seeds, band = min..max", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ppl_vs_k(runs: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for name, by_seed in runs.items():
        rs = list(by_seed.values())
        if kind(rs[0]) == "gpt":
            ax.axhline(math.exp(statistics.fmean(nll(r) for r in rs)), ls="--", lw=1, color="grey")
            ax.text(1, math.exp(statistics.fmean(nll(r) for r in rs)), name, fontsize=7, va="bottom")
            continue
        ks = sorted({int(k) for r in rs for k in r["final"]})
        xs, ys, errs = [], [], []
        for k in ks:
            vals = [nll(r, str(k)) for r in rs if str(k) in r["final"]]
            if not vals:
                continue
            xs.append(k)
            ys.append(math.exp(statistics.fmean(vals)))
            errs.append(ys[-1] * (statistics.stdev(vals) if len(vals) > 1 else 0))
        line = ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=name)
        for where in ("k4b", "looped"):  # the long chains, on fewer windows: dotted
            rk = [r for r in rs if where in r]
            if not rk or kind(rk[0]) == "huginn":
                continue
            ks = sorted(int(k) for k in rk[0][where])
            ys = [math.exp(statistics.fmean(nll(r, str(k), where) for r in rk)) for k in ks]
            ax.plot(ks, ys, ":", marker="x", color=line[0].get_color(),
                    label=f"{name} ({rk[0].get(where + '_windows', 2)} windows)")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_yscale("log")
    ax.set_xlabel("K (0 = ppl@0: one call at sigma_top; huginn: iterations)")
    ax.set_ylabel("held-out PPL (mean over seeds, bar = sd)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ce_sigma(runs: dict, path: Path) -> None:
    db = {n: bs[min(bs)] for n, bs in runs.items() if "ce_curve" in bs[min(bs)]}
    if not db:
        return
    cols = min(4, len(db))
    rows = math.ceil(len(db) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, r) in zip(axes.flat, db.items()):
        for which, style in (("real", "-"), ("shuffled", "--")):
            c = r["ce_curve"][which]
            ax.plot(c["sigmas"], c["ce"], style, label=f"{which} context")
        for e in r["edges"][1:-1]:
            ax.axvline(e, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{name} (seed {r['seed']})", fontsize=9)
        ax.set_xlabel("sigma")
        ax.set_ylabel("CE (nats)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(db):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------


def report(study_dir: Path) -> None:
    runs = load(study_dir)
    if not runs:
        return
    name = study_dir.name
    lines = [f"# Quality study: `{name}` (generated by bench/quality_report.py from the JSON here)", "",
             "PPL = exp(mean held-out NLL) over the final windows; `a ± b (se c)`: mean over seeds ± sd over "
             "seeds, and the estimator's standard error (DiffusionBlocks ppl@k; 0 where exact).", ""]
    if name.startswith("ablations"):
        ref_runs = load(RESULTS / name.replace("ablations", "powered"))
        lines += ["## Each change against the powered study's db_ar of the same B (same seeds, shared windows)", "",
                  *ablation_table(runs, ref_runs), ""]
    lines += ["## Runs at equal training FLOPs", "", *main_table(runs), ""]
    gap = gap_vs_flops(runs)
    if gap:
        lines += ["## The gap to gpt along training (probe windows, PPL / gpt's PPL at the same FLOPs)", "", *gap, ""]
    lines += ["## DiffusionBlocks chains (ppl@k, the K-step sampler; K = 4B with 64 draws, others 16)", "",
              *chain_table(runs), ""]
    variants = sorted({v for bs in runs.values() for r in bs.values() for v in r.get("decode", {})})
    for v in variants:
        lines += [f"### Decode variant `{v}` on the same checkpoints (16 windows: every other final window)", "",
                  *chain_table(runs, v), ""]
    looped = looped_table(runs)
    if len(looped) > 2:
        lines += ["## Looped models: PPL vs K", "", *looped, ""]
        wc = wallclock_table(runs, ["huginn", "looped_db"])
        if wc:
            lines += ["### Equal training time (probe windows, read at the shorter run's CPU seconds)", "", *wc, ""]
    tax = tax_from_probes(runs)
    if tax:
        lines += ["## Block 0 against the depth-matched gpt at equal updates (from the main runs' probes)", "",
                  "Probe windows; gpt_depth2 read at the step equal to db_ar_b2's block-0 updates (mid-schedule, "
                  "so the ratio flatters block 0).", "", *tax, ""]
    leq = looped_equal_flops(runs)
    if leq:
        lines += ["## looped_db against huginn at equal FLOPs (shared final windows)", "", *leq, ""]
    up = looped_equal_flops(runs, "looped_db_sigma_up")
    if up:
        lines += ["## looped_db with its sigma law moved up (p_mean 1.0) against huginn at equal FLOPs", "",
                  "Scored after the estimator's tilt gate (K >= 2), where looped_db's own K >= 2 predate it; ppl@0 and "
                  "K = 1 are the same estimator in both.", "", *up, "", *sigma_law_table(runs), ""]
    quarter = looped_equal_flops(runs, "looped_db_quarter")
    if quarter:
        lines += ["## looped_db at a quarter of huginn's FLOPs (shared final windows)", "", *quarter, ""]
    if "db_ar_b2" in runs and "gpt_depth2_updates" in runs:
        lines += ["## Block 0 against the depth-matched gpt at equal updates", "",
                  *updates_table(runs, "db_ar_b2", "gpt_depth2_updates"), ""]
    (study_dir / "report.md").write_text("\n".join(lines) + "\n")
    plot_curves(runs, study_dir / "curves.png")
    plot_ppl_vs_k(runs, study_dir / "ppl_vs_k.png")
    plot_ce_sigma(runs, study_dir / "ce_sigma.png")
    print(f"wrote {study_dir / 'report.md'}")


def generation_report(study_dir: Path) -> None:
    """The paper's protocol (bench/quality.py generate): generative PPL under the scorer gpt, MAUVE and
    distinct-n per decoding, mean ± sd over the seeds of the generating models."""
    by_seed = {}
    for path in sorted(study_dir.glob("generation__s*.json")):
        r = json.loads(path.read_text())
        by_seed[r["seed"]] = r
    smoke = "_smoke" if study_dir.name.endswith("_smoke") else ""
    if not by_seed:
        temps = temperature_section(study_dir, smoke)
        if temps:
            (study_dir / "report.md").write_text("\n".join(["# Generated text at a temperature sweep", *temps]) + "\n")
        return
    first = by_seed[min(by_seed)]
    scorer = RESULTS / f"scorer{smoke}" / "gpt_big__s0.json"
    scorer_ppl = math.exp(nll(json.loads(scorer.read_text()))) if scorer.exists() else float("nan")
    powered = load(RESULTS / f"powered{smoke}")
    cols = ("gen_ppl", "mauve", "word_distinct_1", "word_distinct_2", "word_distinct_3", "self_repetition_4")

    def cell(vals: list[float], digits: int = 3) -> str:
        m, s = mean_sd(vals)
        return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if not math.isnan(s) else "")

    lines = ["# The paper's protocol at our scale (generated by bench/quality_report.py from the JSON here)", "",
             f"{first['samples']} prompts of {first['prompt_tokens']} held-out bytes, {first['new_tokens']} new bytes "
             f"each. Scorer: `scorer/gpt_big` seed 0 (held-out PPL {scorer_ppl:.3f}). gen PPL = exp(mean scorer NLL "
             "of the continuations): lower is not better on its own (greedy loops score low). MAUVE against the "
             "held-out continuations of the same prompts, on the scorer's mean-pooled last hidden state. "
             "Our measure beside it: the model's own held-out PPL (DB: ppl@k at the row's K, 16 draws; gpt exact; "
             "huginn at K = 8). Mean ± sd over the generating models' seeds.", "",
             "| model | decoding | seeds | gen PPL | MAUVE | distinct-1 | distinct-2 | distinct-3 | self-rep-4 | "
             "held-out PPL (ours) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    human = [r["human"] for r in by_seed.values()]
    lines.append("| held-out text | - | " + seeds_text(by_seed) + " | " +
                 " | ".join(cell([h[c] for h in human]) if c != "mauve" else "1" for c in cols) + " | - |")
    for key in first["rows"]:
        rows = [r["rows"][key] for r in by_seed.values() if key in r["rows"]]
        run, label = rows[0]["run"], rows[0]["decoding"]
        k = label.rsplit("K = ", 1)[1] if "K = " in label else None
        ours = [nll(pr, k if k and kind(pr) != "gpt" else None) for s, pr in powered.get(run, {}).items()
                if s in by_seed]
        lines.append(f"| `{run}` | {label} | {seeds_text(r['seed'] for r in by_seed.values() if key in r['rows'])} | "
                     + " | ".join(cell([row[c] for row in rows]) for c in cols) + f" | {fmt_ppl(ours)} |")
    lines += ["", "First sample of each decoding (seed " + str(min(by_seed)) + "):", ""]
    for key, row in first["rows"].items():
        lines.append(f"- **{key}**: `{row['examples'][0][:160]!r}`")
    lines += temperature_section(study_dir, smoke)
    (study_dir / "report.md").write_text("\n".join(lines) + "\n")
    plot_generation(by_seed, study_dir / "mauve_vs_gen_ppl.png")
    print(f"wrote {study_dir / 'report.md'}")


def temperature_section(study_dir: Path, smoke: str) -> list[str]:
    """MAUVE at a temperature sweep (bench/quality.py temperatures; plan_temperatures.md), with the check
    that each re-trained checkpoint is the studied model (its final scores against the study's)."""
    lines = []
    for path in sorted(study_dir.glob("temperatures*__s*.json")):
        r = json.loads(path.read_text())
        lines += ["", f"## MAUVE at a temperature sweep (seed {r['seed']}, plain sampling; `{path.name}`)", "",
                  "| model | decoding | gen PPL | MAUVE | distinct-1 | self-rep-4 |", "|---|---|---:|---:|---:|---:|",
                  f"| held-out text | - | {r['human']['gen_ppl']:.3f} | 1 | {r['human']['word_distinct_1']:.3f} | "
                  f"{r['human']['self_repetition_4']:.3f} |"]
        for row in r["rows"].values():
            lines.append(f"| `{row['run']}` | {row['decoding']} | {row['gen_ppl']:.3f} | {row['mauve']:.3f} | "
                         f"{row['word_distinct_1']:.3f} | {row['self_repetition_4']:.3f} |")
        checks = []
        for study, name in [("scorer", "gpt_big")] + [("powered", row["run"]) for row in r["rows"].values()]:
            rebuilt = RESULTS / f"{study}_rebuilt{smoke}" / f"{name}__s{r['seed'] if study == 'powered' else 0}.json"
            if rebuilt.exists() and (name, study) not in [c[:2] for c in checks]:
                b = json.loads(rebuilt.read_text())
                ours, theirs = nll(b), (b.get("study_final") or {}).get(primary_label(b), {}).get("nll")
                checks.append((name, study, "-" if theirs is None else f"{ours - theirs:+.2e}"))
        if checks:
            lines += ["", "Re-trained checkpoints (`bench/quality.py rebuild`): final NLL minus the study's own, "
                      "on the same windows (0 = the same model): " +
                      ", ".join(f"{study}/{name} {diff}" for name, study, diff in checks) + "."]
    return lines


def plot_generation(by_seed: dict, path: Path) -> None:
    """MAUVE against generative PPL, one point per (model, decoding, seed), the held-out text's gen PPL
    as a vertical line."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {}
    for seed, r in sorted(by_seed.items()):
        for key, row in r["rows"].items():
            color = colors.setdefault(row["run"], f"C{len(colors)}")
            marker = {"greedy": "x", "top-p": "^", "sampled": "o"}[row["decoding"].split(",")[0].split(" ")[0]]
            ax.scatter(row["gen_ppl"], row["mauve"], color=color, marker=marker, s=30,
                       label=key if seed == min(by_seed) else None)
        ax.axvline(r["human"]["gen_ppl"], color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("generative PPL under the scorer gpt (dashed: held-out text)")
    ax.set_ylabel("MAUVE vs held-out continuations")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(names: list[str] | None = None) -> None:
    dirs = [RESULTS / n for n in names] if names else [d for d in sorted(RESULTS.iterdir()) if d.is_dir()]
    for d in dirs:
        if d.name.startswith("generation"):
            generation_report(d)
        elif d.name.endswith("_rebuilt"):  # re-trained checkpoints: read against their study's own scores
            continue
        elif any(d.glob("*__s*.json")):
            report(d)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("studies", nargs="*", help="result folders under bench/results/quality (default: all)")
    main(ap.parse_args().studies or None)
