"""Inference products through oneDNN's prepacked weights (looped_lm/models/layers.py): the head
(TransposedCopy.product) and the layers' Linear, on CPU for large fp32 weights and more than one row. They compute
x @ weight.T, follow the weight when it changes, survive copying and saving, and the engine returns the same
greedy tokens with them as without them for every LM kind. A prompt's earlier positions never reach the head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looped_lm.engine.engine import Engine, Request
from looped_lm.models import layers
from looped_lm.models.layers import Linear, TransposedCopy
from looped_lm.sampling import GREEDY
from looped_lm.sampling import SharedGenerator
from looped_lm.settings import RowBatch, resolve_settings
from tiny_models import V, build_tiny

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")]


@pytest.fixture
def pack_every_table(monkeypatch):
    """The tiny models' weights are below the packing thresholds: lower them so they take the packed path."""
    monkeypatch.setattr(TransposedCopy, "PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(Linear, "PACK_MIN_ELEMENTS", 0)


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_the_product_is_x_times_the_table_transposed(pack_every_table, rows):
    g = torch.Generator().manual_seed(0)
    table, x = torch.randn(300, 24, generator=g), torch.randn(rows, 3, 24, generator=g)
    copy = TransposedCopy()
    torch.testing.assert_close(copy.product(x, table), x @ table.T, atol=1e-5, rtol=1e-5)
    assert (copy.packed is not None) == (rows * 3 >= 2)  # several rows: the packed weight; one row: not built


def test_one_row_takes_the_transposed_copy(pack_every_table):
    copy, table, x = TransposedCopy(), torch.randn(300, 24), torch.randn(1, 24)
    torch.testing.assert_close(copy.product(x, table), x @ table.T, atol=1e-5, rtol=1e-5)
    assert copy.packed is None and copy.value is not None


def test_the_packed_weight_follows_the_table(pack_every_table):
    copy, table, x = TransposedCopy(lambda t: 2 * t), torch.randn(300, 24), torch.randn(4, 24)
    torch.testing.assert_close(copy.product(x, table), x @ (2 * table).T, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        table.mul_(-1)  # in place: the same storage, a new version
    torch.testing.assert_close(copy.product(x, table), x @ (2 * table).T, atol=1e-5, rtol=1e-5)


def test_small_or_low_precision_tables_are_not_packed():
    copy = TransposedCopy()
    copy.product(torch.randn(8, 24), torch.randn(300, 24))  # below PACK_MIN_ELEMENTS
    assert copy.packed is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TransposedCopy, "PACK_MIN_ELEMENTS", 0)
        copy.product(torch.randn(8, 24, dtype=torch.bfloat16), torch.randn(300, 24, dtype=torch.bfloat16))
        assert copy.packed is None


def greedy_tokens(model, k=None):
    engine = Engine(model, 4, max_len=32)
    prompts = [[1 + i, 5, 9 + 2 * i][: 1 + i % 3] for i in range(4)]
    return [o.token_ids for o in engine.run([Request(p, 6, GREEDY, num_iterations=k) for p in prompts])]


@pytest.mark.parametrize("kind,k", [("gpt", None), ("db_ar", 2), ("db_ar", 4), ("looped_db", 4), ("huginn", 3)])
def test_the_engine_decodes_the_same_tokens_packed_or_not(monkeypatch, kind, k):
    model = build_tiny(kind)
    plain = greedy_tokens(model, k)
    assert not any(m in layers._PACKED for m in model.modules())
    monkeypatch.setattr(TransposedCopy, "PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(Linear, "PACK_MIN_ELEMENTS", 0)
    assert greedy_tokens(model, k) == plain
    heads = [c for c in vars(model).values() if isinstance(c, TransposedCopy)]
    assert any(c.packed is not None for c in heads), "the head's packed path was not taken"
    assert any(m in layers._PACKED for m in model.modules()), "no layer's packed path was taken"


@pytest.mark.parametrize("kind", ["gpt", "huginn", "db_ar"])
def test_a_prompt_reaches_the_head_at_its_last_position_only(monkeypatch, kind):
    """Prefilling 3 rows of 9 tokens runs the head on 3 rows, not 27 (at V 50257 the head product of every
    position would be most of the prefill), and a chunk that is not the prompt's last runs no head."""
    model, rows_seen = build_tiny(kind), []
    product = TransposedCopy.product

    def counting(self, x, table):
        rows_seen.append(x.numel() // x.shape[-1])
        return product(self, x, table)

    monkeypatch.setattr(TransposedCopy, "product", counting)
    settings = resolve_settings(model.iteration_limits() if kind != "gpt" else None, sampling=GREEDY,
                                num_iterations=2 if kind == "db_ar" else None)
    batch = RowBatch([settings] * 3, SharedGenerator(None))
    cache, rows, ids = model.new_cache(3, 32), torch.arange(3), torch.randint(0, V, (3, 9))
    assert model.forward_cached(ids, cache, rows, batch, want_logits=False) is None
    assert rows_seen == []
    assert model.forward_cached(ids, cache, rows, batch).shape == (3, V)
    assert rows_seen and max(rows_seen) == 3, rows_seen


def test_a_model_holding_packed_copies_can_be_copied_and_saved(pack_every_table, tmp_path):
    """Checkpointing deep-copies a model with partly tied weights, after evaluation may have built the packed
    copies: oneDNN's packed tensors cannot be copied or saved, so the copies start empty."""
    import copy

    model = build_tiny("gpt")
    with torch.no_grad():
        model.logits(torch.randn(2, 3, model.tok_emb.weight.shape[1]))
    assert model.head_t.packed is not None
    twin = copy.deepcopy(model)
    assert twin.head_t.packed is None and twin.head_t is not model.head_t
    torch.save(model, tmp_path / "model.pt")
    with torch.no_grad():
        x = torch.randn(2, 3, model.tok_emb.weight.shape[1])
        torch.testing.assert_close(twin.logits(x), model.logits(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_linear_equals_f_linear_and_follows_its_weight(pack_every_table, bias):
    lin, x = Linear(24, 40, bias=bias).eval(), torch.randn(2, 5, 24)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        assert lin in layers._PACKED
        lin.weight.mul_(-2)  # in place, as an optimizer step
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def test_the_linear_packs_only_at_inference_with_several_rows(pack_every_table):
    lin = Linear(24, 40, bias=False)
    lin(torch.randn(4, 24)).sum().backward()  # training: F.linear, gradients flow
    assert lin.weight.grad is not None and lin not in layers._PACKED
    with torch.no_grad():
        lin(torch.randn(3, 24))  # training mode without a gradient (a stacked block's feeders): not packed
        assert lin not in layers._PACKED
        lin.eval()
        lin(torch.randn(1, 1, 24))
        assert lin not in layers._PACKED
        lin(torch.randn(3, 24))
    assert lin in layers._PACKED
    import copy

    twin = copy.deepcopy(lin)  # the packed copy lives beside the module, not in it
    assert twin not in layers._PACKED
    torch.testing.assert_close(twin.weight, lin.weight)
