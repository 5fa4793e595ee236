"""Decode speed and KV-cache size: DiffusionBlocks-AR (B = 4, K routed steps per token) vs gpt.

    python bench/db_decode.py            # ~1-2 min on a 2-core CPU
    python bench/db_decode.py --tokens 16

Same layers as bench/db_train_cost.py (8 layers, d 256, 4 heads, fp32), untrained weights (speed and
cache size do not depend on them), greedy sampling, `looped_lm.engine.generate.generate`.

  tokens/s   batch x new tokens / time of the decode loop: generate(n) - generate(1), so the prompt's
             prefill is excluded; measured as CPU time of one thread (process_time; the box is shared
             with other jobs) and as wall-clock. Target: DB at K = B >= 0.8x gpt.
  KV bytes   DB: DecodeState.nbytes_per_token() (what the model reports) AND the bytes actually held by
             every cache tensor after decoding with that K, divided by max_len; plus the per-token
             `clean_inputs` buffer the DecodeState also keeps. gpt: sum(c.nbytes_per_token()).
             Must not depend on K.
  patch      a bench-side row with `model.target_table` replaced by the table computed once (the
             product recomputes the normalised V x d table for every token): the fix's effect.
  sanity     forward_cached vs next_logits_uncached for the same z (max |diff| of the logits).

Runs at V = 50257 (GPT-2) and V = 512 (head negligible: the layers and the per-step overhead).
Writes bench/results/db_decode.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import torch

from looped_lm.config import config_from_dict
from looped_lm.engine.generate import generate
from looped_lm.sampling import SamplingParams
from looped_lm.models import build_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LAYERS, D_MODEL, HEADS, NUM_BLOCKS, PROMPT = 8, 256, 4, 4, 16
TARGET = 0.8


def build(kind: str, V: int):
    torch.manual_seed(0)
    cfg = config_from_dict({"model": {"kind": kind, "n_layers": LAYERS, "d_model": D_MODEL, "n_heads": HEADS,
                                      "seq_len": 256}, "diffusion": {"num_blocks": NUM_BLOCKS}})
    model = build_model(cfg, V).eval()
    if kind == "db_ar":  # untrained adaLN-Zero is the identity: give the noisy stream real work
        with torch.no_grad():
            for block in model.blocks:
                for layer in block:
                    layer.ada.weight.normal_(0, 0.02)
    return model


def gen(model, prompt, n, kind, K):
    kw = {} if kind == "gpt" else {"num_iterations": K, "bridge": "hard"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # K < B warns that blocks are skipped
        return generate(model, prompt, n, SamplingParams(0.0), seed=0, **kw)


def timed(fn, repeats):
    """min over repeats of (cpu, wall) seconds."""
    best = None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        r = (time.process_time() - c0, time.perf_counter() - t0)
        best = r if best is None or r[0] < best[0] else best
    return best


def decode_speed(model, kind, batch, K, n, repeats):
    g = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, model.vocab_size, (batch, PROMPT), generator=g)
    gen(model, prompt, 4, kind, K)  # warm-up
    c1, w1 = timed(lambda: gen(model, prompt, 1, kind, K), repeats)
    cn, wn = timed(lambda: gen(model, prompt, n + 1, kind, K), repeats)
    return {"tok_s_cpu": batch * n / max(cn - c1, 1e-9), "tok_s_wall": batch * n / max(wn - w1, 1e-9),
            "ms_per_step_cpu": 1000 * (cn - c1) / n}


def kv_check(model, K, n_tokens=24):
    """Decode n tokens with K steps; report the declared and the actually held cache bytes per token."""
    max_len = PROMPT + n_tokens
    state = model.new_cache(1, max_len)
    idx = torch.randint(0, model.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = model.forward_cached(idx, state, num_iterations=K, bridge="hard", generator=g)
        for _ in range(n_tokens - 1):
            logits = model.forward_cached(logits[:, -1].argmax(-1, keepdim=True), state, num_iterations=K,
                                          bridge="hard", generator=g)
    caches = state.prelude + [c for block in state.blocks for c in block]
    held = sum(c.k.nbytes + c.v.nbytes for c in caches) / max_len
    filled = [block[0].length for block in state.blocks]
    return {"K": K, "declared_bytes_per_token": state.nbytes_per_token(), "held_bytes_per_token": held,
            "clean_inputs_bytes_per_token": state.clean_inputs.nbytes / max_len,
            "block_cache_lengths": filled, "history": int(state.lengths.max())}


@torch.no_grad()
def cached_vs_uncached(model, K):
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, model.vocab_size, (2, 12), generator=g)
    z = torch.randn(2, 1, D_MODEL, generator=g) * model.sched.sigma_max
    state = model.new_cache(2, 16)
    import inspect

    kw = "noise" if "noise" in inspect.signature(model.forward_cached).parameters else "z"  # renamed in 8306a19
    model.forward_cached(idx[:, :11], state, num_iterations=K, bridge="hard", **{kw: z})
    a = model.forward_cached(idx[:, 11:], state, num_iterations=K, bridge="hard", **{kw: z})
    b = model.next_logits_uncached(idx, K, "hard", z)
    return float((a - b).abs().max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32, help="new tokens timed per measurement")
    ap.add_argument("--repeats", type=int, default=2, help="timings per measurement (the fastest is kept)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.time()
    out = {"speed": [], "kv": [], "sanity": {}, "speed_vs_K": []}
    with torch.inference_mode(False), torch.no_grad():
        for V in (50257, 512):
            gpt, db = build("gpt", V), build("db_ar", V)
            for batch in (1, 8):
                g = decode_speed(gpt, "gpt", batch, None, args.tokens, args.repeats)
                d = decode_speed(db, "db_ar", batch, NUM_BLOCKS, args.tokens, args.repeats)
                table = db.target_table()  # bench-side patch: the normalised table computed once
                db.target_table = lambda: table
                dc = decode_speed(db, "db_ar", batch, NUM_BLOCKS, args.tokens, args.repeats)
                del db.target_table
                row = {"vocab": V, "batch": batch, "K": NUM_BLOCKS, "gpt": g, "db": d, "db_cached_table": dc,
                       "ratio_cpu": d["tok_s_cpu"] / g["tok_s_cpu"], "ratio_wall": d["tok_s_wall"] / g["tok_s_wall"],
                       "ratio_cached_table_cpu": dc["tok_s_cpu"] / g["tok_s_cpu"]}
                row["verdict"] = "PASS" if row["ratio_cpu"] >= TARGET else "MISS"
                out["speed"].append(row)
                print(f"  V={V} batch={batch}: gpt {g['tok_s_cpu']:.1f} tok/s, DB K=4 {d['tok_s_cpu']:.1f} tok/s "
                      f"-> {row['ratio_cpu']:.2f}x", flush=True)
            if V == 50257:
                gpt_kv = sum(c.nbytes_per_token() for c in gpt.new_cache(1, 8))
                out["gpt_kv_bytes_per_token"] = gpt_kv
                for K in (1, 2, 4, 8, 16):
                    out["kv"].append(kv_check(db, K))
                    out["speed_vs_K"].append({"K": K, **decode_speed(db, "db_ar", 1, K, max(8, args.tokens // 2), 1)})
                out["sanity"] = {f"max_abs_diff_K{K}": cached_vs_uncached(db, K) for K in (1, 4, 8)}

    kv_const = len({r["declared_bytes_per_token"] for r in out["kv"]}) == 1 and \
        len({r["held_bytes_per_token"] for r in out["kv"]}) == 1
    lines = [f"machine: {os.cpu_count()}-core CPU (shared), torch {torch.__version__}, {args.threads} thread, fp32, "
             f"{LAYERS} layers d {D_MODEL} {HEADS} heads, DB-AR B={NUM_BLOCKS}, greedy, hard bridge, prompt {PROMPT}, "
             f"{args.tokens} new tokens timed (prefill excluded); bench wall {time.time() - t_start:.0f}s", "",
             "| V | batch | gpt tok/s | DB (K=4) tok/s | DB/gpt (target ≥0.8) | DB/gpt wall-clock | ms/token gpt / DB "
             "| DB + cached target table (bench patch) tok/s, /gpt |",
             "|---|---|---|---|---|---|---|---|"]
    for r in out["speed"]:
        lines.append(f"| {r['vocab']} | {r['batch']} | {r['gpt']['tok_s_cpu']:.1f} | {r['db']['tok_s_cpu']:.1f} | "
                     f"**{r['ratio_cpu']:.2f}** {r['verdict']} | {r['ratio_wall']:.2f} | "
                     f"{r['gpt']['ms_per_step_cpu']:.1f} / {r['db']['ms_per_step_cpu']:.1f} | "
                     f"{r['db_cached_table']['tok_s_cpu']:.1f}, {r['ratio_cached_table_cpu']:.2f} |")
    lines += ["", f"KV cache bytes per token (V=50257, batch 1; gpt: {out['gpt_kv_bytes_per_token']} B/token):", "",
              "| K | DB declared B/token | DB held B/token | + clean_inputs buffer B/token | block cache lengths after "
              "decoding | DB tok/s (batch 1) |", "|---|---|---|---|---|---|"]
    for r, s in zip(out["kv"], out["speed_vs_K"]):
        lines.append(f"| {r['K']} | {r['declared_bytes_per_token']} | {r['held_bytes_per_token']:.0f} | "
                     f"{r['clean_inputs_bytes_per_token']:.0f} | {r['block_cache_lengths']} of {r['history']} | "
                     f"{s['tok_s_cpu']:.1f} |")
    lines += ["", f"KV bytes/token constant in K: {'PASS' if kv_const else 'MISS'}; "
              f"cached vs uncached logits max|diff|: " + ", ".join(f"{k} {v:.1e}" for k, v in out["sanity"].items()),
              "", "tok/s from CPU time of one thread (process_time; wall-clock ratio alongside)."]
    out["kv_constant_in_K"] = kv_const
    table = "\n".join(lines)
    out["table"] = table
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "db_decode.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
