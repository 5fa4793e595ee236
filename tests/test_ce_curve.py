"""The measured CE(sigma) curve and the options around it: loss_share, network_gain, prev_token, clean_lm_weight.
Hand-computed values on curves whose answers are known in closed form."""

import math

import pytest
import torch
from tiny_models import PAPER, uncached_next_logits

from looped_lm.config import config_from_dict
from looped_lm.diffusion import ce_curve
from looped_lm.engine.generate import generate
from looped_lm.models import build_model
from looped_lm.models.two_stream import noisy_mask
from looped_lm.sampling import GREEDY, SharedGenerator
from looped_lm.settings import resolve_settings

# CE rising linearly in ln(sigma) from 0 at sigma = e^-2 to 4 at sigma = e^2
SIGMAS = [math.exp(-2 + 4 * i / 40) for i in range(41)]
LINEAR = [math.log(s) + 2 for s in SIGMAS]


def test_monotone_is_a_running_max():
    assert ce_curve.monotone([1.0, 0.5, 2.0, 1.5]) == [1.0, 1.0, 2.0, 2.0]


def test_block_shares_by_hand():
    assert ce_curve.block_shares([math.exp(-2), 1.0, math.exp(2)], SIGMAS, LINEAR) == pytest.approx([0.5, 0.5])
    # block 0 owns [e^1, e^2]: CE 3 -> 4 of a 0 -> 4 drop
    assert ce_curve.block_shares([math.exp(-2), math.e, math.exp(2)], SIGMAS, LINEAR) == pytest.approx([0.25, 0.75])


def test_gain_shares_by_hand():
    """What the network adds, ce_z - ce, linear in ln(sigma): each block's mean is its midpoint value."""
    zero = [0.0] * len(SIGMAS)
    # ce_z = 2 * LINEAR, ce = LINEAR: the gain is LINEAR itself, mean 1 over [e^-2, 1] and 3 over [1, e^2]
    doubled = [2 * c for c in LINEAR]
    assert ce_curve.gain_shares([math.exp(-2), 1.0, math.exp(2)], SIGMAS, LINEAR, doubled) == pytest.approx([0.75, 0.25])
    # the same CE drop, all of it free (ce = ce_z): the network adds nothing anywhere, shares are even
    assert ce_curve.gain_shares([math.exp(-2), 1.0, math.exp(2)], SIGMAS, LINEAR, LINEAR) == pytest.approx([0.5, 0.5])
    # a network worse than z alone gains nothing there (clipped at 0), so the other block takes every share
    worse = [2 * c + 1 if s < 1 else c for c, s in zip(LINEAR, SIGMAS)]
    assert ce_curve.gain_shares([math.exp(-2), 1.0, math.exp(2)], SIGMAS, worse, doubled)[0] > 0.95
    assert ce_curve.gain_shares([math.exp(-2), 1.0, math.exp(2)], SIGMAS, zero, zero) == [0.5, 0.5]


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

    def run(m, x_):
        kv = m.clean_kv(0, m.clean_inputs(x_), slots)
        return m.noisy_pass(0, z, sigma, x_, slots + 1, kv, noisy_mask(slots, T))

    base = run(model, x)
    x2 = x.clone()
    x2[:, 6:] = (x2[:, 6:] + 1) % 41
    assert torch.equal(run(model, x2)[:, :6], base[:, :6])
    off = make()  # the same weights without the option: slot inputs differ
    assert not torch.allclose(run(off, x), base)
    settings = resolve_settings(model.iteration_limits(), num_iterations=2, sampling=GREEDY)
    g = torch.Generator().manual_seed(2)
    noise = [model.initial_noise(2, 1, SharedGenerator(g)) for _ in range(4)]
    out, logits = generate(model, x[:, :4], 4, settings, return_logits=True, noise=noise)
    for i in range(4):
        ref = uncached_next_logits(model, out[:, :4 + i], settings, noise[i])
        torch.testing.assert_close(logits[:, i], ref, atol=1e-5, rtol=1e-6)


def test_clean_lm_weight_adds_a_clean_stream_loss():
    x, y = torch.randint(0, 41, (2, 16)), torch.randint(0, 41, (2, 16))
    plain = make().train()
    torch.manual_seed(5)
    base, _ = plain.training_loss(x, y, step=0, seed=0)
    extra = make(clean_lm_weight=0.5).train()
    torch.manual_seed(5)
    loss, metrics = extra.training_loss(x, y, step=0, seed=0)
    assert loss.item() == pytest.approx(base.item() + 0.5 * float(metrics["clean_lm_loss"]), rel=1e-5)
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


def test_network_gain_sampling_follows_the_gain_not_the_drop():
    model = make(block_sampling="network_gain")
    model.set_edges([math.exp(-2), 1.0, math.exp(2)])
    # the drop splits 0.5 / 0.5 (loss_share), the gain 0.75 / 0.25 in block 0's favour
    model.apply_curve({"sigmas": SIGMAS, "ce": LINEAR, "ce_z": [2 * c for c in LINEAR]})
    picks = [model.choose_block(s, 0) for s in range(2000)]
    assert abs(picks.count(0) / 2000 - 0.75) < 0.04
    assert model.uses_curve()


def test_fixed_block_weights_set_each_blocks_share():
    model = make(block_sampling="fixed", block_weights=[3.0, 1.0])
    picks = [model.choose_block(s, 0) for s in range(2000)]
    assert abs(picks.count(0) / 2000 - 0.75) < 0.04 and not model.uses_curve()


def test_measured_curve_has_z_alone_from_uniform_to_exact():
    """ce_z is the CE of z's own likelihood: log V where z carries nothing (sigma_max), ~0 at sigma_min."""
    model = make(block_sampling="network_gain")
    x = torch.randint(0, 41, (2, 16))
    curve = model.measure_curve(x[:, :-1], x[:, 1:], seed=0)
    assert len(curve["ce_z"]) == len(curve["sigmas"])
    assert curve["ce_z"][-1] == pytest.approx(math.log(41), abs=0.15) and curve["ce_z"][0] < 0.01


def test_measured_curve_has_one_point_per_sigma_and_is_saved():
    model = make(block_sampling="loss_share")
    x = torch.randint(0, 41, (2, 16))
    curve = model.measure_curve(x[:, :-1], x[:, 1:], seed=0)
    assert len(curve["ce"]) == len(curve["sigmas"]) == 24 and all(c > 0 for c in curve["ce"])
    model.apply_curve(curve)
    assert model.checkpoint_state()["curve"] == curve
    assert model.uses_curve() and not make().uses_curve()  # uniform block sampling needs no curve


def test_clean_lm_weight_adds_the_clean_stream_loss_on_looped_db_too():
    """docs/method.md claims the option for both DB kinds: looped_db's one core gets the same extra term."""
    def looped(weight):
        cfg = config_from_dict({"model": {"kind": "looped_db", "n_layers": 2, "d_model": 32, "n_heads": 4,
                                          "seq_len": 16}, "diffusion": {"num_blocks": 1, "clean_lm_weight": weight}})
        torch.manual_seed(0)
        return build_model(cfg, 41).train()

    x, y = torch.randint(0, 41, (2, 16)), torch.randint(0, 41, (2, 16))
    torch.manual_seed(5)
    base, _ = looped(0.0).training_loss(x, y, step=0, seed=0)
    torch.manual_seed(5)
    loss, metrics = looped(0.5).training_loss(x, y, step=0, seed=0)
    assert metrics["clean_lm_loss"] > 0
    assert loss.item() == pytest.approx(base.item() + 0.5 * float(metrics["clean_lm_loss"]), rel=1e-5)
