"""The GPT baseline and the generation engine: KV-cache exactness, tied head, training signal, stopping."""

from __future__ import annotations

import math

import pytest
import torch

from looped_lm.config import Config, config_from_dict
from looped_lm.engine.generate import generate
from looped_lm.errors import UserError
from looped_lm.models import build_model
from looped_lm.models.args import GPTArgs
from looped_lm.models.gpt import GPT
from looped_lm.sampling import SamplingParams
from looped_lm.settings import InferenceSettings


def S(params: SamplingParams) -> InferenceSettings:
    return InferenceSettings(params)

V = 257  # byte tokenizer


def tiny_gpt(seed=0, n_layers=2, d_model=32, n_heads=2, seq_len=16, init_std=0.1) -> GPT:
    """fp32, eval mode; a larger init than training's so logits are peaked (no argmax near-ties)."""
    torch.manual_seed(seed)
    return GPT(GPTArgs(vocab_size=V, n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq_len=seq_len,
                       init_std=init_std)).eval()


def prompt_batch(seed=1, batch=2, length=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, length), generator=g)


# ------------------------------------------------------------------------------------------------
# KV cache: cached decoding == recomputing the whole sequence


@pytest.mark.parametrize("params, seed", [(SamplingParams(0.0), None), (SamplingParams(1.0), 123),
                                          (SamplingParams(0.9, top_k=20, top_p=0.9), 7)],
                         ids=["greedy", "sampled", "top-k-top-p"])
def test_cached_generation_equals_full_recompute(params, seed):
    model = tiny_gpt()
    prompt = prompt_batch()
    n_new = 40  # 5 + 40 positions: well past seq_len 16 (max_positions is 4 * seq_len = 64)
    tokens, step_logits = generate(model, prompt, n_new, S(params), seed=seed or 0, return_logits=True)
    assert tokens.shape == (2, 5 + n_new) and step_logits.shape == (2, n_new, V)
    assert torch.equal(tokens[:, :5], prompt)
    with torch.no_grad():
        full, _ = model(tokens[:, :-1])  # no cache: every position recomputed from scratch
    # the logits that chose token t+1 sit at position t of the full pass
    recomputed = full[:, 4:4 + n_new]
    torch.testing.assert_close(step_logits, recomputed, atol=1e-5, rtol=0)
    if params.temperature == 0:
        assert torch.equal(tokens[:, 5:], recomputed.argmax(-1))
        # logits are peaked enough that the greedy choice is not a float tie
        top2 = recomputed.topk(2, dim=-1).values
        assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-4


def test_greedy_generation_equals_step_by_step_argmax_without_cache():
    model = tiny_gpt(seed=3)
    prompt = prompt_batch(seed=4, batch=1, length=3)
    tokens = generate(model, prompt, 12)
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(12):
            nxt = model(seq)[0][:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(tokens, seq)


def test_chunked_prefill_equals_one_shot():
    model = tiny_gpt()
    seq = prompt_batch(seed=5, batch=3, length=20)
    with torch.no_grad():
        full, _ = model(seq)
        one = model.decode(seq, model.new_cache(3, 20))
        cache = model.new_cache(3, 20)
        pieces = [model.decode(seq[:, a:b], cache) for a, b in ((0, 5), (5, 6), (6, 13), (13, 14), (14, 20))]
    caches = cache.layers
    assert caches[0].length == 20 and all(c.length == 20 for c in caches)
    torch.testing.assert_close(one, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)
    # the caches hold the same keys and values either way
    ref = model.new_cache(3, 20)
    with torch.no_grad():
        model.decode(seq, ref)
    for a, b in zip(caches, ref.layers):
        torch.testing.assert_close(a.view()[0], b.view()[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(a.view()[1], b.view()[1], atol=1e-6, rtol=0)


def test_kv_cache_overflow_and_rope_limit_raise():
    model = tiny_gpt()
    caches = model.new_cache(1, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="KV cache full"):
        model.decode(torch.zeros(1, 5, dtype=torch.long), caches)
    with pytest.raises(UserError, match="exceeds the model's 64 positions"):
        generate(model, prompt_batch(length=10), 55)


# ------------------------------------------------------------------------------------------------
# structure and training signal


def test_tied_head_has_no_separate_parameter():
    model = tiny_gpt(n_layers=1)
    names = [n for n, _ in model.named_parameters()]
    assert not any("lm_head" in n or "head" in n.split(".")[0] for n in names)
    big = [n for n, p in model.named_parameters() if p.shape == (V, 32)]
    assert big == ["tok_emb.weight"]
    idx = prompt_batch(length=7)
    with torch.no_grad():
        logits, _ = model(idx)
        cos, sin = model.rope(torch.arange(7))
        h = model.tok_emb(idx)
        for layer in model.layers:
            h = layer(h, cos, sin)
        expected = model.norm(h) @ model.tok_emb.weight.T
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)
    # the head moves with the embedding: scaling one row of tok_emb scales that logit column only
    with torch.no_grad():
        model.tok_emb.weight[65] *= 2  # 'A' never appears in idx below
        idx2 = torch.full((1, 3), 66)
        base = model(idx2)[0]
        model.tok_emb.weight[65] /= 2
        half = model(idx2)[0]
    torch.testing.assert_close(base[..., 65], 2 * half[..., 65], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(base[..., :65], half[..., :65])


def test_parameter_count_matches_the_architecture():
    d, L = 32, 2
    hidden = 128  # SwiGLU width: 8/3 * 32 = 85.3, rounded up to a multiple of 64
    model = tiny_gpt(n_layers=L)
    per_layer = 2 * d + 3 * d * d + d * d + 2 * d * hidden + hidden * d
    assert sum(p.numel() for p in model.parameters()) == V * d + L * per_layer + d


def test_loss_with_targets_is_mean_cross_entropy():
    model = tiny_gpt(n_layers=1)
    x, y = prompt_batch(seed=8, length=9), prompt_batch(seed=9, length=9)
    with torch.no_grad():
        logits, loss = model(x, y)
    manual = -torch.log_softmax(logits, -1).gather(-1, y[..., None]).mean()
    assert abs(float(loss) - float(manual)) < 1e-5
    # an untrained model with a small init predicts nearly uniformly: loss ~ ln(V)
    torch.manual_seed(0)
    fresh = GPT(GPTArgs(vocab_size=V, n_layers=1, d_model=32, n_heads=2, seq_len=16))
    with torch.no_grad():
        assert abs(float(fresh(x, y)[1]) - math.log(V)) < 0.05


@pytest.mark.slow
def test_loss_decreases_when_overfitting_a_fixed_batch():
    torch.manual_seed(0)
    model = GPT(GPTArgs(vocab_size=V, n_layers=2, d_model=32, n_heads=2, seq_len=16)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, V, (4, 17), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(30):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(V), abs=0.05)
    assert losses[-1] < losses[0] - 2.0, losses
    assert all(b < a for a, b in zip(losses[:10], losses[1:11])), losses[:11]


def test_build_model_uses_the_config():
    cfg = config_from_dict({"model": {"n_layers": 3, "d_model": 48, "n_heads": 3, "seq_len": 20, "ffn_hidden": 96}})
    model = build_model(cfg, V)
    assert isinstance(model, GPT) and len(model.layers) == 3
    assert model.tok_emb.weight.shape == (V, 48)
    assert model.layers[0].mlp.down.weight.shape == (48, 96)
    assert model.max_positions == 80
    cfg2 = Config()
    cfg2.model.kind = "no_such_kind"
    with pytest.raises(UserError, match="model.kind 'no_such_kind' is not a registered kind"):
        build_model(cfg2, V)


# ------------------------------------------------------------------------------------------------
# generation's arguments and stop (sampling itself: tests/test_sampling.py)


def test_bad_generate_arguments_raise_user_error():
    model = tiny_gpt(n_layers=1)
    with pytest.raises(UserError, match="max_tokens must be >= 1"):
        generate(model, prompt_batch(), 0)
    with pytest.raises(UserError, match="at least one token"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)


def test_generation_stops_when_every_row_emits_eot():
    model = tiny_gpt(n_layers=1)
    prompt = prompt_batch(batch=1)
    free = generate(model, prompt, 10)
    eot = int(free[0, 7])  # the 3rd generated token: declare it the end-of-text id
    first = int((free[0, 5:] == eot).nonzero()[0])
    tokens, logits = generate(model, prompt, 10, eot_id=eot, return_logits=True)
    assert tokens.shape[1] == 5 + first + 1 and int(tokens[0, -1]) == eot
    assert logits.shape[1] == first + 1
    assert torch.equal(tokens, free[:, :5 + first + 1])
