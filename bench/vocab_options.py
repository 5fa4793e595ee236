"""Quality and cost of the vocabulary-scale options at equal counted FLOPs.

    python bench/vocab_options.py                 # byte level, 2 seeds; ~30 min here
    python bench/vocab_options.py byte,gpt2       # and GPT-2 BPE (V 50257: hours on 2 CPU cores)
    python bench/vocab_options.py table           # the table, from bench/results/vocab_options.json

The likelihood layout runs three vocabulary-sized products per step (head, z's log-likelihood, the
posterior-mean input). Options that cut them (docs/method.md §4):
  shipped    diffusion.head tied, posterior_input full (the defaults)
  cosine     head cosine: the log-likelihood folded into the head's product (one matmul, exact)
  detached   posterior_input detached: the input embedding forward-only, no gradient into the table
  top64      posterior_input topk (64 tokens exactly, the rest on the mean embedding)
  folded     cosine + detached together
Each variant trains `db_ar` (4 layers, d 128, B 2, seq 128, batch 16, the project's DB defaults) on the
embedded Bible through the benches' equal-FLOPs loop (bench/equal_flops.py: the trainer's `train_step`)
for as many steps as fit the shipped run's counted FLOPs (torch's FlopCounterMode over one forward +
backward of each block of THAT variant, and of one CE(sigma) measurement at each refresh); the LR follows
the cosine over the run's own steps. (bench/results/vocab_options.json was measured with this script's
earlier loop: the LR followed the spent share of the FLOPs, and curve refreshes were not charged.) Then ppl@0 and ppl@2 (K = B) on 32 fixed held-out windows, 4 estimator draws, with the
estimate's standard error; and the CPU seconds per training step of each variant, measured side by side
(one thread). Writes bench/results/vocab_options.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import equal_flops  # noqa: E402  (bench/ is not a package: the benches' one equal-FLOPs loop)

RESULTS = ROOT / "bench" / "results" / "vocab_options.json"
VARIANTS = {
    "shipped": {},
    "cosine": {"head": "cosine"},
    "detached": {"posterior_input": "detached"},
    "top64": {"posterior_input": "topk", "posterior_topk": 64},
    "folded": {"head": "cosine", "posterior_input": "detached"},
}
STEPS = {"byte": 400, "gpt2": 200}  # the shipped run's steps; the others get its FLOPs
SEEDS, WINDOWS, LR, MIN_LR, WARMUP = (0, 1), 32, 3e-3, 3e-4, 30


def config(tokenizer: str, variant: str, seed: int):
    from looped_lm.config import config_from_dict

    return config_from_dict({
        "model": {"kind": "db_ar", "n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128},
        "diffusion": {"num_blocks": 2, "curve_every": 100, **VARIANTS[variant]},
        "data": {"tokenizer": tokenizer},
        "train": {"seed": seed, "batch_size": 16, "lr": LR, "min_lr": MIN_LR, "warmup_steps": WARMUP,
                  "weight_decay": 0.1, "grad_clip": 1.0}})


def block_costs(cfg, vocab: int, x, y) -> tuple[dict, dict]:
    """Counted FLOPs and CPU seconds (median of 3) of one forward + backward of each block."""
    from torch.utils.flop_counter import FlopCounterMode

    from looped_lm.models import build_model

    flops, seconds = {}, {}
    for b in range(cfg.diffusion.num_blocks):
        one = cfg.model_copy(deep=True)
        one.diffusion.blocks_to_train = [b]
        model = build_model(one, vocab)
        counter = FlopCounterMode(display=False)
        with counter:
            model.training_loss(x, y, 0, 0)[0].backward()
        flops[b] = counter.get_total_flops()
        times = []
        for _ in range(3):
            t0 = time.process_time()
            model.training_loss(x, y, 0, 0)[0].backward()
            times.append(time.process_time() - t0)
        seconds[b] = sorted(times)[1]
    return flops, seconds


def train(tokenizer: str, variant: str, seed: int, budget: float | None):
    """The shipped variant (budget None) trains STEPS[tokenizer] steps; the others as many as fit its FLOPs."""
    import torch

    from looped_lm.data.bin_dataset import TokenStream
    from looped_lm.data.prepare import ensure_prepared
    from looped_lm.models import build_model
    from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups
    from looped_lm.training import TorchRunner

    cfg = config(tokenizer, variant, seed)
    data = Path(ensure_prepared("bible", str(ROOT / "data_cache"), tokenizer, 0.05, seed, progress=False))
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    train_data, val = TokenStream(str(data / "train.bin"), 128), TokenStream(str(data / "val.bin"), 128)
    x0, y0 = train_data.get_batch(16, seed, 0, 0, 0)
    flops_of, seconds_of = block_costs(cfg, vocab, x0, y0)
    torch.manual_seed(seed)
    model = build_model(cfg, vocab)
    curve_every = cfg.diffusion.curve_every if model.uses_curve() else 0
    curve_cost = 0.0
    if curve_every:  # one measurement's forward FLOPs, charged at every refresh
        model.eval()
        curve_cost = equal_flops.counted(lambda: model.measure_curve(x0, y0, seed=0))
        model.train()
    torch.manual_seed(seed + 1)

    def cost_at(step: int) -> float:
        return flops_of[model.choose_block(step, seed)]

    steps = STEPS[tokenizer] if budget is None else equal_flops.plan_steps(cost_at, budget, curve_every, curve_cost)
    opt = BlockwiseAdamW(param_groups(model, 0.1), lr=LR, betas=(0.9, 0.95), foreach=False)
    runner = TorchRunner(model, opt, grad_clip=1.0, seed=seed)
    t0 = time.process_time()
    state = equal_flops.train(
        model, opt, runner, steps, seed, batch_at=lambda step: train_data.get_batch(16, seed, step, 0, 0),
        cost_at=cost_at, lr_at=lambda step: cosine_with_warmup(step, WARMUP, steps, LR, MIN_LR),
        curve_every=curve_every, curve_batch_at=lambda step: train_data.get_batch(16, seed, -2 - step, 0, 0),
        name=f"{tokenizer} {variant}")
    return model, {"steps": state["step"], "flops": state["flops"], "curve_flops": state["curve_flops"],
                   "flops_per_block_step": flops_of, "cpu_s_per_block_step": seconds_of,
                   "train_cpu_s": time.process_time() - t0}, val


def score(model, val) -> dict:
    import torch

    from looped_lm.settings import ScoreSettings

    tokens = torch.from_numpy(val.tokens[:].astype("int64"))
    starts = torch.linspace(0, len(tokens) - 130, WINDOWS).long()
    rows = torch.stack([tokens[s:s + 129] for s in starts.tolist()])
    model.eval()
    B = len(model.blocks)
    sums = {0: 0.0, B: 0.0}
    var = {0: 0.0, B: 0.0}
    with torch.no_grad():
        for i in range(0, WINDOWS, 16):
            x, y = rows[i:i + 16, :-1], rows[i:i + 16, 1:]
            out = model.score(x, y, ScoreSettings(k_grid=(B,), draws=4), torch.Generator().manual_seed(99 + i))
            for k in (0, B):
                sums[k] += float(out[k].nll.double().sum())
                var[k] += float(out[k].nll_var.double().sum())
    n = rows.shape[0] * 128
    return {f"ppl@{k}": math.exp(sums[k] / n) for k in sums} | \
        {f"ppl@{k}_se": math.exp(sums[k] / n) * math.sqrt(var[k]) / n for k in sums}


def run(tokenizers: tuple[str, ...]) -> dict:
    import torch

    torch.set_num_threads(1)
    out = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}
    out["setting"] = ("db_ar 4 layers d 128 B 2, seq 128, batch 16, embedded Bible, project DB defaults; "
                      f"shipped run {STEPS} steps, the others its counted FLOPs; {WINDOWS} held-out windows, 4 draws")
    for tokenizer in tokenizers:
        for seed in SEEDS:
            budget = None
            for variant in VARIANTS:
                key = f"{tokenizer} {variant} seed {seed}"
                if key in out["runs"]:
                    budget = budget or out["runs"][key]["flops"]
                    continue
                model, info, val = train(tokenizer, variant, seed, budget)
                budget = budget or info["flops"]
                out["runs"][key] = {"tokenizer": tokenizer, "variant": variant, "seed": seed, **info, **score(model, val)}
                print(key, {k: v for k, v in out["runs"][key].items() if k.startswith("ppl") or k == "steps"}, flush=True)
                tmp = RESULTS.with_suffix(".tmp")
                tmp.write_text(json.dumps(out, indent=1) + "\n")
                os.replace(tmp, RESULTS)
    return out


def table(out: dict) -> str:
    lines = ["| tokens | variant | seed | steps | counted GFLOPs | CPU s / block step (b0, b1) | ppl@0 ± se | ppl@2 ± se |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for r in out["runs"].values():
        sec = ", ".join(f"{v:.3f}" for v in r["cpu_s_per_block_step"].values())
        lines.append(f"| {r['tokenizer']} | {r['variant']} | {r['seed']} | {r['steps']} | {r['flops'] / 1e9:.0f} | {sec} | "
                     f"{r['ppl@0']:.3f} ± {r['ppl@0_se']:.3f} | {r['ppl@2']:.3f} ± {r['ppl@2_se']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="byte",
                    help="tokenizers to run, comma-separated (byte, gpt2), or `table` to reprint the JSON")
    args = ap.parse_args(argv)
    if args.what == "table":
        print(table(json.loads(RESULTS.read_text())))
    else:
        print(table(run(tuple(args.what.split(",")))))


if __name__ == "__main__":
    main()
