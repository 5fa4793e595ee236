"""The DiffusionBlocks ViT classifier and its end-to-end baseline (looped_lm/models/vit.py)."""

import functools
from pathlib import Path

import pytest
import torch

from looped_lm import diffusion as dm
from looped_lm.config import load_config
from looped_lm.errors import UserError
from looped_lm.models import build_model
from looped_lm.optim import BlockwiseAdamW, param_groups
from tiny_models import TINY_MODULES, grads_of_one_block, module_config, image_batch, tiny_module

REPO = Path(__file__).resolve().parents[1]
TINY = TINY_MODULES["vit"][0]
tiny = functools.partial(tiny_module, "vit")  # a 3-layer ViT in B = 3 blocks
batch = image_batch


def test_shapes_and_defaults():
    paper = load_config(str(REPO / "configs" / "vit_cifar100.yaml"))  # the paper's CIFAR-100 ViT
    m, d = paper.model, paper.diffusion
    assert (m.n_layers, m.patch, m.d_model, m.n_heads, d.num_blocks, d.overlap) == (12, 4, 128, 4, 3, 0.05)
    assert (d.loss_weight, d.bridge, d.parameterization) == ("batch_mean", "soft", "edm")  # the official code's
    assert d.sample_top_quantile == 1.0  # the chain starts at sigma_max, as the official code (chosen on dev)
    model = tiny()
    x, y = batch()
    assert model.predict(x).shape == (6, 10)
    assert model.predict(x, 6).shape == (6, 10)
    assert model.num_blocks == 3 and all(len(block) == 1 for block in model.blocks)
    assert model.edges == pytest.approx([0.002, 0.180, 0.505, 80.0], abs=1e-3)
    out = model.accuracy(x, y, num_iterations=3, batch_size=4)
    assert set(out) == {"accuracy", "examples", "num_iterations"} and out["examples"] == 6
    assert out["num_iterations"] == 3


def test_classifier_starts_at_zero_and_label_takes_the_cls_slot():
    model = tiny(perturb=False)
    x, y = batch()
    assert torch.equal(model.predict(x), torch.zeros(6, 10))  # zero-initialised classifier
    model = tiny()
    patches = model.embed_patches(x)
    sigma = torch.full((6,), 0.5)
    z = model.label_table[y] + 0.5 * torch.randn(6, 32)
    a = model.block_logits(1, patches, z, sigma)
    b = model.block_logits(1, patches, z + 0.3, sigma)
    assert not torch.allclose(a, b)  # the noisy label in the slot reaches the logits


def test_likelihood_parameterization_adds_the_exact_label_likelihood():
    model = tiny(perturb=False, parameterization="likelihood")  # zero head: only the likelihood term is left
    x, y = batch()
    patches = model.embed_patches(x)
    sigma = torch.tensor([0.1, 0.2, 0.5, 1.0, 2.0, 80.0])
    z = model.label_table[y] + sigma[:, None] * torch.randn(6, 32)
    expected = (z @ model.label_table.T) / sigma[:, None] ** 2  # log N(z; y_v, sigma^2) + const (|y_v| = 1)
    assert torch.allclose(model.block_logits(2, patches, z, sigma), expected, atol=1e-5)


def test_one_block_per_step_only_that_block_and_shared_parts_get_gradients():
    model = tiny()
    x, y = batch()
    for step in range(6):
        b = model.choose_block(step, seed=3)
        model.zero_grad(set_to_none=True)
        loss, metrics = model.training_loss(x, y, step, seed=3)
        loss.backward()
        assert metrics["block"] == b
        assert model.step_units(step, 3) == {"shared", f"block{b}"}
        got = grads_of_one_block(model, b)
        assert {"patch_embed.weight", "head.weight", "pos_emb"} <= got
        assert any(n.startswith("noise_emb.") for n in got)


def test_optimiser_moves_only_the_chosen_block():
    """Under DeepSpeed the idle blocks get zero gradients, not None: weight decay and momentum would move
    them unless step_units / param_unit keep them out of the step."""
    model = tiny()
    opt = BlockwiseAdamW(param_groups(model, 0.1), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch()
    b = model.choose_block(0, 0)
    opt.set_active_units(model.step_units(0, 0))
    loss, _ = model.training_loss(x, y, 0, 0)
    loss.backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        unit = model.param_unit(name)
        moved = not torch.equal(p, before[name])
        if unit.startswith("block"):
            assert moved == (unit == f"block{b}"), name
    assert {model.param_unit(n) for n, _ in model.named_parameters()} == {"shared", "block0", "block1", "block2"}


@pytest.mark.parametrize("end_to_end", [False, True])
def test_loss_decreases_on_a_fixed_batch(end_to_end):
    """Every block's loss on the same batch, sigma and noise (the global RNG re-seeded) falls."""
    model = tiny(perturb=False, end_to_end=end_to_end, block_sampling="round_robin")
    _, y = batch(16)
    patterns = torch.rand(10, 1, 8, 8, generator=torch.Generator().manual_seed(9)) * 2 - 1
    x = patterns[y]  # one picture per class

    def losses():
        out = []
        for step in range(model.num_blocks):  # round-robin: step b trains block b
            torch.manual_seed(123)
            out.append(float(model.training_loss(x, y, step, seed=0)[0].detach()))
        return out

    start = losses()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(45):
        loss, _ = model.training_loss(x, y, step, seed=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(after < 0.8 * before for after, before in zip(losses(), start)), (start, losses())


def test_inference_runs_one_step_per_block_and_is_seeded(monkeypatch):
    model = tiny()
    x, _ = batch()
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    assert torch.equal(model.predict(x, 3, g(1)), model.predict(x, 3, g(1)))
    assert not torch.equal(model.predict(x, 3, g(1)), model.predict(x, 3, g(2)))
    calls = []
    inner = model.block_logits
    monkeypatch.setattr(model, "block_logits", lambda b, *a: calls.append(b) or inner(b, *a))
    model.predict(x, 3)
    assert calls == [0, 1, 2]
    calls.clear()
    model.predict(x, 6)
    assert calls == [0, 0, 1, 1, 2, 2]


def record_calls(monkeypatch, model):
    """[(block, sigma, logits)] of every block_logits call the model makes from now on."""
    seen, inner = [], model.block_logits

    def spy(b, patches, z, sigma, with_features=False):
        out = inner(b, patches, z, sigma, with_features)
        seen.append((b, float(sigma[0]), out[0] if with_features else out))
        return out

    monkeypatch.setattr(model, "block_logits", spy)
    return seen


def test_chain_is_the_official_grid_and_the_last_call_at_sigma_min_is_the_prediction(monkeypatch):
    """B calls on the inclusive CDF grid: block 0 at sigma_top (a quantile block 0 trains on), block 1 at the
    grid's midpoint 0.301, block 2 at sigma_min; the logits of that last call are the prediction."""
    model = tiny()
    x, _ = batch()
    seen = record_calls(monkeypatch, model)
    logits = model.predict(x, 3, torch.Generator().manual_seed(0))
    assert [b for b, _, _ in seen] == [0, 1, 2]
    sigmas = [s for _, s, _ in seen]
    lo, hi = model.train_ranges[0]
    q_lo, q_hi = dm.lognormal_cdf(lo, -1.2, 1.2), dm.lognormal_cdf(hi, -1.2, 1.2)
    assert sigmas[0] == pytest.approx(dm.lognormal_icdf(q_lo + 0.999 * (q_hi - q_lo), -1.2, 1.2), rel=1e-5)
    assert model.edges[-2] < sigmas[0] < 80  # inside block 0's training interval, below sigma_max
    assert sigmas[1:] == pytest.approx([0.301, 0.002], abs=1e-3)
    assert torch.equal(logits, seen[-1][2])
    edge = tiny(last_call="edge", sample_top_quantile=1.0)
    seen = record_calls(monkeypatch, edge)
    edge.predict(x, 3)
    assert [s for _, s, _ in seen] == pytest.approx([80.0, 0.505, 0.180], abs=1e-3)  # the intervals' top edges


def test_network_term_is_c_out_times_a_layer_norm_with_its_gain():
    """h = c_out * LayerNorm(F) + c_skip * z: the network's term has norm c_out * gain * sqrt(d) (not capped
    at c_out), and with the final adaLN at zero the head reads h itself."""
    model = tiny()
    with torch.no_grad():
        model.final_ada.weight.zero_()
        model.final_ada.bias.zero_()
        model.norm.weight.fill_(2.0)
        model.norm.bias.zero_()
    x, y = batch()
    sigma = torch.full((6,), 1.0)
    z = model.label_table[y] + torch.randn(6, 32)
    _, h = model.block_logits(1, model.embed_patches(x), z, sigma, with_features=True)
    c_skip, c_out, _, _ = (float(c[0]) for c in dm.edm_scalings(sigma, 0.5))
    term = (h - c_skip * z).norm(dim=-1)
    assert torch.allclose(term, torch.full((6,), c_out * 2.0 * 32 ** 0.5), rtol=1e-3)


def test_noise_embedding_is_smooth():
    """DiT's timestep embedder: every frequency <= 1 rad per unit c_noise, so the embedding's input moves by at
    most |delta c_noise| per feature; the LM's embedding turns up to 1000 rad per unit (a rough code)."""
    model = tiny(perturb=False)
    assert float(model.noise_emb.freqs.max()) == 1.0
    c = torch.linspace(-1.6, 1.1, 200)
    emb = model.noise_emb(c)
    assert (emb[1:] - emb[:-1]).norm(dim=-1).max() < 0.1 * emb.norm(dim=-1).mean()


def test_end_to_end_baseline_is_one_pass_of_all_layers():
    model = tiny(end_to_end=True)
    assert model.num_blocks == 1 and len(model.blocks[0]) == 3
    assert model.step_units(5, 0) is None
    assert model.checkpoint_state()["end_to_end"] is True
    x, y = batch()
    assert model.accuracy(x, y)["num_iterations"] == 1
    loss, metrics = model.training_loss(x, y, 0, 0)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_loss_weights_normalised_per_block():
    """edm: w(sigma) / E_block[w] per sample; batch_mean (the default, the official code's `loss * w[:, None]`
    broadcast): the batch's mean of that, the same for every sample of the block's step; none: ones."""
    sigma = torch.tensor([0.01, 0.1])
    model = tiny(loss_weight="edm")
    expected = dm.edm_weight(sigma, 0.5) / dm.edm_loss_weight_normaliser(*model.train_ranges[2], model.sched)
    assert torch.allclose(model.loss_weights(sigma, 2), expected.float())
    uniform = tiny().loss_weights(sigma, 2)
    assert torch.allclose(uniform, expected.float().mean().expand(2))
    assert torch.equal(tiny(loss_weight="none").loss_weights(sigma, 2), torch.ones(2))


@pytest.mark.parametrize("kw, match", [
    (dict(image_size=10, patch=4), "not divisible by model.patch"),
    (dict(num_blocks=4), "larger than model.n_layers"),
    (dict(num_blocks=2), "must divide"),
    (dict(d_model=31), "divisible by model.n_heads"),
    (dict(d_model=30), "must be even"),
    (dict(bridge="magic"), "diffusion.bridge must be one of"),
    (dict(last_call="middle"), "diffusion.last_call must be one of"),
    (dict(loss_weight="loss_share"), "diffusion.loss_weight must be one of"),
])
def test_bad_settings_raise_one_clear_line(kw, match):
    with pytest.raises(UserError, match=match):
        build_model(module_config("vit", **kw), 10)


def test_bad_input_raises_one_clear_line():
    model = tiny()
    x, y = batch()
    with pytest.raises(UserError, match="label id 10 is out of range"):
        model.training_loss(x, torch.full((6,), 10), 0, 0)
    with pytest.raises(UserError, match="label id -1"):
        model.accuracy(x, torch.full((6,), -1))
    with pytest.raises(UserError, match=r"num_iterations \(2\) must be >= the number of blocks \(3\)"):
        model.predict(x, 2)
    with pytest.raises(UserError, match=r"shape \(N, 1, 8, 8\)"):
        model.predict(torch.zeros(2, 3, 8, 8))
