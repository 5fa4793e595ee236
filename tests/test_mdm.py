"""Masked diffusion over characters (looped_lm/models/mdm.py) and the text8 data (looped_lm/data/text8.py)."""

import functools
import math

import numpy as np
import pytest
import torch

from looped_lm.data import text8
from looped_lm.errors import UserError
from looped_lm.models.mdm import alpha, elbo_weight, masked_nelbo, route_time, time_edges, time_intervals
from tiny_models import TINY_MODULES, grads_of_one_block, module_config, tiny_module

TINY = TINY_MODULES["mdm"][0]
tiny = functools.partial(tiny_module, "mdm")  # 3 layers in B = 3 blocks


def ids(n=4, T=16, seed=0):
    return torch.randint(27, (n, T), generator=torch.Generator().manual_seed(seed))


# --- the schedule and its partition -----------------------------------------------------------------


def test_partition_of_the_masking_schedule():
    assert time_edges(3, "linear") == [0.0, 1 / 3, 2 / 3, 1.0]
    cosine = time_edges(3, "cosine")
    assert [alpha(t, "cosine") for t in cosine] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])  # alpha(t_b) = 1 - b/B
    # block 0 owns the noisiest interval; an inner edge belongs to the lower-t block
    assert [route_time(t, [0, 1 / 3, 2 / 3, 1]) for t in (1.0, 0.9, 2 / 3, 0.5, 1 / 3, 0.01)] == [0, 0, 1, 1, 2, 2]
    assert sum(time_intervals([0, 0.5, 1.0], 0.1), ()) == pytest.approx((0.45, 1.0, 0.0, 0.55))
    t = torch.tensor([0.25, 0.5])
    assert torch.allclose(elbo_weight(t, "linear"), 1 / t)
    # cosine: -alpha'(t) / (1 - alpha(t)) by finite differences
    h = 1e-4
    deriv = (alpha(t + h, "cosine") - alpha(t - h, "cosine")) / (2 * h)
    assert torch.allclose(elbo_weight(t, "cosine"), -deriv / (1 - alpha(t, "cosine")), rtol=1e-3)


def test_block_trains_on_its_own_t_range():
    model = tiny(overlap=0.0)
    x = ids(64)
    for step in range(6):
        b = model.choose_block(step, 0)
        _, metrics = model.training_loss(x, None, step, 0)
        lo, hi = model.train_ranges[b]
        assert lo - 0.1 < metrics["masked"] < hi + 0.1  # masked share ~ t (linear schedule): inside the block's range
    assert model.train_ranges == [(2 / 3, 1.0), (1 / 3, 2 / 3), (0.0, 1 / 3)]


# --- leaks -----------------------------------------------------------------------------------------


def test_masked_positions_cannot_see_their_own_token():
    model = tiny()
    x = ids()
    t = torch.full((4,), 0.5)
    x_t, mask = model.corrupt(x, t, torch.Generator().manual_seed(3))
    other = torch.where(mask, (x + 1) % 27, x)  # different characters under every mask
    other_t, other_mask = model.corrupt(other, t, torch.Generator().manual_seed(3))
    assert torch.equal(mask, other_mask) and mask.any() and (~mask).any()
    assert torch.equal(model.logits(1, x_t, t), model.logits(1, other_t, t))


def test_unmasked_positions_predictions_are_not_used():
    x = ids()
    mask = torch.rand(4, 16, generator=torch.Generator().manual_seed(1)) < 0.5
    logits = torch.randn(4, 16, 27, requires_grad=True)
    loss = masked_nelbo(logits, x, mask, torch.full((4,), 2.0)).sum()
    loss.backward()
    assert torch.equal(logits.grad[~mask], torch.zeros_like(logits.grad[~mask]))
    assert logits.grad[mask].abs().sum() > 0
    moved = logits.detach() + 5 * torch.randn(4, 16, 27) * (~mask)[..., None]
    assert torch.allclose(masked_nelbo(moved, x, mask, torch.full((4,), 2.0)).sum(), loss)


def test_sampling_never_changes_a_revealed_character(monkeypatch):
    model = tiny()
    seen = []
    inner = model.logits
    monkeypatch.setattr(model, "logits", lambda b, x_t, t: seen.append((b, x_t.clone())) or inner(b, x_t, t))
    out = model.sample(3, 16, steps=6, generator=torch.Generator().manual_seed(0))
    assert [b for b, _ in seen] == [0, 0, 1, 1, 2, 2]  # steps routed to blocks, equal shares
    assert (seen[0][1] == model.mask_id).all()
    states = [x for _, x in seen] + [out]
    for before, after in zip(states, states[1:]):
        revealed = before != model.mask_id
        assert torch.equal(after[revealed], before[revealed])
    assert (out < 27).all() and (out >= 0).all()


# --- training, evaluation, sampling -----------------------------------------------------------------


def test_one_block_per_step_only_that_block_and_shared_parts_get_gradients():
    model = tiny()
    x = ids()
    for step in range(4):
        b = model.choose_block(step, 2)
        model.zero_grad(set_to_none=True)
        loss, metrics = model.training_loss(x, None, step, 2)
        loss.backward()
        assert metrics["block"] == b and model.step_units(step, 2) == {"shared", f"block{b}"}
        got = grads_of_one_block(model, b)
        assert {"tok_emb.weight", "head.weight", "norm.weight"} <= got


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_elbo_of_a_uniform_model_is_log2_of_the_alphabet(schedule):
    """With a zero head every masked character costs ln 27 nats; the NELBO integrates to exactly
    log2(27) bits per character, an equal share per interval (each owns 1/B of the masking rate)."""
    model = tiny(schedule=schedule, d_model=8)  # narrow: the head's zeros make the body irrelevant
    with torch.no_grad():
        model.head.weight.zero_()
    out = model.elbo_bpc(ids(256, 16), samples_per_block=16, generator=torch.Generator().manual_seed(0))
    assert out["bpc"] == pytest.approx(math.log2(27), rel=0.03)
    assert out["share"] == pytest.approx([1 / 3] * 3, abs=0.03)
    assert out["upper_bound"] is True and out["characters"] == 256 * 16


def test_elbo_is_seeded():
    model = tiny()
    x = ids(8)
    a = model.elbo_bpc(x, 2, torch.Generator().manual_seed(5))
    assert a == model.elbo_bpc(x, 2, torch.Generator().manual_seed(5))
    assert a["bpc"] != model.elbo_bpc(x, 2, torch.Generator().manual_seed(6))["bpc"]


@pytest.mark.slow
@pytest.mark.parametrize("end_to_end", [False, True])
def test_loss_decreases_on_a_fixed_batch(end_to_end):
    model = tiny(perturb=False, end_to_end=end_to_end, block_sampling="round_robin")
    x = torch.tensor([[0, 1, 2, 3] * 4] * 8)  # a pattern the model can learn in a few steps
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    start = model.elbo_bpc(x, 4, g())["bpc"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(30):
        loss, _ = model.training_loss(x, None, step, 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.elbo_bpc(x, 4, g())["bpc"] < 0.6 * start


def test_sampling_is_seeded():
    model = tiny()
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    a = model.sample(2, 12, 3, g(0))
    assert a.shape == (2, 12) and torch.equal(a, model.sample(2, 12, 3, g(0)))
    assert not torch.equal(a, model.sample(2, 12, 3, g(1)))


def test_end_to_end_baseline_reports_the_same_intervals():
    model = tiny(end_to_end=True)
    assert model.num_blocks == 1 and len(model.blocks[0]) == 3 and model.step_units(0, 0) is None
    out = model.elbo_bpc(ids(4), 1, torch.Generator().manual_seed(0))
    assert len(out["per_block"]) == 3 and out["t_edges"] == [0.0, 1 / 3, 2 / 3, 1.0]


def test_bad_input_raises_one_clear_line():
    model = tiny()
    with pytest.raises(UserError, match="character id 27 is out of range"):
        model.training_loss(torch.full((2, 8), 27), None, 0, 0)
    with pytest.raises(UserError, match=r"num_iterations \(sampler steps\) \(2\) must be >= the number of blocks \(3\)"):
        model.sample(1, 8, 2)
    with pytest.raises(UserError, match="length must be"):
        model.sample(1, 17, 3)
    with pytest.raises(UserError, match="exceeds mdm.seq_len"):
        model.elbo_bpc(ids(2, 20))
    with pytest.raises(UserError, match="larger than model.n_layers"):
        module_config("mdm", num_blocks=4)
    with pytest.raises(UserError, match="diffusion.schedule must be one of linear, cosine"):
        module_config("mdm", schedule="geometric")


# --- text8 data ------------------------------------------------------------------------------------


def test_text8_loader_splits_90_5_5(tmp_path):
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list(text8.ALPHABET), 2000))
    path = tmp_path / "text8"
    path.write_text(text + "\n")  # one trailing newline is tolerated
    splits = text8.load_text8(path)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (1800, 100, 100)
    assert text8.decode(np.concatenate([splits.train, splits.val, splits.test])) == text
    assert text8.load_chars(f"text8:{path}").val.tolist() == splits.val.tolist()
    g = torch.Generator().manual_seed(0)
    assert splits.batch(5, 32, g).shape == (5, 32)
    w = splits.windows(32, "val")
    assert w.shape == (3, 32) and text8.decode(w[0]) == text[1800:1832]


def test_text8_bad_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        text8.load_text8(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.write_text("hello World")
    with pytest.raises(UserError, match=r"byte b'W' at offset 6"):
        text8.load_text8(bad)
    with pytest.raises(UserError, match=r"character 'É' at offset 2"):
        text8.encode("abÉ")
    with pytest.raises(UserError, match="unknown character source"):
        text8.load_chars("wiki")
    assert text8.to_text8("In the Beginning, God!\n12 x") == "in the beginning god x"
    assert text8.encode("az ").tolist() == [0, 25, 26]


def test_the_bible_in_text8_alphabet():
    splits = text8.load_bible()
    assert splits.train.max() < 27 and len(splits.train) > 3_000_000
    assert text8.decode(splits.train[:30]).startswith("genesis in the beginning god")
