"""The block mechanics every kind shares (looped_lm/diffusion/blocks.py): block choice and the chain's grid."""

import pytest
import torch

from looped_lm import diffusion as dm
from looped_lm.diffusion.blocks import ChainGrid, chain_grid, choose_block
from tiny_models import build_tiny, tiny_module


def test_block_choice_is_seeded_round_robin_or_weighted():
    assert [choose_block(s, 0, [1, 3], "round_robin") for s in range(4)] == [1, 3, 1, 3]
    picks = [choose_block(s, 5, range(3)) for s in range(300)]
    assert picks == [choose_block(s, 5, range(3)) for s in range(300)]  # (step, seed) alone decide
    assert picks != [choose_block(s, 6, range(3)) for s in range(300)]
    assert all(abs(picks.count(b) / 300 - 1 / 3) < 0.1 for b in range(3))
    heavy = [choose_block(s, 5, [0, 1], weights=[0.9, 0.1]) for s in range(400)]
    assert 0.8 < heavy.count(0) / 400 < 0.97


def test_a_module_built_from_a_config_takes_fixed_block_weights():
    """block_sampling fixed reaches the modules through their build (adaln.finish_build): block 0 first."""
    from looped_lm.config import config_from_dict
    from looped_lm.models import build_model

    cfg = config_from_dict({"model": {"kind": "vit", "n_layers": 3, "d_model": 32, "n_heads": 2, "image_size": 8,
                                      "channels": 1, "patch": 2},
                            "diffusion": {"num_blocks": 3, "block_sampling": "fixed", "block_weights": [6, 2, 2]},
                            "data": {"source": "digits"}})
    model = build_model(cfg, 10)
    picks = [model.choose_block(s, 0) for s in range(2000)]
    assert abs(picks.count(0) / 2000 - 0.6) < 0.04 and abs(picks.count(2) / 2000 - 0.2) < 0.04


@pytest.mark.parametrize("kind", ["vit", "dit", "mdm"])
def test_every_module_chooses_by_the_shared_rule(kind):
    model = tiny_module(kind)
    assert [model.choose_block(s, 7) for s in range(40)] == [choose_block(s, 7, range(model.num_blocks))
                                                              for s in range(40)]


def test_the_language_models_block_choice_is_the_shared_rule():
    """db_ar's uniform and loss_share choice draw what `choose_block` draws, with loss_share's weights
    taken from the measured CE curve."""
    lm = build_tiny("db_ar", block_sampling="uniform")  # B = 2
    assert [lm.choose_block(s, 3) for s in range(40)] == [choose_block(s, 3, [0, 1]) for s in range(40)]
    lm = build_tiny("db_ar", block_sampling="loss_share")
    lm.objective.curve = {"sigmas": [0.01, 0.3, 10.0], "ce": [0.1, 2.0, 5.0]}
    from looped_lm.diffusion import ce_curve

    shares = ce_curve.block_shares(lm.edges, lm.objective.curve["sigmas"], lm.objective.curve["ce"])
    weights = torch.tensor(shares, dtype=torch.float64) + 1e-3
    assert [lm.choose_block(s, 3) for s in range(40)] == [choose_block(s, 3, [0, 1], weights=weights)
                                                           for s in range(40)]


def test_grid_of_the_official_code():
    """last_call sigma_min with K = B: calls on the inclusive CDF grid [top, ..., sigma_min], one per block;
    `edge`: the intervals' top edges."""
    sched = dm.NoiseSchedule()
    edges = dm.equi_probability_edges(3, sched)
    ranges = dm.widen(edges, 0.05)
    grid = chain_grid(edges, ranges, sched, 1.0, "sigma_min")
    assert grid.sigmas(3)[:3] == pytest.approx([80.0, 0.301, 0.002], abs=1e-3) and grid.blocks(3) == [0, 1, 2]
    assert ChainGrid(tuple(edges), 80.0, "edge", sched).sigmas(3)[:3] == pytest.approx([80, 0.505, 0.180], abs=1e-3)
    assert grid.steps_per_block(6) == [2, 2, 2] and grid.steps_per_block(1) == [1, 0, 0]
    top = chain_grid(edges, ranges, sched, 0.999, "sigma_min").sigma_top
    assert edges[-2] < top < 80  # a quantile block 0 actually trains on


def test_extra_calls_in_block_0_keep_the_k_equals_b_grid_below_it():
    """extra_calls block0: the K = B grid, with the calls beyond B equally in block 0's CDF from sigma_top down
    (above its lower edge); K <= B and a single block are the spread grid itself."""
    sched = dm.NoiseSchedule()
    edges = dm.equi_probability_edges(3, sched)
    ranges = dm.widen(edges, 0.05)
    spread = chain_grid(edges, ranges, sched, 0.999, "sigma_min")
    block0 = chain_grid(edges, ranges, sched, 0.999, "sigma_min", "block0")
    for K in (1, 2, 3):
        assert block0.sigmas(K) == spread.sigmas(K)
    for K in (4, 7):
        sigmas = block0.sigmas(K)
        assert len(sigmas) == K + 1 and sigmas == sorted(sigmas, reverse=True)
        assert block0.blocks(K) == [0] * (K - 2) + [1, 2]
        assert sigmas[K - 2:] == spread.sigmas(3)[1:]  # below block 0: the K = B grid
        assert sigmas[0] == spread.sigma_top and min(sigmas[:K - 2]) > edges[-2]
        q = [float(dm.cdf_range(edges[-2], s, sched)[1]) for s in sigmas[:K - 2] + [edges[-2]]]
        steps = [a - b for a, b in zip(q, q[1:])]
        assert max(steps) == pytest.approx(min(steps), rel=1e-6)  # equal steps in block 0's noise CDF
    assert spread.steps_per_block(6) == [2, 2, 2] and block0.steps_per_block(6) == [4, 1, 1]
    one = [edges[0], edges[-1]]
    assert chain_grid(one, [tuple(one)], sched, 0.999, "sigma_min", "block0").sigmas(5) == \
        chain_grid(one, [tuple(one)], sched, 0.999, "sigma_min").sigmas(5)
