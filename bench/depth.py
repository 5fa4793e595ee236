"""The depth study (docs/results.md §1): does DiffusionBlocks lose where depth matters, and does
`diffusion.context: stacked` (block b continues from the clean states of blocks < b) close the gap?

    python bench/depth.py data                                  # BPE + splits, cached in bench/work/depth/
    python bench/depth.py run criterion --lanes 2               # gpt 2 / 4 / 8 layers, 3 seeds
    python bench/depth.py run lr --lanes 2                      # the learning-rate sweep (dev half)
    python bench/depth.py run main --lanes 2                    # db_ar independent vs stacked, gpt
    python bench/depth.py report                                # bench/results/depth/report.md
    python bench/depth.py run main --smoke                      # a few steps of everything

Regime, chosen before any DiffusionBlocks run by one criterion (stated in the report): end-to-end gpt
must improve with depth (2 -> 4 -> 8 layers) at equal training FLOPs by more than the seed spread (3
seeds, non-overlapping 95 % intervals on the test half). Data: every offline corpus the project reads
(the King James Bible and Shakespeare's works, split by document, 1 in 10 held out); a byte-level BPE
vocabulary trained on the training documents only with Hugging Face `tokenizers`; d 128, 4 heads,
context 128 tokens, batch 16.

Protocol: equal training FLOPs, counted by torch's FlopCounterMode on each model's real training step
(every block's own step for DiffusionBlocks: a stacked block b also runs blocks < b forward, and an
uneven split is exact); each run its own full schedule (linear warm-up over 5 % of its steps, cosine to
lr / 10); AdamW (idle blocks untouched), wd 0.1, clip 1.0; `block_sampling: uniform` (every block an
equal share of steps; no validation data steers training). Learning rates are chosen on the dev half
of the held-out documents; every verdict is on the test half. gpt is scored exactly on every test
window; db_ar by ppl@0 (one call at the top of the noise range, 2 antithetic draws) on every test window
and by ppl@B (the K = B sampler, the unbiased estimator, 4 draws) on a subset, each with its standard
error. Ratios are paired per seed (same data order, same init seed).

Outputs: bench/results/depth/<study>/<run>__lr<lr>__s<seed>.json (config, FLOPs, steps, CPU seconds,
scores); report.md from them. One torch thread per process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from looped_lm.config import config_from_dict
from looped_lm.data.sources import iter_documents
from looped_lm.models import build_model
from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups
from looped_lm.settings import ScoreSettings
from looped_lm.training import TorchRunner, train_step

ROOT = Path(__file__).resolve().parent
WORK = ROOT / "work" / "depth"
RESULTS = ROOT / "results" / "depth"
VOCAB, SEQ, BATCH, D, HEADS = 2048, 128, 16, 128, 4
BUDGET = 6.0e12  # training FLOPs per run (about 700 steps of the 4-layer gpt)
LRS = (1e-3, 2e-3, 4e-3)
DB = {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False, "bridge": "sample",
      "block_sampling": "uniform", "last_call": "sigma_min"}

RUNS = {  # name -> (model overrides, diffusion overrides)
    "gpt_L2": ({"kind": "gpt", "n_layers": 2}, {}),
    "gpt_L4": ({"kind": "gpt", "n_layers": 4}, {}),
    "gpt_L8": ({"kind": "gpt", "n_layers": 8}, {}),
    "db_L4_B2_independent": ({"kind": "db_ar", "n_layers": 4}, {"num_blocks": 2, "context": "independent"}),
    "db_L4_B2_stacked": ({"kind": "db_ar", "n_layers": 4}, {"num_blocks": 2, "context": "stacked"}),
    "db_L8_B4_independent": ({"kind": "db_ar", "n_layers": 8}, {"num_blocks": 4, "context": "independent"}),
    "db_L8_B4_stacked": ({"kind": "db_ar", "n_layers": 8}, {"num_blocks": 4, "context": "stacked"}),
}
STUDY_BUDGET = {"lr": 0.5}  # the sweep runs at half the budget, with its own full schedule (this machine's limit)
STUDIES = {  # study -> [(run, lr, seeds)]
    "criterion": [(r, 2e-3, (0, 1, 2)) for r in ("gpt_L2", "gpt_L4", "gpt_L8")],
    "lr": [(r, lr, (0,)) for lr in LRS for r in ("gpt_L8", "db_L8_B4_independent", "db_L8_B4_stacked")],
    "main": [(r, None, (0, 1, 2)) for r in ("gpt_L8", "db_L8_B4_independent", "db_L8_B4_stacked", "gpt_L4",
                                           "db_L4_B2_independent", "db_L4_B2_stacked")],
}


# --- data ---------------------------------------------------------------------------------------------

def documents() -> list[str]:
    return [d for source in ("bible", "shakespeare") for d in iter_documents(source)]


def prepare() -> dict:
    """Train a byte-level BPE on the training documents; token arrays of train / dev / test (cached)."""
    meta_path = WORK / "meta.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    from tokenizers import ByteLevelBPETokenizer

    WORK.mkdir(parents=True, exist_ok=True)
    docs = documents()
    held = [i for i in range(len(docs)) if i % 10 == 5]  # every tenth document, offset 5
    split = {i: ("dev" if j % 2 == 0 else "test") for j, i in enumerate(held)}
    train_docs = [d for i, d in enumerate(docs) if i not in split]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(train_docs, vocab_size=VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"])
    tok.save(str(WORK / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    arrays = {"train": [], "dev": [], "test": []}
    for i, d in enumerate(docs):
        arrays[split.get(i, "train")].append(np.array(tok.encode(d).ids + [eot], dtype=np.uint16))
    meta = {"vocab": tok.get_vocab_size(), "documents": {k: sum(1 for i in range(len(docs)) if split.get(i, "train") == k)
                                                          for k in arrays}}
    for k, parts in arrays.items():
        a = np.concatenate(parts)
        np.save(WORK / f"{k}.npy", a)
        meta.setdefault("tokens", {})[k] = int(a.size)
    meta["bytes_per_token"] = sum(len(d.encode()) for d in train_docs) / meta["tokens"]["train"]
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def tokens(split: str) -> torch.Tensor:
    return torch.from_numpy(np.load(WORK / f"{split}.npy").astype(np.int64))


def train_batch(data: torch.Tensor, seed: int, step: int):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - SEQ - 1, (BATCH,), generator=g)
    idx = starts[:, None] + torch.arange(SEQ + 1)
    seq = data[idx]
    return seq[:, :-1], seq[:, 1:]


def windows(data: torch.Tensor, limit: int | None = None):
    """Disjoint SEQ-token windows of a held-out split (x, y), all of them or the first `limit`."""
    n = (data.numel() - 1) // SEQ
    if limit:
        n = min(n, limit)
    x = data[: n * SEQ].view(n, SEQ)
    y = data[1: n * SEQ + 1].view(n, SEQ)
    return x, y


# --- models, FLOPs ------------------------------------------------------------------------------------

def config(name: str, vocab: int):
    model, diffusion = RUNS[name]
    return config_from_dict({"model": {"d_model": D, "n_heads": HEADS, "seq_len": SEQ, "init_std": 0.02, **model},
                             "diffusion": {**DB, **diffusion} if model["kind"] == "db_ar" else {}})


def step_flops(model, x, y) -> float:
    """Mean training FLOPs per step (forward + backward), over the blocks a step may train."""
    units = len(model.blocks) if hasattr(model, "objective") else 1
    costs = []
    for b in range(units):
        step = next(s for s in range(1000) if units == 1 or model.choose_block(s, 0) == b)
        with FlopCounterMode(display=False) as counter:
            loss, _ = model.training_loss(x, y, step, 0)
            loss.backward()
        model.zero_grad(set_to_none=True)
        costs.append(counter.get_total_flops())
    return sum(costs) / len(costs), costs


# --- one run --------------------------------------------------------------------------------------------

def result_path(study: str, name: str, lr: float, seed: int, smoke: bool) -> Path:
    return (WORK / "smoke" if smoke else RESULTS) / study / f"{name}__lr{lr:g}__s{seed}.json"


@torch.no_grad()
def score(model, split: str, final: bool, smoke: bool) -> dict:
    x, y = windows(tokens(split), 8 if smoke else None)
    out, kind = {}, "gpt" if not hasattr(model, "objective") else "db"
    g = torch.Generator().manual_seed(1234)
    chunks = range(0, x.shape[0], 32)
    if kind == "gpt":
        nll = torch.cat([model.score(x[i:i + 32], y[i:i + 32], ScoreSettings())["exact"].nll for i in chunks])
        out["nll"] = float(nll.mean())
        out["se"] = float(nll.mean(1).std() / math.sqrt(nll.shape[0]))  # over windows
        out["tokens"] = int(nll.numel())
        return out
    parts = [model.score(x[i:i + 32], y[i:i + 32], ScoreSettings(k_grid=(), draws=2), g)[0] for i in chunks]
    nll = torch.cat([p.nll for p in parts])
    out["nll"] = float(nll.mean())
    out["se"] = float(nll.mean(1).std() / math.sqrt(nll.shape[0]))
    out["tokens"] = int(nll.numel())
    if final:  # the K = B sampler on a subset: 16 windows, 4 draws, the estimator's own standard error
        B = len(model.blocks)
        xs, ys = x[:2 if smoke else 16], y[:2 if smoke else 16]
        s = model.score(xs, ys, ScoreSettings(k_grid=(B,), draws=4), g)
        out[f"chain_K{B}"] = {"nll": float(s[B].nll.mean()), "est_se": float(s[B].nll_var.sum().sqrt() / s[B].nll.numel()),
                              "nll_at0_same_windows": float(s[0].nll.mean()), "tokens": int(s[B].nll.numel())}
    return out


def run_one(study: str, name: str, lr: float, seed: int, smoke: bool) -> dict:
    torch.set_num_threads(1)
    meta = prepare()
    cfg = config(name, meta["vocab"])
    torch.manual_seed(seed)
    model = build_model(cfg, meta["vocab"])
    train = tokens("train")
    x0, y0 = train_batch(train, 99, 0)
    per_step, per_block = step_flops(model, x0, y0)
    budget = BUDGET * STUDY_BUDGET.get(study, 1.0)
    steps = 4 if smoke else int(budget // per_step)
    warmup = max(1, round(0.05 * steps))
    opt = BlockwiseAdamW(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95))
    runner = TorchRunner(model, opt, grad_clip=1.0, seed=seed)
    model.train()
    t0, curve = time.process_time(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_with_warmup(step, warmup, steps, lr, lr / 10)
        result = train_step(model, opt, runner, [train_batch(train, seed, step)], step, seed)
        if not math.isfinite(result.loss):
            curve.append((step, float(result.loss)))
            break
        if step % max(1, steps // 20) == 0:
            curve.append((step, round(float(result.loss), 4)))
    cpu = time.process_time() - t0
    model.eval()
    out = {"study": study, "run": name, "lr": lr, "seed": seed, "budget_flops": budget, "steps": steps,
           "flops_per_step": per_step,
           "flops_per_block_step": per_block, "train_flops": per_step * steps, "train_cpu_s": round(cpu, 1),
           "cpu_s_per_step": round(cpu / max(steps, 1), 4), "train_curve": curve,
           "config": cfg.model_dump(), "data": meta, "diverged": not math.isfinite(float(result.loss)),
           "dev": score(model, "dev", False, smoke), "test": score(model, "test", True, smoke)}
    return out


# --- studies --------------------------------------------------------------------------------------------

def best_lr(name: str) -> float:
    """The learning rate of `name` (or of the same kind at L8, for the sweep's nearest row) with the lowest
    dev NLL in the sweep."""
    kind = "gpt" if name.startswith("gpt") else ("stacked" if name.endswith("stacked") else "independent")
    rows = [json.loads(p.read_text()) for p in (RESULTS / "lr").glob("*.json")]
    rows = [r for r in rows if (r["run"].startswith("gpt") if kind == "gpt" else r["run"].endswith(kind))
            and not r["diverged"]]
    if not rows:
        raise SystemExit(f"no learning-rate sweep for {name} yet: run `python bench/depth.py run lr` first")
    return min(rows, key=lambda r: r["dev"]["nll"])["lr"]


def jobs(study: str, smoke: bool) -> list[tuple[str, float, int]]:
    out = []
    for name, lr, seeds in STUDIES[study]:
        lr = lr if lr is not None else best_lr(name)
        for seed in seeds:
            done = [result_path(s, name, lr, seed, smoke) for s in (study, "criterion")]  # gpt rows are shared
            if not any(p.is_file() for p in done):
                out.append((name, lr, seed))
    return out


def run_study(study: str, lanes: int, smoke: bool) -> None:
    prepare()
    todo = jobs(study, smoke)
    print(f"{study}: {len(todo)} runs to do", flush=True)
    running: list = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    while todo or running:
        while todo and len(running) < lanes:
            name, lr, seed = todo.pop(0)
            args = [sys.executable, __file__, "one", study, name, str(lr), str(seed)] + (["--smoke"] if smoke else [])
            running.append((subprocess.Popen(args, env=env), name, seed))
        time.sleep(2)
        for job in list(running):
            if job[0].poll() is not None:
                running.remove(job)
                print(f"  {job[1]} seed {job[2]}: exit {job[0].returncode}", flush=True)


def one(study: str, name: str, lr: float, seed: int, smoke: bool) -> None:
    path = result_path(study, name, lr, seed, smoke)
    out = run_one(study, name, lr, seed, smoke)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)
    print(f"{path.name}: dev {out['dev']['nll']:.4f} test {out['test']['nll']:.4f} ({out['steps']} steps, "
          f"{out['train_cpu_s']:.0f} CPU-s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("data")
    r = sub.add_parser("run")
    r.add_argument("study", choices=STUDIES)
    r.add_argument("--lanes", type=int, default=1)
    r.add_argument("--smoke", action="store_true")
    o = sub.add_parser("one")
    o.add_argument("study")
    o.add_argument("name", choices=RUNS)
    o.add_argument("lr", type=float)
    o.add_argument("seed", type=int)
    o.add_argument("--smoke", action="store_true")
    sub.add_parser("report")
    a = p.parse_args()
    if a.cmd == "data":
        print(json.dumps(prepare(), indent=1))
    elif a.cmd == "run":
        run_study(a.study, a.lanes, a.smoke)
    elif a.cmd == "one":
        one(a.study, a.name, a.lr, a.seed, a.smoke)
    else:
        from depth_report import write_report

        write_report(RESULTS)


if __name__ == "__main__":
    main()
