"""Training cost and decode speed on a GPU, bf16 autocast (the last step of bench/gpu_check.sh): gpt vs db_ar
B = 4 (and target_fraction 0.25) at 12 x 768, seq 1024; huginn (r 32, k 8) vs looped_db at 2 + 4 + 2, d 512.
Activation memory = max_memory_allocated during forward + backward minus what was held before; step time =
`train_step`, CUDA-synchronised, mean after warm-up (a DB step trains one block).

    python bench/gpu_bench.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from looped_lm.config import config_from_dict
from looped_lm.engine.generate import generate
from looped_lm.sampling import SamplingParams
from looped_lm.models import build_model
from looped_lm.optim import BlockwiseAdamW, param_groups
from looped_lm.training import TorchRunner, train_step

AR = {"n_layers": 12, "d_model": 768, "n_heads": 12, "seq_len": 1024, "vocab_size": 50304}
LOOPED = {"n_prelude": 2, "n_layers": 4, "n_coda": 2, "d_model": 512, "n_heads": 8, "seq_len": 1024,
          "vocab_size": 50304}


def make(kind, model_extra, diffusion=None):
    m = {"kind": kind, **model_extra}
    vocab = m.pop("vocab_size")
    cfg = config_from_dict({"model": m, "diffusion": diffusion or {}})
    torch.manual_seed(0)
    return build_model(cfg, vocab).cuda()


def huginn_loss(model, r=32, k=8):
    """Huginn at a fixed recurrence (r iterations, gradients through the last k): comparable step times."""
    def loss(x, y, step, seed):
        logits = model(x, r, no_grad_iterations=r - k)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()), {}
    return loss


class MeasuredRunner(TorchRunner):
    """Records the memory that forward + backward added, before the optimiser step allocates anything."""

    def optimizer_step(self) -> None:
        self.peak = torch.cuda.max_memory_allocated() - self.base
        super().optimizer_step()


def measure_training(model, batch, steps, warmup, loss_fn=None):
    seq, vocab = model.seq_len, model.vocab_size
    opt = BlockwiseAdamW(param_groups(model, 0.1), lr=1e-4, fused=False, foreach=True)
    runner = MeasuredRunner(model, opt, grad_clip=0.0, loss_fn=loss_fn, amp_dtype=torch.bfloat16)
    x = torch.randint(0, vocab, (batch, seq), device=next(model.parameters()).device)
    y = torch.randint(0, vocab, (batch, seq), device=x.device)
    times, peaks, losses = [], [], []
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        runner.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        result = train_step(model, opt, runner, [(x, y)], step, 0)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            peaks.append(runner.peak)
            losses.append(float(result.loss))
    return {"step_ms": 1000 * sum(times) / len(times), "act_gib": max(peaks) / 2 ** 30,
            "tokens_per_s": batch * seq / (sum(times) / len(times))}


@torch.no_grad()
def measure_decode(model, batch, new_tokens, num_iterations=None):
    from looped_lm.models.contract import Iterative
    from looped_lm.settings import resolve_settings

    model.eval()
    limits = model.iteration_limits() if isinstance(model, Iterative) else None
    settings = resolve_settings(limits, num_iterations=num_iterations, sampling=SamplingParams(0.0))
    prompt = torch.randint(0, model.vocab_size, (batch, 16), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        generate(model, prompt, 8, settings, seed=0)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate(model, prompt, new_tokens, settings, seed=0)
        torch.cuda.synchronize()
    model.train()
    return batch * new_tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    rows, out = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch}

    def run(name, model, **kw):
        r = measure_training(model, args.batch, args.steps, args.warmup, **kw)
        out[name] = r
        rows.append((name, r))
        del model
        torch.cuda.empty_cache()
        return r

    gpt = run("gpt 12x768", make("gpt", AR))
    db = run("db_ar B=4", make("db_ar", AR, {"num_blocks": 4}))
    dbf = run("db_ar B=4 f=0.25", make("db_ar", AR, {"num_blocks": 4, "target_fraction": 0.25}))
    huginn = make("huginn", {**LOOPED, "mean_recurrence": 32, "backprop_depth": 8})
    hug = run("huginn r=32 k=8", huginn, loss_fn=huginn_loss(huginn))
    del huginn
    loop = run("looped_db", make("looped_db", LOOPED, {"num_blocks": 1}))
    loopf = run("looped_db f=0.25", make("looped_db", LOOPED, {"num_blocks": 1, "target_fraction": 0.25}))

    print("| model | step ms | tokens/s | activation GiB |")
    print("|---|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['act_gib']:.2f} |")
    ratios = {
        "db_mem_vs_gpt": db["act_gib"] / gpt["act_gib"],
        "db_f025_mem_vs_gpt": dbf["act_gib"] / gpt["act_gib"],
        "db_B_steps_time_vs_gpt": 4 * db["step_ms"] / gpt["step_ms"],
        "db_f025_B_steps_time_vs_gpt": 4 * dbf["step_ms"] / gpt["step_ms"],
        "huginn_time_vs_looped_db": hug["step_ms"] / loop["step_ms"],
        "huginn_mem_vs_looped_db": hug["act_gib"] / loop["act_gib"],
        "huginn_time_vs_looped_db_f025": hug["step_ms"] / loopf["step_ms"],
        "huginn_mem_vs_looped_db_f025": hug["act_gib"] / loopf["act_gib"],
    }
    out["ratios"] = ratios
    print("\n| ratio | value |\n|---|---:|")
    for k, v in ratios.items():
        print(f"| {k} | {v:.2f} |")

    decode = {}
    for batch in (1, 8):
        g = make("gpt", AR)
        decode[f"gpt b{batch}"] = measure_decode(g, batch, 64)
        del g
        d = make("db_ar", AR, {"num_blocks": 4})
        decode[f"db_ar K=4 b{batch}"] = measure_decode(d, batch, 64, num_iterations=4)
        del d
        torch.cuda.empty_cache()
    out["decode_tokens_per_s"] = decode
    print("\n| decode | tokens/s |\n|---|---:|")
    for k, v in decode.items():
        print(f"| {k} | {v:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
