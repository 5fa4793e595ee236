"""Our gpt training step against transformers' LlamaForCausalLM at the same shape (6 x 384, T 256, V 50257,
batch 2, foreach AdamW, one thread), eager and compiled, interleaved, min over rounds; ours / Llama. The target
(bench/README.md): ours at least 1.0x Llama's speed, eager and with both compiled.

    python bench/step_vs_llama.py [--json bench/results/step_vs_llama.json] [--rounds 3] [--no-compile] [--profile]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import time

import torch

SHAPE = dict(layers=6, d=384, heads=6, ffn=1024, seq=256, batch=2, vocab=50257)


def ours(shape):
    from looped_lm.config import config_from_dict
    from looped_lm.models import build_model

    cfg = config_from_dict({"model": {"kind": "gpt", "n_layers": shape["layers"], "d_model": shape["d"],
                                      "n_heads": shape["heads"], "ffn_hidden": shape["ffn"], "seq_len": shape["seq"]}})
    torch.manual_seed(0)
    model = build_model(cfg, shape["vocab"]).train()
    return model, lambda x, y: model.training_loss(x, y, 0, 0)[0]


def llama(shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["d"], intermediate_size=shape["ffn"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["heads"], max_position_embeddings=shape["seq"],
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    return model, lambda x, y: model(input_ids=x, labels=y).loss


def stepper(build, shape, compiled: bool):
    model, loss_fn = build(shape)
    if compiled:
        loss_fn = torch.compile(loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)

    def step():
        loss = loss_fn(x, x)  # timing only: which token is the target does not change the work
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, sum(p.numel() for p in model.parameters())


def time_steps(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def top_ops(step, top: int = 12) -> list[dict]:
    """One profiled step: the operators (compiled kernels included) with the most self CPU time."""
    with torch.profiler.profile() as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key[:80], "ms": e.self_cpu_time_total / 1000, "calls": e.count} for e in events]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="each model's top operators in each mode (where the difference goes), into the JSON")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = {"shape": SHAPE, "threads": 1, "torch": torch.__version__, "modes": {}}
    for compiled in ([False] if args.no_compile else [False, True]):
        pair = {name: stepper(build, SHAPE, compiled) for name, build in (("ours", ours), ("llama", llama))}
        for step, _ in pair.values():
            for _ in range(args.warmup):  # compiles on the first call
                step()
        best = {name: float("inf") for name in pair}
        for _ in range(args.rounds):  # interleaved
            for name, (step, _) in pair.items():
                best[name] = min(best[name], time_steps(step, args.steps))
        mode = "compiled" if compiled else "eager"
        result["modes"][mode] = {"seconds_per_step": best, "ratio_ours_over_llama": best["ours"] / best["llama"],
                                 "parameters": {name: n for name, (_, n) in pair.items()}}
        if args.profile:
            result["modes"][mode]["profile_top"] = {name: top_ops(step) for name, (step, _) in pair.items()}
        print(f"{mode}: ours {best['ours']:.3f} s, llama {best['llama']:.3f} s, ours/llama "
              f"{best['ours'] / best['llama']:.3f}", flush=True)
    if not args.no_compile:
        e, c = result["modes"]["eager"]["seconds_per_step"], result["modes"]["compiled"]["seconds_per_step"]
        result["compiled_speedup"] = {name: e[name] / c[name] for name in e}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
