"""The inference engine: continuous batching gives each request exactly what it gets alone.

Tiny random models (no training): batched == solo for every model kind, == `generate()` (the
reference decoding loop), independent of the prefill chunk size and of the slot count; every running
row decodes in one model call per step whatever its K, bridge and sampler; prompt log-probs == the
model's `token_logprobs` (exact for gpt, the estimated sampler marginal for DiffusionBlocks); the KV
pool sized from a memory budget; aborts, errors and the async API.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from looped_lm.engine.engine import Engine, InvalidRequest, Request, scoring_seed
from looped_lm.engine.generate import generate
from looped_lm.engine.runner import kv_bytes_per_token
from looped_lm.models.contract import split_logprobs
from looped_lm.errors import UserError
from looped_lm.sampling import GREEDY, SamplingParams
from looped_lm.settings import resolve_settings
from tiny_models import D, V, build_tiny


pytestmark = pytest.mark.usefixtures("one_thread")


def build(kind: str, seq_len: int = 16, bridge: str = "hard"):
    if kind == "db_ar_stacked":  # depth composition (diffusion.context: stacked)
        return build_tiny("db_ar", seq_len, bridge=bridge, context="stacked")
    return build_tiny(kind, seq_len, bridge=bridge)


@pytest.fixture(scope="module")
def models():
    return {kind: build(kind) for kind in ("gpt", "db_ar", "db_ar_stacked", "looped_db", "huginn")}


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


@pytest.mark.parametrize("kind", ["gpt", "db_ar", "db_ar_stacked", "looped_db", "huginn"])
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
        limits = None if kind == "gpt" else model.iteration_limits()
        settings = resolve_settings(limits, num_iterations=req.num_iterations, sampling=GREEDY)
        ref = generate(model, torch.tensor([req.prompt]), req.max_tokens, settings, seed=req.seed)
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
    """`bridge: sample` draws a token at every denoising step: each row draws from its own generator,
    and rows of different K, temperature and top-p still decode in ONE model call per step."""
    model = build("db_ar", bridge="sample")
    reqs = requests("db_ar")
    for i, r in enumerate(reqs):  # mixed samplers as well as mixed K
        r.sampling = (GREEDY, SamplingParams(0.8), SamplingParams(1.0, top_p=0.5))[i % 3]
    engine = Engine(model, 6, prefill_chunk=5)
    batched = engine.run(reqs)
    for req, out in zip(reqs, batched):
        assert out.token_ids == solo(model, req)
    assert engine.stats.decode_calls <= engine.stats.steps  # one decode call per step, whatever the mix
    assert engine.stats.decoded_rows / engine.stats.decode_calls > 1.5  # rows of 3 K values shared them
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
def test_prompt_logprobs_are_the_models_token_logprobs(models, kind, max_tokens):
    model = models[kind]
    prompt = [5, 9, 2, 33, 40, 7]
    K = None if kind == "gpt" else 3
    req = Request(prompt, max_tokens, GREEDY, seed=11, num_iterations=K, logprobs=2, prompt_logprobs=2)
    engine = Engine(model, 1)
    out = engine.run([req])[0]
    scoring = torch.Generator().manual_seed(scoring_seed(11, prompt))  # the engine's scoring stream
    x = torch.tensor([prompt[:-1]])
    y = torch.tensor([prompt[1:]])
    ref = split_logprobs(model.token_logprobs(x, y, engine.score_settings, K, scoring))[0][0].float()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for t, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[t]
        assert entry.logprob == pytest.approx(float(ref[t - 1, prompt[t]]), abs=1e-5)
        assert -30 < entry.logprob < 0  # never a read-back's -inf / 0
        assert [i for i, _ in entry.top] == ref[t - 1].topk(2).indices.tolist()
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    assert out.logprobs is not None and len(out.logprobs) == max_tokens
    if max_tokens:  # the new tokens are the ones the same request without echo generates
        plain = Request(prompt, max_tokens, GREEDY, seed=11, num_iterations=K, logprobs=2)
        assert Engine(model, 1).run([plain])[0].token_ids == out.token_ids
    for entry in out.logprobs:
        assert -30 < entry.logprob <= 0


def test_db_logprobs_are_the_samplers_marginal_not_a_read_back():
    """With `last_call: sigma_min` the chain's last call reads the drawn token back, so its own softmax is
    one-hot; the log-probs reported are the K-step sampler's marginal, which is not."""
    model = build_tiny("db_ar", parameterization="likelihood", noisy_self=False, bridge="sample",
                       last_call="sigma_min")
    req = Request([5, 9, 2, 33], max_tokens=4, sampling=SamplingParams(1.0), seed=3, num_iterations=2,
                  logprobs=3, prompt_logprobs=3)
    out = Engine(model, 1).run([req])[0]
    entries = [e for e in out.prompt_logprobs[1:]] + list(out.logprobs)
    assert all(-20 < e.logprob < -0.01 for e in entries), [e.logprob for e in entries]
    for e in entries:  # a distribution over several tokens, summing to about 1 where listed
        assert len(e.top) == 3 and sum(math.exp(lp) for _, lp in e.top) < 1.0 + 1e-3
    # and asking for log-probs does not change the sampled text
    plain = Engine(model, 1).run([Request(req.prompt, 4, req.sampling, seed=3, num_iterations=2)])[0]
    assert plain.token_ids == out.token_ids


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
    (dict(prompt=[1] * 500, max_tokens=1), "prompt"),  # the prompt alone fills the context: the prompt is at fault
    (dict(num_iterations=9), "num_iterations"),
    (dict(bridge="sideways"), "bridge"),
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


def test_resolved_settings_pass_through_unchanged(models, monkeypatch):
    """A request that carries resolved settings (what the server sends) runs them as they are: the engine
    resolves nothing, and the tokens equal the same request given as loose fields (resolved once on arrival)."""
    import looped_lm.engine.engine as engine_module

    model = models["looped_db"]
    engine = Engine(model, 2, default_iterations=3)
    settings = engine.resolve(sampling=GREEDY, bridge="soft")
    assert (settings.num_iterations, settings.bridge) == (3, "soft")  # this engine's default K
    calls = []
    monkeypatch.setattr(engine_module, "resolve_settings", lambda *a, **k: calls.append(k))
    by_settings = engine.run([Request([5, 9, 2], max_tokens=4, seed=1, settings=settings)])[0]
    assert calls == [] and by_settings.num_iterations == 3
    monkeypatch.undo()
    loose = Engine(model, 1, default_iterations=3).run([Request([5, 9, 2], 4, GREEDY, seed=1, bridge="soft")])[0]
    assert by_settings.token_ids == loose.token_ids
    with pytest.raises(ValueError, match="not both"):
        Request([1], 1, GREEDY, settings=settings)
    # settings resolved against the model's own limits may exceed this engine's cap: refused, not run
    capped = Engine(model, 1, max_iterations=4)
    with pytest.raises(InvalidRequest, match="1..4") as e:
        capped.check(Request([1], 1, settings=resolve_settings(model.iteration_limits(), num_iterations=8)))
    assert e.value.param == "num_iterations"


def test_the_engine_counts_the_iterations_a_rule_leaves(models):
    """stats.iterations sums the denoising calls each generated token took: K without a rule, fewer with."""
    from looped_lm.settings import ExitRule

    model = models["looped_db"]
    for rule, per_token in ((None, 6), (ExitRule(kl_threshold=float("inf")), 2)):
        engine = Engine(model, 1)
        engine.run([Request([5, 9, 2], max_tokens=5, settings=engine.resolve(sampling=GREEDY, num_iterations=6,
                                                                              exit_rule=rule))])
        assert engine.stats.iterations == per_token * 5
