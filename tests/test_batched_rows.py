"""Rows of one KV pool at different positions decode together exactly as each would alone.

This is what continuous batching stands on: a slot's request joins and leaves while others run.
"""

import pytest
import torch

from looped_lm.sampling import GREEDY, SharedGenerator
from looped_lm.settings import RowBatch, resolve_settings
from tiny_models import D, V, build_tiny


def build(kind):
    if kind.endswith("_clean_state"):  # noisy_input clean_state: the slot reads its row's stored clean input
        stacked = {"context": "stacked", "stack_order": "low_noise_first"} if "stacked" in kind else {}
        return build_tiny("db_ar", parameterization="likelihood", noisy_self=False, noisy_input="clean_state",
                          **stacked)
    if kind == "db_ar_defaults":  # the product's DB layout: slots attend the clean keys only
        return build_tiny("db_ar", parameterization="likelihood", noisy_self=False, noisy_input="prev_token")
    if kind.startswith("db_ar_stacked"):  # depth composition: one block continues from the other's clean states
        return build_tiny("db_ar", parameterization="likelihood", noisy_self=False, noisy_input="prev_token",
                          context="stacked", stack_order="low_noise_first" if kind.endswith("low") else "high_noise_first")
    return build_tiny(kind)


def step(model, kind, tokens, caches, rows, noise):
    """One forward_cached call with explicit noise so a row's result does not depend on batching."""
    limits = None if kind == "gpt" else model.iteration_limits()
    kind = "db_ar" if kind.startswith("db_ar") else kind
    settings = resolve_settings(limits, num_iterations=None if kind == "gpt" else 3, sampling=GREEDY)
    if kind == "huginn":
        noise = noise.expand(-1, tokens.shape[1], -1)
    batch = RowBatch.uniform(settings, tokens.shape[0], SharedGenerator(None), noise)
    return model.forward_cached(tokens, caches, rows, batch)


@pytest.mark.parametrize("slots", [(0, 1), (2, 0)], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("kind", ["gpt", "db_ar", "db_ar_defaults", "db_ar_stacked", "db_ar_stacked_low", "looped_db",
                                  "huginn", "db_ar_clean_state", "db_ar_stacked_clean_state"])
@torch.no_grad()
def test_interleaved_rows_equal_solo_runs(kind, slots):
    model = build(kind)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (1, 5), generator=g), torch.randint(0, V, (1, 2), generator=g)]
    follow = torch.randint(0, V, (2, 4), generator=g)
    noise = torch.randn(2, 6, 1, D, generator=g) * 80.0  # per row, per call

    solo = []
    for r in range(2):
        caches = model.new_cache(1, 16)
        outs = [step(model, kind, prompts[r], caches, None, noise[r, 0][None])]
        for t in range(4):
            outs.append(step(model, kind, follow[r:r + 1, t:t + 1], caches, None, noise[r, t + 1][None]))
        solo.append(torch.cat(outs))

    pool = model.new_cache(3, 16)  # one row stays empty; the other two sit at different positions
    rows = [torch.tensor([slots[0]]), torch.tensor([slots[1]])]
    first = [step(model, kind, prompts[r], pool, rows[r], noise[r, 0][None]) for r in range(2)]
    batched = [torch.stack(first)[:, 0]]
    both = torch.tensor(slots)
    for t in range(4):
        batched.append(step(model, kind, follow[:, t:t + 1], pool, both, noise[:, t + 1]))
    for r in range(2):
        got = torch.stack([b[r] for b in batched])
        torch.testing.assert_close(got, solo[r], atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["gpt", "db_ar", "db_ar_defaults", "db_ar_stacked", "huginn"])
@torch.no_grad()
def test_a_freed_row_serves_a_new_sequence_like_a_fresh_cache(kind):
    model = build(kind)
    g = torch.Generator().manual_seed(1)
    old, new = torch.randint(0, V, (1, 7), generator=g), torch.randint(0, V, (1, 3), generator=g)
    noise = torch.randn(1, D, generator=g)[None] * 80.0
    pool = model.new_cache(2, 16)
    step(model, kind, old, pool, torch.tensor([1]), noise)
    model.reset_rows(pool, torch.tensor([1]))
    reused = step(model, kind, new, pool, torch.tensor([1]), noise)
    fresh = step(model, kind, new, model.new_cache(1, 16), None, noise)
    torch.testing.assert_close(reused, fresh, atol=2e-5, rtol=0)
