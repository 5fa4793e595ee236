"""No training or scoring slot can see its own target or anything after it (mutation tests).

Slot t predicts y[t] (= x[t+1] in real text) from the clean tokens x[0..t] and its own noisy z_t. Its
training CE (`BlockObjective.slot_losses`, deterministic given the noise) and its scoring NLL
(`model.score` under a fixed generator) must not move when everything else changes: the clean tokens
after t (x[t+1] is the target itself), the other targets (later slots' z encode later tokens) and the
other slots' noise. Each test also checks that the slot really reads its context and its target, so an
output that ignores its inputs cannot pass.
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

from looped_lm.models.db.contexts import WindowContext
from looped_lm.models.layers import token_cross_entropy
from looped_lm.settings import ScoreSettings
from tiny_models import V, build_tiny, shifted_batch

T = 12
POSITIONS = (0, 4, 10)

LAYOUTS = {
    "paper": {},  # edm, self key, noise input (tiny_models.PAPER)
    "likelihood": {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False,
                   "bridge": "sample"},
    "likelihood_self": {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": True},
    "cosine_topk": {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False,
                    "head": "cosine", "posterior_input": "topk", "posterior_topk": 5},
    "edm_cosine_prev": {"head": "cosine", "noisy_input": "prev_token"},
}


def mutate_outside(x, y, noise, t, g):
    """Everything slot t must not read: x after t, the other targets, the other slots' noise."""
    x2, y2, n2 = x.clone(), y.clone(), noise.clone()
    x2[:, t + 1:] = torch.randint(0, V, x2[:, t + 1:].shape, generator=g)
    keep = y2[:, t].clone()
    y2 = torch.randint(0, V, y2.shape, generator=g)
    y2[:, t] = keep
    others = torch.ones(noise.shape[1], dtype=torch.bool)
    others[t] = False
    n2[:, others] = torch.randn(n2[:, others].shape, generator=g)
    return x2, y2, n2


def batch(g, B=3):
    return shifted_batch(g, B, vocab=V, T=T)


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind,block", [("db_ar", 0), ("db_ar", 1), ("looped_db", 0)])
def test_training_slot_sees_no_target(kind, block, layout):
    model = build_tiny(kind, seq_len=T, **LAYOUTS[layout])
    g = torch.Generator().manual_seed(0)
    x, y = batch(g)
    noise = torch.randn(3, T, model.tok_emb.weight.shape[1], generator=g)
    sigma = torch.tensor([0.05, 0.5, 5.0])  # low (z nearly the token), middle, high noise
    base = model.objective.slot_losses(x, y, block, sigma, noise)
    for t in POSITIONS:
        x2, y2, n2 = mutate_outside(x, y, noise, t, g)
        moved = model.objective.slot_losses(x2, y2, block, sigma, n2)
        torch.testing.assert_close(moved[:, t], base[:, t], rtol=0, atol=1e-5)
        if t > 0:  # the context is read ...
            x3 = x.clone()
            x3[:, :t] = (x3[:, :t] + 1) % V
            assert (model.objective.slot_losses(x3, y, block, sigma, noise)[:, t] - base[:, t]).abs().max() > 1e-4
        y3 = y.clone()  # ... and so is the target (the CE's label and z)
        y3[:, t] = (y3[:, t] + 1) % V
        assert (model.objective.slot_losses(x, y3, block, sigma, noise)[:, t] - base[:, t]).abs().max() > 1e-4


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind,block", [("db_ar", 0), ("db_ar", 1), ("looped_db", 0)])
def test_training_slot_reads_its_target_only_through_z(kind, block, layout):
    """The mutation test above cannot see slot t reading y[t] itself (it keeps y[t]). The training CE
    must be the CE of the scoring path's logits at the same z: that path gets the clean tokens x and z,
    never y, so the target enters training only as z and as the label."""
    model = build_tiny(kind, seq_len=T, **LAYOUTS[layout])
    g = torch.Generator().manual_seed(4)
    x, y = batch(g)
    noise = torch.randn(3, T, model.tok_emb.weight.shape[1], generator=g)
    sigma = torch.tensor([0.05, 0.5, 5.0])
    z = model.targets(y) + sigma[:, None, None] * noise
    scoring_ce = token_cross_entropy(WindowContext(model, x).denoise(block, z, sigma), y)
    torch.testing.assert_close(model.objective.slot_losses(x, y, block, sigma, noise), scoring_ce, rtol=1e-5,
                               atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("layout", ["paper", "likelihood"])
def test_training_slot_subset_and_clean_lm_see_no_target(layout):
    """target_fraction < 1 trains a subset of slots; clean_lm_weight adds the clean stream's own CE."""
    model = build_tiny("db_ar", seq_len=T, **LAYOUTS[layout])
    g = torch.Generator().manual_seed(1)
    x, y = batch(g)
    slots = torch.tensor([[1, 4, 10]] * 3)
    noise = torch.randn(3, 3, model.tok_emb.weight.shape[1], generator=g)
    sigma = torch.tensor([0.1, 1.0, 3.0])
    base, base_clean = model.objective.slot_losses(x, y, 0, sigma, noise, slots, clean_lm=True)
    for j, t in enumerate(slots[0].tolist()):
        x2, y2, _ = mutate_outside(x, y, torch.zeros(3, T, 1), t, g)
        n2 = noise.clone()
        others = [i for i in range(3) if i != j]
        n2[:, others] = torch.randn(n2[:, others].shape, generator=g)
        moved, moved_clean = model.objective.slot_losses(x2, y2, 0, sigma, n2, slots, clean_lm=True)
        torch.testing.assert_close(moved[:, j], base[:, j], rtol=0, atol=1e-5)
        torch.testing.assert_close(moved_clean[:, t], base_clean[:, t], rtol=0, atol=1e-5)


def score_all(model, x, y, settings, seed=5):
    return model.score(x, y, settings, torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("kind,layout,bridge", [
    ("db_ar", "paper", "sample"), ("db_ar", "likelihood", "sample"), ("db_ar", "likelihood", "hard"),
    ("db_ar", "likelihood", "soft"), ("db_ar", "likelihood_self", "sample"), ("db_ar", "cosine_topk", "sample"),
    ("looped_db", "likelihood", "sample"), ("looped_db", "paper", "hard")])
def test_scoring_slot_sees_no_target(kind, layout, bridge):
    """Every ppl@k (k = 0, 1, B, 2B, beyond) of slot t is a function of x[0..t] and y[t] only."""
    model = build_tiny(kind, seq_len=T, **LAYOUTS[layout])
    B = len(model.blocks)
    settings = ScoreSettings(k_grid=tuple(sorted({1, B, 2 * B, 5})), draws=2, bridge=bridge)
    g = torch.Generator().manual_seed(2)
    x, y = batch(g, B=2)
    base = score_all(model, x, y, settings)
    for t in POSITIONS:
        x2, y2, _ = mutate_outside(x, y, torch.zeros(2, T, 1), t, g)
        moved = score_all(model, x2, y2, settings)
        for k in base:
            torch.testing.assert_close(moved[k].nll[:, t], base[k].nll[:, t], rtol=0, atol=1e-6,
                                       msg=lambda m: f"ppl@{k}, slot {t}: {m}")
    y3 = y.clone()
    y3[:, 4] = (y3[:, 4] + 1) % V
    changed = score_all(model, x, y3, settings)
    assert all((changed[k].nll[:, 4] - base[k].nll[:, 4]).abs().max() > 1e-6 for k in base)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["gpt", "huginn"])
def test_exact_scores_see_no_target(kind):
    model = build_tiny(kind, seq_len=T)
    settings = ScoreSettings(k_grid=(1, 3) if kind == "huginn" else None)
    g = torch.Generator().manual_seed(3)
    x, y = batch(g, B=2)
    base = score_all(model, x, y, settings)
    for t in POSITIONS:
        x2, y2, _ = mutate_outside(x, y, torch.zeros(2, T, 1), t, g)
        moved = score_all(model, x2, y2, settings)
        for k in base:
            torch.testing.assert_close(moved[k].nll[:, t], base[k].nll[:, t], rtol=0, atol=1e-6)
