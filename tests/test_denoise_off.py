"""diffusion.denoise_weight 0, the control arm: each block trains on the clean next-token loss alone (the
blocks before it in the stack frozen and detached), and the model is read through its clean stream."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looped_lm.config import config_from_dict
from looped_lm.errors import UserError
from looped_lm.eval import format_table, report
from looped_lm.kinds import get_kind
from looped_lm.settings import ScoreSettings
from tiny_models import V, build_tiny

OFF = dict(denoise_weight=0.0, clean_lm_weight=1.0, context="stacked", block_sampling="uniform")


def test_the_arm_needs_a_clean_loss_a_stack_and_no_curve_rule():
    base = {"model": {"kind": "db_ar", "n_layers": 2}, "diffusion": {**OFF, "num_blocks": 2}}
    assert config_from_dict(base, flat_era=False).diffusion.denoise_weight == 0
    for change, needle in (({"clean_lm_weight": 0.0}, "leaves no loss"),
                           ({"block_sampling": "network_gain"}, "reads the denoiser's CE curve"),
                           ({"context": "independent"}, "needs diffusion.context stacked"),
                           ({"denoise_weight": -1.0}, "must be >= 0")):
        with pytest.raises(UserError, match=needle):
            config_from_dict({**base, "diffusion": {**base["diffusion"], **change}}, flat_era=False)


def clean_readout_nll(model, x, y):
    """The stack's clean stream by hand: prelude, block 0 then block 1's layers, the tied head."""
    h, pos = model.tok_emb(x), torch.arange(x.shape[1])
    cos, sin = model.rope(pos)
    for layer in model.prelude:
        h = layer(h, cos, sin)
    for b in model.stack_order:
        for layer in model.blocks[b]:
            h, _, _ = layer.clean(h, cos, sin)
    logits = F.linear(model.norm(h), model.tok_emb.weight)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)


def test_a_step_trains_one_block_on_its_clean_loss_and_the_model_reads_as_an_lm():
    model = build_tiny("db_ar", **OFF).train()
    x = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(0))
    y = x.roll(-1, 1)
    for b in (0, 1):
        model.zero_grad()
        loss, metrics = model.objective.block_loss(x, y, b)
        loss.backward()
        moved = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert any(n.startswith(f"blocks.{b}.") for n in moved)
        assert not any(n.startswith(f"blocks.{1 - b}.") for n in moved), "the other block is frozen and detached"
        assert not any("noise_emb" in n or ".noisy" in n for n in moved), "no noisy stream runs"
        assert metrics == {"block": b, f"loss_block{b}": metrics[f"loss_block{b}"]}
    model.eval()
    scores = model.score(x, y, ScoreSettings(k_grid=(2,), draws=1), torch.Generator().manual_seed(1))
    assert set(scores) == {"clean"}, "an untrained denoiser's ppl@k are not reported"
    torch.testing.assert_close(scores["clean"].nll, clean_readout_nll(model, x, y))
    torch.testing.assert_close(model.validation_loss(x, y, 0), scores["clean"].nll.mean())
    rep = report({"clean": float(scores["clean"].nll.sum())}, {}, y.numel(), 16, 0, "byte", "d", None, "db_ar")
    assert rep["primary"] == "clean" and rep["ppl"] == rep["ppl_clean"] and "| clean |" in format_table(rep)
    with pytest.raises(UserError, match="cannot sample"):
        model.new_cache(1, 16)


def test_a_denoising_model_with_a_clean_loss_reports_both():
    model = build_tiny("db_ar", clean_lm_weight=1.0, context="stacked")
    x = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    scores = model.score(x, x.roll(-1, 1), ScoreSettings(k_grid=(2,), draws=2), torch.Generator().manual_seed(1))
    assert set(scores) == {0, 2, "clean"}
    independent = build_tiny("db_ar", clean_lm_weight=1.0)  # blocks are separate shallow LMs: no one readout
    assert "clean" not in independent.score(x, x.roll(-1, 1), ScoreSettings(k_grid=(2,), draws=2))


def test_the_cost_model_charges_the_clean_stream_only():
    cfg = config_from_dict({"model": {"kind": "db_ar", "n_layers": 4, "seq_len": 64},
                            "diffusion": {**OFF, "num_blocks": 2}}, flat_era=False)
    on = config_from_dict({"model": {"kind": "db_ar", "n_layers": 4, "seq_len": 64},
                           "diffusion": {**OFF, "num_blocks": 2, "denoise_weight": 1.0}}, flat_era=False)
    kind = get_kind("db_ar")
    first, second, on_flops = (kind.step_flops(cfg, 257, 8, 0), kind.step_flops(cfg, 257, 8, 1),
                               kind.step_flops(on, 257, 8, 1))
    gpt = {n: get_kind("gpt").step_flops(config_from_dict({"model": {"kind": "gpt", "n_layers": n, "seq_len": 64}},
                                                           flat_era=False), 257, 8) for n in (2, 4)}
    # the first block of the stack: its clean stream (2 layers) and the head, a 2-layer gpt's step
    assert first == pytest.approx(gpt[2], rel=0.01)
    # the second also runs the first block forward (no gradient): a third of two layers' training cost
    assert second - first == pytest.approx((gpt[4] - gpt[2]) / 3, rel=0.01)
    assert second < 0.7 * on_flops
