"""The DiffusionBlocks AR model: no leak, one-block training, cached decoding equals recompute, bridges."""

import math

import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.diffusion.chain import bridge_points
from looped_lm.engine.generate import generate
from looped_lm.errors import UserError
from looped_lm.models import build_model, build_network
from looped_lm.models.two_stream import noisy_mask, slot_mask
from looped_lm.optim import BlockwiseAdamW, param_groups
from looped_lm.sampling import GREEDY, SamplingParams, SharedGenerator
from looped_lm.settings import ScoreSettings, resolve_settings
from tiny_models import PAPER, uncached_next_logits

V = 61


def make_model(num_blocks=2, n_layers=4, n_prelude=1, seed=0, init_std=0.2, **diffusion):
    cfg = config_from_dict({
        "model": {"kind": "db_ar", "n_layers": n_layers, "d_model": 32, "n_heads": 4, "seq_len": 16,
                  "n_prelude": n_prelude, "init_std": init_std},
        "diffusion": {"num_blocks": num_blocks, **PAPER, **diffusion},
    })
    torch.manual_seed(seed)
    model = build_model(cfg, V)
    # adaLN-Zero starts at zero; give it weight so every path is exercised by the equality tests
    with torch.no_grad():
        for block in model.blocks:
            for layer in block:
                layer.ada.weight.normal_(0, 0.2)
                layer.ada.bias.normal_(0, 0.2)
    return model.eval()


def slot_logits(model, x, block, sigma=0.5, seed=0):
    """Training-path logits of every noisy slot of block `block`, fixed z."""
    B, T = x.shape
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, 32, generator=g)
    slots = torch.arange(T)
    s = torch.full((B,), sigma)
    kv = model.clean_kv(block, model.clean_inputs(x), slots)
    return model.noisy_pass(block, z, s, x, slots + 1, kv, slot_mask(slots, T, model.noisy_self))


@pytest.mark.parametrize("parameterization,noisy_self", [("edm", True), ("likelihood", True), ("likelihood", False)])
@pytest.mark.parametrize("block", [0, 1])
def test_no_leak_from_current_or_later_tokens(block, parameterization, noisy_self):
    model = make_model(parameterization=parameterization, noisy_self=noisy_self)
    x = torch.randint(0, V, (2, 12))
    base = slot_logits(model, x, block)
    # slot i predicts x[i+1] from clean x[0..i]: changing x[t] must leave slots < t untouched
    for t in (3, 7, 11):
        x2 = x.clone()
        x2[:, t:] = (x2[:, t:] + 1) % V
        changed = slot_logits(model, x2, block)
        assert torch.equal(changed[:, :t], base[:, :t])  # exact zeros, not a tolerance
        assert (changed[:, t:] - base[:, t:]).abs().max() > 1e-4  # and the context is really read


def test_noisy_mask_by_hand():
    mask = noisy_mask(torch.tensor([0, 2]), 3)
    expected = torch.tensor([[1, 0, 0, 1, 0],
                             [1, 1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    per_row = noisy_mask(torch.tensor([[1], [0]]), 2)
    assert per_row.shape == (2, 1, 1, 3)
    assert per_row[0, 0].tolist() == [[True, True, True]] and per_row[1, 0].tolist() == [[True, False, True]]


def test_target_fraction_slots_see_only_their_context():
    """With target_fraction < 1 a slot at position s (of a subset) reads clean x[0..s] and predicts y[s]:
    moving any later x or another position's y leaves its CE exactly where it was; moving x[s] moves it."""
    model = make_model(target_fraction=0.25)
    x, y = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    slots = torch.tensor([[1, 5, 9, 14], [0, 3, 4, 12]])
    sigma, noise = torch.full((2,), 0.5), torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))
    for block in (0, 1):
        base = model.objective.slot_losses(x, y, block, sigma, noise, slots)
        assert base.shape == (2, 4)
        for j in range(4):
            s = slots[:, j]
            later = torch.arange(16)[None] > s[:, None]
            other = torch.arange(16)[None] != s[:, None]
            x2 = torch.where(later, (x + 1) % V, x)
            y2 = torch.where(other, (y + 1) % V, y)
            moved = model.objective.slot_losses(x2, y2, block, sigma, noise, slots)
            assert torch.equal(moved[:, j], base[:, j]), (block, j)
            own = torch.where(torch.arange(16)[None] == s[:, None], (x + 1) % V, x)
            assert (model.objective.slot_losses(own, y, block, sigma, noise, slots)[:, j] - base[:, j]).abs().min() > 1e-6
    loss, metrics = model.training_loss(x, y, step=0, seed=0)
    assert math.isfinite(loss.item()) and metrics["block"] in (0, 1)


def test_one_block_per_step_gets_gradients():
    model = make_model(num_blocks=2).train()
    x, y = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    for step in range(6):
        model.zero_grad(set_to_none=True)
        loss, metrics = model.training_loss(x, y, step=step, seed=3)
        loss.backward()
        b = model.choose_block(step, 3)
        assert metrics["block"] == b
        for name, p in model.named_parameters():
            unit = model.param_unit(name)
            if unit == f"block{b}" or unit == "shared":
                continue
            assert p.grad is None, f"{name} got a gradient in a step of block {b}"
        trained = [p.grad for n, p in model.named_parameters() if model.param_unit(n) == f"block{b}"]
        assert all(g is not None for g in trained)
    # the choice depends on (step, seed) only: every rank agrees
    assert [model.choose_block(s, 3) for s in range(20)] == [model.choose_block(s, 3) for s in range(20)]
    assert len({model.choose_block(s, 3) for s in range(40)}) == 2


def test_round_robin_and_blocks_to_train():
    model = make_model(num_blocks=4, n_layers=4, block_sampling="round_robin", blocks_to_train=[1, 3])
    assert [model.choose_block(s, 0) for s in range(4)] == [1, 3, 1, 3]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("blocks.0.", "blocks.2.")) for n in frozen)
    units = {g["unit"] for g in param_groups(model, 0.1)}
    assert units == {"shared", "block1", "block3"}  # frozen blocks hold no optimiser state


@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
def test_blockwise_adamw_leaves_idle_blocks_untouched(implementation):
    """Each of torch's AdamW paths (the trainer takes fused on CUDA, foreach elsewhere): an idle block's
    weights AND moments are bit-identical after a step, the active block moves."""
    model = make_model(num_blocks=2).train()
    opt = BlockwiseAdamW(param_groups(model, 0.1), implementation=implementation, lr=1e-2)
    x, y = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    for step in range(4):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        moments = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
        opt.set_active_units(model.step_units(step, 0))
        # zero gradients everywhere (what DeepSpeed's reduction produces for unused parameters)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        loss, _ = model.training_loss(x, y, step=step, seed=0)
        loss.backward()
        opt.step()
        b = model.choose_block(step, 0)
        for n, p in model.named_parameters():
            unit = model.param_unit(n)
            if unit.startswith("block") and unit != f"block{b}":
                assert torch.equal(p, before[n]), f"{n} moved in a step of block {b}"
                assert set(opt.state[p]) == set(moments[n]), n
                assert all(torch.equal(v, moments[n][k]) for k, v in opt.state[p].items()), n
        moved = [n for n, p in model.named_parameters() if model.param_unit(n) == f"block{b}"
                 and not torch.equal(p, before[n])]
        assert moved


def test_adamw_implementations_take_the_same_step():
    """foreach and fused compute what the for-loop reference does (to fp32 rounding)."""
    x, y = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    after = {}
    for implementation in ("for-loop", "foreach", "fused"):
        torch.manual_seed(0)
        model = make_model(num_blocks=2).train()
        opt = BlockwiseAdamW(param_groups(model, 0.1), implementation=implementation, lr=1e-2)
        for step in range(3):
            opt.set_active_units(model.step_units(step, 0))
            opt.zero_grad()
            torch.manual_seed(step)
            model.training_loss(x, y, step=step, seed=0)[0].backward()
            opt.step()
        after[implementation] = [p.detach().clone() for p in model.parameters()]
    for implementation in ("foreach", "fused"):
        for a, b in zip(after["for-loop"], after[implementation]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # lr 1e-2: a step is ~1e-2


def _cached_equals_recompute(model, K, close):
    model.max_iterations = 16
    prompt = torch.randint(0, V, (2, 5))
    n_new = 6
    settings = resolve_settings(model.iteration_limits(), num_iterations=K, bridge="hard", sampling=GREEDY)
    g = SharedGenerator(torch.Generator().manual_seed(11))
    noise = [model.initial_noise(2, 1, g) for _ in range(n_new)]
    out, logits = generate(model, prompt, n_new, settings, return_logits=True, noise=noise)
    for i in range(n_new):
        ref = uncached_next_logits(model, out[:, :5 + i], settings, noise[i])
        close(logits[:, i], ref)
        assert torch.equal(out[:, 5 + i], ref.argmax(-1))


@pytest.mark.parametrize("num_blocks,K,parameterization", [
    (2, 1, "edm"), (2, 2, "edm"), (2, 6, "edm"), (4, 4, "edm"), (4, 2, "edm"),
    (2, 2, "likelihood"), (4, 12, "likelihood"), (2, 3, "no_self")])
def test_cached_decoding_equals_recompute(num_blocks, K, parameterization):
    kw = {"parameterization": "likelihood", "noisy_self": False} if parameterization == "no_self" else \
        {"parameterization": parameterization}
    model = make_model(num_blocks=num_blocks, n_layers=4, **kw)
    # the likelihood term makes logits O(100) at low sigma: fp32 rounding is relative there
    _cached_equals_recompute(model, K, lambda a, b: torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6))


@pytest.mark.parametrize("num_blocks,K", [(2, 2), (2, 5), (4, 4)])
def test_cached_decoding_equals_recompute_with_the_last_call_at_sigma_min(num_blocks, K):
    """The default last call runs at sigma_min, where <z, y_v>/sigma^2 puts logits near 1e5: fp32 rounds
    them to ~eps x that, so the tolerance follows each row's logit scale (a wrong cache or mask moves the
    network's part by O(1), far above it)."""
    model = make_model(num_blocks=num_blocks, n_layers=4, parameterization="likelihood", noisy_self=False,
                       last_call="sigma_min")

    def close(a, b):
        scale = b.abs().amax(-1, keepdim=True)
        assert scale.min() > 1e3  # the regime this test is about
        assert ((a - b).abs() <= 1e-5 + 4e-7 * scale).all(), float(((a - b).abs() / scale).max())

    _cached_equals_recompute(model, K, close)


@torch.no_grad()
def test_cache_size_is_tied_to_tokens_and_not_to_k():
    """The decode state holds, per token, one K/V pair per clean-stream layer and the stored clean input,
    whatever K runs: decoding at K = 1 and K = 12 leaves caches of identical size."""
    model = make_model(num_blocks=2, n_layers=4, n_prelude=1)
    model.max_iterations = 16
    state = model.new_cache(1, 32)
    # 1 prelude + 4 block layers, keys and values, d_model fp32, plus the stored clean input
    assert state.nbytes_per_token() == 5 * 2 * 32 * 4 + 32 * 4
    sizes = {}
    for K in (1, 12):
        cache = model.new_cache(1, 32)
        settings = resolve_settings(model.iteration_limits(), num_iterations=K, sampling=GREEDY)
        from looped_lm.settings import RowBatch
        for t in range(4):
            model.forward_cached(torch.tensor([[t + 1]]), cache, None, RowBatch([settings], SharedGenerator(None)))
        sizes[K] = (sum(t.numel() for t in _tensors(cache)), [int(c.lengths[0]) for b in cache.blocks for c in b])
    assert sizes[1][0] == sizes[12][0]
    assert sizes[12][1] == [4] * 4  # every block's cache holds the 4 tokens, at K = 12 as at K = 1 (caught up)
    assert sizes[1][1][:2] == [4, 4]  # K = 1 runs block 0 only: block 1 has not needed them yet


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list):
        for x in obj:
            yield from _tensors(x)
    elif hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            yield from _tensors(x)


def points(model, logits, kind, sampling=SamplingParams(1.0), seed=0):
    R = logits.shape[0]
    random = SharedGenerator(torch.Generator().manual_seed(seed))
    return bridge_points(logits, [kind] * R, [sampling] * R, random, torch.arange(R), model.targets, model.target_table)


def test_soft_bridge_is_the_expected_target():
    model = make_model()
    logits = torch.tensor([[[0.0, math.log(3.0)] + [-1e9] * (V - 2)]])
    table = model.target_table()
    torch.testing.assert_close(points(model, logits, "soft")[0, 0], 0.25 * table[0] + 0.75 * table[1])
    torch.testing.assert_close(points(model, logits, "hard")[0, 0], table[1])
    assert torch.allclose(table.norm(dim=-1), torch.ones(V))  # unit-norm targets


def test_edm_loss_weight_is_normalised():
    model = make_model(loss_weight="edm")
    from looped_lm import diffusion as dm

    lo, hi = model.train_ranges[1]
    sigma = dm.sample_sigma(200_000, lo, hi, model.sched, generator=torch.Generator().manual_seed(0))
    w = model.objective.loss_weights(sigma, 1)
    assert abs(w.mean().item() - 1.0) < 0.05
    batch = make_model(loss_weight="batch_mean").objective.loss_weights(sigma[:8], 1)
    assert torch.allclose(batch, batch[0].expand(8))  # one scalar per batch


def test_edges_saved_and_reused():
    model = make_model(num_blocks=4, n_layers=4)
    state = model.checkpoint_state()
    assert [round(e, 3) for e in state["edges"]] == [0.002, 0.134, 0.301, 0.677, 80.0]
    custom = [0.01, 0.2, 0.5, 1.5, 20.0]
    other = build_network(model.args, {"edges": custom})
    assert other.edges == custom
    with pytest.raises(UserError, match="blocks"):
        build_network(model.args, {"edges": [0.01, 1.0, 20.0]})


def test_sampled_bridge_draws_targets_in_proportion():
    model = make_model()
    logits = torch.full((4000, 1, V), -1e9)
    logits[..., 0], logits[..., 1] = 0.0, math.log(3.0)
    table = model.target_table()
    picked = points(model, logits, "sample")[:, 0]
    is_one = torch.isclose(picked, table[1].expand_as(picked), atol=1e-6).all(-1)
    is_zero = torch.isclose(picked, table[0].expand_as(picked), atol=1e-6).all(-1)
    assert bool((is_one | is_zero).all()) and abs(is_one.float().mean().item() - 0.75) < 0.03
    assert torch.equal(picked, points(model, logits, "sample")[:, 0])  # seeded


def test_token_loglik_is_the_gaussian_log_likelihood_by_hand():
    model = make_model(parameterization="likelihood")
    table = model.target_table()
    g = torch.Generator().manual_seed(3)
    z, sigma = torch.randn(2, 3, 32, generator=g), torch.tensor([0.7, 2.0])
    loglik = model.token_loglik(z, sigma)
    # log N(z; y_v, sigma^2 I) = -|z - y_v|^2 / (2 sigma^2) + const: equal up to a per-slot constant
    gauss = -((z[:, :, None, :] - table) ** 2).sum(-1) / (2 * sigma[:, None, None] ** 2)
    torch.testing.assert_close(loglik.log_softmax(-1), gauss.log_softmax(-1), atol=1e-5, rtol=0)


def test_likelihood_parameterization_reads_the_token_at_low_sigma_whatever_the_weights():
    # with edm the logits at sigma_min come from a trained read-back; with likelihood they are exact:
    # an untrained model already recovers the token from z = y + sigma*eps
    model = make_model(parameterization="likelihood")
    x, y = torch.randint(0, V, (2, 10)), torch.randint(0, V, (2, 10))
    slots = torch.arange(10)
    sigma = torch.full((2,), 0.01)
    z = model.targets(y) + 0.01 * torch.randn(2, 10, 32)
    kv = model.clean_kv(1, model.clean_inputs(x), slots)
    logits = model.noisy_pass(1, z, sigma, x, slots + 1, kv, noisy_mask(slots, 10))
    assert torch.equal(logits.argmax(-1), y)
    # at high sigma z says almost nothing: the network's own (context) logits decide
    loglik = model.token_loglik(model.targets(y) + 50 * torch.randn(2, 10, 32), torch.full((2,), 50.0))
    assert float(loglik.std(-1).max()) < 0.05


def test_likelihood_input_carries_no_raw_noise_at_high_sigma():
    model = make_model(parameterization="likelihood")
    sigma = torch.full((3,), 60.0)
    h, _, _ = model.noisy_input(60.0 * torch.randn(3, 4, 32), sigma)
    mean_embedding = model.tok_emb.weight.mean(0)
    # the posterior-mean embedding under an uninformative z is (almost) the table's mean
    torch.testing.assert_close(h, mean_embedding.expand_as(h), atol=0.02, rtol=0)


def test_sampled_bridge_draws_with_the_requests_sampler():
    model = make_model()
    logits = torch.full((2000, 1, V), -1e9)
    logits[..., 0], logits[..., 1], logits[..., 2] = 0.0, math.log(3.0), math.log(2.0)
    table = model.target_table()
    greedy = points(model, logits, "sample", SamplingParams(0.0))
    torch.testing.assert_close(greedy, points(model, logits, "hard"))
    top2 = points(model, logits, "sample", SamplingParams(1.0, top_k=2))[:, 0]
    is_one = torch.isclose(top2, table[1].expand_as(top2), atol=1e-6).all(-1)
    is_two = torch.isclose(top2, table[2].expand_as(top2), atol=1e-6).all(-1)
    assert bool((is_one | is_two).all()) and abs(is_one.float().mean().item() - 0.6) < 0.04  # 3 / (3 + 2)


def test_generate_with_sample_bridge_follows_the_temperature():
    model = make_model(parameterization="likelihood")
    prompt = torch.randint(0, V, (2, 4))
    limits = model.iteration_limits()
    hard = generate(model, prompt, 5, resolve_settings(limits, num_iterations=2, bridge="hard", sampling=GREEDY), seed=3)
    sampled_greedy = generate(model, prompt, 5, resolve_settings(limits, num_iterations=2, bridge="sample",
                                                                 sampling=GREEDY), seed=3)
    assert torch.equal(hard, sampled_greedy)  # temperature 0: the bridge takes the argmax too


def test_noisy_slots_without_self_key_use_plain_causal_attention():
    model = make_model(noisy_self=False)
    x = torch.randint(0, V, (2, 9))
    causal = slot_logits(model, x, 1)  # every slot: the CAUSAL fast path
    slots = torch.arange(9)
    kv = model.clean_kv(1, model.clean_inputs(x), slots)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 9, 32, generator=g)
    explicit = model.noisy_pass(1, z, torch.full((2,), 0.5), x, slots + 1, kv, noisy_mask(slots, 9)[:, :9])
    torch.testing.assert_close(causal, explicit, atol=1e-5, rtol=0)
    assert slot_mask(slots, 9, False) == "causal" and slot_mask(slots[:4], 9, False).shape == (4, 9)
    # and it is a different model from the one whose slots also read their own key
    model.noisy_self = True
    assert (slot_logits(model, x, 1) - causal).abs().max() > 1e-4


@pytest.mark.slow
@torch.no_grad()
def test_last_call_at_sigma_min_makes_the_k_equals_b_sampler_block_0s_distribution():
    model = make_model(parameterization="likelihood", last_call="sigma_min", bridge="sample")
    grid = model.grid()
    sigmas = grid.sigmas(2)
    assert sigmas[0] == model.sigma_top() and sigmas[1] == sigmas[2] == model.edges[0]
    assert grid.blocks(4) == [0, 0, 0, 1]  # the calls beyond B in block 0 (extra_calls' default)
    x, y = torch.randint(0, V, (2, 7)), torch.randint(0, V, (2, 7))
    scores = model.score(x, y, ScoreSettings(k_grid=(2,), draws=16), torch.Generator().manual_seed(4))
    # the last call only reads the drawn token back: ppl@2 is ppl@0 (up to the estimates' spread)
    se = (scores[0].nll_var.sum() + scores[2].nll_var.sum()).sqrt() / y.numel()
    assert abs(float(scores[2].nll.mean() - scores[0].nll.mean())) < 4 * float(se) + 1e-3
    # and the chain's last call reads the bridged token back exactly
    settings = resolve_settings(model.iteration_limits(), num_iterations=2, bridge="hard", sampling=GREEDY)
    z = model.initial_noise(2, 1, SharedGenerator(torch.Generator().manual_seed(1)))
    chain = uncached_next_logits(model, x, settings, z)
    first = uncached_next_logits(model, x, resolve_settings(model.iteration_limits(), num_iterations=1,
                                                             sampling=GREEDY), z)
    assert torch.equal(chain.argmax(-1), first.argmax(-1))


def test_removed_config_options_say_why():
    from looped_lm.errors import UserError as E

    for key in ("noise",):  # context came back: tests/test_stacked.py
        with pytest.raises(E, match=f"diffusion.{key} was removed"):
            config_from_dict({"model": {"kind": "db_ar"}, "diffusion": {key: "x"}})
    with pytest.raises(E, match="partition must be one of equi_probability, uniform"):
        config_from_dict({"model": {"kind": "db_ar"}, "diffusion": {"partition": "equi_entropy"}})


@torch.no_grad()
def test_posterior_input_topk_error_is_within_its_bound():
    exact = make_model(parameterization="likelihood")
    topk = make_model(parameterization="likelihood", posterior_input="topk", posterior_topk=5)
    topk.load_state_dict(exact.state_dict())
    table = exact.tok_emb.weight
    for sigma_value in (0.05, 0.5, 5.0):
        sigma = torch.full((2,), sigma_value)
        z = exact.targets(torch.randint(0, V, (2, 6))) + sigma_value * torch.randn(2, 6, 32)
        loglik = exact.token_loglik(z, sigma)
        a, b = exact.posterior_embedding(loglik), topk.posterior_embedding(loglik)
        p = loglik.softmax(-1)
        rest = 1 - p.topk(5, dim=-1).values.sum(-1)
        bound = rest * (table - table.mean(0)).norm(dim=-1).max() * 2
        assert bool(((a - b).norm(dim=-1) <= bound + 1e-5).all())
    # sharp likelihood (low sigma): top-k is exact; flat (high sigma): the rest's mean carries the mass
    sigma = torch.full((2,), 0.01)
    z = exact.targets(torch.randint(0, V, (2, 6)))
    torch.testing.assert_close(topk.posterior_embedding(exact.token_loglik(z, sigma)),
                               exact.posterior_embedding(exact.token_loglik(z, sigma)), atol=1e-5, rtol=0)


def test_detached_posterior_input_sends_no_gradient_into_the_table_through_the_input():
    x, y = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    grads = {}
    for mode in ("full", "detached"):
        model = make_model(parameterization="likelihood", posterior_input=mode, noisy_input="noise").train()
        torch.manual_seed(3)
        loss, _ = model.training_loss(x, y, step=0, seed=0)
        loss.backward()
        grads[mode] = model.tok_emb.weight.grad.clone()
    assert not torch.allclose(grads["full"], grads["detached"])  # the input path carried a gradient


def test_cosine_head_folds_the_likelihood_into_one_product_with_the_heads_gradient_only():
    model = make_model(parameterization="likelihood", head="cosine")
    g = torch.Generator().manual_seed(0)
    h, z = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    sigma = torch.tensor([0.3, 2.0])
    table = model.unit_table()
    u = model.cosine_state(h)
    separate = u @ table.T + (z / sigma[:, None, None] ** 2) @ table.detach().T
    folded = model.denoise_logits(h, z, sigma)
    torch.testing.assert_close(folded, separate, atol=1e-4, rtol=1e-5)
    w = torch.randn(folded.shape, generator=g)
    ga = torch.autograd.grad((folded * w).sum(), model.tok_emb.weight, retain_graph=True)[0]
    gb = torch.autograd.grad((separate * w).sum(), model.tok_emb.weight)[0]
    torch.testing.assert_close(ga, gb, atol=1e-4, rtol=1e-4)
