"""Quality and cost of the vocabulary-scale options at equal counted FLOPs (docs/method.md §4, docs/results.md).

    python bench/vocab_options.py                 # byte level, 2 seeds; ~30 min here
    python bench/vocab_options.py byte,gpt2       # and GPT-2 BPE (V 50257: hours on 2 CPU cores)
    python bench/vocab_options.py table           # the table, from bench/results/vocab_options.json

The likelihood layout runs three vocabulary-sized products per step (head, z's log-likelihood, the
posterior-mean input). Options that cut them: `cosine` (diffusion.head cosine: the log-likelihood folded
into the head's product), `detached` (posterior_input detached: forward-only, no gradient into the table),
`top64` (posterior_input topk 64), `folded` (cosine + detached), against `shipped` (the defaults). Each trains
`db_ar` (4 layers, d 128, B 2, seq 128, batch 16) on the embedded Bible through the benches' equal-FLOPs loop
(bench/common.py) for as many steps as fit the shipped run's counted FLOPs (FlopCounterMode over each block
of THAT variant, and of each CE(sigma) refresh). (bench/results/vocab_options.json was measured with this
script's earlier loop: the LR followed the spent share of the FLOPs, and curve refreshes were not charged.)
Then ppl@0 and ppl@2 on 32 fixed held-out windows (4 estimator draws, with the estimate's standard error)
and the CPU seconds of one step of each block. Writes bench/results/vocab_options.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

RESULTS = common.ROOT / "bench" / "results" / "vocab_options.json"
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


def score(model, val) -> dict:
    import torch

    from looped_lm.settings import ScoreSettings

    rows = common.val_rows(val, WINDOWS)
    model.eval()
    B = len(model.blocks)
    sums, var = {0: 0.0, B: 0.0}, {0: 0.0, B: 0.0}
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
            budget = None  # the shipped run's FLOPs, for the other variants
            for variant in VARIANTS:
                key = f"{tokenizer} {variant} seed {seed}"
                if key not in out["runs"]:
                    model, state, flops_of, seconds_of, val = common.train_bible_db(
                        config(tokenizer, variant, seed), tokenizer, seed, STEPS[tokenizer], budget, WARMUP,
                        f"{tokenizer} {variant}", time_blocks=True)
                    out["runs"][key] = {"tokenizer": tokenizer, "variant": variant, "seed": seed,
                                        "steps": state["step"], "flops": state["flops"],
                                        "curve_flops": state["curve_flops"], "flops_per_block_step": flops_of,
                                        "cpu_s_per_block_step": seconds_of, "train_cpu_s": state["train_cpu_s"],
                                        **score(model, val)}
                    print(key, {k: v for k, v in out["runs"][key].items() if k.startswith("ppl") or k == "steps"},
                          flush=True)
                    common.write_json(out, RESULTS)
                budget = budget or out["runs"][key]["flops"]
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
    print(table(json.loads(RESULTS.read_text()) if args.what == "table" else run(tuple(args.what.split(",")))))


if __name__ == "__main__":
    main()
