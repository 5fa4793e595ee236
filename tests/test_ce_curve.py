"""The measured-curve options of method.md §8: equi_entropy edges, adaptive noise, loss_share, prev_token,
clean_lm_weight. Hand-computed values on curves whose answers are known in closed form."""

import math
import warnings

import pytest
import torch
from tiny_models import PAPER

from looped_lm.config import config_from_dict
from looped_lm.diffusion import ce_curve
from looped_lm.engine.generate import generate
from looped_lm.engine.sampling import SamplingParams
from looped_lm.models import build_model
from looped_lm.models.dblm import noisy_mask

# CE rising linearly in ln(sigma) from 0 at sigma = e^-2 to 4 at sigma = e^2
SIGMAS = [math.exp(-2 + 4 * i / 40) for i in range(41)]
LINEAR = [math.log(s) + 2 for s in SIGMAS]


def test_monotone_is_a_running_max():
    assert ce_curve.monotone([1.0, 0.5, 2.0, 1.5]) == [1.0, 1.0, 2.0, 2.0]


def test_equi_entropy_edges_on_a_linear_curve():
    edges = ce_curve.equi_entropy_edges(SIGMAS, LINEAR, 2)
    # plateau 0.99: sigma_lo where CE = 0.04, sigma_hi where CE = 3.96; the middle edge at CE = 2.0
    expected = [math.exp(-1.96), 1.0, math.exp(1.96)]
    assert edges == pytest.approx(expected, rel=1e-9)
    four = ce_curve.equi_entropy_edges(SIGMAS, LINEAR, 4)
    assert [math.log(e) for e in four] == pytest.approx([-1.96, -0.98, 0.0, 0.98, 1.96], abs=1e-9)


def test_flat_curve_keeps_the_old_partition():
    assert ce_curve.equi_entropy_edges(SIGMAS, [3.0] * len(SIGMAS), 2) is None


def test_block_shares_by_hand():
    assert ce_curve.block_shares([math.exp(-2), 1.0, math.exp(2)], SIGMAS, LINEAR) == pytest.approx([0.5, 0.5])
    # block 0 owns [e^1, e^2]: CE 3 -> 4 of a 0 -> 4 drop
    assert ce_curve.block_shares([math.exp(-2), math.e, math.exp(2)], SIGMAS, LINEAR) == pytest.approx([0.25, 0.75])


def test_adaptive_sigma_is_uniform_in_ce():
    g = torch.Generator().manual_seed(0)
    s = ce_curve.sample_sigma_from_curve(20_000, math.exp(-1), math.exp(1), SIGMAS, LINEAR, g)
    assert s.min() >= math.exp(-1) - 1e-6 and s.max() <= math.exp(1) + 1e-6
    assert abs(s.log().mean().item()) < 0.02  # uniform in CE = uniform in ln(sigma) here: mean 0
    # where the curve is flat nothing is learned: no draws there
    half_flat = [max(0.0, math.log(x)) for x in SIGMAS]
    s = ce_curve.sample_sigma_from_curve(5_000, math.exp(-2), math.exp(2), SIGMAS, half_flat, g)
    assert s.min() >= 1.0 - 1e-6


def make(**diffusion):
    cfg = config_from_dict({"model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16,
                                      "init_std": 0.2},
                            "diffusion": {"num_blocks": 2, **PAPER, **diffusion}})
    torch.manual_seed(0)
    model = build_model(cfg, 41)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ada" in name:
                p.normal_(0, 0.2)
    return model.eval()


def test_prev_token_input_keeps_the_no_leak_rule_and_cache_exactness():
    model = make(noisy_input="prev_token")
    x = torch.randint(0, 41, (2, 10))
    T = 10
    slots = torch.arange(T)
    z = torch.randn(2, T, 32)
    sigma = torch.full((2,), 0.4)
    base = model.run_block(0, model.clean_inputs(x), z, sigma, slots + 1, noisy_mask(slots, T), prev=x)
    x2 = x.clone()
    x2[:, 6:] = (x2[:, 6:] + 1) % 41
    changed = model.run_block(0, model.clean_inputs(x2), z, sigma, slots + 1, noisy_mask(slots, T), prev=x2)
    assert torch.equal(changed[:, :6], base[:, :6])
    off = make()  # the same weights without the option: slot inputs differ
    assert not torch.allclose(off.run_block(0, off.clean_inputs(x), z, sigma, slots + 1, noisy_mask(slots, T),
                                            prev=x), base)
    out, logits = generate(model, x[:, :4], 4, SamplingParams(0.0), seed=2, return_logits=True, num_iterations=2)
    g = torch.Generator().manual_seed(2)
    for i in range(4):
        ref = model.next_logits_uncached(out[:, :4 + i], 2, "hard", model.initial_noise(2, 1, g))[:, -1]
        torch.testing.assert_close(logits[:, i], ref, atol=1e-5, rtol=0)


def test_clean_lm_weight_adds_a_clean_stream_loss():
    x, y = torch.randint(0, 41, (2, 16)), torch.randint(0, 41, (2, 16))
    plain = make().train()
    torch.manual_seed(5)
    base, _ = plain.training_loss(x, y, step=0, seed=0)
    extra = make(clean_lm_weight=0.5).train()
    torch.manual_seed(5)
    loss, metrics = extra.training_loss(x, y, step=0, seed=0)
    assert loss.item() == pytest.approx(base.item() + 0.5 * metrics["clean_lm_loss"], rel=1e-5)
    loss.backward()
    block = extra.choose_block(0, 0)
    # the clean loss reaches the last clean layer's MLP, which the DB loss alone never uses
    last = extra.blocks[block][-1].mlp.down.weight
    assert last.grad is not None and last.grad.abs().sum() > 0


def test_loss_share_sampling_follows_the_curve():
    model = make(block_sampling="loss_share")
    model.set_edges([math.exp(-2), math.e, math.exp(2)])
    model.apply_curve({"sigmas": SIGMAS, "ce": LINEAR})  # block shares 0.25 / 0.75
    picks = [model.choose_block(s, 0) for s in range(2000)]
    assert abs(picks.count(0) / 2000 - 0.25) < 0.04
    assert [model.choose_block(s, 0) for s in range(50)] == picks[:50]  # deterministic per step


def test_equi_entropy_moves_edges_from_a_measured_curve():
    model = make(partition="equi_entropy")
    assert [round(e, 3) for e in model.edges] == [0.002, 0.301, 80.0]  # starts at equal noise mass
    model.apply_curve({"sigmas": SIGMAS, "ce": LINEAR})
    assert model.edges == pytest.approx([math.exp(-1.96), 1.0, math.exp(1.96)])
    assert model.checkpoint_state()["curve"]["ce"] == LINEAR
    x = torch.randint(0, 41, (2, 16))
    curve = model.measure_curve(x[:, :-1], x[:, 1:], seed=0, n_sigma=6)
    assert len(curve["ce"]) == 6 and all(c > 0 for c in curve["ce"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nll = model.eval_nll(x[:, :-1], x[:, 1:], k_grid=[2], draws=1, generator=torch.Generator().manual_seed(0))
    assert set(nll) == {0, 2}
