"""Training-step throughput and peak memory of the GPT baseline, at two sizes.

    python bench/train_step.py [--steps N] [--warmup W] [--json out.json] [--vocab V] [--device cpu]

One step = the trainer's `train_step` (looped_lm/training.py): forward + backward + global-norm clip +
the trainer's optimiser (BlockwiseAdamW over the trainer's parameter groups), on a fixed random batch of
`batch x seq` tokens, fp32. Plain PyTorch (`TorchRunner`): the DeepSpeed engine's own overhead is not
included. Warm-up steps are excluded from the timing.

Memory: each size runs in a fresh subprocess; peak memory is the process's max resident set size
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`), reported both as the absolute peak and as the growth over
the baseline measured after imports and before the model is built (weights + grads + AdamW state +
activations + allocator slack). On CUDA, torch.cuda.max_memory_allocated is reported instead.
Absolute numbers are only meaningful on the machine they come from; compare rows within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

SIZES = [  # (name, d_model, n_layers, n_heads)
    ("gpt d128 x 4", 128, 4, 4),
    ("gpt d256 x 6", 256, 6, 8),
]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def worker(args) -> dict:
    """Measure one size in this (fresh) process; return a result row."""
    import torch

    from looped_lm.models.gpt import GPT
    from looped_lm.optim import BlockwiseAdamW, param_groups
    from looped_lm.training import TorchRunner, train_step

    device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    baseline = _rss_mib()
    torch.manual_seed(0)
    model = GPT(args.layers, args.d_model, args.heads, args.seq, args.vocab).to(device).train()
    params = sum(p.numel() for p in model.parameters())
    opt = BlockwiseAdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=False,
                         foreach=False)
    runner = TorchRunner(model, opt, grad_clip=1.0)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = data[:, :-1], data[:, 1:]
    steps_done = [0]

    def step():
        steps_done[0] += 1
        return train_step(model, opt, runner, [(x, y)], steps_done[0], 0).loss

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses = []
    t0 = time.perf_counter()
    # stop early once the time budget is spent (at least one timed step): slow machines stay bounded
    while len(losses) < args.steps and (not losses or time.perf_counter() - t0 < args.max_seconds):
        losses.append(step())
        if device.type == "cuda":
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    steps = len(losses)
    tokens = steps * args.batch * args.seq
    row = {
        "model": args.name, "d_model": args.d_model, "n_layers": args.layers, "params": params,
        "vocab": args.vocab, "seq": args.seq, "batch": args.batch, "warmup": args.warmup,
        "device": str(device), "threads": torch.get_num_threads(),
        "steps": steps, "step_ms": 1000 * elapsed / steps, "tokens_per_s": tokens / elapsed,
        "first_loss": losses[0], "last_loss": losses[-1],
    }
    if device.type == "cuda":
        row.update(memory="torch.cuda.max_memory_allocated", peak_mib=torch.cuda.max_memory_allocated() / 2**20,
                   delta_mib=None)
    else:
        peak = _rss_mib()
        row.update(memory="ru_maxrss", peak_mib=peak, delta_mib=peak - baseline)
    return row


def run_size(name, d_model, layers, heads, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--name", name, "--d-model", str(d_model),
           "--layers", str(layers), "--heads", str(heads), "--seq", str(args.seq), "--batch", str(args.batch),
           "--vocab", str(args.vocab), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--max-seconds", str(args.max_seconds), "--threads", str(args.threads), "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {name} worker failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    mem = rows[0]["memory"]
    head = ("| model | params | seq x batch | step ms | tokens/s | peak MiB | growth MiB | loss first -> last |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:  # steps timed may differ per size when --max-seconds cut a size short
        delta = "-" if r["delta_mib"] is None else f"{r['delta_mib']:.0f}"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['seq']} x {r['batch']} | {r['step_ms']:.1f} "
                     f"| {r['tokens_per_s']:,.0f} | {r['peak_mib']:.0f} | {delta} "
                     f"| {r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    r0 = rows[0]
    lines.append("")
    timed = ", ".join(f"{r['steps']}" for r in rows)
    lines.append(f"fp32, vocab {r0['vocab']}, device {r0['device']}, {r0['threads']} threads, timed steps {timed} "
                 f"after {r0['warmup']} warm-up; one step = fwd + bwd + clip + AdamW (no DeepSpeed engine). "
                 f"Memory: {mem}" + (" of a fresh process per size; growth = peak minus the RSS after imports."
                                     if mem == "ru_maxrss" else "."))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed steps per size, at most (default 8)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps (default 1)")
    p.add_argument("--max-seconds", type=float, default=15.0,
                   help="stop timing a size after this many seconds, once one step is done (default 15)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=257, help="257 = the byte tokenizer; 50304 for GPT-2 sized heads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads; 0 = torch's default (all cores). On a shared machine use 1: "
                        "OpenMP threads competing with other processes can make steps 10x slower")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--timeout", type=int, default=300, help="seconds per size")
    # worker mode (one size, in a fresh process)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--d-model", type=int, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    rows = [run_size(name, d, layers, heads, args) for name, d, layers, heads in SIZES]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "train_step", "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
