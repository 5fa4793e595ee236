"""The DiffusionBlocks DiT denoiser and its end-to-end baseline (looped_lm/models/dit.py)."""

import functools
import math
from pathlib import Path

import pytest
import torch

from looped_lm import diffusion as dm
from looped_lm.config import load_config
from looped_lm.errors import UserError
from looped_lm.models.dit import frechet_distance
from tiny_models import TINY_MODULES, grads_of_one_block, module_config, image_batch, tiny_module

TINY = TINY_MODULES["dit"][0]
tiny = functools.partial(tiny_module, "dit")  # a 2-layer DiT in B = 2 blocks
batch = image_batch


def test_the_imagenet_config_is_dit_l2():
    paper = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "dit_imagenet256.yaml"))
    m, d = paper.model, paper.diffusion
    assert (m.n_layers, m.d_model, m.n_heads, m.patch, d.label_dropout, d.overlap) == (24, 1024, 16, 2, 0.1, 0.05)


def test_denoiser_is_the_edm_skip_at_init_and_shapes_hold():
    model = tiny(perturb=False)
    x, y = batch()
    sigma = torch.full((6,), 0.7)
    z = x + 0.7 * torch.randn_like(x)
    c_skip = 0.25 / (0.49 + 0.25)
    assert torch.allclose(model.denoise(0, z, sigma, y), c_skip * z)  # zero output layer: F = 0
    assert tiny().denoise(1, z, sigma, y).shape == (6, 1, 8, 8)


def test_one_block_per_step_only_that_block_and_shared_parts_get_gradients():
    model = tiny()
    x, y = batch()
    for step in range(4):
        b = model.choose_block(step, seed=1)
        model.zero_grad(set_to_none=True)
        loss, metrics = model.training_loss(x, y, step, seed=1)
        loss.backward()
        assert metrics["block"] == b and model.step_units(step, 1) == {"shared", f"block{b}"}
        lo, hi = model.train_ranges[b]
        assert lo <= metrics["sigma_mean"] <= hi
        got = grads_of_one_block(model, b)
        assert {"patch_embed.weight", "out.weight", "label_emb.weight"} <= got


@pytest.mark.slow
@pytest.mark.parametrize("end_to_end", [False, True])
def test_loss_decreases_on_a_fixed_batch(end_to_end):
    model = tiny(perturb=False, end_to_end=end_to_end, block_sampling="round_robin")
    _, y = batch(16)
    x = torch.linspace(-1, 1, 64).view(1, 1, 8, 8).expand(16, 1, 8, 8)  # one image to learn
    start = float(model.validation_loss(x, y, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(40):
        loss, _ = model.training_loss(x, y, step, seed=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(model.validation_loss(x, y, seed=0)) < 0.6 * start


def test_label_dropout_uses_the_null_class():
    model = tiny(label_dropout=0.5)
    torch.manual_seed(0)
    y = torch.zeros(4000, dtype=torch.long)
    dropped = (model.drop_labels(y, 4000, "cpu") == model.null_label).float().mean()
    assert abs(float(dropped) - 0.5) < 0.03
    assert not (tiny(label_dropout=0.0).drop_labels(y, 4000, "cpu") == 10).any()


def test_sampling_is_seeded_routed_and_guided(monkeypatch):
    model = tiny()
    y = torch.tensor([1, 2, 3])
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    a = model.sample(y, steps=4, cfg_scale=2.0, generator=g(0))
    assert a.shape == (3, 1, 8, 8) and a.abs().max() <= 1
    assert torch.equal(a, model.sample(y, steps=4, cfg_scale=2.0, generator=g(0)))
    assert not torch.equal(a, model.sample(y, steps=4, cfg_scale=2.0, generator=g(1)))
    assert not torch.equal(a, model.sample(y, steps=4, cfg_scale=1.0, generator=g(0)))  # guidance matters
    calls = []
    inner = model.denoise
    monkeypatch.setattr(model, "denoise", lambda b, z, s, l: calls.append((b, z.shape[0])) or inner(b, z, s, l))
    model.sample(y, steps=4, cfg_scale=2.0)
    assert calls == [(0, 6), (0, 6), (1, 6), (1, 6)]  # equal steps per block; cond + null in one batch
    calls.clear()
    model.sample(y, steps=2, cfg_scale=1.0)
    assert calls == [(0, 3), (1, 3)]
    assert model.steps_per_block(50) == [25, 25]
    assert tiny(num_blocks=1).steps_per_block(50) == [50]


def test_sampler_runs_the_lm_grid_and_returns_the_last_calls_denoised_image(monkeypatch):
    """The chain starts at a quantile block 0 trains on, its last call runs at sigma_min, and the sample is
    that call's D (not z stepped onto sigma_min from the previous call)."""
    model = tiny()
    y = torch.tensor([1, 2, 3])
    seen, inner = [], model.denoise

    def spy(b, z, sigma, labels):
        D = inner(b, z, sigma, labels)
        seen.append((b, float(sigma[0]), D))
        return D

    monkeypatch.setattr(model, "denoise", spy)
    out = model.sample(y, steps=3, cfg_scale=1.0, generator=torch.Generator().manual_seed(0))
    assert [b for b, _, _ in seen] == [0, 1, 1]  # the midpoint is the edge: the lower block owns it
    sigmas = [s for _, s, _ in seen]
    assert sigmas[0] == pytest.approx(model.grid.sigma_top) and model.edges[1] < sigmas[0] < 80
    assert sigmas[2] == pytest.approx(0.002)
    assert torch.allclose(out, seen[-1][2].clamp(-1, 1))


def test_guidance_zero_is_the_unconditional_model():
    model = tiny()
    y = torch.tensor([1, 2])
    a = model.sample(y, steps=2, cfg_scale=0.0, generator=torch.Generator().manual_seed(0))
    b = model.sample(torch.tensor([7, 9]), steps=2, cfg_scale=0.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)  # scale 0 keeps only the null-label pass
    c = model.sample(torch.tensor([7, 9]), steps=2, cfg_scale=1.0, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(a, c)


def test_end_to_end_baseline_is_one_block_over_the_whole_range():
    model = tiny(end_to_end=True)
    assert model.num_blocks == 1 and len(model.blocks[0]) == 2
    assert model.edges == [0.002, 80.0] and model.step_units(3, 0) is None


def test_frechet_distance_against_hand_computed_values():
    a = torch.tensor([[0.0], [2.0]])  # mean 1, variance 2 (unbiased)
    b = torch.tensor([[0.0], [4.0]])  # mean 2, variance 8
    assert frechet_distance(a, b) == pytest.approx(1 + 2 + 8 - 2 * math.sqrt(16))
    x = torch.randn(200, 5, generator=torch.Generator().manual_seed(0))
    assert frechet_distance(x, x) == pytest.approx(0.0, abs=1e-6)
    assert frechet_distance(x, x + 1) == pytest.approx(5.0, abs=1e-6)
    with pytest.raises(UserError):
        frechet_distance(x, torch.randn(10, 4))


def test_bad_input_raises_one_clear_line():
    model = tiny()
    x, y = batch()
    with pytest.raises(UserError, match=r"num_iterations \(sampler steps\) \(1\) must be >= the number of blocks \(2\)"):
        model.sample(y, steps=1)
    with pytest.raises(UserError, match="label id 12 is out of range"):
        model.sample(torch.tensor([12]), steps=4)
    with pytest.raises(UserError, match="label id 10"):
        model.training_loss(x, torch.full((6,), 10), 0, 0)
    with pytest.raises(UserError, match="not divisible by model.patch"):
        module_config("dit", image_size=9)
    with pytest.raises(UserError, match="larger than model.n_layers"):
        module_config("dit", num_blocks=3)
    with pytest.raises(UserError, match=r"diffusion.label_dropout must be in \[0, 1\)"):
        module_config("dit", label_dropout=1.0)
    with pytest.raises(UserError, match="cfg_scale"):
        model.sample(y, steps=2, cfg_scale=-1)


def test_noise_intervals_come_from_the_shared_partition():
    model = tiny(num_blocks=2)
    assert model.edges == pytest.approx(dm.equi_probability_edges(2, dm.NoiseSchedule()))
    assert model.train_ranges == dm.widen(model.edges, 0.05)
