"""Tables and plots of the quality study from the JSON that bench/quality.py writes.

    python bench/quality.py report        # every study already run
Writes <out_dir>/report.md and <out_dir>/{curves,ppl_vs_k,ce_sigma}.png.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_runs(out_dir: Path) -> dict:
    runs = {}
    for path in sorted(out_dir.glob("*.json")):
        if path.name in ("generation.json",):
            continue
        data = json.loads(path.read_text())
        runs[data["run"]] = data
    return runs


def at(probes: list[dict], key: str, value: float) -> float:
    """The val NLL at `key` (train_s / flops / tokens) = value, linear between probes (last probe if beyond)."""
    xs = [p[key] for p in probes]
    ys = [p["val_nll"] for p in probes]
    if value >= xs[-1]:
        return ys[-1]
    for i in range(1, len(xs)):
        if xs[i] >= value:
            f = (value - xs[i - 1]) / max(xs[i] - xs[i - 1], 1e-12)
            return ys[i - 1] + f * (ys[i] - ys[i - 1])
    return ys[0]


def ppl(nll: float) -> float:
    return math.exp(nll) if nll < 50 else float("inf")


def kind(run: dict) -> str:
    return run["config"]["model"]["kind"]


def main_table(runs: dict, ref: str) -> list[str]:
    t_star = min(r["train_s"] for r in runs.values())
    ref_ppl = ppl(runs[ref]["probes"][-1]["val_nll"]) if ref in runs else None
    lines = [f"Equal FLOPs: every run trained to the same counted FLOPs. Equal wall-clock: val read at "
             f"t* = {t_star:.0f} s of training (the shortest run), linear between probes.", "",
             "| run | kind | params | steps | tokens | TFLOPs | train s | PPL at equal FLOPs | × ref | "
             "PPL at t* | chain PPL (K: ppl) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in runs.items():
        end = r["probes"][-1]
        p = ppl(end["val_nll"])
        ratio = f"{p / ref_ppl:.2f}" if ref_ppl else ""
        chain = ", ".join(f"{k}: {ppl(v):.1f}" for k, v in r["final"].items() if k != "0")
        lines.append(f"| {name} | {kind(r)} | {r['params'] / 1e6:.2f} M | {r['steps']} | {end['tokens'] / 1e6:.2f} M | "
                     f"{end['flops'] / 1e12:.2f} | {r['train_s']:.0f} | {p:.2f} | {ratio} | "
                     f"{ppl(at(r['probes'], 'train_s', t_star)):.2f} | {chain} |")
    lines += ["", "PPL columns: exact next-token PPL (gpt; huginn at K = its mean recurrence) or ppl@0 (DB: one "
              "call at sigma_hi), on the probe windows. Chain PPL: final scoring on more windows, 2 draws "
              "(DB: ppl@k, the K = k sampler; huginn: exact PPL after k iterations)."]
    return lines


def db_table(runs: dict) -> list[str]:
    lines = ["| run | ppl@0 | ppl@K soft | hard | sample | K | edges (sigma, low to high) | "
             "context gap per block (nats, shuffled - real) |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for name, r in runs.items():
        if "bridges" not in r:
            continue
        b = r["bridges"]
        gaps = context_gaps(r)
        edges = ", ".join(f"{e:.3g}" for e in r["edges_final"])
        lines.append(f"| {name} | {ppl(r['final']['0']):.2f} | {ppl(b['soft']):.1f} | {ppl(b['hard']):.1f} | "
                     f"{ppl(b['sample']):.1f} | {r['bridges_k']} | {edges} | {gaps} |")
    return lines


def context_gaps(run: dict) -> str:
    """Mean (shuffled - real) CE over the sigma grid points each block owns: how much it reads context."""
    real, shuf, edges = run["ce_curve"]["real"], run["ce_curve"]["shuffled"], run["edges_final"]
    B = len(edges) - 1
    out = []
    for b in range(B):  # block b owns [edges[B-1-b], edges[B-b]]
        lo, hi = edges[B - 1 - b], edges[B - b]
        gaps = [s - r for sig, r, s in zip(real["sigmas"], real["ce"], shuf["ce"]) if lo <= sig <= hi]
        out.append(f"{sum(gaps) / len(gaps):.2f}" if gaps else "-")
    return " / ".join(out)


def generation_table(gen: dict) -> list[str]:
    lines = ["| run | K | decoding | gen PPL (scored by gpt) | distinct-1 | distinct-2 | distinct-3 | s |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for key, g in gen.items():
        name, k, mode = key.split("|")
        d = g["distinct"]
        lines.append(f"| {name} | {k[2:]} | {mode} | {g['gen_ppl']:.1f} | {d['1']:.2f} | {d['2']:.2f} | "
                     f"{d['3']:.2f} | {g['seconds']:.0f} |")
    return lines


def plot_curves(runs: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, r in runs.items():
        for ax, key, scale in zip(axes, ("tokens", "flops", "train_s"), (1e6, 1e12, 1)):
            xs = [p[key] / scale for p in r["probes"]]
            ys = [p["val_nll"] for p in r["probes"]]
            ax.plot(xs, ys, marker=".", label=name)
    for ax, label in zip(axes, ("tokens (M)", "training FLOPs (T, counted)", "training seconds")):
        ax.set_xlabel(label)
        ax.set_ylabel("val NLL (nats; DB: ppl@0)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ppl_vs_k(runs: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in runs.items():
        ks = sorted(int(k) for k in r["final"])
        if len(ks) < 2:
            continue
        ax.plot(ks, [ppl(r["final"][str(k)]) for k in ks], marker="o", label=name)
    if "gpt" in runs:
        ax.axhline(ppl(runs["gpt"]["final"]["0"]), color="k", ls="--", label="gpt")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_yscale("log")
    ax.set_xlabel("K (0 = ppl@0, one call at sigma_hi)")
    ax.set_ylabel("PPL")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ce_sigma(runs: dict, path: Path) -> None:
    db = {n: r for n, r in runs.items() if "ce_curve" in r}
    if not db:
        return
    cols = min(4, len(db))
    rows = math.ceil(len(db) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, r) in zip(axes.flat, db.items()):
        for which, style in (("real", "-"), ("shuffled", "--")):
            c = r["ce_curve"][which]
            ax.plot(c["sigmas"], c["ce"], style, label=f"{which} context")
        for e in r["edges_final"][1:-1]:
            ax.axvline(e, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("sigma")
        ax.set_ylabel("CE (nats)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(db):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(out_dir: Path, study: str) -> None:
    runs = load_runs(out_dir)
    if not runs:
        return
    lines = [f"# Quality study: {study}", "", *main_table(runs, "gpt"), "", "## DiffusionBlocks runs", "",
             *db_table(runs)]
    gen_path = out_dir / "generation.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
        lines += ["", "## Generated text (100 prompts of 16 val tokens, 48 new tokens)", "", *generation_table(gen),
                  "", "Samples (first of each setting):", ""]
        for key, g in gen.items():
            lines += [f"- `{key}`: {json.dumps(g['samples'][0])}"]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    plot_curves(runs, out_dir / "curves.png")
    plot_ppl_vs_k(runs, out_dir / "ppl_vs_k.png")
    plot_ce_sigma(runs, out_dir / "ce_sigma.png")
    print(f"wrote {out_dir / 'report.md'}")
