"""`diffusion.context: stacked` (docs/method.md §4): block b's clean stream continues from the clean states
of blocks < b, run without gradient, so a prediction has the context depth of every block up to its own.

The same guarantees as the default layout: no slot sees its target or the future (training and scoring),
the training path equals the scoring path, cached decoding equals recompute at every K (K < B skips
blocks whose states the next ones still need), batched rows equal solo ones; and what is new: block b
really reads blocks < b (its logits move with their weights, and not under `independent`), a step of block
b gives blocks < b no gradient, and the config refuses what the layout cannot do.
"""

import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.errors import UserError
from looped_lm.models import build_model
from looped_lm.models.db.contexts import WindowContext
from looped_lm.models.layers import token_cross_entropy
from looped_lm.sampling import GREEDY, SharedGenerator
from looped_lm.settings import ScoreSettings, resolve_settings
from looped_lm.engine.generate import generate
from tiny_models import perturb_adaln, shifted_batch, uncached_next_logits

pytestmark = pytest.mark.usefixtures("one_thread")

V, T = 53, 12
ORDERS = ["high_noise_first", "low_noise_first"]
LIKELIHOOD = {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False,
              "bridge": "sample", "block_sampling": "uniform"}


def make_config(num_blocks=4, n_layers=4, context="stacked", **diffusion):
    return config_from_dict({
        "model": {"kind": "db_ar", "n_layers": n_layers, "d_model": 32, "n_heads": 4, "seq_len": 16,
                  "n_prelude": 1, "init_std": 0.2, "max_iterations": 16},
        "diffusion": {"num_blocks": num_blocks, "context": context, **LIKELIHOOD, **diffusion}})


def make(num_blocks=4, n_layers=4, context="stacked", seed=0, **diffusion):
    cfg = make_config(num_blocks, n_layers, context, **diffusion)
    torch.manual_seed(seed)
    return perturb_adaln(build_model(cfg, V)).eval()


def batch(g, B=3):
    return shifted_batch(g, B, vocab=V, T=T)


# --- the layout ---------------------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("order", ORDERS)
def test_block_input_is_the_previous_blocks_clean_states(order):
    """high_noise_first: block b continues blocks 0..b-1; low_noise_first: blocks B-1..b+1 (block 0 last)."""
    model = make(stack_order=order)
    x, _ = batch(torch.Generator().manual_seed(0))
    pos = torch.arange(T)
    h = model.clean_inputs(x)
    chain = [0, 1, 2, 3] if order == "high_noise_first" else [3, 2, 1, 0]
    expected = {chain[0]: h}
    for prev, b in zip(chain, chain[1:]):
        cos, sin = model.rope(pos)
        for layer in model.blocks[prev]:
            h, _, _ = layer.clean(h, cos, sin)
        expected[b] = h
    for b in range(4):
        torch.testing.assert_close(model.block_input(b, model.clean_inputs(x), pos), expected[b], rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("context,order", [("stacked", "high_noise_first"), ("independent", "high_noise_first"),
                                           ("stacked", "low_noise_first")])
def test_a_block_reads_the_blocks_below_it_only_when_stacked(context, order):
    """Perturb the first block of the stack: a later block's logits move under stacked, not under
    independent; the perturbed block's own logits move either way (the perturbation is real)."""
    model = make(context=context, stack_order=order)
    first, later = (0, 2) if order == "high_noise_first" else (3, 1)
    x, y = batch(torch.Generator().manual_seed(1))
    z = model.targets(y) + 0.5 * torch.randn(3, T, 32, generator=torch.Generator().manual_seed(2))
    sigma = torch.full((3,), 0.5)
    before = {b: WindowContext(model, x).denoise(b, z, sigma) for b in (first, later)}
    for p in model.blocks[first].parameters():
        p.add_(0.3 * torch.randn_like(p))
    after = {b: WindowContext(model, x).denoise(b, z, sigma) for b in (first, later)}
    assert (after[first] - before[first]).abs().max() > 1e-3
    moved = (after[later] - before[later]).abs().max()
    assert (moved > 1e-3) if context == "stacked" else (moved == 0)


@pytest.mark.parametrize("order", ORDERS)
def test_a_step_of_block_b_gives_the_blocks_below_no_gradient(order):
    model = make(stack_order=order).train()
    x, y = batch(torch.Generator().manual_seed(3))
    for b in (0, 1, 3):
        model.zero_grad(set_to_none=True)
        sigma = torch.full((3,), 0.3)
        noise = torch.randn(3, T, 32)
        model.objective.slot_losses(x, y, b, sigma, noise).mean().backward()
        for j in range(4):
            grads = [p.grad for p in model.blocks[j].parameters()]
            if j == b:
                assert all(g is not None and g.abs().sum() > 0 for g in grads)
            else:
                assert all(g is None for g in grads), f"block {j} got a gradient in a step of block {b}"


# --- no leak; training path = scoring path ------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("block", [0, 1, 3])
def test_training_slot_sees_no_target_and_reads_its_context(block, order):
    model = make(stack_order=order)
    g = torch.Generator().manual_seed(4)
    x, y = batch(g)
    noise = torch.randn(3, T, 32, generator=g)
    sigma = torch.tensor([0.05, 0.5, 5.0])
    base = model.objective.slot_losses(x, y, block, sigma, noise)
    for t in (0, 4, 10):
        x2, y2, n2 = x.clone(), torch.randint(0, V, y.shape, generator=g), noise.clone()
        x2[:, t + 1:] = torch.randint(0, V, x2[:, t + 1:].shape, generator=g)
        y2[:, t] = y[:, t]
        others = torch.arange(T) != t
        n2[:, others] = torch.randn(n2[:, others].shape, generator=g)
        torch.testing.assert_close(model.objective.slot_losses(x2, y2, block, sigma, n2)[:, t], base[:, t],
                                   rtol=0, atol=1e-5)
        if t > 0:
            x3 = x.clone()
            x3[:, :t] = (x3[:, :t] + 1) % V
            assert (model.objective.slot_losses(x3, y, block, sigma, noise)[:, t] - base[:, t]).abs().max() > 1e-4


@torch.no_grad()
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("block", [0, 1, 3])
def test_training_loss_is_the_scoring_paths_ce(block, order):
    model = make(stack_order=order)
    g = torch.Generator().manual_seed(5)
    x, y = batch(g)
    noise = torch.randn(3, T, 32, generator=g)
    sigma = torch.tensor([0.05, 0.5, 5.0])
    z = model.targets(y) + sigma[:, None, None] * noise
    scoring = token_cross_entropy(WindowContext(model, x).denoise(block, z, sigma), y)
    torch.testing.assert_close(model.objective.slot_losses(x, y, block, sigma, noise), scoring, rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("order", ORDERS)
def test_scoring_slot_sees_no_target(order):
    model = make(num_blocks=2, n_layers=2, stack_order=order)
    settings = ScoreSettings(k_grid=(1, 2, 4), draws=2)
    g = torch.Generator().manual_seed(6)
    x, y = batch(g, B=2)
    base = model.score(x, y, settings, torch.Generator().manual_seed(5))
    for t in (0, 4, 10):
        x2, y2 = x.clone(), torch.randint(0, V, y.shape, generator=g)
        x2[:, t + 1:] = torch.randint(0, V, x2[:, t + 1:].shape, generator=g)
        y2[:, t] = y[:, t]
        moved = model.score(x2, y2, settings, torch.Generator().manual_seed(5))
        for k in base:
            torch.testing.assert_close(moved[k].nll[:, t], base[k].nll[:, t], rtol=0, atol=1e-6)


# --- decoding -----------------------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("num_blocks,n_layers,K,lpb", [(2, 2, 1, 0), (2, 2, 2, 0), (2, 2, 5, 0), (4, 4, 2, 0),
                                                       (4, 4, 4, 0), (4, 4, 12, 0), (2, 4, 3, [3, 1])])
def test_cached_decoding_equals_recompute(num_blocks, n_layers, K, lpb, order):
    """K < B skips blocks: their caches (and the states they hand on) catch up when a later block runs."""
    model = make(num_blocks=num_blocks, n_layers=n_layers, layers_per_block=lpb, bridge="hard", last_call="edge",
                 stack_order=order)
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(7))
    settings = resolve_settings(model.iteration_limits(), num_iterations=K, bridge="hard", sampling=GREEDY)
    g = SharedGenerator(torch.Generator().manual_seed(11))
    noise = [model.initial_noise(2, 1, g) for _ in range(5)]
    out, logits = generate(model, prompt, 5, settings, return_logits=True, noise=noise)
    for i in range(5):
        ref = uncached_next_logits(model, out[:, :5 + i], settings, noise[i])
        scale = ref.abs().amax(-1, keepdim=True)
        assert ((logits[:, i] - ref).abs() <= 1e-5 + 1e-6 * scale).all()
        assert torch.equal(out[:, 5 + i], ref.argmax(-1))


@torch.no_grad()
def test_a_stacked_decode_state_holds_each_blocks_inputs_once():
    """Per token: every clean-stream K/V plus one stored clean input per block (the shared one and the
    B - 1 handed-on states), whatever K runs. K = 1 runs block 0 only, yet decoding at K = 1 then at
    K = 4 equals decoding at K = 4 throughout for the later tokens' block-3 inputs (they catch up)."""
    from looped_lm.settings import RowBatch

    model = make()
    state = model.new_cache(1, 16)
    assert state.nbytes_per_token() == (1 + 4) * 2 * 32 * 4 + 4 * 32 * 4
    caches = {}
    for schedule in ((1, 1, 4), (4, 4, 4)):
        cache = model.new_cache(1, 16)
        for t, K in enumerate(schedule):
            settings = resolve_settings(model.iteration_limits(), num_iterations=K, bridge="hard", sampling=GREEDY)
            batch = RowBatch([settings], SharedGenerator(None), torch.full((1, 1, 32), 3.0))
            model.forward_cached(torch.tensor([[t + 1]]), cache, None, batch)
        caches[schedule] = cache
    a, b = caches[(1, 1, 4)], caches[(4, 4, 4)]
    assert [int(c.lengths[0]) for blk in a.blocks for c in blk] == [3] * 4
    assert sorted(a.handed) == [1, 2, 3]  # block 0 starts from the shared input
    for blk in a.handed:
        torch.testing.assert_close(a.handed[blk][:, :3], b.handed[blk][:, :3], rtol=0, atol=1e-5)  # float order of a catch-up batch
    assert a.handed[3][:, :3].abs().sum() > 0


# --- what the layout refuses --------------------------------------------------------------------------

@pytest.mark.parametrize("model, diffusion, fragment", [
    ({"kind": "db_ar", "n_layers": 4}, {"num_blocks": 2, "context": "stacked", "blocks_to_train": [1]},
     "independent block jobs"),
    ({"kind": "gpt", "n_layers": 4}, {"context": "stacked"}, "diffusion.context is a field of model.kind db_ar, not of gpt"),
    ({"kind": "looped_db", "n_layers": 2}, {"num_blocks": 1, "context": "stacked"}, "not of looped_db"),
    ({"kind": "db_ar", "n_layers": 4}, {"context": "deep"}, "diffusion.context"),
])
def test_the_config_refuses_what_stacked_cannot_do(model, diffusion, fragment):
    with pytest.raises(UserError, match=fragment):
        config_from_dict({"model": model, "diffusion": diffusion}, flat_era=False)  # as a user's YAML


def test_old_configs_load_as_independent():
    cfg = config_from_dict({"model": {"kind": "db_ar", "n_layers": 4}, "diffusion": {"num_blocks": 2}})
    assert cfg.diffusion.context == "independent"
    assert not build_model(cfg, V).stacked


def test_the_loss_share_curve_is_measured_on_training_data(monkeypatch):
    """block_sampling loss_share steers which block trains from a CE(sigma) curve: it must come from the
    training split (a fixed batch the loop never draws), never from validation data."""
    import deepspeed.comm

    from looped_lm import trainer

    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda: 1)
    asked = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def get_batch(self, batch, seed, step, micro, rank):
            asked.append((self.name, step))
            x = torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(0))
            return x, x.roll(-1, 1)

    model = make(num_blocks=2, n_layers=2)
    cfg = make_config(num_blocks=2, n_layers=2)
    cfg.train.batch_size = 2
    curve = trainer.refresh_curve(model, Stream("train"), cfg, "cpu", 0, 10)
    assert asked == [("train", -2)] and len(curve["ce"]) == len(curve["sigmas"])
    import inspect  # and the loop hands it the training stream

    from looped_lm.trainer import run as trainer_run
    assert "refresh_curve(run.model, run.train_stream," in inspect.getsource(trainer_run._refresh_curve)


def test_a_stacked_run_trains_evaluates_and_refuses_merge(tmp_path, write_config, capsys, one_line_error):
    """The trainer runs a stacked db_ar end to end; `eval` scores its checkpoint; `merge` refuses it in one
    line (its blocks were not trained apart), exit 2, nothing written."""
    from looped_lm import cli
    from looped_lm import trainer

    cfg = write_config(tmp_path / "s.yaml", {"model": {"kind": "db_ar", "n_layers": 2, "n_prelude": 1},
                                             "diffusion": {"num_blocks": 2, "context": "stacked"},
                                             "train": {"out_dir": str(tmp_path / "s"), "max_steps": 2}})
    assert trainer.main(["--config", str(cfg)]) == 0
    ckpt = tmp_path / "s" / "step_0000002"
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--max-tokens", "64", "--num-iterations", "2"]) == 0
    assert "| 2 |" in capsys.readouterr().out  # the K = 2 row
    out = tmp_path / "merged"
    assert cli.main(["merge", str(ckpt), str(ckpt), "--out", str(out)]) == 2
    one_line_error(capsys.readouterr(), "diffusion.context stacked")
    assert not out.exists()
