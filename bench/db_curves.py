"""Short training curves on the embedded Bible corpus: gpt vs DiffusionBlocks-AR (B = 2, 4).

    python bench/db_curves.py                       # ~8-10 min on a shared 2-core CPU
    python bench/db_curves.py --steps 200 --runs gpt,db2

Data: `data.source: bible`, GPT-2 tokenizer, `ensure_prepared("bible", "data_cache", "gpt2", 0.05, 0)`,
batches from `TokenStream.get_batch(batch, seed=0, step, 0, 0)` (the SAME batches for every run).
Bench-side relabelling: the corpus uses only ~9.9k of the 50257 GPT-2 ids, so ids are mapped onto
that compact set before they reach the model (same tokens and targets, a 5x smaller softmax: the
tied head would otherwise be ~90% of the compute at d 128 and no run would fit its time budget).

Models (4 layers, d 128, 4 heads, seq 128, fp32): `gpt`; `db_ar` B=2 (2 layers per block) and
B=4 (1 layer per block), uniform block sampling, the config defaults otherwise.
Optimiser: `looped_lm.optim.BlockwiseAdamW` over `param_groups(model, 0.1)`; for DB every step
calls `set_active_units(model.step_units(step, seed))`, so only the chosen block and the shared
parameters (embedding/head, noise embedder, final norm) move. lr 3e-3, 30 warm-up steps, cosine
to 3e-4, betas (0.9, 0.95), grad clip 1.0. Every run sees the same number of tokens.

Evaluation every `--eval-every` steps on fixed val batches: gpt exact next-token loss; DB
log ppl@0 and log ppl@B from `model.eval_nll(x, y, k_grid=[B], draws=2, generator=g)` (mean
per-token NLL, nats). Writes bench/results/db_curves.json and bench/results/db_curves.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from looped_lm.config import config_from_dict
from looped_lm.data.bin_dataset import TokenStream
from looped_lm.data.prepare import ensure_prepared
from looped_lm.models import build_model
from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SEED = 0


def compact_vocab(data_dir: str):
    ids = np.unique(np.concatenate([np.unique(np.memmap(f"{data_dir}/{s}.bin", dtype=np.uint16, mode="r"))
                                    for s in ("train", "val")]))
    lut = torch.full((50257,), -1, dtype=torch.long)
    lut[torch.from_numpy(ids.astype(np.int64))] = torch.arange(len(ids))
    return lut, len(ids)


def make_model(kind: str, blocks: int, V: int, args):
    torch.manual_seed(SEED)
    cfg = config_from_dict({"model": {"kind": kind, "n_layers": 4, "d_model": 128, "n_heads": 4,
                                      "seq_len": args.seq},
                            "diffusion": {"num_blocks": blocks}})
    return build_model(cfg, V)


@torch.no_grad()
def evaluate(model, kind, blocks, val_batches):
    model.eval()
    out = {}
    if kind == "gpt":
        out["val_loss"] = float(np.mean([model(x, y)[1].item() for x, y in val_batches]))
    else:
        acc = {0: [], blocks: []}
        for i, (x, y) in enumerate(val_batches):
            g = torch.Generator().manual_seed(1000 + i)  # the same noise at every evaluation
            nll = model.eval_nll(x, y, k_grid=[blocks], draws=2, generator=g)
            for k in acc:
                acc[k].append(float(nll[k].mean()))
        out["log_ppl0"] = float(np.mean(acc[0]))
        out[f"log_ppl{blocks}"] = float(np.mean(acc[blocks]))
    model.train()
    return out


def train_run(name, kind, blocks, V, lut, train, val_batches, args):
    model = make_model(kind, blocks, V, args)
    opt = BlockwiseAdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                         fused=False, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_with_warmup(s, args.warmup, args.steps, args.lr, args.lr / 10) / args.lr)
    torch.manual_seed(SEED + 1)  # sigma / z / slot draws
    tokens_per_step = args.batch * args.seq
    log = {"name": name, "kind": kind, "blocks": blocks, "evals": [], "train": []}
    block_counts = [0] * blocks
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            e = evaluate(model, kind, blocks, val_batches)
            log["evals"].append({"step": step, "tokens": step * tokens_per_step, **e})
            print(f"  {name:<6} step {step:4d}  {json.dumps({k: round(v, 3) for k, v in e.items()})}  "
                  f"[{time.perf_counter() - t0:.0f}s]", flush=True)
        if step == args.steps:
            break
        if kind != "gpt":
            opt.set_active_units(model.step_units(step, SEED))
        x, y = train.get_batch(args.batch, SEED, step, 0, 0)
        x, y = lut[x], lut[y]
        opt.zero_grad(set_to_none=True)
        loss, metrics = model.training_loss(x, y, step=step, seed=SEED)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        opt.step()
        sched.step()
        b = metrics.get("block")
        if b is not None:
            block_counts[b] += 1
        log["train"].append({"step": step + 1, "loss": loss.item(), "block": b})
    log["wall_s"] = time.perf_counter() - t0
    log["cpu_s"] = time.process_time() - c0
    log["block_steps"] = block_counts
    log["tokens"] = args.steps * tokens_per_step
    return log


def plot(logs, args, V, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"gpt": "black", "db2": "tab:blue", "db4": "tab:red"}
    for log in logs:
        c = colors.get(log["name"], None)
        toks = [e["tokens"] / 1e3 for e in log["evals"]]
        if log["kind"] == "gpt":
            ax.plot(toks, [e["val_loss"] for e in log["evals"]], "-o", color=c, label="gpt: val loss (exact)")
        else:
            B = log["blocks"]
            ax.plot(toks, [e["log_ppl0"] for e in log["evals"]], "-o", color=c, label=f"DB B={B}: log ppl@0")
            ax.plot(toks, [e[f"log_ppl{B}"] for e in log["evals"]], "--s", color=c, alpha=0.7,
                    label=f"DB B={B}: log ppl@{B} (K={B} chain)")
        # train loss, EMA (DB: the CE of whichever block trained, at its own sigma)
        ema, ys, xs = None, [], []
        for r in log["train"]:
            ema = r["loss"] if ema is None else 0.95 * ema + 0.05 * r["loss"]
            ys.append(ema)
            xs.append(r["step"] * args.batch * args.seq / 1e3)
        ax2.plot(xs, ys, color=c, label=f"{log['name']} train loss (EMA 0.95)")
    ax.axhline(math.log(V), color="gray", lw=0.8, ls=":", label=f"uniform: ln {V}")
    ax.set_xlabel("training tokens (thousands)")
    ax.set_ylabel("nats / token")
    ax.set_title(f"held-out (lower is better): Bible val, GPT-2 ids compacted to {V}; {args.val_batches}x{args.batch}x{args.seq} tokens")
    vals = [v for log in logs for ev in log["evals"] for k, v in ev.items() if k not in ("step", "tokens")]
    ax.set_ylim(min(vals) - 0.3, max(vals) + 0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("training tokens (thousands)")
    ax2.set_ylabel("nats / token")
    ax2.set_title("training loss (DB: CE of the block trained that step, at its sigma)")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(f"gpt vs DiffusionBlocks-AR, 4 layers d 128, seq {args.seq}, batch {args.batch}, "
                 f"{args.steps} steps, lr {args.lr} cosine (CPU, torch {torch.__version__})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--val-batches", type=int, default=4)
    ap.add_argument("--runs", default="gpt,db2,db4", help="comma list of gpt, db2, db4")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "1")),
                    help="1 by default: on a 2-core box shared with other jobs one thread is as fast and steadier")
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from bench/results/db_curves.json")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads((RESULTS / "db_curves.json").read_text())
        plot(saved["runs"], argparse.Namespace(**saved["args"]), saved["vocab_compact"], RESULTS / "db_curves.png")
        return
    torch.set_num_threads(args.threads)
    os.chdir(ROOT)
    data_dir = ensure_prepared("bible", "data_cache", "gpt2", 0.05, 0, progress=False)
    lut, V = compact_vocab(data_dir)
    train = TokenStream(f"{data_dir}/train.bin", args.seq)
    val = TokenStream(f"{data_dir}/val.bin", args.seq)
    val_batches = [tuple(lut[t] for t in val.get_batch(args.batch, SEED, -1, i, 0)) for i in range(args.val_batches)]
    specs = {"gpt": ("gpt", 1), "db2": ("db_ar", 2), "db4": ("db_ar", 4)}
    logs = []
    t_start = time.time()
    for name in args.runs.split(","):
        kind, blocks = specs[name]
        logs.append(train_run(name, kind, blocks, V, lut, train, val_batches, args))
        print(f"  {name}: {logs[-1]['wall_s']:.0f}s wall, block steps {logs[-1]['block_steps']}", flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        plot(logs, args, V, RESULTS / "db_curves.png")

    lines = [f"data: bible (GPT-2 BPE, ids compacted to {V}), train {train.num_tokens} / val {val.num_tokens} tokens; "
             f"{args.steps} steps x {args.batch} x {args.seq} = {args.steps * args.batch * args.seq} tokens per run; "
             f"val {args.val_batches} x {args.batch} x {args.seq} tokens; torch {torch.__version__}, "
             f"{args.threads} thread(s); total {time.time() - t_start:.0f}s", "",
             "| run | tokens | val loss / log ppl@0 (nats) | ppl | log ppl@B (K=B chain) | ppl@B | block steps | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for log in logs:
        e = log["evals"][-1]
        if log["kind"] == "gpt":
            lines.append(f"| gpt | {log['tokens']} | {e['val_loss']:.3f} (exact) | {math.exp(e['val_loss']):.1f} | - | - | - | "
                         f"{log['wall_s']:.0f} |")
        else:
            B = log["blocks"]
            lines.append(f"| db_ar B={B} | {log['tokens']} | {e['log_ppl0']:.3f} (ppl@0, 2 draws) | "
                         f"{math.exp(e['log_ppl0']):.1f} | {e[f'log_ppl{B}']:.3f} | {math.exp(e[f'log_ppl{B}']):.1f} | "
                         f"{log['block_steps']} | {log['wall_s']:.0f} |")
    lines += ["", "curve (val, nats):"]
    for log in logs:
        key = "val_loss" if log["kind"] == "gpt" else "log_ppl0"
        lines.append(f"- {log['name']} {key}: " + ", ".join(f"{e['step']}:{e[key]:.3f}" for e in log["evals"]))
        if log["kind"] != "gpt":
            k = f"log_ppl{log['blocks']}"
            lines.append(f"- {log['name']} {k}: " + ", ".join(f"{e['step']}:{e[k]:.3f}" for e in log["evals"]))
    table = "\n".join(lines)
    print(table)
    (RESULTS / "db_curves.json").write_text(json.dumps({"args": vars(args), "vocab_compact": V, "runs": logs,
                                                        "table": table}, indent=1))


if __name__ == "__main__":
    main()
