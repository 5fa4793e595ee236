"""models/blockwise.py: the one BlockSchedule every DiffusionBlocks network trains its blocks by."""

import json

import pytest
import torch
import torch.nn as nn

from looped_lm import diffusion as dm
from looped_lm.diffusion import ce_curve
from looped_lm.diffusion.blocks import choose_block
from looped_lm.errors import UserError
from looped_lm.models.args import DBArgs, VitArgs
from looped_lm.models.blockwise import CURVE_FLOOR, BlockSchedule, noise_partition
from looped_lm.models.db.model import DiffusionBlocksLM
from looped_lm.models.vit import build as build_vit
from looped_lm.kinds import IterationLimits

SCHED = dm.NoiseSchedule()
EDGES = dm.make_edges("equi_probability", 4, SCHED)
RANGES = dm.widen(EDGES, 0.1)
CURVE = {"sigmas": [0.002, 0.05, 0.5, 3.0, 80.0], "ce": [0.1, 0.5, 2.0, 4.0, 5.0], "ce_z": [0.2, 1.5, 4.0, 5.5, 6.0]}


def schedule(blocks_to_train=(), sampling="uniform", block_weights=()):
    return BlockSchedule(EDGES, RANGES, blocks_to_train, sampling, block_weights)


def picks(s: BlockSchedule, n: int = 2000, seed: int = 0) -> list[int]:
    return [s.choose_block(step, seed) for step in range(n)]


def test_uniform_draws_the_shared_rule_over_every_block():
    assert picks(schedule(), 60, 5) == [choose_block(step, 5, range(4)) for step in range(60)]
    assert set(picks(schedule())) == {0, 1, 2, 3}


def test_round_robin_walks_the_trainable_blocks_in_the_order_given():
    assert picks(schedule((2, 0, 3), "round_robin"), 7) == [2, 0, 3, 2, 0, 3, 2]
    assert picks(schedule((), "round_robin"), 5) == [0, 1, 2, 3, 0]


def test_fixed_weights_follow_the_trainable_blocks():
    every = picks(schedule((), "fixed", (4.0, 1.0, 2.0, 0.5)))
    assert abs(every.count(0) / len(every) - 4 / 7.5) < 0.04 and abs(every.count(3) / len(every) - 0.5 / 7.5) < 0.02
    some = schedule((3, 1), "fixed", (4.0, 1.0, 2.0, 0.5))
    assert picks(some, 60, 9) == [choose_block(step, 9, [3, 1], "fixed", [0.5, 1.0]) for step in range(60)]
    assert abs(picks(some).count(1) / 2000 - 1 / 1.5) < 0.04  # block 1 weighs twice block 3


@pytest.mark.parametrize("rule", ["loss_share", "network_gain"])
def test_the_curve_rules_draw_uniformly_until_a_curve_then_by_its_shares(rule):
    s = schedule((2, 0, 3), rule)
    assert s.uses_curve() and s.weights() is None
    assert picks(s, 60, 3) == [choose_block(step, 3, [2, 0, 3]) for step in range(60)]
    s.curve = CURVE
    shares = (ce_curve.gain_shares(EDGES, CURVE["sigmas"], CURVE["ce"], CURVE["ce_z"]) if rule == "network_gain"
              else ce_curve.block_shares(EDGES, CURVE["sigmas"], CURVE["ce"]))
    weights = torch.tensor([shares[b] for b in (2, 0, 3)], dtype=torch.float64) + CURVE_FLOOR
    assert torch.equal(s.weights(), weights)
    assert picks(s, 60, 3) == [choose_block(step, 3, [2, 0, 3], rule, weights) for step in range(60)]
    assert not schedule((1,), rule).uses_curve()  # one trainable block: nothing to choose
    assert not schedule((), "uniform").uses_curve()


def test_a_subset_is_all_that_trains_and_all_that_is_chosen():
    s = schedule((3, 1))
    assert set(picks(s)) == {1, 3}
    blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    s.freeze_untrained(blocks)
    assert [all(p.requires_grad for p in block.parameters()) for block in blocks] == [False, True, False, True]


def test_a_step_updates_the_shared_parameters_and_its_own_block():
    s = schedule((2, 0, 3), "round_robin")
    assert [s.step_units(step, 0) for step in range(3)] == [{"shared", "block2"}, {"shared", "block0"},
                                                            {"shared", "block3"}]
    assert s.param_unit("blocks.3.0.attn.qkv.weight") == "block3"
    assert s.param_unit("tok_emb.weight") == "shared" and s.param_unit("coda.0.ada.bias") == "shared"


def test_the_state_round_trips_through_json():
    s = schedule((2, 0, 3), "network_gain")
    assert s.state() == {"edges": EDGES, "num_blocks": 4}  # no curve measured yet: none saved
    s.curve = CURVE
    saved = json.loads(json.dumps(s.state()))
    assert saved["curve"] == CURVE and saved["num_blocks"] == 4
    fresh = schedule((2, 0, 3), "network_gain")
    fresh.restore(saved)
    assert fresh.curve == CURVE and picks(fresh, 200, 1) == picks(s, 200, 1)
    with pytest.raises(UserError, match="cannot resume"):
        fresh.restore({**saved, "edges": [EDGES[0], *[e * 1.01 for e in EDGES[1:-1]], EDGES[-1]]})
    with pytest.raises(UserError, match="cannot resume"):
        fresh.restore({**saved, "num_blocks": 3})


def test_the_partition_is_the_args_or_the_checkpoints():
    args = VitArgs(num_blocks=4, overlap=0.1, partition="uniform", schedule=SCHED)
    edges, ranges = noise_partition(args, 4)
    assert edges == dm.make_edges("uniform", 4, SCHED) != EDGES and ranges == dm.widen(edges, 0.1)
    assert noise_partition(args, 4, EDGES) == (EDGES, RANGES)  # saved edges win over the args' partition
    with pytest.raises(UserError, match="saved edges have 4 blocks but the model has 3"):
        noise_partition(args, 3, EDGES)


def test_both_homes_train_by_their_schedule():
    lm = DiffusionBlocksLM(DBArgs(vocab_size=11, n_layers=2, d_model=16, n_heads=2, seq_len=8, block_layers=(1, 1),
                                  block_sampling="round_robin", blocks_to_train=(1, 0),
                                  limits=IterationLimits(2, 64, 2, "sample", False)))
    assert [lm.choose_block(step, 0) for step in range(3)] == [1, 0, 1]
    assert lm.edges is lm.block_schedule.edges and lm.checkpoint_state() == lm.block_schedule.state()
    vit = build_vit(VitArgs(image_size=8, channels=1, patch=2, n_layers=2, d_model=16, n_heads=2, num_blocks=2,
                            block_sampling="round_robin", blocks_to_train=(1, 0)), None)
    assert [vit.choose_block(step, 0) for step in range(3)] == [0, 1, 0]  # the modules walk their blocks ascending
    assert vit.checkpoint_state() == {**vit.block_schedule.state(), "end_to_end": False}
    whole = build_vit(VitArgs(image_size=8, channels=1, patch=2, n_layers=2, d_model=16, n_heads=2, num_blocks=2,
                              end_to_end=True), None)
    assert whole.step_units(0, 0) is None and vit.step_units(0, 0) == {"shared", "block0"}
