"""The cost model's tables (the model itself is looped_lm/cost.py).

    python bench/cost_model.py table     # markdown tables + bench/results/cost_model.json

`table` prints (1) B DB steps / one gpt step and (2) DB(K = B) / gpt decode per token at the project's
shapes (bench/README.md "cost_model.py"). The table of the paper-layout measurements beside their floors
(db_train_cost.json, db_decode.json, looped_cost.json) was printed by this script at commit ec9be3c.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from looped_lm.cost import DBLayout, Shape, decode_ratio, train_ratio

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["table"])
    ap.add_argument("--context", type=int, default=32, help="cached tokens before the decoded one")
    ap.add_argument("--json", default=str(RESULTS / "cost_model.json"))
    args = ap.parse_args(argv)
    tables = build_tables(args.context)
    text = markdown(tables)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({**tables, "table": text, "shapes": {k: asdict(v) for k, v in SHAPES.items()},
                                           "layouts": {k: asdict(v) for k, v in LAYOUTS.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
