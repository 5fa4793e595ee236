"""Activation memory of one training step at the GPT-2 shape (12 x 768, V 50257, loss_chunk 128, fp32, CPU):
gpt, db_ar B = 2, 4, looped_db, with and without `model.activation_checkpointing` (bench/README.md,
"step_vs_llama.py and train_memory.py"): bytes autograd keeps, the step's peak (the profiler's memory
timeline) and `floor_bytes`, what recomputation cannot drop. Target: db_ar B = 4 below gpt, both checkpointed.

    python bench/train_memory.py [--json bench/results/train_memory.json] [--batch 1] [--seq 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

GPT2 = {"n_layers": 12, "d_model": 768, "n_heads": 12}
VOCAB = 50257
ROWS = {
    "gpt": ({"kind": "gpt"}, None),
    "db_ar B=2": ({"kind": "db_ar"}, {"num_blocks": 2, "block_sampling": "round_robin"}),
    "db_ar B=4": ({"kind": "db_ar"}, {"num_blocks": 4, "block_sampling": "round_robin"}),
    "looped_db": ({"kind": "looped_db", "n_prelude": 2, "n_layers": 8, "n_coda": 2}, {"num_blocks": 1}),
}


def step_peak_bytes(model, x, y) -> int:
    """The most bytes live at once among those allocated during forward + backward (activations, the
    recomputation of checkpointed parts, gradients, temporaries; weights and optimizer state excluded):
    the profiler's memory timeline, which works on CPU."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        loss, _ = model.training_loss(x, y, 0, 0)
        loss.backward()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    model.zero_grad(set_to_none=True)
    return peak


def floor_bytes(name: str, model_cfg: dict, batch: int, seq: int) -> int:
    """What checkpointing cannot drop, fp32: each recomputed layer's input (B T d per stream), the K/V the noisy
    stream reads from each clean layer of the block (2 B T d), the chunked head's input (B T d)."""
    d, L = GPT2["d_model"], model_cfg.get("n_layers", GPT2["n_layers"])
    tokens = batch * seq * d
    if name == "gpt":
        return 4 * tokens * (L + 1)  # each layer's input (the first is the embeddings), the head's input
    prelude, coda = model_cfg.get("n_prelude", 0), model_cfg.get("n_coda", 0)
    blocks = ROWS[name][1]["num_blocks"]
    depth = (L // blocks if name != "looped_db" else L) + coda
    # prelude layers' inputs (clean), the block's layers: clean input + K/V, noisy input; the head's input
    return 4 * tokens * (prelude + depth * (1 + 2 + 1) + 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from looped_lm.config import config_from_dict
    from looped_lm.models import build_model

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
    y = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
    rows = []
    for name, (model_cfg, diffusion) in ROWS.items():
        for checkpointing in (False, True):
            raw = {"model": {**GPT2, **model_cfg, "seq_len": args.seq, "loss_chunk": 128,
                             "activation_checkpointing": checkpointing}}
            if diffusion:
                raw["diffusion"] = diffusion
            torch.manual_seed(0)
            model = build_model(config_from_dict(raw), VOCAB).train()
            params = sum(p.numel() for p in model.parameters())
            row = {"row": name, "activation_checkpointing": checkpointing,
                   "activation_mib": common.saved_bytes(model, x, y, 0) / 2 ** 20,
                   "step_peak_mib": step_peak_bytes(model, x, y) / 2 ** 20,
                   "floor_mib": floor_bytes(name, raw["model"], args.batch, args.seq) / 2 ** 20 if checkpointing else None,
                   "params_m": params / 1e6, "weights_grads_adamw_mib": 16 * params / 2 ** 20}
            rows.append(row)
            print(f"| {name} | checkpointing {'on ' if checkpointing else 'off'} | kept for backward "
                  f"{row['activation_mib']:,.0f} MiB | step peak {row['step_peak_mib']:,.0f} MiB | floor "
                  f"{row['floor_mib'] or 0:,.0f} MiB | "
                  f"params {row['params_m']:.1f} M |", flush=True)
            del model
    by = {(r["row"], r["activation_checkpointing"]): r["step_peak_mib"] for r in rows}
    result = {"shape": {**GPT2, "seq": args.seq, "batch": args.batch, "vocab": VOCAB, "loss_chunk": 128},
              "rows": rows, "target": "db_ar B=4 with checkpointing below gpt with checkpointing",
              "target_ratio": by[("db_ar B=4", True)] / by[("gpt", True)],
              "target_met": by[("db_ar B=4", True)] < by[("gpt", True)]}
    print(f"step peak, db_ar B=4 / gpt, both checkpointed: {result['target_ratio']:.2f}x (target < 1: "
          f"{'met' if result['target_met'] else 'missed'})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
