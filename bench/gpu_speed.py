"""How fast a training step runs on this GPU: tokens/s, MFU and peak memory, beside what was expected
before any run. The first thing `bench/gpu_check.sh` runs (about 5 minutes on one H200, most of it compiling:
bench/results/gpu/README.md).

    python bench/gpu_speed.py --json out.json            # GPU: the GPT-2 shape, bf16, compiled
    python bench/gpu_speed.py --tiny --device cpu        # the same code at a toy shape (tests/test_bench.py)

Rows, at 12 x 768, 12 heads, T 1024, V 50257 (GPT-2 124M), bf16 autocast, `torch.compile` as the trainer
does it (looped_lm/compile.py), foreach/fused AdamW as the trainer picks it, batch `--batch`:
  gpt          the end-to-end model
  db_ar B=2    one DiffusionBlocks step (one block of 6 layers, both streams), blocks alternating
  db_ar B=4    the same with blocks of 3 layers
  gpt ckpt, db_ar B=4 ckpt    the same with `model.activation_checkpointing` and the chunked loss
               (`model.loss_chunk` 128: no T x V tensor is held), as train_memory.py measures memory on CPU
               (the target: DB below gpt)
Each: tokens/s (mean over timed steps after warm-up, CUDA-synchronised), MFU (looped_lm/mfu.py: the cost
model's FLOPs of each step over the device's dense bf16 peak), peak memory (torch.cuda.max_memory_allocated
over the timed steps, weights and optimizer state included), and the seconds the warm-up took (compiles).
A row that fails records its error and the next one runs; the JSON is rewritten after every row, so a run
stopped by its time limit keeps what it measured. `--decode` adds the engine's greedy decode of gpt (and db_ar, `--decode-kinds`) at that
shape, eager vs compiled (CUDA graphs through "reduce-overhead"), at `--decode-batches`, the tokens compared.

EXPECTED was written before this script first ran on a GPU (the checkpointing rows' too): nanoGPT's 124M reaches ~50 % MFU on an A100
with compile and flash attention; ours should reach at least 40 % on an H200 at batch 16. A DB step runs
one block in two streams over 2T tokens, plus the head and the likelihood terms at V = 50257: its MFU is
expected lower (the vocabulary terms are a larger share of a smaller step), at least 25 %.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from looped_lm.compile import compile_for_training
from looped_lm.config import config_from_dict
from looped_lm.kinds import get_kind
from looped_lm.mfu import StepFlops, peak_flops
from looped_lm.models import build_model
from looped_lm.optim import BlockwiseAdamW, adamw_implementation, param_groups
from looped_lm.training import TorchRunner, train_step

GPT2 = {"n_layers": 12, "d_model": 768, "n_heads": 12, "seq_len": 1024}
TINY = {"n_layers": 4, "d_model": 64, "n_heads": 4, "seq_len": 64}
SMALL = {"n_layers": 6, "d_model": 384, "n_heads": 6, "seq_len": 256}  # the CPU's comparison shape (step_vs_llama)
# looped_db's expectation written 2026-12-04, before any run of the row: a DB step's (its core is one block)
EXPECTED_MFU = {"gpt": 0.40, "db_ar B=2": 0.25, "db_ar B=4": 0.25, "gpt ckpt": 0.30, "db_ar B=4 ckpt": 0.20,
                "looped_db": 0.25}
B2, B4 = {"num_blocks": 2, "block_sampling": "round_robin"}, {"num_blocks": 4, "block_sampling": "round_robin"}
LEAN = {"activation_checkpointing": True, "loss_chunk": 128}
ROWS = {"gpt": ("gpt", {}, {}), "db_ar B=2": ("db_ar", B2, {}), "db_ar B=4": ("db_ar", B4, {}),
        "gpt ckpt": ("gpt", {}, LEAN), "db_ar B=4 ckpt": ("db_ar", B4, LEAN),
        "looped_db": ("looped_db", {"num_blocks": 1}, {"n_prelude": 1, "n_coda": 1})}
DEFAULT_ROWS = ["gpt", "db_ar B=2", "db_ar B=4"]


def measure(name: str, shape: dict, vocab: int, batch: int, steps: int, warmup: int, device: torch.device,
            compile_: bool, profile: bool = False) -> dict:
    kind, diffusion, lean = ROWS[name]
    cfg = config_from_dict({"model": {"kind": kind, **shape, **lean}, "train": {"batch_size": batch},
                            **({"diffusion": diffusion} if diffusion else {})})
    torch.manual_seed(0)
    model = build_model(cfg, vocab).to(device).train()
    if compile_:
        compile_for_training(model, get_kind(kind))
    opt = BlockwiseAdamW(param_groups(model, 0.1), adamw_implementation(device.type), lr=1e-4)
    amp = torch.bfloat16 if device.type == "cuda" else None
    runner = TorchRunner(model, opt, amp_dtype=amp)
    x = torch.randint(0, vocab, (batch, shape["seq_len"]), device=device)
    y = torch.randint(0, vocab, (batch, shape["seq_len"]), device=device)
    flops = StepFlops(cfg, vocab)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for step in range(warmup):  # compiles every block's graph
        train_step(model, opt, runner, [(x, y)], step, 0)
    sync()
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    total, start = 0.0, time.perf_counter()
    for step in range(warmup, warmup + steps):
        result = train_step(model, opt, runner, [(x, y)], step, 0)
        total += flops(result.metrics.get("block"))
    sync()
    seconds = time.perf_counter() - start
    peak = peak_flops(device, torch.bfloat16 if amp else torch.float32)
    row = {"row": name, "tokens_per_s": steps * batch * shape["seq_len"] / seconds,
           "step_ms": 1000 * seconds / steps, "flops_per_s": total / seconds,
           "mfu": total / seconds / peak if peak else None, "expected_mfu": EXPECTED_MFU[name],
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None,
           "loss": float(result.loss), "warmup_s": warmup_s}
    row["met"] = None if row["mfu"] is None else row["mfu"] >= row["expected_mfu"]
    if profile:
        row["profile"] = top_ops(lambda s: train_step(model, opt, runner, [(x, y)], s, 0), warmup + steps, device)
    return row


def top_ops(step_fn, first_step: int, device: torch.device, steps: int = 3, top: int = 15) -> list[dict]:
    """Where a step's time goes: the `top` operators by self time on the device (CPU time on a CPU) over
    `steps` profiled steps, per step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for s in range(first_step, first_step + steps):
            step_fn(s)
        if cuda:
            torch.cuda.synchronize()

    def self_us(e) -> float:  # the device-time attribute was renamed across torch versions
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    events = sorted(prof.key_averages(), key=self_us, reverse=True)[:top]
    return [{"op": e.key, "ms_per_step": self_us(e) / 1000 / steps, "calls_per_step": e.count / steps}
            for e in events]


DECODE_KINDS = {  # the decoded model: gpt, or db_ar with B = 2 at K = 2 (each block call compiled)
    "gpt": ({"kind": "gpt"}, None, None),
    "db_ar": ({"kind": "db_ar"}, {"num_blocks": 2}, 2),
}


def decode_row(shape: dict, vocab: int, batch: int, device: torch.device, prompt: int = 16, new: int = 48,
               kind: str = "gpt") -> dict:
    """The engine's greedy decode of an untrained `kind` (bf16 weights on CUDA), eager then compiled, in a pool of
    prompt + new + 1 positions: tokens/s of the new tokens (a 1-token run's time, the prefill, subtracted)."""
    from looped_lm.engine.engine import Engine, Request
    from looped_lm.sampling import GREEDY

    torch.manual_seed(0)
    model_section, diffusion, K = DECODE_KINDS[kind]
    sections = {"model": {**model_section, **shape}, **({"diffusion": diffusion} if diffusion else {})}
    model = build_model(config_from_dict(sections), vocab).to(device).eval()
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(batch)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    row = {"kind": kind, "batch": batch, "new_tokens": new, "num_iterations": K}
    tokens = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        start = time.perf_counter()
        engine = Engine(model, num_slots=batch, max_len=prompt + new + 1, compile_decode=compiled)

        def timed(n):
            sync()
            t = time.perf_counter()
            outs = engine.run([Request(prompt=p, max_tokens=n, seed=0, sampling=GREEDY, num_iterations=K)
                               for p in prompts])
            sync()
            return time.perf_counter() - t, [o.token_ids for o in outs]

        _, tokens[name] = timed(new)
        row[f"{name}_build_s"] = time.perf_counter() - start
        best = min(timed(new)[0] - timed(1)[0] for _ in range(3))
        row[f"{name}_tokens_per_s"] = batch * (new - 1) / max(best, 1e-9)
    row["compiled_vs_eager"] = row["compiled_tokens_per_s"] / row["eager_tokens_per_s"]
    row["same_tokens"] = tokens["eager"] == tokens["compiled"]
    pairs = [(a, b) for ea, ca in zip(tokens["eager"], tokens["compiled"]) for a, b in zip(ea, ca)]
    row["token_agreement"] = sum(a == b for a, b in pairs) / len(pairs)  # bf16 kernels may flip near-ties
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a toy shape (the code path on CPU, no claim)")
    p.add_argument("--small", action="store_true", help="6 x 384, T 256, V 50257: the shape CPU comparisons use")
    p.add_argument("--compile-vs-eager", action="store_true",
                   help="each row eager, then compiled: compiled_vs_eager, the speed ratio (the rows' MFU: compiled)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8, help="steps before timing (compiles each DB block's graph)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--backend", default=None,
                   help="torch.compile backend for the rows and the compiled decode (default inductor; the CPU dry "
                        "run of bench/gpu_check.sh takes aot_eager: the same graphs, no code generation)")
    p.add_argument("--json", default=None)
    p.add_argument("--rows", nargs="*", default=DEFAULT_ROWS, choices=list(ROWS), metavar="ROW",
                   help=f"rows to run, in order (default: {', '.join(DEFAULT_ROWS)}; all: {', '.join(ROWS)})")
    p.add_argument("--profile", nargs="*", default=[], choices=list(ROWS), metavar="ROW",
                   help="rows whose top operators by device time (3 steps, torch.profiler) go into their JSON row")
    p.add_argument("--decode", action="store_true", help="also the engine's decode, eager vs compiled")
    p.add_argument("--decode-kinds", nargs="+", default=["gpt"], choices=list(DECODE_KINDS),
                   help="models decoded (db_ar: B = 2 at K = 2; 4 graphs per bucket)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16],
                   help="decode batch sizes (each compiles one graph per power-of-two bucket up to it: ~40 s each "
                        "on an H200)")
    args = p.parse_args(argv)
    if args.backend:
        import looped_lm.compile
        import looped_lm.engine.compiled

        looped_lm.compile.BACKEND = looped_lm.engine.compiled.BACKEND = args.backend
    device = torch.device(args.device)
    shape, vocab = (TINY, 257) if args.tiny else (SMALL, 50257) if args.small else (GPT2, 50257)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "shape": shape, "vocab": vocab, "batch": args.batch, "compiled": not args.no_compile,
              "torch": torch.__version__, "rows": [], "decode": []}

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    for name in args.rows:
        try:
            eager = measure(name, shape, vocab, args.batch, args.steps, args.warmup, device, False) \
                if args.compile_vs_eager else None
            row = measure(name, shape, vocab, args.batch, args.steps, args.warmup, device, not args.no_compile,
                          profile=name in args.profile)
            if eager:
                row.update(eager_tokens_per_s=eager["tokens_per_s"],
                           compiled_vs_eager=row["tokens_per_s"] / eager["tokens_per_s"])
        except Exception as e:  # noqa: BLE001 - a GPU check reports every row it can
            row = {"row": name, "error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"| {name} | failed: {row['error'][:300]} |", flush=True)
        else:
            mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f} %"
            mem = "n/a" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.1f} GiB"
            print(f"| {name} | {row['tokens_per_s']:,.0f} tok/s | MFU {mfu} (expected >= "
                  f"{100 * row['expected_mfu']:.0f} %) | peak {mem} | warm-up {row['warmup_s']:.0f} s |", flush=True)
        result["rows"].append(row)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.decode:
        for kind, batch in ((k, b) for k in args.decode_kinds for b in args.decode_batches):
            try:
                row = decode_row(shape, vocab, batch, device, kind=kind)
            except Exception as e:  # noqa: BLE001
                row = {"kind": kind, "batch": batch, "error": f"{type(e).__name__}: {e}"[:2000]}
            print("decode", row, flush=True)
            result["decode"].append(row)
            save()
    return 1 if any("error" in r for r in result["rows"] + result["decode"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
