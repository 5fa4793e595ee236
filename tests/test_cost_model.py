"""looped_lm/cost.py counts what the model code does: its matmul FLOPs equal torch's FlopCounterMode on
the real code (fwd + bwd of `training_loss` for one block's step; `forward_cached` for one decoded token
after a cached prompt), within TOL. Attention runs on torch's math SDPA kernel here, which the counter
sees as dense bmm over the whole (queries x keys) rectangle, hence `attention="dense"`. Only matmuls are
compared: norms, RoPE, softmax, cross-entropy and elementwise ops are not counted by either side."""

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from looped_lm import cost as cm
from looped_lm.config import config_from_dict
from looped_lm.models import build_model
from looped_lm.models.contract import Iterative
from looped_lm.models.huginn import sample_recurrence
from looped_lm.models.layers import ffn_width
from looped_lm.models.two_stream import noisy_mask
from looped_lm.sampling import PLAIN, SharedGenerator
from looped_lm.settings import RowBatch, resolve_settings

TOL = 1e-3  # relative; the counts agree exactly today, TOL only absorbs float rounding of large sums

SHAPES = [cm.Shape(d=32, layers=4, heads=4, vocab=97, seq=24, batch=2),
          cm.Shape(d=48, layers=2, heads=3, vocab=61, seq=20, batch=3, ffn=80)]


@contextmanager
def counting():
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        yield counter


def build(kind, s, lay=None, **model_extra):
    model = {"kind": kind, "n_layers": s.layers, "d_model": s.d, "n_heads": s.heads, "seq_len": s.seq,
             "ffn_hidden": s.ffn, "n_prelude": s.prelude, "n_coda": s.coda, **model_extra}
    diffusion = {}
    if lay is not None:
        model["loss_chunk"] = lay.loss_chunk
        diffusion = {"num_blocks": lay.blocks, "target_fraction": lay.target_fraction,
                     "parameterization": lay.parameterization, "noisy_self": lay.noisy_self,
                     "block_sampling": "round_robin", "clean_lm_weight": 0.5 if lay.clean_lm else 0.0}
        if lay.layers_per_block:
            diffusion["layers_per_block"] = list(lay.layers_per_block)
    torch.manual_seed(0)
    return build_model(config_from_dict({"model": model, "diffusion": diffusion}), s.vocab)


def step_flops(model, s, step):
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, s.vocab, (s.batch, s.seq), generator=g) for _ in range(2))
    with counting() as c:
        loss, _ = model.training_loss(x, y, step, seed=0)
        loss.backward()
    return c.get_total_flops()


def decode_flops(model, s, context, rows, num_iterations=None, bridge=None):
    """FLOPs of forward_cached for one new token per row after `context` cached prompt tokens."""
    ids = torch.randint(0, s.vocab, (rows, context + 1), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(rows, context + 8)
    limits = model.iteration_limits() if isinstance(model, Iterative) else None
    settings = resolve_settings(limits, num_iterations=num_iterations, bridge=bridge, sampling=PLAIN)
    batch = RowBatch.uniform(settings, rows, SharedGenerator(torch.Generator().manual_seed(3)))
    with torch.no_grad():
        model.forward_cached(ids[:, :context], cache, None, batch)
        with counting() as c:
            model.forward_cached(ids[:, context:], cache, None, batch)
    return c.get_total_flops()


def close(measured, analytic):
    assert measured > 0
    assert abs(measured - analytic) <= TOL * measured, f"FlopCounterMode {measured:,} vs cost model {analytic:,.0f}"


def test_ffn_rule_matches_the_model():
    for d in (32, 48, 100, 256, 768):
        assert cm.ffn_width(d) == ffn_width(d, 0)


@pytest.mark.parametrize("s", SHAPES)
@pytest.mark.parametrize("chunk", [0, 8])
def test_gpt_training_step(s, chunk):
    close(step_flops(build("gpt", s, loss_chunk=chunk), s, 0), cm.gpt_train(s, chunk, "dense").total())


DB_LAYOUTS = [
    cm.DBLayout(blocks=2),  # the shipped layout: likelihood, no self key
    cm.DBLayout(blocks=2, parameterization="edm", noisy_self=True),  # the paper's
    cm.DBLayout(blocks=2, loss_chunk=8),
    cm.DBLayout(blocks=2, parameterization="edm", loss_chunk=8),
    cm.DBLayout(blocks=2, target_fraction=0.25),
    cm.DBLayout(blocks=2, target_fraction=0.5, noisy_self=True, loss_chunk=4),
    cm.DBLayout(blocks=2, target_fraction=0.25, loss_chunk=8),  # 6 slots: one chunk, no recompute
    cm.DBLayout(blocks=2, clean_lm=True),
    cm.DBLayout(blocks=2, layers_per_block=(3, 1)),  # an uneven split: block 0 costs more
]


@pytest.mark.parametrize("lay", DB_LAYOUTS, ids=lambda lay: "-".join(
    f"{k}={v}" for k, v in vars(lay).items() if v != getattr(cm.DBLayout(blocks=2), k)) or "shipped")
def test_db_ar_training_step_of_every_block(lay):
    s = replace(SHAPES[0], prelude=1)
    model = build("db_ar", s, lay)
    for b in range(lay.blocks):  # round-robin: step b trains block b
        close(step_flops(model, s, b), cm.db_train(s, lay, b, "dense").total())


CURVE_LAYOUTS = [cm.DBLayout(blocks=2), cm.DBLayout(blocks=2, clean_lm=True),
                 cm.DBLayout(blocks=2, parameterization="edm", noisy_self=True)]


@pytest.mark.parametrize("lay", CURVE_LAYOUTS, ids=["shipped", "clean_lm", "paper"])
def test_a_curve_refresh(lay):
    """What network_gain / loss_share spend every diffusion.curve_every steps (measure_curve, forward only):
    charged to DB's training budget in equal-FLOPs comparisons."""
    s = replace(SHAPES[0], prelude=1)
    model = build("db_ar", s, lay)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, s.vocab, (s.batch, s.seq), generator=g) for _ in range(2))
    with counting() as c:
        model.measure_curve(x, y, seed=0)
    close(c.get_total_flops(), cm.db_curve(s, lay, attention="dense").total())


def test_looped_db_training_step():
    s = replace(SHAPES[1], prelude=1, coda=1)
    lay = cm.DBLayout(blocks=1, loss_chunk=8)
    close(step_flops(build("looped_db", s, lay), s, 0), cm.db_train(s, lay, 0, "dense").total())


def test_huginn_training_step():
    s = replace(SHAPES[0], layers=1, prelude=1, coda=1)
    model = build("huginn", s, mean_recurrence=4, backprop_depth=2)
    for step in (0, 1, 2):
        r = sample_recurrence(4, torch.Generator().manual_seed(0 * 1_000_003 + step))  # training_loss's draw
        close(step_flops(model, s, step), cm.huginn_train(s, r, 2, "dense").total())


@pytest.mark.parametrize("rows", [1, 3])
def test_gpt_decode_token(rows):
    s = SHAPES[0]
    close(decode_flops(build("gpt", s), s, 10, rows), cm.gpt_decode(s, 10, rows).total())


def blocks_visited(model, K):
    return len(set(model.grid().blocks(K)))


@pytest.mark.parametrize("lay,K,bridge", [
    (cm.DBLayout(blocks=2), 2, "hard"),
    (cm.DBLayout(blocks=2), 5, "soft"),
    (cm.DBLayout(blocks=2, parameterization="edm", noisy_self=True), 2, "sample"),
    (cm.DBLayout(blocks=2, parameterization="edm"), 1, "hard"),
])
def test_db_decode_token(lay, K, bridge):
    s = replace(SHAPES[0], prelude=1)
    model = build("db_ar", s, lay).eval()
    visited = blocks_visited(model, K)
    for rows in (1, 3):
        measured = decode_flops(model, s, 10, rows, num_iterations=K, bridge=bridge)
        close(measured, cm.db_decode(s, lay, K, 10, rows, bridge, blocks_visited=visited).total())


def test_looped_db_and_huginn_decode_token():
    s = replace(SHAPES[1], prelude=1, coda=1)
    lay = cm.DBLayout(blocks=1)
    model = build("looped_db", s, lay).eval()
    close(decode_flops(model, s, 7, 2, num_iterations=3, bridge="hard"), cm.db_decode(s, lay, 3, 7, 2).total())
    huginn = build("huginn", s, mean_recurrence=3, backprop_depth=2).eval()
    close(decode_flops(huginn, s, 7, 2, num_iterations=3), cm.huginn_decode(s, 3, 7, 2).total())


@pytest.mark.parametrize("noisy_self", [False, True])
def test_visible_pairs_are_the_masks(noisy_self):
    """attention="visible" counts the keys each noisy slot's attention call lets through (f = 1): without
    the self key, the mask's pairs; with it, over a whole window, the structural call's (one square causal
    SDPA over a dummy query, the sink and the clean keys, at head dim + SINK_PAD), not the (T, 2T) mask's."""
    T, s = 24, SHAPES[0]
    lay = cm.DBLayout(blocks=1, noisy_self=noisy_self)
    one_layer = replace(s, layers=1, seq=T, batch=1)
    dense = cm.db_train(one_layer, lay, attention="dense").fwd["attn_scores"]
    floor = cm.db_train(one_layer, lay, attention="visible").fwd["attn_scores"]
    clean_pairs = 0  # the block's only clean layer stops at K/V: no clean attention
    if noisy_self:
        head = s.d // s.heads
        width = s.d * (head + cm.SINK_PAD) / head
        assert floor == pytest.approx(4 * width * ((T + 1) * (T + 2) / 2 + clean_pairs))
        assert dense == pytest.approx(4 * width * (T + 1) ** 2)
    else:
        visible = int(noisy_mask(torch.arange(T), T).sum()) - T  # slot i: clean keys <= i
        assert floor == pytest.approx(4 * s.d * (visible + clean_pairs))
        assert dense == 4 * s.d * T * T


def test_an_uneven_split_charges_each_block_its_own_layers():
    s = replace(SHAPES[0], prelude=1)
    even, uneven = cm.DBLayout(blocks=2), cm.DBLayout(blocks=2, layers_per_block=(3, 1))
    costs = [cm.db_train(s, uneven, b).total() for b in range(2)]
    assert costs[0] > cm.db_train(s, even, 0).total() > costs[1]
    with pytest.raises(ValueError, match="summing to 4"):
        cm.db_train(s, cm.DBLayout(blocks=2, layers_per_block=(2, 1)))


@pytest.mark.parametrize("kind", ["gpt", "db_ar"])
def test_a_frozen_base_runs_no_weight_gradients(kind):
    """What MFU charges a LoRA step (total(frozen=FROZEN_UNDER_LORA)): the frozen base's projections, MLPs and
    tied head run forward and pass input gradients, but compute no weight gradients. Exact here: the base is
    frozen by hand, without adapters, whose own rank-r matmuls the count leaves out (module docs)."""
    s = replace(SHAPES[0], prelude=1) if kind == "db_ar" else SHAPES[0]
    lay = cm.DBLayout(blocks=2) if kind == "db_ar" else None
    model = build(kind, s, lay)
    for name, p in model.named_parameters():  # LoRA's split: the new DB parts (adaLN, noise MLP) train fully
        p.requires_grad_(p.dim() < 2 or ".ada." in name or name.startswith("noise_emb."))
    led = cm.gpt_train(s, 0, "dense") if lay is None else cm.db_train(s, lay, 0, "dense")
    measured = step_flops(model, s, 0)
    close(measured, led.total(frozen=cm.FROZEN_UNDER_LORA))
    assert led.total() > 1.2 * measured  # full fine-tuning's count is not what ran
