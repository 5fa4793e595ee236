"""What one training step costs: depth-composing db_ar (`diffusion.context: stacked`) beside the default
layout, end-to-end gpt and gpt with activation checkpointing, at T = 1024 and V = 50257 (GPT-2 BPE).

    python bench/depth_cost.py            # ~5 min on a 2-core CPU; writes bench/results/depth_cost.json
    python bench/depth_cost.py --quick    # T = 256

8 layers, d 256, 4 heads, batch 1, fp32; db_ar B = 4 (2 layers a block), every block's own step. Per
configuration and block:

  act_bytes   the bytes autograd saves for backward (torch.autograd.graph.saved_tensors_hooks),
              deduplicated by storage, parameters and buffers excluded (common.saved_bytes): exact,
              whatever else runs on the machine.
  flops       forward + backward matmul and attention FLOPs of the real step (FlopCounterMode, common.step_flops).
  cpu_s       process CPU seconds of one step (noisy on a shared machine; FLOPs and bytes are not).

Beside each ratio, its analytic floor: a DB step keeps the activations of ONE block over 2T tokens (the
clean stream and the noisy slots), L/B of gpt's layers, so its layers' activations are 2/B of gpt's;
stacked adds blocks < b run forward without gradient, which save nothing, so the same floor, and b x
(the forward FLOPs of one block's clean stream) more compute. gpt with activation checkpointing keeps
each layer's input (T x d per layer) and recomputes the rest (one more forward: 4/3 of the FLOPs).
`loss_chunk: 128` everywhere the vocabulary head runs (the (T, V) logits never whole); without it the
head alone saves T x V x 4 bytes twice (logits and log-softmax), shown as `*_unchunked` rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from looped_lm.config import config_from_dict
from looped_lm.models import build_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402  (bench/ is not a package)

LAYERS, D, HEADS, B, V = 8, 256, 4, 4, 50257
DB = {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False, "num_blocks": B,
      "block_sampling": "round_robin"}
CONFIGS = {  # name -> (model overrides, diffusion overrides)
    "gpt": ({"kind": "gpt"}, {}),
    "gpt_checkpointed": ({"kind": "gpt", "activation_checkpointing": True}, {}),
    "gpt_unchunked": ({"kind": "gpt", "loss_chunk": 0}, {}),
    "db_independent": ({"kind": "db_ar"}, {"context": "independent"}),
    "db_stacked": ({"kind": "db_ar"}, {"context": "stacked"}),
    "db_stacked_clean_lm": ({"kind": "db_ar"}, {"context": "stacked", "clean_lm_weight": 0.5}),
    "db_independent_clean_lm": ({"kind": "db_ar"}, {"context": "independent", "clean_lm_weight": 0.5}),
    "db_independent_clean_lm_unchunked": ({"kind": "db_ar", "loss_chunk": 0},
                                          {"context": "independent", "clean_lm_weight": 0.5}),
}


def measure(name: str, T: int) -> dict:
    model_kw, diffusion = CONFIGS[name]
    cfg = config_from_dict({"model": {"n_layers": LAYERS, "d_model": D, "n_heads": HEADS, "seq_len": T,
                                      "loss_chunk": 128, **model_kw},
                            "diffusion": {**DB, **diffusion} if model_kw["kind"] == "db_ar" else {}})
    torch.manual_seed(0)
    model = build_model(cfg, V).train()
    x = torch.randint(0, V, (1, T))
    y = x.roll(-1, 1)
    rows = []
    for b in range(B if model_kw["kind"] == "db_ar" else 1):  # round_robin: step b trains block b
        act_bytes, flops = common.saved_bytes(model, x, y, b), common.step_flops(model, x, y, b)
        t0 = time.process_time()
        model.training_loss(x, y, b, 0)[0].backward()
        model.zero_grad(set_to_none=True)
        rows.append({"block": b, "act_bytes": act_bytes, "flops": flops, "cpu_s": time.process_time() - t0})
    return {"name": name, "T": T, "per_step": rows,
            "mean": {k: sum(r[k] for r in rows) / len(rows) for k in ("act_bytes", "flops", "cpu_s")},
            "max_act_bytes": max(r["act_bytes"] for r in rows)}


def floors(T: int) -> dict:
    """Analytic ratios to gpt's layers (the head excluded): DB 2/B activation; stacked block b's extra
    forward FLOPs b x L/B layers' clean stream = b / (3 L) of gpt's step per block (a layer's forward is
    1/3 of its forward + backward; the noisy stream doubles a DB block's tokens)."""
    return {"db_act_layers": 2 / B, "stacked_extra_flops_vs_gpt_layers": [b * (LAYERS / B) / (3 * LAYERS) for b in range(B)],
            "checkpointed_flops_vs_gpt": 4 / 3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    T = 256 if a.quick else 1024
    out = {"T": T, "layers": LAYERS, "d_model": D, "blocks": B, "vocab": V, "batch": 1, "loss_chunk": 128,
           "floors": floors(T), "configs": {}}
    for name in CONFIGS:
        out["configs"][name] = measure(name, T)
        m = out["configs"][name]
        print(f"{name:36s} act {m['max_act_bytes'] / 2**20:8.1f} MiB  flops {m['mean']['flops'] / 1e9:8.1f} G  "
              f"cpu {m['mean']['cpu_s']:.2f} s", flush=True)
    gpt = out["configs"]["gpt"]
    for name, m in out["configs"].items():
        m["vs_gpt"] = {"act": m["max_act_bytes"] / gpt["max_act_bytes"], "flops": m["mean"]["flops"] / gpt["mean"]["flops"],
                       "cpu": m["mean"]["cpu_s"] / gpt["mean"]["cpu_s"]}
    path = ROOT / "bench" / "results" / ("depth_cost_quick.json" if a.quick else "depth_cost.json")
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
