"""The inference engine: continuous batching gives each request exactly what it gets alone.

Tiny random models (no training): batched == solo for every model kind, == `generate()` (the
reference decoding loop), independent of the prefill chunk size and of the slot count; prompt
log-probs == log_softmax(prompt_logits); the KV pool sized from a memory budget; aborts, errors and
the async API.
"""

from __future__ import annotations

import asyncio
import warnings

import pytest
import torch

from looped_lm.engine.engine import Engine, InvalidRequest, Request, kv_bytes_per_token
from looped_lm.engine.generate import generate
from looped_lm.engine.sampling import SamplingParams
from looped_lm.errors import UserError
from tiny_models import D, V, build_tiny

GREEDY = SamplingParams(0.0)


pytestmark = pytest.mark.usefixtures("one_thread")


def build(kind: str, seq_len: int = 16, bridge: str = "hard"):
    return build_tiny(kind, seq_len, bridge=bridge)


@pytest.fixture(scope="module")
def models():
    return {kind: build(kind) for kind in ("gpt", "db_ar", "looped_db", "huginn")}


def requests(kind: str, sampling=GREEDY, n: int = 6) -> list[Request]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(0, V, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
        k = None if kind == "gpt" else (1, 2, 4)[i % 3]  # mixed K in one batch
        out.append(Request(prompt, max_tokens=4 + 3 * (i % 3), sampling=sampling, seed=100 + i, num_iterations=k))
    return out


def solo(model, request: Request, **engine_kw) -> list[int]:
    return Engine(model, 1, **engine_kw).run([request])[0].token_ids


@pytest.mark.parametrize("kind", ["gpt", "db_ar", "looped_db", "huginn"])
def test_batched_requests_equal_each_request_alone(models, kind):
    model = models[kind]
    reqs = requests(kind)
    engine = Engine(model, 4, prefill_chunk=5)  # fewer slots than requests: admission mid-flight
    outs = engine.run(reqs)
    assert engine.stats.decoded_rows > engine.stats.decode_calls  # rows really shared decode calls
    for req, out in zip(reqs, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == req.max_tokens
        assert out.token_ids == solo(model, req, prefill_chunk=64), req
        assert out.num_iterations == (None if kind == "gpt" else req.num_iterations)
    assert engine.num_free_slots == 4 and engine.num_running == 0


@pytest.mark.parametrize("kind", ["gpt", "db_ar"])
def test_engine_equals_the_reference_generate_loop(models, kind):
    model = models[kind]
    for req in requests(kind)[:3]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # K < B skips blocks: intended here
            kw = {} if kind == "gpt" else model.inference_kwargs(req.num_iterations, None)
        ref = generate(model, torch.tensor([req.prompt]), req.max_tokens, GREEDY, seed=req.seed, **kw)
        assert Engine(model, 2).run([req])[0].token_ids == ref[0, len(req.prompt):].tolist()


@pytest.mark.parametrize("kind", ["gpt", "db_ar"])
def test_sampled_requests_are_seeded_and_batch_independent(models, kind):
    model = models[kind]
    reqs = requests(kind, SamplingParams(0.9, top_k=20, top_p=0.9))
    batched = Engine(model, 6).run(reqs)
    for req, out in zip(reqs, batched):
        assert out.token_ids == solo(model, req)
    first = reqs[0]
    other_seed = Request(first.prompt, first.max_tokens, first.sampling, seed=7, num_iterations=first.num_iterations)
    assert solo(model, other_seed) != batched[0].token_ids


def test_a_bridge_that_samples_inside_the_chain_stays_batch_independent():
    """`bridge: sample` draws a token at every denoising step: each row draws from its own generator."""
    model = build("db_ar", bridge="sample")
    reqs = requests("db_ar")
    batched = Engine(model, 6, prefill_chunk=5).run(reqs)
    for req, out in zip(reqs, batched):
        assert out.token_ids == solo(model, req)
    reseeded = Request(reqs[1].prompt, reqs[1].max_tokens, GREEDY, seed=99, num_iterations=reqs[1].num_iterations)
    assert solo(model, reseeded) != batched[1].token_ids  # greedy sampling, yet the chain's draws differ


@pytest.mark.parametrize("kind", ["gpt", "db_ar"])
def test_chunked_prefill_changes_nothing(models, kind):
    model = models[kind]
    req = Request(list(range(1, 30)), max_tokens=6, sampling=GREEDY, seed=3)
    whole = Engine(model, 2, prefill_chunk=64).run([req])[0]
    chunked_engine = Engine(model, 2, prefill_chunk=4, prefill_budget=4)
    chunked = chunked_engine.run([req])[0]
    assert chunked.token_ids == whole.token_ids
    assert chunked_engine.stats.prompt_tokens == 29 and chunked_engine.stats.steps >= 8


def test_stop_token_ends_a_request(models):
    model = models["gpt"]
    req = requests("gpt")[0]
    first = solo(model, req)
    stop = Request(req.prompt, 10, GREEDY, stop_token_ids=frozenset({first[1]}))
    out = Engine(model, 1).run([stop])[0]
    assert out.finish_reason == "stop" and out.token_ids == first[:first.index(first[1]) + 1]


@pytest.mark.parametrize("kind", ["gpt", "db_ar"])
@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_prompt_logprobs_are_log_softmax_of_prompt_logits(models, kind, max_tokens):
    model = models[kind]
    prompt = [5, 9, 2, 33, 40, 7]
    req = Request(prompt, max_tokens, GREEDY, seed=11, num_iterations=None if kind == "gpt" else 3,
                  logprobs=2, prompt_logprobs=2)
    out = Engine(model, 1).run([req])[0]
    kw = {} if kind == "gpt" else {**model.inference_kwargs(3, None), "generator": torch.Generator().manual_seed(11)}
    with torch.no_grad():
        ref = model.prompt_logits(torch.tensor([prompt]), **kw)[0].float().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for t, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[t]
        assert entry.logprob == pytest.approx(float(ref[t - 1, prompt[t]]), abs=1e-5)
        assert [i for i, _ in entry.top] == ref[t - 1].topk(2).indices.tolist()
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    assert out.logprobs is not None and len(out.logprobs) == max_tokens
    if max_tokens == 1 or (max_tokens and kind == "gpt"):  # the first token from the same logits
        assert out.logprobs[0].logprob == pytest.approx(float(ref[-1, out.token_ids[0]]), abs=1e-5)


def test_kv_pool_is_sized_by_the_memory_budget(models):
    gpt = models["gpt"]
    per_token = kv_bytes_per_token(gpt)
    assert per_token == 2 * 2 * D * 4  # K and V, 2 layers, width D, fp32
    one_slot = per_token * gpt.max_positions / 2 ** 30
    assert Engine.from_memory_budget(gpt, 3.5 * one_slot).stats.num_slots == 3
    assert Engine.from_memory_budget(gpt, 1.0, max_slots=5).stats.num_slots == 5
    assert Engine.from_memory_budget(gpt, 3.5 * one_slot, max_len=gpt.max_positions // 2).stats.num_slots == 7
    with pytest.raises(UserError, match="holds no sequence"):
        Engine.from_memory_budget(gpt, 0.5 * one_slot)
    huginn = models["huginn"]  # one cache per iteration: the budget counts the largest K served
    assert kv_bytes_per_token(huginn, 8) > kv_bytes_per_token(huginn, 2)


@pytest.mark.parametrize("change, param", [
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[V]), "prompt"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=1000), "max_tokens"),
    (dict(num_iterations=9), "num_iterations"),
    (dict(num_iterations=0), "num_iterations"),
    (dict(sampling=SamplingParams(-1.0)), "temperature"),
    (dict(sampling=SamplingParams(1.0, top_p=0.0)), "top_p"),
    (dict(logprobs=V + 1), "logprobs"),
])
def test_invalid_requests_name_the_field(models, change, param):
    engine = Engine(models["db_ar"], 1)
    req = Request(**{**dict(prompt=[1, 2], max_tokens=2, sampling=GREEDY), **change})
    with pytest.raises(InvalidRequest) as e:
        engine.check(req)
    assert e.value.param == param
    with pytest.raises(InvalidRequest, match="no K"):
        Engine(models["gpt"], 1).check(Request([1], 1, GREEDY, num_iterations=2))
    with pytest.raises(UserError, match="max-iterations"):
        Engine(models["db_ar"], 1, max_iterations=9)


def test_async_api_streams_deltas_and_an_early_exit_frees_the_slot(models):
    model = models["db_ar"]
    engine = Engine(model, 2).start()
    reqs = requests("db_ar")[:2]
    expected = [solo(model, r) for r in reqs]

    async def main():
        async def collect(req):
            tokens = []
            async for out in engine.generate(req):
                tokens += out.token_ids
                last = out
            return tokens, last.finish_reason

        results = await asyncio.gather(*(collect(r) for r in reqs))
        assert [t for t, _ in results] == expected and {r for _, r in results} == {"length"}

        # as long as the model allows, so it cannot finish before the consumer leaves
        long = Request([1, 2, 3], max_tokens=model.max_positions - 3, sampling=GREEDY, num_iterations=8)
        seen = 0
        async for out in engine.generate(long):
            seen += len(out.token_ids)
            break  # the consumer leaves: the request is aborted
        for _ in range(500):
            if engine.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return seen

    try:
        assert asyncio.run(main()) >= 1
        assert engine.num_running == 0 and engine.num_free_slots == 2  # the slot is free again
        # aborted when the consumer left, unless the engine thread had already run it to its end
        finished = engine.stats.finished
        assert (finished["abort"], finished["length"]) in {(1, 2), (0, 3)}
    finally:
        engine.shutdown()
    assert not engine.is_alive


def test_a_failing_model_call_fails_its_requests_and_the_engine_goes_on(models, monkeypatch):
    model = models["gpt"]
    engine = Engine(model, 2)
    real = model.forward_cached
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward_cached", flaky)
    req = requests("gpt")[0]
    failed = engine.run([req])[0]
    assert failed.finish_reason == "error" and "boom" in failed.error
    assert engine.num_free_slots == 2
    monkeypatch.setattr(model, "forward_cached", real)
    assert engine.run([req])[0].token_ids == solo(model, req)
