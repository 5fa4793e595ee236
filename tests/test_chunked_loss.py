"""model.loss_chunk: head + CE chunk by chunk, recomputed in backward: the same loss and gradients, and the
(tokens, vocab) logits are never saved for backward."""

import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.models import build_model

V, T = 1021, 24  # V large enough that logits dwarf every layer activation


def build(kind: str, loss_chunk: int, **diffusion):
    model = {"kind": kind, "n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": T, "loss_chunk": loss_chunk}
    raw = {"model": model, "diffusion": {"num_blocks": 2, **diffusion}} if kind == "db_ar" else {"model": model}
    torch.manual_seed(0)
    return build_model(config_from_dict(raw), V)


def loss_and_grads(model, x, y):
    torch.manual_seed(5)  # the same sigma / noise draws
    loss, _ = model.training_loss(x, y, step=3, seed=0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def saved_bytes(model, x, y) -> int:
    """The largest single tensor autograd saves for backward in one training step."""
    largest = [0]

    def pack(t):
        largest[0] = max(largest[0], t.numel() * t.element_size())
        return t

    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.training_loss(x, y, step=3, seed=0)[0].backward()
    return largest[0]


@pytest.mark.parametrize("kind,diffusion", [
    ("gpt", {}), ("db_ar", {}), ("db_ar", {"parameterization": "likelihood", "noisy_input": "prev_token"}),
    ("db_ar", {"clean_lm_weight": 0.5}),  # the clean stream's own CE is chunked too
    ("db_ar", {"context": "stacked", "clean_lm_weight": 0.5, "block_sampling": "round_robin"})])
def test_chunked_loss_equals_the_whole_one(kind, diffusion):
    x, y = torch.randint(0, V, (3, T)), torch.randint(0, V, (3, T))
    whole, chunked = build(kind, 0, **diffusion), build(kind, 5, **diffusion)  # 5 does not divide 24
    loss_a, grads_a = loss_and_grads(whole, x, y)
    loss_b, grads_b = loss_and_grads(chunked, x, y)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5)
    # the whole step saves a (3, 24, V) logits-sized tensor; chunks of 5 positions save at most (3, 5, V)
    assert saved_bytes(whole, x, y) >= 3 * T * V * 4
    assert saved_bytes(chunked, x, y) < 3 * 6 * V * 4


def test_gpt_activation_checkpointing_keeps_the_gradients_and_saves_less():
    """model.activation_checkpointing: the same loss and gradients, and only each layer's input is saved
    for backward (the end-to-end alternative bench/depth_cost.py compares DiffusionBlocks with)."""
    x, y = torch.randint(0, V, (3, T)), torch.randint(0, V, (3, T))

    def make(flag):
        torch.manual_seed(0)
        return build_model(config_from_dict({"model": {"kind": "gpt", "n_layers": 3, "d_model": 32, "n_heads": 4,
                                                       "seq_len": T, "activation_checkpointing": flag}}), 61)

    plain, ckpt = make(False), make(True)
    x, y = x % 61, y % 61
    loss_a, grads_a = loss_and_grads(plain, x, y)
    loss_b, grads_b = loss_and_grads(ckpt, x, y)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5)

    def total_saved(model):
        seen = {}

        def pack(t):
            if t.grad_fn is not None or not t.requires_grad:  # activations, not parameters
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.training_loss(x, y, step=0, seed=0)[0].backward()
        return sum(seen.values())

    assert total_saved(ckpt) < 0.5 * total_saved(plain)
