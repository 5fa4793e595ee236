"""A refactor's identity check: every kind's tiny model, built from a config at a fixed seed, trained 3 steps.

    python bench/refactor_identity.py --out /tmp/before.json       record: per case, the losses, a sha256 of every
                                                                   state_dict tensor, the checkpoint state, a
                                                                   validation loss
    python bench/refactor_identity.py --compare /tmp/before.json /tmp/after.json    exit 1 on any difference

Each case builds through `looped_lm.models.build_model` (the callers' entry), then runs `training_loss` on one
fixed batch with a plain torch AdamW, so a change to how a network is built or trained shows as a different hash.
CPU only, one thread: a few seconds in all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

from looped_lm.config import config_from_dict
from looped_lm.models import build_model

V = 61  # the language models' vocabulary
PAPER = {"parameterization": "edm", "noisy_self": True, "noisy_input": "noise", "bridge": "hard",
         "block_sampling": "uniform", "last_call": "edge"}
LM = {"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 12, "init_std": 0.2}
GEMMA = {"qk_norm": True, "head_dim": 16, "attn_scalar": 24.0, "sandwich_norm": True, "mlp_activation": "gelu_tanh",
         "embed_scale": True, "tie_embeddings": False, "layer_types": ["sliding_attention", "full_attention"],
         "sliding_window": 4, "rope_local_theta": 500.0}

# name -> (the run config's sections, the batch's kind)
CASES = {
    "gpt": ({"model": {"kind": "gpt", **LM}}, "tokens"),
    "gpt_options": ({"model": {"kind": "gpt", **LM, **GEMMA, "loss_chunk": 5, "qkv_bias": True}}, "tokens"),
    "db_ar": ({"model": {"kind": "db_ar", **LM, "n_layers": 4, "n_prelude": 1},
               "diffusion": {"num_blocks": 2, **PAPER}}, "tokens"),
    "db_ar_defaults": ({"model": {"kind": "db_ar", **LM, "n_layers": 4, "n_coda": 1},
                        "diffusion": {"num_blocks": 2}}, "tokens"),
    "db_ar_split": ({"model": {"kind": "db_ar", **LM, "n_layers": 4},
                     "diffusion": {"layers_per_block": [3, 1], "block_sampling": "fixed", "block_weights": [1, 2],
                                   "loss_weight": "edm", "target_fraction": 0.5, "top_share": 0.5,
                                   "clean_lm_weight": 0.3, "partition": "uniform",
                                   "target_scale": "sigma_data"}}, "tokens"),
    "db_ar_stacked": ({"model": {"kind": "db_ar", **LM, "n_layers": 3, "n_prelude": 1, "loss_chunk": 4, **GEMMA,
                                 "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2},
                       "diffusion": {"num_blocks": 3, "context": "stacked", "stack_order": "low_noise_first",
                                     "noisy_input": "clean_state", "head": "cosine", "posterior_input": "topk",
                                     "posterior_topk": 5, "block_sampling": "round_robin",
                                     "loss_weight": "batch_mean"}}, "tokens"),
    "db_ar_control": ({"model": {"kind": "db_ar", **LM, "n_layers": 2},
                       "diffusion": {"num_blocks": 2, "context": "stacked", "denoise_weight": 0.0,
                                     "clean_lm_weight": 1.0, "block_sampling": "uniform"}}, "tokens"),
    "looped_db": ({"model": {"kind": "looped_db", **LM, "n_prelude": 1, "n_coda": 1},
                   "diffusion": {"num_blocks": 1, "posterior_input": "detached"}}, "tokens"),
    "huginn": ({"model": {"kind": "huginn", **LM, "n_prelude": 1, "n_coda": 1, "mean_recurrence": 3,
                          "backprop_depth": 2}}, "tokens"),
    "vit": ({"model": {"kind": "vit", "image_size": 8, "channels": 1, "num_classes": 10, "patch": 2, "n_layers": 3,
                       "d_model": 32, "n_heads": 2},
             "diffusion": {"num_blocks": 3, "overlap": 0.05, "block_sampling": "uniform", "loss_weight": "batch_mean",
                           "bridge": "soft", "parameterization": "edm"}, "data": {"source": "digits"}}, "images"),
    "vit_learned": ({"model": {"kind": "vit", "image_size": 8, "channels": 1, "num_classes": 10, "patch": 2,
                               "n_layers": 2, "d_model": 32, "n_heads": 2, "label_table": "learned"},
                     "diffusion": {"num_blocks": 2, "blocks_to_train": [1], "loss_weight": "edm"},
                     "data": {"source": "digits"}}, "images"),
    "vit_end_to_end": ({"model": {"kind": "vit", "image_size": 8, "channels": 1, "num_classes": 10, "patch": 2,
                                  "n_layers": 2, "d_model": 32, "n_heads": 2, "end_to_end": True},
                        "diffusion": {"num_blocks": 2}, "data": {"source": "digits"}}, "images"),
    "dit": ({"model": {"kind": "dit", "image_size": 8, "channels": 1, "num_classes": 10, "patch": 2, "n_layers": 2,
                       "d_model": 32, "n_heads": 2},
             "diffusion": {"num_blocks": 2, "overlap": 0.05, "block_sampling": "uniform", "label_dropout": 0.3},
             "data": {"source": "digits"}}, "images"),
    "mdm": ({"model": {"kind": "mdm", "seq_len": 16, "n_layers": 3, "d_model": 32, "n_heads": 2},
             "diffusion": {"num_blocks": 3, "overlap": 0.05, "block_sampling": "uniform", "schedule": "cosine"},
             "data": {"source": "bible"}}, "chars"),
    "mdm_end_to_end": ({"model": {"kind": "mdm", "seq_len": 16, "n_layers": 2, "d_model": 32, "n_heads": 2,
                                  "end_to_end": True}, "diffusion": {"num_blocks": 2}, "data": {"source": "bible"}},
                       "chars"),
}


def batch(kind: str, g: torch.Generator):
    if kind == "tokens":
        x = torch.randint(0, V, (3, LM["seq_len"]), generator=g)
        return x, torch.cat([x[:, 1:], torch.randint(0, V, (3, 1), generator=g)], dim=1)
    if kind == "images":
        return torch.rand(4, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 10, (4,), generator=g)
    x = torch.randint(0, 27, (3, 16), generator=g)
    return x, x


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def run_case(sections: dict, batch_kind: str) -> dict:
    cfg = config_from_dict(sections)
    torch.manual_seed(0)
    model = build_model(cfg, V).train()
    init = {k: tensor_hash(v) for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    x, y = batch(batch_kind, torch.Generator().manual_seed(1))
    losses = []
    for step in range(3):
        torch.manual_seed(100 + step)
        loss, _ = model.training_loss(x, y, step, 7)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    torch.manual_seed(200)
    val = float(model.validation_loss(x, y, 5))
    return {"losses": losses, "validation_loss": val, "init": init,
            "final": {k: tensor_hash(v) for k, v in model.state_dict().items()},
            "checkpoint_state": json.loads(json.dumps(model.checkpoint_state(), default=str))}


def compare(a: dict, b: dict) -> list[str]:
    lines = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            lines.append(f"{name}: only in {'the second' if name not in a else 'the first'}")
            continue
        diff = [key for key in ("losses", "validation_loss", "init", "final", "checkpoint_state")
                if a[name].get(key) != b[name].get(key)]
        lines.append(f"{name}: {'identical' if not diff else 'DIFFERS in ' + ', '.join(diff)}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the record of every case here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two records")
    p.add_argument("--only", nargs="*", help="these cases only")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        lines = compare(a, b)
        print("\n".join(lines))
        return 0 if all(line.endswith("identical") for line in lines) else 1
    torch.set_num_threads(1)
    record = {name: run_case(*CASES[name]) for name in (args.only or CASES)}
    for name, r in record.items():
        print(f"{name}: losses {', '.join(f'{v:.6f}' for v in r['losses'])}  val {r['validation_loss']:.6f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
