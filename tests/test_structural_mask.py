"""The noisy stream's attention over a whole window with its self key (`noisy_self: true`) runs without the
(T, 2T) mask of the concatenated keys (`causal_plus_self_attention`: causal SDPA against the clean keys and
a score-0 sink, the self term merged by its score); it must be the masked attention, forward and backward,
in a layer and through a DB model's loss and its scoring."""

import pytest
import torch
import torch.nn.functional as F

from looped_lm.models.db.contexts import WindowContext
from looped_lm.models.two_stream import CAUSAL_SELF, causal_plus_self_attention, noisy_mask, slot_mask
from tiny_models import build_tiny, markov_batch


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_it_is_softmax_over_the_clean_keys_and_the_self_key(dtype, tol):
    torch.manual_seed(0)
    B, H, T, D = 2, 3, 9, 8
    q, k, v, k_self, v_self = [(3 * torch.randn(B, H, T, D, dtype=dtype)).requires_grad_() for _ in range(5)]
    masked = F.scaled_dot_product_attention(q, torch.cat([k, k_self], 2), torch.cat([v, v_self], 2),
                                            attn_mask=noisy_mask(torch.arange(T), T))
    structural = causal_plus_self_attention(q, k, v, k_self, v_self)
    torch.testing.assert_close(structural, masked, rtol=tol, atol=tol)
    g = torch.randn_like(masked)
    for a, b in zip(torch.autograd.grad((masked * g).sum(), [q, k, v, k_self, v_self]),
                    torch.autograd.grad((structural * g).sum(), [q, k, v, k_self, v_self])):
        torch.testing.assert_close(b, a, rtol=10 * tol, atol=10 * tol)


def test_a_whole_window_gets_no_mask_tensor():
    T = 64
    assert slot_mask(torch.arange(T), T, attend_self=True, full_window=True) == CAUSAL_SELF
    assert slot_mask(torch.arange(T), T, attend_self=True) == CAUSAL_SELF  # found by reading the slots
    part = slot_mask(torch.tensor([1, 5]), T, attend_self=True)  # some slots: the mask, (n, T + n)
    assert part.shape == (2, T + 2)


@pytest.mark.parametrize("diffusion", [{}, {"context": "stacked"}], ids=["independent", "stacked"])
def test_a_db_models_loss_gradients_and_scores_are_the_masked_ones(diffusion, one_thread):
    """The paper layout (noisy_self: true): the training loss and every gradient, and a window's logits,
    with the structural path and with the explicit (T, 2T) mask."""
    model = build_tiny("db_ar", noisy_self=True, **diffusion).train()
    x, y = markov_batch(torch.Generator().manual_seed(2), batch=3, T=16)
    results = []
    for mask in ("structural", "masked"):
        if mask == "masked":  # the reference: the mask the slots' positions give, as a tensor
            import looped_lm.models.db.objective as objective

            real = objective.slot_mask
            objective.slot_mask = lambda slots, T, attend_self, full=None: noisy_mask(slots, T)
        try:
            model.zero_grad()
            torch.manual_seed(4)
            loss, _ = model.training_loss(x, y, step=1, seed=0)
            loss.backward()
        finally:
            if mask == "masked":
                objective.slot_mask = real
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    for name, grad in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)

    model.eval()
    z = torch.randn(3, 16, model.tok_emb.weight.shape[1], generator=torch.Generator().manual_seed(5))
    sigma = torch.full((3,), 0.8)
    window = WindowContext(model, x)
    assert window.mask == CAUSAL_SELF
    with torch.no_grad():
        structural = window.denoise(0, z, sigma)
        window.mask = noisy_mask(window.slots, 16)
        masked = window.denoise(0, z, sigma)
    torch.testing.assert_close(structural, masked, rtol=1e-5, atol=1e-5)
