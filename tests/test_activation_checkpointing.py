"""model.activation_checkpointing for every LM kind (gpt: each layer; db_ar / looped_db: each layer of the
trained block, both streams; huginn: each layer of the iterations with gradient): the same loss and
gradients, and less kept for backward."""

import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.models import build_model

MODELS = {
    "gpt": ({}, None),
    "db_ar": ({}, {"num_blocks": 2, "block_sampling": "round_robin", "clean_lm_weight": 1.0}),
    "looped_db": ({"n_prelude": 1, "n_coda": 1}, {"num_blocks": 1}),
    "huginn": ({"n_prelude": 1, "n_coda": 1, "mean_recurrence": 3, "backprop_depth": 2}, None),
}


def build(kind, recompute: bool):
    extra, diffusion = MODELS[kind]
    raw = {"model": {"kind": kind, "n_layers": 4, "d_model": 32, "n_heads": 2, "seq_len": 32,
                     "activation_checkpointing": recompute, **extra}}
    if diffusion:
        raw["diffusion"] = diffusion
    torch.manual_seed(0)
    return build_model(config_from_dict(raw), 61).train()


def step(model, x, y, step_no):
    """(loss, grads, bytes autograd keeps for backward) of one training step."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad()
    torch.manual_seed(step_no)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = model.training_loss(x, y, step_no, 0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved[0]


@pytest.mark.parametrize("kind", list(MODELS))
def test_recomputed_layers_give_the_same_loss_and_gradients_and_keep_less(kind, one_thread):
    plain, recomputed = build(kind, False), build(kind, True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 61, (4, 32), generator=g), torch.randint(0, 61, (4, 32), generator=g)
    for step_no in range(2):  # db_ar: both blocks
        loss_a, grads_a, kept_a = step(plain, x, y, step_no)
        loss_b, grads_b, kept_b = step(recomputed, x, y, step_no)
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-6, msg=name)
        assert kept_b < 0.7 * kept_a, (kind, kept_b, kept_a)
