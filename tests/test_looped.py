"""Recurrent-depth models: the Huginn BPTT baseline and the single-pass DiffusionBlocks looped LM."""

import math

import pytest
import torch
from tiny_models import PAPER, uncached_next_logits

from looped_lm.config import config_from_dict
from looped_lm.diffusion.adaptive_exit import kl_divergence
from looped_lm.diffusion.chain import run_chain
from looped_lm.engine.generate import generate
from looped_lm.errors import UserError
from looped_lm.models import build_model
from looped_lm.models.huginn import sample_recurrence
from looped_lm.sampling import GREEDY, SharedGenerator
from looped_lm.settings import ExitRule, InferenceSettings, RowBatch, ScoreSettings, resolve_settings

V = 53


def huginn(**model):
    cfg = config_from_dict({"model": {"kind": "huginn", "n_prelude": 1, "n_layers": 2, "n_coda": 1, "d_model": 32,
                                      "n_heads": 4, "seq_len": 16, "mean_recurrence": 4, "backprop_depth": 2,
                                      "init_std": 0.2, **model}})
    torch.manual_seed(0)
    return build_model(cfg, V).eval()


def looped_db(**diffusion):
    cfg = config_from_dict({"model": {"kind": "looped_db", "n_prelude": 1, "n_layers": 2, "n_coda": 1, "d_model": 32,
                                      "n_heads": 4, "seq_len": 16, "init_std": 0.2},
                            "diffusion": {"num_blocks": 1, **PAPER, **diffusion}})
    torch.manual_seed(0)
    model = build_model(cfg, V)
    with torch.no_grad():  # adaLN-Zero starts at zero: give it weight so equality tests mean something
        for layer in [*model.blocks[0], *model.coda]:
            layer.ada.weight.normal_(0, 0.2)
    return model.eval()


# --- huginn -------------------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 3, 6])
def test_huginn_cached_equals_recompute(K):
    model = huginn()
    x = torch.randint(0, V, (2, 10))
    s0 = torch.randn(2, 10, 32)
    full = model(x, K, s0=s0)
    caches = model.new_cache(2, 16)
    settings = resolve_settings(model.iteration_limits(), num_iterations=K, sampling=GREEDY)

    def step(ids, noise):
        return model.forward_cached(ids, caches, None, RowBatch.uniform(settings, 2, SharedGenerator(None), noise))

    parts = [step(x[:, :4], s0[:, :4])]
    for t in range(4, 10):
        parts.append(step(x[:, t:t + 1], s0[:, t:t + 1]))
    torch.testing.assert_close(torch.stack(parts[1:], 1), full[:, 4:], atol=1e-5, rtol=0)
    torch.testing.assert_close(parts[0], full[:, 3], atol=1e-5, rtol=0)
    # one cache entry per (iteration, core layer), plus prelude and coda: grows with K
    assert model.kv_bytes_per_token(caches) == (1 + 1 + 2 * K) * 2 * 32 * 4


def test_huginn_recurrence_draw_has_the_configured_mean():
    g = torch.Generator().manual_seed(0)
    draws = [sample_recurrence(32, g) for _ in range(4000)]
    assert min(draws) >= 1
    assert abs(sum(draws) / len(draws) - 32) < 1.0
    assert sample_recurrence(1, g) == 1


def test_huginn_truncated_backprop_reaches_only_the_last_iterations():
    model = huginn(mean_recurrence=6, backprop_depth=2).train()
    x = torch.randint(0, V, (1, 8))
    # with all iterations without gradient but the last 2, the initial state and the prelude get
    # gradient only through the adapter's input injection, never through the first 4 core passes
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        model(x, 6, no_grad_iterations=4).sum().backward()
    n_truncated = len(saved)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        model(x, 6, no_grad_iterations=0).sum().backward()
    assert len(saved) > n_truncated * 1.5  # 6 differentiable core passes keep far more than 2


def test_huginn_eval_per_k_is_exact_cross_entropy():
    model = huginn()
    x, y = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))
    scores = model.score(x, y, ScoreSettings(k_grid=(2, 5)), generator=torch.Generator().manual_seed(1))
    s0 = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    for K in (2, 5):
        logits = model(x, K, s0=s0)
        ref = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        torch.testing.assert_close(scores[K].nll, ref)
        assert scores[K].nll_var is None  # exact


# --- looped_db ----------------------------------------------------------------------------------


def test_looped_db_trains_one_core_on_the_whole_sigma_range():
    model = looped_db(overlap=0.1)
    assert len(model.blocks) == 1 and model.train_ranges == [(0.002, 80.0)]
    x, y = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    model.train()
    loss, metrics = model.training_loss(x, y, step=0, seed=0)
    loss.backward()
    assert metrics["block"] == 0
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.dim() > 1)


@pytest.mark.parametrize("K", [1, 4, 16])
def test_looped_db_cached_equals_recompute(K):
    model = looped_db()
    prompt = torch.randint(0, V, (2, 4))
    settings = resolve_settings(model.iteration_limits(), num_iterations=K, bridge="hard", sampling=GREEDY)
    g = SharedGenerator(torch.Generator().manual_seed(3))
    noise = [model.initial_noise(2, 1, g) for _ in range(5)]
    out, logits = generate(model, prompt, 5, settings, return_logits=True, noise=noise)
    for i in range(5):
        ref = uncached_next_logits(model, out[:, :4 + i], settings, noise[i])
        torch.testing.assert_close(logits[:, i], ref, atol=1e-5, rtol=1e-6)


def kv_bytes_after_decoding(model, K: int) -> int:
    """Cache bytes per token after a prompt and two tokens decoded at K iterations (the cache reserved for K)."""
    cache = model.new_cache(1, 8)
    model.reserve(cache, K)
    settings = resolve_settings(model.iteration_limits(), num_iterations=K, sampling=GREEDY)
    batch = RowBatch.uniform(settings, 1, SharedGenerator(torch.Generator().manual_seed(0)))
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for chunk in (ids[:, :4], ids[:, 4:5], ids[:, 5:]):
            model.forward_cached(chunk, cache, None, batch)
    return model.kv_bytes_per_token(cache)


def test_looped_db_kv_cache_is_flat_in_k():
    model = looped_db()
    per_token = (1 + 2 + 1) * 2 * 32 * 4 + 32 * 4  # prelude + core + coda K/V, and the clean input
    assert [kv_bytes_after_decoding(model, K) for K in (1, 8, 32)] == [per_token] * 3
    # the measurement sees a cache that grows with K: Huginn keeps one K/V set per (iteration, core layer)
    grows = [kv_bytes_after_decoding(huginn(), K) for K in (1, 8, 32)]
    assert grows == [(1 + 1 + K * 2) * 2 * 32 * 4 for K in (1, 8, 32)]


# --- adaptive exit ------------------------------------------------------------------------------


def test_kl_divergence_by_hand():
    p = torch.tensor([[math.log(0.5), math.log(0.5)]])
    q = torch.tensor([[math.log(0.25), math.log(0.75)]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert abs(kl_divergence(p, q).item() - expected) < 1e-6


def test_rows_exit_at_different_steps():
    model = looped_db()
    steady = torch.zeros(1, 1, V)
    steady[..., 3] = 5.0

    def call(block, z, sigma, rows):  # row 0 settles at once; row 1's prediction moves every step
        step = call.count
        call.count += 1
        moving = torch.zeros(1, 1, V)
        moving[..., step % V] = 5.0
        return torch.cat([steady, moving])[rows]

    def chain(K, rule):
        call.count = 0
        settings = [InferenceSettings(GREEDY, K, "hard", rule)] * 2
        z = torch.zeros(2, 1, 32)
        return run_chain(call, model.grid(), settings, z, SharedGenerator(None), model.targets, model.target_table)

    result = chain(6, ExitRule(kl_threshold=1e-3))
    assert result.iterations.tolist() == [[2], [6]]
    assert torch.equal(result.logits[0], steady[0]) and result.logits[1, 0].argmax() == 5
    assert chain(8, ExitRule(argmax_stable=3)).iterations.tolist() == [[4], [8]]


def test_rows_with_and_without_an_exit_rule_share_a_chain():
    model = looped_db()
    steady = torch.zeros(2, 1, V)
    steady[..., 3] = 5.0
    settings = [InferenceSettings(GREEDY, 6, "hard", ExitRule(kl_threshold=1e-3)), InferenceSettings(GREEDY, 6, "hard")]
    result = run_chain(lambda b, z, s, rows: steady[rows], model.grid(), settings, torch.zeros(2, 1, 32),
                       SharedGenerator(None), model.targets, model.target_table)
    assert result.iterations.tolist() == [[2], [6]]


def test_adaptive_exit_through_generate_reports_iterations():
    model = looped_db()
    log = []
    settings = resolve_settings(model.iteration_limits(), num_iterations=8, exit_rule=ExitRule(kl_threshold=float("inf")),
                                sampling=GREEDY)
    generate(model, torch.tensor([[1, 2]]), 3, settings, iteration_log=log)
    assert [int(t[0]) for t in log] == [2, 2, 2]  # the first comparison is possible after 2 steps


@pytest.mark.parametrize("threshold,criterion,message", [
    (-0.1, None, "exit threshold must be >= 0"),
    (None, "argmax-stable:0", "integer m >= 1"),
    (None, "entropy:3", "unknown --exit-criterion"),
    (None, "kl:abc", "needs a number"),
])
def test_bad_exit_options(threshold, criterion, message):
    with pytest.raises(UserError, match=message):
        ExitRule.parse(threshold, criterion)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_cfg,diffusion,message", [
    ({"kind": "huginn", "mean_recurrence": 0}, {}, "mean_recurrence must be >= 1"),
    ({"kind": "huginn", "mean_recurrence": 4, "backprop_depth": 8}, {}, "allow_full_backprop"),
    ({"kind": "looped_db"}, {"num_blocks": 4}, "num_blocks must be 1"),
])
def test_bad_looped_configs(model_cfg, diffusion, message):
    with pytest.raises(UserError, match=message):
        config_from_dict({"model": model_cfg, "diffusion": diffusion})


def test_full_backprop_needs_the_flag_only():
    cfg = config_from_dict({"model": {"kind": "huginn", "mean_recurrence": 4, "backprop_depth": 8,
                                      "allow_full_backprop": True}})
    assert cfg.model.backprop_depth == 8


@pytest.mark.parametrize("build", [huginn, looped_db])
def test_iterations_above_the_maximum_are_refused(build):
    limits = build().iteration_limits()
    for bad in (65, 0, -3, 2.5, True):
        with pytest.raises(UserError, match=r"num_iterations must be an integer in 1\.\.64") as e:
            resolve_settings(limits, num_iterations=bad)
        assert e.value.param == "num_iterations"


def test_settings_defaults_live_in_one_place():
    db, hug = looped_db(bridge="sample"), huginn()
    s = resolve_settings(db.iteration_limits())
    assert (s.num_iterations, s.bridge) == (1, "sample")  # K = B = 1 for the looped core; the config's bridge
    assert resolve_settings(hug.iteration_limits()).num_iterations == 4  # the mean recurrence
    assert resolve_settings(db.iteration_limits(), default_iterations=6).num_iterations == 6  # a server default
    with pytest.raises(UserError, match="bridge applies to DiffusionBlocks"):
        resolve_settings(hug.iteration_limits(), bridge="hard")
    with pytest.raises(UserError, match="adaptive exit"):
        resolve_settings(hug.iteration_limits(), exit_rule=ExitRule(kl_threshold=0.1))
    with pytest.raises(UserError, match="no K"):
        resolve_settings(None, num_iterations=2)
