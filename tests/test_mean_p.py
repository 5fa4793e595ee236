"""`looped_lm eval`'s mean p: the mean probability the model (for DiffusionBlocks models: the K-step sampler)
gives the held-out token. The estimator's draws are unbiased for p itself, so their plain mean is too, and it
stays resolved where ppl@K is not; it is checked here against plain Monte-Carlo of the real chain, and a K
whose mean p falls below a smaller K's is named in the report."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from looped_lm.diffusion.chain import run_chain
from looped_lm.eval import format_table, perplexity, report, worse_with_more
from looped_lm.models.db.contexts import WindowContext
from looped_lm.sampling import PLAIN, SharedGenerator
from looped_lm.settings import InferenceSettings, ScoreSettings
from tiny_models import V, build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_report_gives_mean_p_with_its_standard_error_and_names_more_iterations_that_do_worse():
    tokens = 100
    sums = {0: 230.0, 2: 220.0, 4: 260.0}
    variances = {0: 1.0, 2: 1.0, 4: 4.0}
    probs = {0: [30.0, 0.01], 2: [32.0, 0.01], 4: [25.0, 0.04], "clean": [40.0, None]}
    rep = report(sums, variances, tokens, 16, 0, "byte", "val.bin", ScoreSettings(draws=4), "db_ar", probs)
    assert rep["mean_p_at_k"] == {"0": 0.30, "2": 0.32, "4": 0.25}
    assert rep["mean_p_se"]["4"] == pytest.approx(math.sqrt(0.04) / tokens)
    assert rep["worse_with_more"] == [{"k": 4, "than": 2, "mean_p": 0.25, "than_mean_p": 0.32, "exact": False}]
    table = format_table(rep)
    assert "| 4 | 13.464 | " in table and "0.2500 (0.0020) |" in table
    assert "K = 4 gives the held-out tokens less probability than K = 2" in table
    # within noise: nothing named (the gap, 0.01, is under 2 se of the difference, 0.014)
    assert worse_with_more({1: 0.30, 2: 0.29}, {1: 0.005, 2: 0.005}) == []
    # k = 0 (one call at the top noise level) is not a sampler K: never the reference
    assert worse_with_more({0: 0.9, 1: 0.3}, {0: 0.001, 1: 0.001}) == []
    # huginn's per-K scores are exact: any drop is one, and the note says exact
    exact = report({1: 230.0, 4: 240.0}, {}, tokens, 16, 0, "byte", "val.bin", ScoreSettings(draws=4), "huginn",
                   {1: [30.0, None], 4: [29.0, None]})
    assert exact["worse_with_more"] == [{"k": 4, "than": 1, "mean_p": 0.29, "than_mean_p": 0.30, "exact": True}]
    assert "(0.2900 vs 0.3000, exact)" in format_table(exact) and "0.2900 |" in format_table(exact)


def test_an_exact_model_reports_the_mean_of_its_probabilities(tmp_path):
    model = build_tiny("gpt")
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "val.bin"
    np.asarray(torch.randint(0, V, (16 * 4 + 1,), generator=g).numpy(), dtype=np.uint16).tofile(path)
    probs: dict = {}
    sums, variances, tokens = perplexity(model, str(path), 16, settings=ScoreSettings(), progress=False, probs=probs)
    x = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    by_hand = 0.0
    for i in range(4):
        logits = model(x[None, i * 16:(i + 1) * 16])[0]
        by_hand += float(logits.detach().float().softmax(-1)[0].gather(-1, x[i * 16 + 1:(i + 1) * 16 + 1, None]).sum())
    rep = report(sums, variances, tokens, 16, 0, "byte", "val.bin", ScoreSettings(), "gpt", probs)
    assert rep["mean_p"] == pytest.approx(by_hand / tokens, rel=1e-5)


@torch.no_grad()
def plain_chain_p(model, x, y, K: int, chains: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain Monte-Carlo of the served chain: p_final(y) per slot averaged over `chains` independent runs
    (no importance weights), and its standard error per slot."""
    context = WindowContext(model, x)
    random = SharedGenerator(torch.Generator().manual_seed(seed))
    settings = InferenceSettings(sampling=PLAIN, num_iterations=K, bridge="sample")
    denoise = lambda b, z, sigma, rows: context.denoise(b, z, sigma, torch.zeros_like(rows))  # noqa: E731
    z = model.initial_noise(chains, x.shape[1], random)
    logits = run_chain(denoise, model.grid(), [settings] * chains, z, random, model.targets, model.target_table).logits
    p = logits.softmax(-1).gather(-1, y.expand(chains, -1)[..., None])[..., 0].double()
    return p.mean(0), p.std(0) / math.sqrt(chains)


@pytest.mark.parametrize("K, extra_calls", [(1, "block0"), (2, "block0"), (4, "block0"), (4, "spread")])
def test_mean_p_agrees_with_plain_monte_carlo_of_the_chain(K, extra_calls):
    """On a B = 2 model with the sample bridge, at K = 1, B and 2B (the calls beyond B in block 0, the default,
    or spread): the estimator's mean p (what eval reports) within 4 standard errors of plain Monte-Carlo of the
    chain itself, per slot and over the window."""
    model = build_tiny("db_ar", bridge="sample", extra_calls=extra_calls)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (1, 16), generator=g)
    y = torch.randint(0, V, (1, 16), generator=g)
    mc, mc_se = plain_chain_p(model, x, y, K, 4000, seed=K)
    scores = model.score(x, y, ScoreSettings(k_grid=(K,), draws=64, bridge="sample"), torch.Generator().manual_seed(2))
    est, est_var = scores[K].probability()
    est, est_se = est[0], est_var[0].sqrt()
    se = (mc_se ** 2 + est_se ** 2).sqrt()
    assert float(((est - mc).abs() / se).max()) < 4.5, (est, mc, se)
    assert abs(float(est.mean() - mc.mean())) < 4 * float(se.pow(2).sum().sqrt()) / 16
    assert float(mc.std()) > 3 * float(mc_se.max())  # the slots differ beyond noise: numbers that could disagree
