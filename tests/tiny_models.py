"""Tiny models of every kind, shared by the decoding, batching and engine tests."""

import torch

from looped_lm.config import config_from_dict
from looped_lm.models import build_model

V, D = 47, 32
# The paper's layout (method.md §4-5), which the mechanism tests (caches, batching, export) pin so their
# logits stay O(1); the product's defaults (docs/results.md) have their own tests in test_dblm.py.
PAPER = {"parameterization": "edm", "noisy_self": True, "noisy_input": "noise", "bridge": "hard",
         "block_sampling": "uniform"}


def build_tiny(kind: str, seq_len: int = 16, **diffusion):
    """A 2-layer d-32 model of `kind` (db_ar: B = 2; looped kinds: prelude 1 + core 2 + coda 1), with
    adaLN weights perturbed (adaLN-Zero starts at zero) so the noise level matters, in eval mode."""
    model = {"kind": kind, "n_layers": 2, "d_model": D, "n_heads": 4, "seq_len": seq_len, "init_std": 0.2,
             "max_iterations": 8}
    if kind in ("looped_db", "huginn"):
        model.update(n_prelude=1, n_coda=1, mean_recurrence=3, backprop_depth=2)
    if kind == "db_ar":
        model["n_prelude"] = 1
    diffusion = {"num_blocks": 2 if kind == "db_ar" else 1, **PAPER, **diffusion}
    torch.manual_seed(0)
    m = build_model(config_from_dict({"model": model, "diffusion": diffusion}), V)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "ada" in name:
                p.normal_(0, 0.2)
    return m.eval()
