"""Analytic cost model: matmul FLOPs per training step and per decoded token, counted term by term from
what the model code does (looped_lm/models/: gpt, db/, two_stream, layers, huginn). The equal-FLOPs
benches (bench/decision.py, bench/scaleout.py) charge each step from it; `bench/cost_model.py table` prints its tables;
tests/test_cost_model.py checks it against torch's FlopCounterMode on the real steps.

Every count is a ledger of matmuls, each tagged with a term:

    attn_proj    q/k/v and output projections          mlp       SwiGLU gate_up and down
    attn_scores  q.k and p.v (per visible key)          head      final norm's output @ E^T (tied)
    cond         noise embedding MLP + adaLN (DB)       adapter   Huginn's cat[s, e] -> d
    loglik       <z, y_v> / sigma^2 against the V x d target table (parameterization: likelihood)
    posterior    softmax(loglik) @ E, the noisy stream's input (likelihood)
    bridge       softmax @ target table between decode steps (bridge: soft)

A linear of `rows` x d_in -> d_out costs 2 rows d_in d_out forward and the same again for each of its
input gradient and weight gradient that autograd computes (an input that needs no gradient, e.g. the
detached target table, costs nothing backward). Attention costs 4 d per (query, key) pair forward (q.k
and p.v over all heads), twice that backward (no recompute). `attention="dense"` counts every pair of
the (queries x keys) rectangle, which is what a masked SDPA and torch's math kernel compute and what
`FlopCounterMode` reports; `attention="visible"` counts only the pairs the mask lets through (a causal
flash kernel's work, the floor). Excluded: norms, RoPE, softmax / cross-entropy, elementwise ops,
embedding lookups and the target-table normalisation (memory traffic, no matmul).

A DiffusionBlocks step is counted per block: `db_train(shape, layout, block)` runs the prelude, then
block `block`'s layers (`layers_of`: an even split, or `layout.layers_per_block`) in the clean and the
noisy stream, then the head and likelihood terms. Checkpointed chunks (`loss_chunk`) run forward twice:
once in the forward, once when backward recomputes what it saved. Counted as the code runs under torch's
non-reentrant checkpoint, which stops recomputing at the last saved tensor (so a trailing matmul whose
output is not saved is not rerun).

Decode also gets a weight-traffic count (`weight_params`: every matmul call reads its weight matrix once,
whatever the batch): at small batch decode is memory-bound and that is its floor; KV-cache reads are
listed apart (`kv_elements`).

Projections (flags marked PROJECTION) model changes that are not in the code: they are labelled as such
wherever they are printed and the validation test does not cover them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

SINK_PAD = 8  # looped_lm.models.two_stream.SINK_PAD (this module imports nothing of the models)
TERMS = ("attn_proj", "attn_scores", "mlp", "cond", "adapter", "head", "loglik", "posterior", "bridge")
LAYER_TERMS = ("attn_proj", "attn_scores", "mlp", "cond", "adapter")
VOCAB_TERMS = ("head", "loglik", "posterior", "bridge")
# LoRA (train.lora_rank > 0) freezes the pretrained matrices of these terms: their weight gradients never run.
# The budgets charge a LoRA step as full fine-tuning on purpose (one FLOPs count per recipe); MFU asks what ran.
FROZEN_UNDER_LORA = ("attn_proj", "mlp", "head", "posterior")  # head and posterior: the frozen embedding


def ffn_width(d: int, ffn: int = 0) -> int:
    """Llama's SwiGLU width rule, as looped_lm.models.layers.ffn_width."""
    return ffn if ffn > 0 else 64 * math.ceil(8 * d / 3 / 64)


@dataclass(frozen=True)
class Shape:
    """Model and batch shape. `heads` does not change a count: attention costs H x D = d per key."""

    d: int
    layers: int  # gpt: all of them; db_ar: split into blocks; looped_db / huginn: the core
    heads: int
    vocab: int
    seq: int  # training window T
    batch: int = 1  # sequences per training step
    ffn: int = 0  # 0 = Llama's rule
    prelude: int = 0
    coda: int = 0

    @property
    def hidden(self) -> int:
        return ffn_width(self.d, self.ffn)


@dataclass(frozen=True)
class DBLayout:
    blocks: int = 4  # looped_db: 1 (the core)
    denoise: bool = True  # diffusion.denoise_weight > 0; False: the clean stream and its head only
    target_fraction: float = 1.0
    parameterization: str = "likelihood"  # or "edm"
    noisy_self: bool = False
    loss_chunk: int = 0
    clean_lm: bool = False  # diffusion.clean_lm_weight > 0
    # PROJECTION: with unit-norm targets tied to the head, scale*<norm h, y_v> + <z, y_v>/sigma^2 is one
    # matmul <scale*norm h + z/sigma^2, y_v>: the head's separate loglik product disappears
    fold_likelihood: bool = False
    # PROJECTION: "no_grad" = the posterior-mean input embedding without a gradient into E (and
    # computed once, outside the checkpointed chunks); "topk" = that, over the top `topk` tokens only
    posterior: str = "full"
    topk: int = 0
    layers_per_block: tuple[int, ...] = ()  # diffusion.layers_per_block; () = an even split
    stack_order: tuple[int, ...] = ()  # context stacked: the clean stream's block order; () = independent


def layers_of(s: Shape, lay: DBLayout, block: int) -> int:
    """Layers of block `block` in each stream, the coda's included (looped_lm.models.db layers_of)."""
    if lay.layers_per_block:
        if len(lay.layers_per_block) != lay.blocks or sum(lay.layers_per_block) != s.layers:
            raise ValueError(f"layers_per_block {list(lay.layers_per_block)} must be {lay.blocks} counts "
                             f"summing to {s.layers}")
        return lay.layers_per_block[block] + s.coda
    return s.layers // lay.blocks + s.coda


@dataclass
class Ledger:
    """Matmul FLOPs by term, forward and backward, plus weights read per call (decode)."""

    fwd: dict = field(default_factory=lambda: defaultdict(float))
    bwd: dict = field(default_factory=lambda: defaultdict(float))
    bwd_weight: dict = field(default_factory=lambda: defaultdict(float))  # the part of bwd that is weight grads
    weight_params: float = 0.0
    kv_elements: float = 0.0

    def linear(self, term, rows, d_in, d_out, grad_in=False, grad_w=False, runs=1):
        """`runs` forward passes (2 with a checkpoint's recompute) and one backward."""
        flops = 2.0 * rows * d_in * d_out
        self.fwd[term] += runs * flops
        self.bwd[term] += flops * (int(grad_in) + int(grad_w))
        self.bwd_weight[term] += flops * int(grad_w)
        self.weight_params += runs * d_in * d_out

    def attention(self, batch, queries, keys_per_query, d, grad=False):
        flops = 4.0 * batch * queries * keys_per_query * d
        self.fwd["attn_scores"] += flops
        self.bwd["attn_scores"] += 2 * flops if grad else 0.0
        self.kv_elements += batch * queries * keys_per_query * 2 * d

    def total(self, terms=TERMS, frozen=()) -> float:
        """`frozen`: terms whose weight gradients do not run (FROZEN_UNDER_LORA for a LoRA step)."""
        return sum(self.fwd.get(t, 0.0) + self.bwd.get(t, 0.0) - (self.bwd_weight.get(t, 0.0) if t in frozen else 0.0)
                   for t in terms)

    def as_dict(self) -> dict:
        terms = {t: {"fwd": self.fwd.get(t, 0.0), "bwd": self.bwd.get(t, 0.0)} for t in TERMS
                 if self.fwd.get(t, 0.0) or self.bwd.get(t, 0.0)}
        return {"total": self.total(), "layers": self.total(LAYER_TERMS), "vocab": self.total(VOCAB_TERMS),
                "terms": terms, "weight_params": self.weight_params, "kv_elements": self.kv_elements}


def _causal_keys(T: int, attention: str) -> float:
    """Keys per query of causal self-attention over T tokens: T (dense) or (T + 1) / 2 (visible)."""
    return T if attention == "dense" else (T + 1) / 2


# --- the pieces every model shares -----------------------------------------------------------------


def _layer(led, s: Shape, batch, T, keys, grad, qkv_only=False):
    """One pre-norm layer over `T` tokens of `batch` rows (TransformerLayer / the clean stream).
    qkv_only: the last clean layer of a DB block, which only produces K/V (q is computed, unused).
    With grad, every matmul's input needs a gradient too: the norms' weights make it so even where the
    layer's input does not."""
    rows = batch * T
    led.linear("attn_proj", rows, s.d, 3 * s.d, grad, grad)
    if qkv_only:
        return
    led.attention(batch, T, keys, s.d, grad)
    led.linear("attn_proj", rows, s.d, s.d, grad, grad)
    led.linear("mlp", rows, s.d, 2 * s.hidden, grad, grad)
    led.linear("mlp", rows, s.hidden, s.d, grad, grad)


def _noisy_layer(led, s: Shape, batch, n, keys, noisy_self, grad, width=None):
    """One noisy-stream layer (TwoStreamLayer.noisy) over n slots of `batch` rows; `width`: the attention's
    H x head dim (padded on the structural path)."""
    rows = batch * n
    led.linear("cond", batch, s.d, 6 * s.d, grad, grad)  # adaLN from the (batch, d) condition
    led.linear("attn_proj", rows, s.d, (3 if noisy_self else 1) * s.d, grad, grad)  # qkv, or q only
    led.attention(batch, n, keys, width or s.d, grad)
    led.linear("attn_proj", rows, s.d, s.d, grad, grad)
    led.linear("mlp", rows, s.d, 2 * s.hidden, grad, grad)
    led.linear("mlp", rows, s.hidden, s.d, grad, grad)


def _noise_embedding(led, s: Shape, batch, grad):
    led.linear("cond", batch, 2 * (s.d // 2), s.d, False, grad)  # Fourier features need no gradient
    led.linear("cond", batch, s.d, s.d, grad, grad)


# --- training: one step's forward + backward -------------------------------------------------------


def gpt_train(s: Shape, loss_chunk: int = 0, attention: str = "visible") -> Ledger:
    led, T, Bsz = Ledger(), s.seq, s.batch
    for _ in range(s.layers):
        _layer(led, s, Bsz, T, _causal_keys(T, attention), grad=True)
    chunked = 0 < loss_chunk < T
    led.linear("head", Bsz * T, s.d, s.vocab, True, True, runs=2 if chunked else 1)
    return led


def db_train(s: Shape, lay: DBLayout, block: int = 0, attention: str = "visible") -> Ledger:
    """One DiffusionBlocks step (db_ar, or looped_db with lay.blocks = 1): prelude, then block `block`'s
    clean and noisy streams (and the coda), head and likelihood terms."""
    led, T, Bsz = Ledger(), s.seq, s.batch
    d, V = s.d, s.vocab
    n = max(1, round(lay.target_fraction * T))
    M = Bsz * n
    causal = _causal_keys(T, attention)
    for _ in range(s.prelude):
        _layer(led, s, Bsz, T, causal, grad=True)
    # context stacked: the blocks before this one in the stack hand their clean states on, forward only
    for before in lay.stack_order[:lay.stack_order.index(block)] if lay.stack_order else ():
        for _ in range(layers_of(s, lay, before) - s.coda):
            _layer(led, s, Bsz, T, causal, grad=False)
    depth = layers_of(s, lay, block)
    for i in range(depth):
        _layer(led, s, Bsz, T, causal, grad=True, qkv_only=(i + 1 == depth and not lay.clean_lm))
    if not lay.denoise:  # the control arm: the clean stream's next-token loss alone
        led.linear("head", Bsz * T, d, V, True, True)
        return led
    keys, width = _slot_keys(s, lay, T, n, attention)
    _noise_embedding(led, s, Bsz, grad=True)
    for _ in range(depth):
        _noisy_layer(led, s, Bsz, n, keys, lay.noisy_self, grad=True, width=width)
    runs = 2 if 0 < lay.loss_chunk < n else 1  # checkpointed chunks rerun their forward in backward
    if lay.parameterization == "likelihood":
        _likelihood_train(led, lay, M, d, V, runs)
    else:
        led.linear("head", M, d, V, True, True, runs=runs)
    if lay.clean_lm:
        led.linear("head", Bsz * T, d, V, True, True)
    return led


def db_curve(s: Shape, lay: DBLayout, n_sigma: int = 24, attention: str = "visible") -> Ledger:
    """One refresh of the measured CE(sigma) curve (block_sampling loss_share / network_gain, every
    diffusion.curve_every steps; `DBObjective.measure_curve`): forward only, on one training batch. Every
    block's clean stream runs once (its last layer K/V only, unless it hands its states on under context
    stacked), then each of the n_sigma grid points runs the owning block's noisy stream over the whole
    window, the head, and z's own likelihood (the network_gain reference)."""
    led, T, Bsz = Ledger(), s.seq, s.batch
    d, V, M = s.d, s.vocab, s.batch * s.seq
    causal = _causal_keys(T, attention)
    for _ in range(s.prelude):
        _layer(led, s, Bsz, T, causal, grad=False)
    hands_on = set(lay.stack_order[:-1]) if lay.stack_order else set()
    for b in range(lay.blocks):
        depth = layers_of(s, lay, b)
        for i in range(depth):
            last = i + 1 == depth and not (b in hands_on and s.coda == 0)
            _layer(led, s, Bsz, T, causal, grad=False, qkv_only=last)
    keys, width = _slot_keys(s, lay, T, T, attention)
    for i in range(n_sigma):
        depth = layers_of(s, lay, 0)  # an even split; an uneven one charges block 0's depth
        _noise_embedding(led, s, Bsz, grad=False)
        for _ in range(depth):
            _noisy_layer(led, s, Bsz, T, keys, lay.noisy_self, grad=False, width=width)
        if lay.parameterization == "likelihood":
            led.linear("loglik", M, d, V)
            led.linear("posterior", M, lay.topk if lay.posterior == "topk" else V, d)
        led.linear("head", M, d, V)
        led.linear("loglik", M, d, V)  # ce_z: z's own likelihood alone
    return led


def _slot_keys(s: Shape, lay: DBLayout, T: int, n: int, attention: str) -> tuple[float, float]:
    """(keys per noisy slot, attention width) for n slots of a T-token window: clean positions <= its own
    (+ its own key with noisy_self). Every slot of the window with its self key runs
    `causal_plus_self_attention`: one causal SDPA over a sink and the clean keys at head dim D + SINK_PAD,
    the self score elementwise (T + 1 queries: a dummy one in front makes the call square); some slots:
    the masked SDPA over T + n keys."""
    structural = lay.noisy_self and n == T
    width = s.d * (s.d // s.heads + SINK_PAD) / (s.d // s.heads) if structural else s.d
    if attention == "dense":
        keys = (T + 1) ** 2 / T if structural else T + (n if lay.noisy_self else 0)
    else:
        keys = (T + 2) / 2 * (T + 1) / T if structural else (T + 1) / 2 + (1 if lay.noisy_self else 0)
    return keys, width


def _likelihood_train(led, lay: DBLayout, M, d, V, runs):
    # the noisy stream's input: loglik (no gradient: z and the table are detached), posterior (gradient
    # into E only). Chunked: recomputed in backward up to the posterior matmul, whose input (the
    # softmax) is the last thing saved, so that matmul itself is not rerun.
    if lay.posterior == "full":
        led.linear("loglik", M, d, V, runs=runs)
        led.linear("posterior", M, V, d, False, True)
    elif lay.posterior == "no_grad":  # PROJECTION
        led.linear("loglik", M, d, V)
        led.linear("posterior", M, V, d)
    elif lay.posterior == "topk":  # PROJECTION: exact top-k of the loglik, k rows of E + the mean embedding
        led.linear("loglik", M, d, V)
        led.linear("posterior", M, lay.topk, d)
    else:
        raise ValueError(f"posterior: {lay.posterior}")
    # the head: logits + loglik. Without loss_chunk the input's loglik is reused; with it (even when the
    # slots fit in one chunk) `slot_ce` computes it again, and again in its recompute
    if not lay.fold_likelihood and lay.loss_chunk > 0:
        led.linear("loglik", M, d, V, runs=runs)
    led.linear("head", M, d, V, True, True, runs=runs)


def huginn_train(s: Shape, r: int, k: int, attention: str = "visible") -> Ledger:
    """r recurrences, the last min(r, k) with gradient (truncated BPTT); full-vocabulary head, no chunking."""
    led, T, Bsz = Ledger(), s.seq, s.batch
    causal = _causal_keys(T, attention)
    k = min(r, k)
    for _ in range(s.prelude):
        _layer(led, s, Bsz, T, causal, grad=True)
    for i in range(r):
        grad = i >= r - k
        led.linear("adapter", Bsz * T, 2 * s.d, s.d, grad, grad)
        for _ in range(s.layers):
            _layer(led, s, Bsz, T, causal, grad=grad)
    for _ in range(s.coda):
        _layer(led, s, Bsz, T, causal, grad=True)
    led.linear("head", Bsz * T, s.d, s.vocab, True, True)
    return led


# --- decode: one new token per row, after `context` cached tokens ----------------------------------


def gpt_decode(s: Shape, context: int, rows: int = 1) -> Ledger:
    led = Ledger()
    for _ in range(s.layers):
        _layer(led, s, rows, 1, context + 1, grad=False)
    led.linear("head", rows, s.d, s.vocab)
    return led


def db_decode(s: Shape, lay: DBLayout, K: int, context: int, rows: int = 1, bridge: str = "hard",
              blocks_visited: int | None = None, fused: bool = True) -> Ledger:
    """One token of K routed Euler steps (DiffusionBlocksLM.forward_cached with one new token). Each
    visited block runs the pending clean token (its last layer: K/V only) and every call runs the noisy
    slot and the head. blocks_visited: distinct blocks the K-step grid routes to (default min(K, blocks);
    the test reads it from the model's grid). fused (the code's decode path, `TwoStreamLayer.fused`): a
    block's first call runs the clean token and the slot in one weight pass; the slot's k and v come out
    of the shared qkv product and are dropped without noisy_self. fused=False counts the two-pass decode."""
    led = Ledger()
    d, V = s.d, s.vocab
    visited = min(K, lay.blocks) if blocks_visited is None else blocks_visited
    if len(set(lay.layers_per_block)) > 1:  # which blocks the K calls reach is not modelled here
        raise ValueError("db_decode counts an even split: layers_per_block must be equal")
    depth = layers_of(s, lay, 0)
    for _ in range(s.prelude):
        _layer(led, s, rows, 1, context + 1, grad=False)
    for _ in range(visited):
        for i in range(depth):
            _layer(led, s, rows, 1, context + 1, grad=False, qkv_only=(i + 1 == depth))
    keys = context + 1 + (1 if lay.noisy_self else 0)
    for _ in range(K):
        _noise_embedding(led, s, rows, grad=False)
        for _ in range(depth):
            _noisy_layer(led, s, rows, 1, keys, lay.noisy_self, grad=False)
        if lay.parameterization == "likelihood":
            led.linear("loglik", rows, d, V)
            led.linear("posterior", rows, lay.topk if lay.posterior == "topk" else V, d)
        led.linear("head", rows, d, V)  # with likelihood, the input's loglik is added: no second product
    if bridge == "soft":
        for _ in range(K - 1):
            led.linear("bridge", rows, V, d)
    if fused:  # the first call of each visited block reads the matrices both streams use once
        if not lay.noisy_self:
            for _ in range(visited * depth):
                led.linear("attn_proj", rows, d, 2 * d)  # the slot's k, v from the shared qkv product
        led.weight_params -= visited * _shared_weights(s, depth, lay.noisy_self)
    return led


def _shared_weights(s: Shape, depth: int, noisy_self: bool) -> int:
    """Weights a block's clean token and its noisy slot both read: q (or all of qkv), and for every
    layer but the last (whose clean part stops at K/V) the output projection and the MLP."""
    qkv = (3 if noisy_self else 1) * s.d * s.d
    return depth * qkv + (depth - 1) * (s.d * s.d + 3 * s.d * s.hidden)


def huginn_decode(s: Shape, K: int, context: int, rows: int = 1) -> Ledger:
    led = Ledger()
    for _ in range(s.prelude):
        _layer(led, s, rows, 1, context + 1, grad=False)
    for _ in range(K):
        led.linear("adapter", rows, 2 * s.d, s.d)
        for _ in range(s.layers):
            _layer(led, s, rows, 1, context + 1, grad=False)
    for _ in range(s.coda):
        _layer(led, s, rows, 1, context + 1, grad=False)
    led.linear("head", rows, s.d, s.vocab)
    return led


# --- ratios --------------------------------------------------------------------------------------


def train_ratio(s: Shape, lay: DBLayout, gpt_chunk: int | None = None, attention: str = "visible") -> dict:
    """B DB steps (one per block) / one gpt step, in FLOPs; gpt uses the same loss_chunk unless given."""
    gpt = gpt_train(s, lay.loss_chunk if gpt_chunk is None else gpt_chunk, attention)
    db = [db_train(s, lay, b, attention) for b in range(lay.blocks)]
    db_total = sum(x.total() for x in db)
    db_layers = sum(x.total(LAYER_TERMS) for x in db)
    return {"ratio": db_total / gpt.total(), "layers_ratio": db_layers / gpt.total(LAYER_TERMS),
            "gpt_gflop": gpt.total() / 1e9, "db_step_gflop": db_total / lay.blocks / 1e9,
            "db_vocab_share": sum(x.total(VOCAB_TERMS) for x in db) / db_total,
            "gpt_vocab_share": gpt.total(VOCAB_TERMS) / gpt.total(),
            "db_terms": db[0].as_dict()["terms"], "gpt_terms": gpt.as_dict()["terms"]}


def decode_ratio(s: Shape, lay: DBLayout, K: int, context: int, rows: int, bridge: str = "hard",
                 fused: bool = True, bytes_per_param: int = 4) -> dict:
    """DB / gpt tokens per second at the floor: gpt cost / DB cost, by FLOPs and by bytes read (weights
    once per call + each row's KV)."""
    gpt, db = gpt_decode(s, context, rows), db_decode(s, lay, K, context, rows, bridge, fused=fused)

    def traffic(led):
        return (led.weight_params + led.kv_elements) * bytes_per_param

    return {"flops_ratio": gpt.total() / db.total(), "bytes_ratio": traffic(gpt) / traffic(db),
            "gpt_mflop_per_token": gpt.total() / rows / 1e6, "db_mflop_per_token": db.total() / rows / 1e6,
            "gpt_mbytes_per_step": traffic(gpt) / 1e6, "db_mbytes_per_step": traffic(db) / 1e6,
            "db_vocab_share": db.total(VOCAB_TERMS) / db.total()}
