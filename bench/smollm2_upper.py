"""Why does the DB recipe on SmolLM2-135M stop gaining with budget? A diagnostic, not a comparison at equal FLOPs.

In the recipe's stacked layout (low_noise_first) block 0, whose call at sigma_top is the prediction ppl@0 and the
K = B chain read, holds the source's upper 15 layers; the lower 15 (block 1) carry its clean context. No gradient
crosses blocks, so the lower half learns only from block 1's own steps (a tenth of them, denoising near
sigma_min, where z nearly names the token). Hypothesis: the gap to end-to-end is mostly the lower half not
adapting. Test: the end-to-end fine-tune with LoRA on the upper 15 layers only (the lower half stays the
source's), at the end-to-end arm's budget, lr and warm-up. If it lands near the DB recipe, the lower half's
adaptation is the gap; if near end-to-end, the objective is.

    python bench/smollm2_upper.py --times 3 --seed 0      # -> bench/results/smollm2/upper/x3_s0.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)
import smollm2_block0 as block0  # noqa: E402
import smollm2_budget as budget  # noqa: E402
import smollm2_compare as compare  # noqa: E402

from looped_lm import cli, trainer  # noqa: E402
from looped_lm.checkpoint import load_checkpoint  # noqa: E402
from looped_lm.kinds.builtin import Gpt  # noqa: E402

OUT = common.ROOT / "bench" / "results" / "smollm2" / "upper"
WORK = common.ROOT / "bench" / "work" / "smollm2_upper"
UPPER = r"layers(?=\.(?:1[5-9]|2\d)\.)"  # layers 15..29 of 30: the ones DB's block 0 holds


def upper_only(self, cfg) -> tuple[list[str], bool]:
    """gpt's LoRA layers, narrowed to the upper half (this script only; the product adapts every layer)."""
    return [UPPER], True


def evaluate(ckpt: Path, split: str, tag: str) -> dict:
    """`looped_lm eval` in this process (the checkpoint's adapters sit on the upper layers only, which a fresh
    process would not rebuild), scored as the budget study scores gpt: exact ppl on the first 576 tokens."""
    out = WORK / f"{tag}_{split}.json"
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--split", split, "--max-tokens", str(compare.TOKENS),
                     "--no-verify", "--no-progress", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    return {k: rep[k] for k in ("ppl", "nll", "tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--times", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=None, help="default: the gpt arm's choice at this budget")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lr = args.lr or budget.chosen_lr(args.times, "gpt")
    warmup = budget.chosen_warmup(args.times, "gpt")
    steps = budget.budget(args.times)["steps"]["gpt"]
    tag = f"x{args.times}_lr{lr:.0e}_s{args.seed}"
    run_dir = WORK / tag
    cfg = block0.config("gpt", lr, args.seed, steps, warmup, run_dir)
    cfg["train"].update(save_every=budget.SAVE_EVERY, keep_last=1, resume="auto")
    path = run_dir.with_suffix(".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    Gpt.lora_layers = upper_only
    t0 = time.time()
    assert trainer.main(["--config", str(path)]) == 0
    ckpt = sorted(run_dir.glob("step_*"))[-1]
    model = load_checkpoint(ckpt, verify=False)[0]
    adapted = sorted({int(n.split(".")[1]) for n, _ in model.named_parameters() if "lora_" in n})
    assert adapted == list(range(15, 30)), adapted  # the adapters sit where this diagnostic says
    result = {"what": "gpt, LoRA on layers 15-29 only", "times": args.times, "lr": lr, "warmup": warmup,
              "seed": args.seed, "steps": steps, "train_s": round(time.time() - t0, 1), "adapted_layers": adapted,
              "dev": evaluate(ckpt, "val", tag), "test": evaluate(ckpt, "test", tag),
              "commit": common.git_commit(), "finished_utc": common.utc_now()}
    common.write_json(OUT / f"{tag}.json", result)
    shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps({k: result[k] for k in ("lr", "warmup", "steps", "dev", "test")}))


if __name__ == "__main__":
    main()
