"""Decode tokens/s of gpt and db_ar (K = 2, 4) beside looped_lm/cost.py's floor, and KV bytes per token vs K
(looped_db, huginn); bench/README.md, "decode.py". One thread, untrained quickstart shapes, greedy `generate`,
CPU time of 48 new tokens (prefill excluded), interleaved repeats, the fastest kept.

    python bench/decode.py [--quick]     # -> bench/results/decode.json

`--compiled` (the engine's gpt decode step compiled vs eager, no committed JSON) is this script at commit
cafa2ef; the compiled decode's GPU numbers are bench/gpu_speed.py's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from looped_lm import cost as cm
from looped_lm.config import config_from_dict
from looped_lm.engine.generate import generate
from looped_lm.engine.runner import kv_bytes_per_token
from looped_lm.models import build_model
from looped_lm.models.contract import Iterative
from looped_lm.sampling import GREEDY
from looped_lm.settings import resolve_settings

HERE = Path(__file__).resolve().parent
PROMPT, NEW = 16, 48


def build(kind: str, vocab: int):
    """The quickstart's shape of `kind`, untrained."""
    model = {"kind": kind, "n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128}
    diffusion = {"num_blocks": 2} if kind == "db_ar" else {}
    if kind in ("looped_db", "huginn"):
        model.update(n_layers=2, n_prelude=1, n_coda=1)
        diffusion = {"num_blocks": 1}
    if kind == "huginn":
        model.update(mean_recurrence=8, backprop_depth=4)
    torch.manual_seed(0)
    return build_model(config_from_dict({"model": model, "diffusion": diffusion}), vocab).eval()


def tokens_per_s(model, batch: int, K: int | None) -> float:
    limits = model.iteration_limits() if isinstance(model, Iterative) else None
    settings = resolve_settings(limits, num_iterations=K, sampling=GREEDY)
    prompt = torch.randint(0, model.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    t = time.process_time()
    generate(model, prompt, 1, settings)
    one = time.process_time() - t
    t = time.process_time()
    generate(model, prompt, NEW + 1, settings)
    return batch * NEW / max(time.process_time() - t - one, 1e-9)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repeat, one vocabulary")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeats = 1 if args.quick else args.repeats
    out = {"new_tokens": NEW, "prompt": PROMPT, "speed": [], "kv": []}
    for vocab in ((257,) if args.quick else (257, 50257)):
        models = {"gpt": build("gpt", vocab), "db_ar": build("db_ar", vocab)}
        shape = cm.Shape(d=128, layers=4, heads=4, vocab=vocab, seq=128, batch=1)
        for batch in (1, 8):
            cases = [("gpt", None), ("db_ar", 2), ("db_ar", 4)]
            best = {c: 0.0 for c in cases}
            for _ in range(repeats):
                for kind, K in cases:
                    best[(kind, K)] = max(best[(kind, K)], tokens_per_s(models[kind], batch, K))
            gpt = best[("gpt", None)]
            for (kind, K), tps in best.items():
                row = {"vocab": vocab, "batch": batch, "kind": kind, "K": K, "tokens_per_s": tps,
                       "vs_gpt": tps / gpt}
                if kind == "db_ar":
                    floor = cm.decode_ratio(shape, cm.DBLayout(blocks=2), K=K, context=PROMPT + NEW // 2, rows=batch)
                    row.update(floor_flops=floor["flops_ratio"], floor_bytes=floor["bytes_ratio"],
                               of_floor_bytes=(tps / gpt) / floor["bytes_ratio"])
                out["speed"].append(row)
                print(row, flush=True)
    looped, huginn = build("looped_db", 257), build("huginn", 257)
    for K in (1, 2, 4, 8, 16, 32):
        out["kv"].append({"K": K, "looped_db": kv_bytes_per_token(looped, K), "huginn": kv_bytes_per_token(huginn, K)})
    (HERE / "results" / "decode.json").write_text(json.dumps(out, indent=1))
    lines = ["| vocab | batch | model | K | tokens/s (CPU) | / gpt | floor by bytes (FLOPs) | of the bytes floor |",
             "|---|---|---|---|---|---|---|---|"]
    for r in out["speed"]:
        floor = f"{r['floor_bytes']:.2f} ({r['floor_flops']:.2f})" if "floor_bytes" in r else "-"
        share = f"{r['of_floor_bytes']:.2f}" if "of_floor_bytes" in r else "-"
        lines.append(f"| {r['vocab']} | {r['batch']} | {r['kind']} | {r['K'] or '-'} | {r['tokens_per_s']:.0f} | "
                     f"{r['vs_gpt']:.2f} | {floor} | {share} |")
    lines += ["", "| K | looped_db KV bytes/token | huginn KV bytes/token |", "|---|---|---|"]
    lines += [f"| {r['K']} | {r['looped_db']} | {r['huginn']} |" for r in out["kv"]]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
