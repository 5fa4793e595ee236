"""diffusion.top_share: a share of block 0's training samples sits at exactly sigma_max, where z carries
nothing (as at a chain's first call); the rest, and every other block, draw from their intervals as before."""

from __future__ import annotations

import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.errors import UserError
from tiny_models import V, build_tiny


def block_sigmas(model, b: int, batch: int = 64) -> torch.Tensor:
    """The sigmas block b's loss drew for one batch (the objective's own draw, captured at the noisy pass)."""
    seen = []
    noisy_pass = model.noisy_pass
    model.noisy_pass = lambda blk, z, sigma, *a, **k: seen.append(sigma) or noisy_pass(blk, z, sigma, *a, **k)
    x = torch.randint(0, V, (batch, 8), generator=torch.Generator().manual_seed(0))
    model.objective.block_loss(x, x.roll(-1, 1), b)
    model.noisy_pass = noisy_pass
    return seen[0]


@pytest.mark.parametrize("kind", ["db_ar", "looped_db"])
def test_block_0_takes_its_share_at_sigma_max(kind):
    torch.manual_seed(1)
    top = block_sigmas(build_tiny(kind, top_share=0.5).train(), 0)
    at_max = top == 80.0
    assert 0.25 < at_max.float().mean() < 0.75  # 64 draws of a fair coin
    assert (top[~at_max] < 80.0).all()
    torch.manual_seed(1)
    assert (block_sigmas(build_tiny(kind, top_share=1.0).train(), 0) == 80.0).all()


def test_other_blocks_and_the_default_draw_as_before():
    model = build_tiny("db_ar", top_share=1.0).train()
    low = block_sigmas(model, 1)
    lo, hi = model.train_ranges[1]
    assert ((low >= lo) & (low <= hi)).all() and (low < 80.0).all()
    torch.manual_seed(2)
    default = block_sigmas(build_tiny("db_ar").train(), 0)
    torch.manual_seed(2)
    zero = block_sigmas(build_tiny("db_ar", top_share=0.0).train(), 0)
    assert torch.equal(default, zero) and (default < 80.0).all()  # 0 draws nothing more: old runs stay bit-identical


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_a_share_outside_0_1_is_refused(bad):
    with pytest.raises(UserError, match="top_share must be in"):
        config_from_dict({"model": {"kind": "db_ar", "n_layers": 2}, "diffusion": {"num_blocks": 2, "top_share": bad}})
