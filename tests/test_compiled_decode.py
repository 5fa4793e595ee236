"""The engine's compiled decode step (looped_lm/engine/compiled.py): gpt's fixed-shape step computes what its
eager cached step computes, for ragged rows, row subsets and padded (repeated) rows; the engine with
`compile_decode` returns the eager engine's tokens; one graph per bucket, with no graph break and no
recompilation as requests come and go. Dynamo runs with a counting backend (the graphs inductor would get,
without its code generation: tens of seconds per graph on this CPU); bench/decode.py runs inductor."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from looped_lm.engine import compiled
from looped_lm.engine.engine import Engine, Request
from looped_lm.sampling import GREEDY, SamplingParams
from tiny_models import V, build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def filled_cache(model, lengths):
    """A 5-row cache whose rows hold `lengths` tokens (ragged), and the ids that filled them."""
    g = torch.Generator().manual_seed(3)
    cache = model.new_cache(5, 32)
    for row, n in enumerate(lengths):
        ids = torch.randint(0, V, (1, n), generator=g)
        model.forward_cached(ids, cache, torch.tensor([row]))
    return cache


def clone(cache):
    import copy

    return copy.deepcopy(cache)


def test_the_fixed_shape_step_equals_the_cached_step_on_ragged_padded_rows():
    model = build_tiny("gpt").eval()
    base = filled_cache(model, [3, 7, 1, 5, 2])
    rows, ids = torch.tensor([4, 1, 3]), torch.tensor([[5], [9], [11]])
    eager_cache, fixed_cache = clone(base), clone(base)
    eager = model.forward_cached(ids, eager_cache, rows)
    padded_rows, padded_ids = torch.cat([rows, rows[-1:].expand(2)]), torch.cat([ids, ids[-1:].expand(2, 1)])
    fixed = model.decode_fixed(padded_ids, fixed_cache, padded_rows)
    torch.testing.assert_close(fixed[:3], eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fixed[3:], eager[2:].expand(2, -1), atol=1e-5, rtol=1e-5)  # the padding's copies
    for a, b in zip(eager_cache.layers, fixed_cache.layers):  # the same keys, values and lengths written
        assert torch.equal(a.lengths, b.lengths)
        torch.testing.assert_close(a.k, b.k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(a.v, b.v, atol=1e-6, rtol=1e-6)
    # and the next step after it still agrees (the written keys are read back at the right positions)
    torch.testing.assert_close(model.decode_fixed(ids, fixed_cache, rows), model.forward_cached(ids, eager_cache, rows),
                               atol=1e-5, rtol=1e-5)


def test_buckets_are_powers_of_two_up_to_the_slot_count():
    assert compiled.buckets(1) == [1]
    assert compiled.buckets(6) == [1, 2, 4, 6]
    assert compiled.buckets(8) == [1, 2, 4, 8]


def requests():
    sampled = SamplingParams(temperature=0.9, top_k=20)
    return [Request(prompt=list(range(1, 3 + 4 * i)), max_tokens=6 + 3 * i, seed=i,
                    sampling=GREEDY if i % 2 else sampled) for i in range(4)]


def test_the_compiled_engine_returns_the_eager_engines_tokens_with_one_graph_per_bucket(monkeypatch):
    counter = CompileCounter()
    monkeypatch.setattr(compiled, "BACKEND", counter)
    model = build_tiny("gpt").eval()
    eager = [o.token_ids for o in Engine(model, num_slots=4, max_len=64).run(requests())]
    engine = Engine(model, num_slots=4, max_len=64, compile_decode=True)
    assert engine.runner.compiled is not None
    assert [o.token_ids for o in engine.run(requests())] == eager
    graphs = counter.frame_count
    assert 1 <= graphs <= len(compiled.buckets(4))  # rows 4 -> 3 -> 2 -> 1 as requests finish: one graph each
    assert [o.token_ids for o in engine.run(requests())] == eager  # steady state: nothing recompiles
    assert counter.frame_count == graphs


def test_models_without_a_fixed_shape_step_decode_eagerly():
    engine = Engine(build_tiny("db_ar").eval(), num_slots=2, max_len=32, compile_decode=True)
    assert engine.runner.compiled is None


def test_every_bucket_of_a_large_pool_fits_dynamos_graph_limit():
    model = build_tiny("gpt").eval()
    engine = Engine(model, num_slots=300, max_len=8, compile_decode=True)  # buckets 1, 2, ..., 256, 300
    assert torch._dynamo.config.recompile_limit >= len(engine.runner.compiled.buckets) == 10
