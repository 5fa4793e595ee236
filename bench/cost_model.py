"""The cost model's tables (the model itself is looped_lm/cost.py).

    python bench/cost_model.py table     # markdown tables + bench/results/cost_model.json

`table` prints (1) B DB steps / one gpt step and (2) DB(K = B) / gpt decode per token at the project's
shapes, and (3) every measured ratio of bench/README.md (read from the committed bench JSONs) beside the
floor the cost model gives for the configuration that was measured.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from looped_lm.cost import DBLayout, Shape, db_train, decode_ratio, huginn_train, train_ratio

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# --- the CLI table -------------------------------------------------------------------------------

SHAPES = {
    "d256 x8 (bench)": Shape(d=256, layers=8, heads=4, vocab=50257, seq=1024, batch=4),
    "d768 x12 (paper)": Shape(d=768, layers=12, heads=12, vocab=50257, seq=1024, batch=4),
}
LAYOUTS = {
    "paper (edm, self key)": DBLayout(parameterization="edm", noisy_self=True),
    "edm, no self key": DBLayout(parameterization="edm"),
    "shipped (likelihood, no self key)": DBLayout(),
    "PROJECTION fold + posterior no-grad": DBLayout(fold_likelihood=True, posterior="no_grad"),
    "PROJECTION fold + posterior top-64": DBLayout(fold_likelihood=True, posterior="topk", topk=64),
}


def build_tables(context: int = 32) -> dict:
    train_rows, decode_rows = [], []
    for shape_name, s in SHAPES.items():
        for lay_name, lay in LAYOUTS.items():
            for f in (1.0, 0.25):
                for chunk in (0, 128):
                    lay_f = replace(lay, target_fraction=f, loss_chunk=chunk)
                    r = train_ratio(s, lay_f)
                    train_rows.append({"shape": shape_name, "layout": lay_name, "target_fraction": f,
                                       "loss_chunk": chunk, **{k: v for k, v in r.items() if "terms" not in k},
                                       "db_terms_block0": r["db_terms"], "gpt_terms": r["gpt_terms"]})
        for lay_name in ("paper (edm, self key)", "shipped (likelihood, no self key)",
                         "PROJECTION fold + posterior top-64"):
            for rows in (1, 8):
                for fused in (False, True):
                    lay = LAYOUTS[lay_name]
                    r = decode_ratio(s, lay, K=lay.blocks, context=context, rows=rows, fused=fused)
                    decode_rows.append({"shape": shape_name, "layout": lay_name, "batch": rows, "K": lay.blocks,
                                        "context": context, "fused_weights": fused, **r})
    return {"train": train_rows, "decode": decode_rows, "context": context}


def markdown(tables: dict) -> str:
    out = ["B DB steps / one gpt step, matmul FLOPs (attention: visible pairs only), V 50257, T 1024, "
           "batch 4, B 4; gpt with the same loss_chunk:", "",
           "| shape | DB layout | f | loss_chunk | B·DB/gpt | layers only | vocab share DB / gpt |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in tables["train"]:
        out.append(f"| {r['shape']} | {r['layout']} | {r['target_fraction']:g} | {r['loss_chunk']} | "
                   f"**{r['ratio']:.2f}** | {r['layers_ratio']:.2f} | "
                   f"{r['db_vocab_share']:.0%} / {r['gpt_vocab_share']:.0%} |")
    out += ["", f"Decode, one token per row after {tables['context']} cached tokens, DB at K = B = 4, hard bridge: "
            "DB / gpt tokens per second at the floor (gpt cost / DB cost). 'weights' = parameters + KV read "
            "per step (the memory-bound floor at small batch); 'fused' (the code now; unfused = the earlier two-pass decode) = the clean token and "
            "the noisy slot share one weight pass per block:", "",
            "| shape | DB layout | batch | DB/gpt by FLOPs | DB/gpt by weight+KV bytes | same, fused | "
            "MFLOP/token gpt / DB | vocab share of DB FLOPs |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    rows = tables["decode"]
    for r in rows:
        if r["fused_weights"]:
            continue
        fused = next(x for x in rows if x["fused_weights"] and x["shape"] == r["shape"]
                     and x["layout"] == r["layout"] and x["batch"] == r["batch"])
        out.append(f"| {r['shape']} | {r['layout']} | {r['batch']} | **{r['flops_ratio']:.2f}** | "
                   f"{r['bytes_ratio']:.2f} | {fused['bytes_ratio']:.2f} | {r['gpt_mflop_per_token']:.1f} / "
                   f"{r['db_mflop_per_token']:.1f} | {r['db_vocab_share']:.0%} |")
    return "\n".join(out)


# --- the measured ratios of bench/README.md beside their floors ----------------------------------

PAPER_LAYOUT = DBLayout(parameterization="edm", noisy_self=True)  # what the older benches measured


def measured_vs_floor() -> list[dict]:
    """Every measured DB / gpt (and huginn / looped_db) ratio in the committed bench JSONs, with the
    floor this model gives for the same shapes and layout, and x_floor = measured / floor in the ratio's
    own direction: training cost ratios (lower is better; target <= 1.15), decode speed ratios and the
    huginn / looped_db step ratio (higher is better; decode target >= 0.9)."""
    out = []

    def load(name):
        path = RESULTS / name
        return json.loads(path.read_text()) if path.exists() else None

    runs = [("db_train_cost.json", PAPER_LAYOUT, 0, "paper layout (edm, self key), no loss_chunk"),
            ("db_train_cost_chunked.json", DBLayout(loss_chunk=128), 128,
             "shipped layout (likelihood, prev_token, no self key), loss_chunk 128 in both")]
    for name, lay, chunk, layout in runs:
        data = load(name)
        for r in (data or {}).get("rows", []):
            s = Shape(d=256, layers=8, heads=4, vocab=r["vocab"], seq=r["seq"], batch=4)
            floor = train_ratio(s, replace(lay, target_fraction=r["target_fraction"]), chunk)
            out.append({"source": name, "what": "B DB steps / gpt step, CPU time (cost: lower is better)", "layout": layout,
                        "config": f"V {r['vocab']}, T {r['seq']}, f {r['target_fraction']:g}",
                        "measured": r["time_ratio_B_steps"], "floor": floor["ratio"],
                        "floor_layers_only": floor["layers_ratio"], "x_floor": r["time_ratio_B_steps"] / floor["ratio"]})
    data = load("db_decode.json")
    for r in (data or {}).get("speed", []):
        s = Shape(d=256, layers=8, heads=4, vocab=r["vocab"], seq=256)
        floor = decode_ratio(s, PAPER_LAYOUT, K=r["K"], context=32, rows=r["batch"])
        out.append({"source": "db_decode.json", "what": "DB / gpt decode tok/s, CPU time (speed: higher is better)",
                    "layout": "paper layout, hard bridge, K = 4, ~32 cached tokens",
                    "config": f"V {r['vocab']}, batch {r['batch']}", "measured": r["ratio_cpu"],
                    "floor": floor["flops_ratio"], "floor_bytes": floor["bytes_ratio"],
                    "x_floor": r["ratio_cpu"] / floor["flops_ratio"]})
    data = load("looped_cost.json")
    for r in (data or {}).get("rows", []):
        s = Shape(d=512, layers=4, heads=8, vocab=r["vocab"], seq=256, batch=2, prelude=2, coda=2)
        lay = replace(PAPER_LAYOUT, blocks=1, target_fraction=r["target_fraction"])
        floor = huginn_train(s, 32, 8).total() / db_train(s, lay).total()
        out.append({"source": "looped_cost.json", "what": "huginn (r 32, k 8) step / looped_db step, CPU time (higher is better)",
                    "layout": "paper layout", "config": f"V {r['vocab']}, f {r['target_fraction']:g}",
                    "measured": r["time_ratio"], "floor": floor, "x_floor": r["time_ratio"] / floor})
    return out


def measured_markdown(rows: list[dict]) -> str:
    out = ["| measured in | ratio | layout | config | measured | analytic floor | measured / floor |",
           "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['source']} | {r['what']} | {r['layout']} | {r['config']} | {r['measured']:.2f} | "
                   f"{r['floor']:.2f} | {r['x_floor']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["table"])
    ap.add_argument("--context", type=int, default=32, help="cached tokens before the decoded one")
    ap.add_argument("--json", default=str(RESULTS / "cost_model.json"))
    args = ap.parse_args(argv)
    tables = build_tables(args.context)
    tables["measured_vs_floor"] = measured_vs_floor()
    text = markdown(tables) + "\n\nMeasured ratios of bench/README.md beside their floors:\n\n" + \
        measured_markdown(tables["measured_vs_floor"])
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({**tables, "table": text, "shapes": {k: asdict(v) for k, v in SHAPES.items()},
                                           "layouts": {k: asdict(v) for k, v in LAYOUTS.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
