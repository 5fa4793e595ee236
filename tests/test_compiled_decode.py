"""The engine's compiled decode steps (looped_lm/engine/compiled.py): gpt's fixed-shape step and a DB model's
fixed-shape block call compute what their eager cached calls compute, for ragged rows, row subsets and padded
(repeated) rows; the engine with `compile_decode` returns the eager engine's tokens (DB models at K below, at
and above B, looped_db with adaptive exit); two graphs (one row, and any other bucket: the row count is dynamic), per block and call for DB models, with no graph break
and no recompilation as requests come and go. Dynamo runs with a counting backend (the graphs inductor would get,
without its code generation: tens of seconds per graph on this CPU); bench/decode.py runs inductor."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from looped_lm.engine import compiled
from looped_lm.engine.engine import Engine, Request
from looped_lm.models.db.contexts import CachedContext
from looped_lm.sampling import GREEDY, SamplingParams, SharedGenerator
from looped_lm.settings import ExitRule, RowBatch, resolve_settings
from tiny_models import D, V, build_tiny

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


@pytest.mark.parametrize("backend", ["counter", "aot_eager"])
def test_the_compiled_engine_returns_the_eager_engines_tokens_with_one_graph_per_bucket(monkeypatch, backend):
    """aot_eager adds AOTAutograd's functionalization of the cache writes (what inductor receives)."""
    counter = CompileCounter() if backend == "counter" else None
    monkeypatch.setattr(compiled, "BACKEND", counter or backend)
    model = build_tiny("gpt").eval()
    eager = [o.token_ids for o in Engine(model, num_slots=4, max_len=64).run(requests())]
    engine = Engine(model, num_slots=4, max_len=64, compile_decode=True)
    assert engine.runner.compiled is not None
    if counter:
        assert counter.frame_count == 2  # at start-up: one row, and every other bucket (a dynamic row count)
    outs = engine.run(requests())
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert [o.token_ids for o in outs] == eager
    assert [o.token_ids for o in engine.run(requests())] == eager  # the pool was left empty by the warm-up
    if counter:
        assert counter.frame_count == 2  # steady state: rows 4 -> 3 -> 2 -> 1 ran in buckets 4, 4, 2, 1


def test_several_engines_in_one_process_each_get_their_graphs(monkeypatch):
    """Every engine compiles the same method; each keeps its own graph count (dynamo's default is 8)."""
    monkeypatch.setattr(compiled, "BACKEND", CompileCounter())
    model = build_tiny("gpt").eval()
    for slots in (1, 4, 16, 64, 3):
        engine = Engine(model, num_slots=slots, max_len=48, compile_decode=True)
        outs = engine.run(requests()[:min(slots, 4)])
        assert all(o.finish_reason == "length" for o in outs), (slots, [o.finish_reason for o in outs])


def test_models_without_a_fixed_shape_step_decode_eagerly():
    engine = Engine(build_tiny("huginn").eval(), num_slots=2, max_len=32, compile_decode=True)
    assert engine.runner.compiled is None and engine.runner.compiled_blocks is None


# --- DiffusionBlocks: each block call of the chain compiled ---------------------------------------------------

DB_LAYOUTS = {  # the paper's layout (edm, self key), the product's (likelihood, no self key), stacked + clean_state
    "paper": {},
    "product": {"parameterization": "likelihood", "noisy_self": False, "noisy_input": "prev_token", "bridge": "sample"},
    "stacked": {"context": "stacked", "noisy_input": "clean_state", "parameterization": "likelihood"},
}


@torch.no_grad()
def db_cache(model, lengths):
    """A 5-row decode state whose rows hold `lengths` tokens (ragged), every block caught up (K = B), then one
    more token in each row's history that no block has cached yet."""
    g = torch.Generator().manual_seed(3)
    cache = model.new_cache(5, 32)
    settings = resolve_settings(model.iteration_limits(), num_iterations=len(model.blocks), sampling=GREEDY)
    for row, n in enumerate(lengths):
        ids = torch.randint(0, V, (1, n), generator=g)
        model.forward_cached(ids, cache, torch.tensor([row]), RowBatch([settings], SharedGenerator(None)))
    cache.append(model, torch.randint(0, V, (5, 1), generator=g), None)
    return cache


@pytest.mark.parametrize("layout", DB_LAYOUTS)
@torch.no_grad()  # as the engine decodes
def test_the_fixed_block_step_equals_the_eager_block_call_on_ragged_padded_rows(layout):
    """Both calls: the pending token with the slot (the fused pass), then the block's second call at the same
    token (the slot against the cache); each block; logits, and every key, value and handed state written."""
    model = build_tiny("db_ar", **DB_LAYOUTS[layout])
    base = db_cache(model, [3, 7, 1, 5, 2])
    rows = torch.tensor([4, 1, 3])
    pad = torch.cat([rows, rows[-1:].expand(2)])
    eager_cache, fixed_cache = clone(base), clone(base)
    g = torch.Generator().manual_seed(5)
    for b in model.stack_order if model.stacked else range(len(model.blocks)):
        for append in (True, False):
            z = torch.randn(3, 1, D, generator=g) * 3
            sigma = torch.tensor([4.0, 1.5, 0.3])
            eager = CachedContext(model, eager_cache, rows).denoise(b, z, sigma)
            fixed = model.decode_block_fixed(b, fixed_cache, pad, torch.cat([z, z[-1:].expand(2, -1, -1)]),
                                             torch.cat([sigma, sigma[-1:].expand(2)]), append)
            torch.testing.assert_close(fixed[:3], eager, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(fixed[3:], eager[2:].expand(2, -1, -1), atol=1e-4, rtol=1e-4)
            for a, c in zip(eager_cache.blocks[b], fixed_cache.blocks[b]):
                assert torch.equal(a.lengths, c.lengths), (b, append)
                torch.testing.assert_close(a.k, c.k, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(a.v, c.v, atol=1e-5, rtol=1e-5)
            for h in eager_cache.handed:
                torch.testing.assert_close(eager_cache.handed[h], fixed_cache.handed[h], atol=1e-5, rtol=1e-5)


def db_requests(K, exit_rule=None):
    sampled = SamplingParams(temperature=0.9, top_k=20)
    return [Request(prompt=list(range(1, 3 + 4 * i)), max_tokens=6 + 3 * i, seed=i, num_iterations=K,
                    exit_rule=exit_rule, sampling=GREEDY if i % 2 else sampled) for i in range(4)]


@pytest.mark.parametrize("kind,layout,K,exit_kl,backend", [
    ("db_ar", "paper", 1, None, "counter"), ("db_ar", "paper", 2, None, "counter"),
    ("db_ar", "product", 4, None, "counter"), ("db_ar", "product", 4, None, "aot_eager"),
    ("db_ar", "stacked", 2, None, "counter"), ("looped_db", "paper", 4, None, "counter"),
    ("looped_db", "paper", 8, 1e-2, "counter"), ("db_ar", "product", 2, None, "bf16")])
def test_the_compiled_db_engine_returns_the_eager_engines_tokens(monkeypatch, kind, layout, K, exit_kl, backend):
    """Greedy and sampled rows, at K below, at and above B, looped_db with adaptive exit: the eager engine's
    tokens; every (block, call) compiled at start-up and none after; the compiled step ran. aot_eager adds
    the functionalisation of the cache, length and handed-state writes (what inductor receives); bf16: the
    weights a GPU serves with (the chain still hands fp32 slots: a graph built for bf16 ones would recompile)."""
    counter = CompileCounter()
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager" if backend == "aot_eager" else counter)
    model = build_tiny(kind, **DB_LAYOUTS[layout])
    if backend == "bf16":
        model = model.to(torch.bfloat16)
    rule = ExitRule(kl_threshold=exit_kl) if exit_kl else None
    eager = [o.token_ids for o in Engine(model, num_slots=4, max_len=64).run(db_requests(K, rule))]
    engine = Engine(model, num_slots=4, max_len=64, compile_decode=True)
    graphs = 2 * len(model.blocks) * 2 if backend != "aot_eager" else 0  # per block and call: one row, any other
    assert counter.frame_count == graphs
    blocks, calls = engine.runner.compiled_blocks, []
    step = blocks.step
    monkeypatch.setattr(blocks, "step", lambda *args: calls.append(args[0]) or step(*args))
    outs = engine.run(db_requests(K, rule))
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert [o.token_ids for o in outs] == eager
    assert counter.frame_count == graphs  # no recompilation as rows come and go
    decode_steps = sum(len(o.token_ids) for o in outs) - len(outs)  # tokens after each request's first
    assert len(calls) >= decode_steps // 4  # every decode step of the full batch at least (4 rows a step)


@torch.no_grad()
def test_rows_with_different_pending_counts_run_eagerly():
    """The compiled block call assumes one pending token per row (or none, for all): a batch that mixes them
    (a row whose last chain skipped the block beside rows that ran it) must take the eager path."""
    model = build_tiny("db_ar", **DB_LAYOUTS["product"])
    cache = db_cache(model, [3, 7, 1, 5, 2])  # every row: one token pending for every block
    rows = torch.tensor([0, 1, 2])
    called = []
    model.use_block_step(cache, lambda *args: called.append(args) or torch.zeros(3, 1, V))
    z, sigma = model.example_slots(3, "cpu")
    assert CachedContext(model, cache, rows)._compiled(0, z, sigma) is not None and called[-1][-1] is True
    model.decode_block_fixed(0, cache, torch.tensor([1]), z[:1], sigma[:1])  # row 1 catches up on block 0
    assert CachedContext(model, cache, rows)._compiled(0, z, sigma) is None  # pending 1, 0, 1
    assert CachedContext(model, cache, torch.tensor([1]))._compiled(0, z[:1], sigma[:1]) is not None
    assert called[-1][-1] is False  # its second call at this token: no token to append
    model.use_block_step(cache, None)


def test_the_engine_freezes_the_inference_tables_a_compiled_graph_reads(monkeypatch):
    """A compiled graph cannot check a TransposedCopy against its table; frozen, it reads the copy made
    before (instead of recomputing the V x d table per call), and the copy is among the pool's tensors."""
    monkeypatch.setattr(compiled, "BACKEND", CompileCounter())
    model = build_tiny("db_ar", **DB_LAYOUTS["product"])
    engine = Engine(model, num_slots=2, max_len=32, compile_decode=True)
    pool = engine.runner.pool
    assert model.targets_t.frozen and any(t is model.targets_t.value for t in compiled._tensors(pool))
    table = torch.zeros_like(model.tok_emb.weight)
    read = torch.compile(lambda w: model.targets_t(w), backend="eager", fullgraph=True)
    assert torch.equal(read(table), model.targets_t.value)  # the frozen copy, not the zeros' table
    model.use_block_step(pool, None)
    torch._dynamo.reset()
    assert not model.targets_t.frozen and torch.equal(read(table), model._normalized(table).T)
