"""Sampling: temperature / top-k / top-p keep exactly the expected tokens with the expected probabilities,
numeric extremes stay finite, draws follow the filtered distribution, seeds reproduce, bad parameters
are refused with a line naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from looped_lm.engine.generate import generate
from looped_lm.errors import UserError
from looped_lm.models.args import GPTArgs
from looped_lm.models.gpt import GPT
from looped_lm.sampling import SamplingParams, SharedGenerator, filtered_probs, sample
from looped_lm.settings import InferenceSettings

V = 257  # byte tokenizer


def S(params: SamplingParams) -> InferenceSettings:
    return InferenceSettings(params)


def tiny_gpt(init_std: float, n_layers: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTArgs(vocab_size=V, n_layers=n_layers, d_model=32, n_heads=2, seq_len=16, init_std=init_std)).eval()


def prompt_batch(seed=1, batch=2, length=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, length), generator=g)



def test_same_seed_same_output_different_seed_different():
    model = tiny_gpt(0.02)  # flat logits: sampling really is random
    prompt = prompt_batch()
    p = SamplingParams(1.0)
    a = generate(model, prompt, 24, S(p), seed=11)
    b = generate(model, prompt, 24, S(p), seed=11)
    c = generate(model, prompt, 24, S(p), seed=12)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 5:], c[:, 5:])
    # greedy ignores the seed
    assert torch.equal(generate(model, prompt, 8, seed=1), generate(model, prompt, 8, seed=2))


def test_top_k_1_and_tiny_top_p_equal_greedy():
    model = tiny_gpt(0.05)
    prompt = prompt_batch()
    greedy = generate(model, prompt, 20)
    assert torch.equal(generate(model, prompt, 20, S(SamplingParams(1.0, top_k=1)), seed=5), greedy)
    assert torch.equal(generate(model, prompt, 20, S(SamplingParams(1.5, top_p=1e-6)), seed=6), greedy)
    assert torch.equal(generate(model, prompt, 20, S(SamplingParams(0.7, top_k=3, top_p=1e-9)), seed=7), greedy)


LOGITS = torch.tensor([[0.1, 2.0, -1.0, 1.0, 0.5]])  # sorted order: 1, 3, 4, 0, 2


@pytest.mark.parametrize("params, keep", [
    (SamplingParams(1.0), {0, 1, 2, 3, 4}),
    (SamplingParams(1.0, top_k=1), {1}),
    (SamplingParams(1.0, top_k=2), {1, 3}),
    (SamplingParams(1.0, top_k=5), {0, 1, 2, 3, 4}),
    (SamplingParams(1.0, top_k=99), {0, 1, 2, 3, 4}),
    # probs of (2, 1, .5, .1, -1) = .5586 .2055 .1246 .0835 .0278; mass before = 0 .5586 .7641 .8887 .9722
    (SamplingParams(1.0, top_p=0.5), {1}),
    (SamplingParams(1.0, top_p=0.7), {1, 3}),
    (SamplingParams(1.0, top_p=0.8), {1, 3, 4}),
    (SamplingParams(1.0, top_p=0.95), {1, 3, 4, 0}),
    (SamplingParams(1.0, top_p=0.99), {0, 1, 2, 3, 4}),
    # top-k 3 first renormalises over (2, 1, .5): .6285 .2312 .1402; mass before = 0 .6285 .8597
    (SamplingParams(1.0, top_k=3, top_p=0.85), {1, 3}),
    (SamplingParams(1.0, top_k=3, top_p=0.87), {1, 3, 4}),
    # temperature 2 halves the logits: probs .3719 .2256 .1757 .1438 .0830; mass before 0 .3719 .5975 .7732
    (SamplingParams(2.0, top_p=0.55), {1, 3}),
    (SamplingParams(2.0, top_p=0.65), {1, 3, 4}),
])
def test_filtered_probs_keep_exactly_the_expected_set(params, keep):
    probs = filtered_probs(LOGITS, [params])[0]
    kept = {i for i in range(5) if float(probs[i]) > 0}
    assert kept == keep
    weights = {i: math.exp(float(LOGITS[0, i]) / params.temperature) for i in keep}
    for i in keep:  # renormalised over what is kept, at the temperature
        assert float(probs[i]) == pytest.approx(weights[i] / sum(weights.values()), rel=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(1e-40), SamplingParams(1.0, top_p=5e-324),
                                    SamplingParams(1e-30, top_k=3, top_p=1e-300), SamplingParams(1e30)])
def test_numeric_extremes_never_give_nan(params):
    """A tiny temperature is greedy, a tiny top_p keeps the top token, a huge temperature is uniform."""
    probs = filtered_probs(LOGITS, [params])[0]
    assert torch.isfinite(probs).all() and float(probs.sum()) == pytest.approx(1.0)
    if params.temperature < 1 or params.top_p < 1e-10:
        assert float(probs[1]) == pytest.approx(1.0)
    token = sample(LOGITS, [params], SharedGenerator(torch.Generator().manual_seed(0)))
    assert 0 <= int(token) < 5


def test_sampling_frequencies_follow_the_filtered_distribution():
    params = SamplingParams(1.0, top_k=2)
    logits = LOGITS.expand(20000, 5)
    g = SharedGenerator(torch.Generator().manual_seed(0))
    counts = torch.bincount(sample(logits, [params] * 20000, g), minlength=5)
    assert counts[[0, 2, 4]].sum() == 0
    p1 = math.exp(2.0) / (math.exp(2.0) + math.exp(1.0))  # 0.7311
    assert abs(counts[1].item() / 20000 - p1) < 0.015


@pytest.mark.parametrize("params, needle", [
    (SamplingParams(-0.1), "temperature"),
    (SamplingParams(1.0, top_k=-1), "top_k"),
    (SamplingParams(1.0, top_p=0.0), "top_p"),
    (SamplingParams(1.0, top_p=1.01), "top_p"),
    (SamplingParams(1.0, top_p=-0.5), "top_p"),
    (SamplingParams(float("nan")), "temperature"),
], ids=["negative-temperature", "negative-top-k", "zero-top-p", "top-p-above-1", "negative-top-p",
        "nan-temperature"])
def test_bad_sampling_params_raise_user_error(params, needle):
    with pytest.raises(UserError, match=needle):
        params.validate()
    with pytest.raises(UserError, match=needle):
        generate(tiny_gpt(0.1, n_layers=1), prompt_batch(), 3, S(params), seed=0)


def test_the_cpu_argmax_is_torch_argmax_first_index_included():
    """sampling.argmax (blocks' maxima, then argmax within the first block holding the largest value) returns
    torch's argmax: the first index of the largest value, a NaN's index, a maximum in the short last block,
    ties across blocks, rows of -inf, any leading shape, and small vocabularies (plain argmax)."""
    from looped_lm.sampling import argmax

    g = torch.Generator().manual_seed(0)
    for shape in [(16, 50257), (1, 50257), (3, 2, 50257), (4, 2048), (5, 2047), (2, 257)]:
        x = torch.randn(*shape, generator=g)
        assert torch.equal(argmax(x), x.argmax(-1)), shape
    x = torch.randn(8, 5000, generator=g)
    x[0, [100, 4999]] = 9.0  # a tie across blocks: the first
    x[1, 4999] = 9.0  # in the last, short block (5000 = 9 x 512 + 392)
    x[2, [4700, 4990]] = 9.0  # a tie inside the last block
    x[3, 30] = float("nan")
    x[4] = float("-inf")
    x[5] = 0.0
    x[6, [511, 512]] = 9.0  # a block boundary
    assert torch.equal(argmax(x), x.argmax(-1)), (argmax(x), x.argmax(-1))
