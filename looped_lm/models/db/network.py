"""The DiffusionBlocks LM network (docs/method.md §4): parameters, the clean encoder, the noisy step.

    tokens x_0..x_{T-1} -> embedding -> [prelude: shared, clean only] -> every block's clean input
                (context stacked: only the first block's of stack_order; each next block continues from
                 the clean states after the previous one's own layers, see `block_input`)
    block b (its own two-stream layers, then the shared coda) owns one sigma interval (block 0 = highest)
      clean stream  causal over x, no sigma conditioning: its K/V never depend on sigma or K
      noisy stream  slot i holds z_i (a noisy target for x_{i+1}) at RoPE position i+1; it attends clean
                    positions <= i (and itself with noisy_self); adaLN-Zero from c_noise; its input: what
                    it reads of z, + E[x_i] (noisy_input prev_token) or + block b's clean input at i
                    (clean_state: the noisy stream continues the clean stream's depth)
    logits: likelihood  head(norm(F)) + <z, y_v>/sigma^2      (the exact log-likelihood of z, added)
            edm         head(norm(c_out * s*normalize(F) + c_skip * z))

`db_ar` has B untied blocks; `looped_db` one weight-tied core (B = 1) between a prelude and a coda.
This module is the network only: training (`objective.py`), decoding contexts (`contexts.py`), the chain
and its estimator (`looped_lm/diffusion/`) are written once elsewhere.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from looped_lm import diffusion as dm
from looped_lm.errors import UserError
from looped_lm.models.args import DBArgs
from looped_lm.models.blockwise import BlockSchedule, noise_partition
from looped_lm.models.layers import (OutputHead, RotaryEmbedding, ScaledEmbedding, TransformerLayer,
                                     TransposedCopy, chunked, ffn_width, init_weights, positions_after)
from looped_lm.models.two_stream import NoiseEmbedding, TwoStreamLayer, windowed_slot_mask



class FoldedHead(torch.autograd.Function):
    """logits = (u + l) @ table^T in ONE product, with the gradient of the head alone: u is the head's
    scaled unit state, l = z / sigma^2 the noise's log-likelihood direction, whose product with the
    targets is the exact (fixed) likelihood term, so no gradient reaches the table through it."""

    @staticmethod
    def forward(ctx, u, l, table):
        ctx.save_for_backward(u, table)
        return (u + l) @ table.T

    @staticmethod
    def backward(ctx, grad):
        u, table = ctx.saved_tensors
        return grad @ table, None, grad.flatten(0, -2).T @ u.flatten(0, -2)


class DBNetwork(nn.Module, OutputHead):
    def __init__(self, args: DBArgs, block_schedule: BlockSchedule):
        """`block_schedule`: the blocks as training sees them, here read for the partition (edges, intervals)."""
        super().__init__()
        self.args, self.vocab_size, self.n_heads = args, args.vocab_size, args.n_heads
        self.seq_len, self.max_positions = args.seq_len, args.positions
        self.activation_checkpointing = args.activation_checkpointing
        self.sched = args.schedule.validate()
        self.block_schedule = block_schedule
        num_blocks = args.num_blocks  # looped_db: its one weight-tied core
        self.noisy_self = args.noisy_self
        # context stacked: the clean stream runs through the blocks in stack_order, each continuing the one before
        stacking = args.context == "stacked"
        self.stacked = stacking and num_blocks > 1
        order = list(range(num_blocks))
        self.stack_order = order[::-1] if stacking and args.stack_order == "low_noise_first" else order
        self.likelihood = args.parameterization == "likelihood"
        self.prev_token = args.noisy_input == "prev_token"
        self.clean_state = args.noisy_input == "clean_state"  # the slot starts from its block's clean input state
        self.posterior_input, self.posterior_topk = args.posterior_input, args.posterior_topk
        self.cosine_head = args.head == "cosine"
        self.loss_chunk = args.loss_chunk  # training: (slots, V) tensors per chunk, recomputed in backward
        d_model = args.d_model
        self.target_scale = 1.0 if args.target_scale == "unit" else args.schedule.sigma_data * math.sqrt(d_model)

        ffn = ffn_width(d_model, args.ffn_hidden)
        depths = args.block_layers  # per block, block 0 first (diffusion.layers_per_block: may be uneven)
        self.tok_emb = ScaledEmbedding(args.vocab_size, d_model, args.embed_scale)
        att, heads, eps = args.layer, args.n_heads, args.norm_eps
        self.prelude = nn.ModuleList(TransformerLayer(d_model, heads, ffn, eps, att) for _ in range(args.n_prelude))
        self.blocks = nn.ModuleList(
            nn.ModuleList(TwoStreamLayer(d_model, heads, ffn, eps, att) for _ in range(depth))
            for depth in depths)
        # shared coda: more two-stream layers after whichever block ran (looped_db: after the core)
        self.coda = nn.ModuleList(TwoStreamLayer(d_model, heads, ffn, eps, att) for _ in range(args.n_coda))
        self.noise_emb = NoiseEmbedding(d_model)
        self.norm = nn.RMSNorm(d_model, eps=eps)
        self.head_dim = att.attention.width(d_model, heads)
        self.rope = RotaryEmbedding(self.head_dim, self.max_positions + 1, args.rope_theta, args.rope_local_theta)
        if self.cosine_head:  # logits = exp(log_scale) * cos(norm(h), y_v); starts at sqrt(d), a unit-variance logit
            self.log_scale = nn.Parameter(torch.tensor(0.5 * math.log(d_model)))
        self.make_head(d_model, args.vocab_size, args.tie_embeddings)  # tied: the embedding, also the targets' table
        init_weights(self, args.init_std, max(depths) + args.n_prelude + args.n_coda)
        # inference: contiguous transposes of the head and of the target table (faster products)
        self.head_t, self.targets_t = TransposedCopy(), TransposedCopy(self._normalized)
        self.mean_row_t = TransposedCopy(lambda table: table.mean(0, keepdim=True))  # noisy_input clean_state
        for layer in [*self.coda, *(layer for block in self.blocks for layer in block)]:  # adaLN-Zero
            nn.init.zeros_(layer.ada.weight)
            nn.init.zeros_(layer.ada.bias)
        if args.local_layers:  # Gemma 3's sliding-window layers
            args.local_layers.apply(self)

    @property
    def edges(self) -> list[float]:
        return self.block_schedule.edges

    @property
    def train_ranges(self) -> list[tuple[float, float]]:
        """By block, block 0 = highest sigma."""
        return self.block_schedule.train_ranges

    def set_edges(self, edges: list[float]) -> None:
        self.block_schedule.set_partition(*noise_partition(self.args, self.args.num_blocks, edges))

    def layers_of(self, b: int) -> list:
        """The denoiser for block b: its own layers, then the shared coda."""
        return [*self.blocks[b], *self.coda]

    # --- targets and the noise's likelihood -------------------------------------------------------

    def targets(self, ids: torch.Tensor) -> torch.Tensor:
        """y = s * normalize(E[ids]): the clean points of the noisy stream (no gradient into E)."""
        return self.target_scale * F.normalize(self.tok_emb.weight[ids].detach().float(), dim=-1)

    def _normalized(self, table: torch.Tensor) -> torch.Tensor:
        return self.target_scale * F.normalize(table.float(), dim=-1)

    def target_table(self) -> torch.Tensor:
        return self._normalized(self.tok_emb.weight.detach())

    def token_loglik(self, z, sigma):
        """log p(z | token v) up to a constant, for every v: <z, y_v> / sigma^2 (B, n, V), exact because
        every target has the same norm. Added to the logits with parameterization: likelihood (Bayes:
        posterior = context prior x likelihood), so no block has to read the token back from z."""
        if torch.is_grad_enabled():
            dots = z.float() @ self.target_table().T
        else:
            dots = self.targets_t.product(z.float(), self.tok_emb.weight)
        return dots / sigma.float()[:, None, None] ** 2

    def posterior_embedding(self, loglik):
        """The embedding expected under z's likelihood: softmax(loglik) @ E, exactly (posterior_input full /
        detached), or its top-k tokens exactly plus the rest's mass on the mean of the other rows (topk).
        The top-k error is at most rest_mass * max_v |E_v - mean of the rest| (tests/test_dblm.py)."""
        table = self.tok_emb.weight if self.posterior_input == "full" else self.tok_emb.weight.detach()
        p = loglik.softmax(-1).to(table.dtype)
        if self.posterior_input != "topk" or self.posterior_topk >= p.shape[-1]:
            return p @ table
        k = self.posterior_topk
        top_p, top_i = p.topk(k, dim=-1)
        rest = (1 - top_p.sum(-1, keepdim=True)).clamp_min(0)
        total = table.sum(0)
        rest_mean = (total - table[top_i].sum(-2)) / (table.shape[0] - k)  # mean of the rows not listed
        return (top_p.unsqueeze(-1) * table[top_i]).sum(-2) + rest * rest_mean

    # --- the noisy step ---------------------------------------------------------------------------

    def table_mean(self) -> torch.Tensor:
        """The embedding table's mean row (d,), with a gradient into the table exactly when the posterior
        input has one (posterior_input full); at inference from a cached copy."""
        if not torch.is_grad_enabled():
            return self.mean_row_t(self.tok_emb.weight)[:, 0]
        table = self.tok_emb.weight if self.posterior_input == "full" else self.tok_emb.weight.detach()
        return table.mean(0)

    def noisy_input(self, z, sigma, prev=None, clean=None):
        """(the noisy stream's input, its conditioning from c_noise, z's log-likelihood or None).
        Input: c_in*z (edm), or the embedding expected under z's likelihood (likelihood: no raw noise
        enters the residual stream); + E[previous token] with noisy_input: prev_token. With noisy_input:
        clean_state, `clean` (R, n, C) is the block's clean input state at each slot's previous token (what
        `block_input` gives at that position) and the input is that + (posterior-mean embedding - the
        table's mean row: 0 where the posterior is uniform, as at sigma_top), so the slot continues the clean
        stream's depth (edm: + c_in*z). Embeddings enter as the clean stream's do (model.embed_scale: scaled)."""
        _, _, c_in, c_noise = dm.edm_scalings(sigma, self.sched.sigma_data)
        loglik = None
        if self.likelihood and self.posterior_input != "full":  # forward-only: no gradient into the table
            with torch.no_grad():
                h = self.posterior_embedding(self.token_loglik(z, sigma))
        elif self.likelihood and self.chunking():  # the head recomputes the likelihood per chunk
            h = chunked(lambda z_: self.posterior_embedding(self.token_loglik(z_, sigma)), self.loss_chunk, z)
        elif self.likelihood:
            loglik = self.token_loglik(z, sigma)
            h = self.posterior_embedding(loglik)
        else:
            h = (c_in.to(z.dtype)[:, None, None] * z).to(self.tok_emb.weight.dtype)
        if self.likelihood:
            h = self.tok_emb.scaled(h)
        if self.clean_state:
            if clean is None:
                raise UserError("diffusion.noisy_input clean_state: this path does not hand the noisy slots "
                                "their block's clean input state")
            if self.likelihood:
                h = h - self.tok_emb.scaled(self.table_mean().to(h.dtype))
            h = h + clean
        elif prev is not None and self.prev_token:
            h = h + self.tok_emb(prev)
        return h, self.noise_emb(c_noise.to(z.device)), loglik

    def denoise_logits(self, h_noisy, z, sigma, loglik=None):
        """Block output F (B, n, C) at noise sigma (B,) -> logits (B, n, V)."""
        if self.likelihood and self.cosine_head:  # <scale*u + z/sigma^2, y_v>: one product
            return FoldedHead.apply(self.cosine_state(h_noisy), z.float() / sigma.float()[:, None, None] ** 2,
                                    self.unit_table())
        if self.likelihood:
            loglik = self.token_loglik(z, sigma) if loglik is None else loglik
            return self.tied_head(h_noisy).float() + loglik
        c_skip, c_out, _, _ = (c.to(z.dtype)[:, None, None] for c in dm.edm_scalings(sigma, self.sched.sigma_data))
        h = c_out * self.target_scale * F.normalize(h_noisy, dim=-1) + c_skip * z
        if self.cosine_head:  # h is fp32 (the scalings): into the norm at the weights' dtype
            return self.cosine_state(h.to(self.tok_emb.weight.dtype)) @ self.unit_table().T
        return self.tied_head(h.to(self.tok_emb.weight.dtype))

    def tied_head(self, h):
        """norm(h) @ W^T, W the head (the embedding E when tied): through a cached inference copy of W
        (TransposedCopy) at inference."""
        if torch.is_grad_enabled():
            return F.linear(self.norm(h), self.head_weight)
        return self.head_t.product(self.norm(h), self.head_weight)

    def cosine_state(self, h):
        """The cosine head's side: exp(log_scale) * normalize(norm(h))."""
        return self.log_scale.exp() * F.normalize(self.norm(h).float(), dim=-1)

    def unit_table(self):
        """The targets with their gradient: what the cosine head compares against (= target_table)."""
        return self.target_scale * F.normalize(self.tok_emb.weight.float(), dim=-1)

    def chunking(self) -> bool:
        return bool(self.loss_chunk) and torch.is_grad_enabled()

    # --- the two streams ----------------------------------------------------------------------------

    def clean_inputs(self, idx, caches=None, rows=None) -> torch.Tensor:
        """Token ids (R, n) -> the clean stream every block starts from (embedding + shared prelude)."""
        x = self.tok_emb(idx)
        if not self.prelude:
            return x
        positions = positions_after(caches[0].lengths, rows, idx.shape[1], idx.device) if caches else \
            torch.arange(idx.shape[1], device=idx.device)
        cos, sin = self.rope(positions)
        for i, layer in enumerate(self.prelude):
            x = layer(x, cos, sin, caches[i] if caches else None, rows)
        return x

    def clean_kv(self, b: int, clean, positions, caches=None, rows=None) -> list:
        """THE clean encoder: block b's clean stream over `clean` (R, n, C) at `positions` -> per layer
        (keys, values): the window's, or with `caches`, everything each row holds after appending these
        tokens (a row's unfilled tail is masked by its cache's lengths). The block's last layer only
        yields K/V: nobody reads its clean output."""
        return self.clean_pass(b, clean, positions, caches, rows)[0]

    def clean_pass(self, b: int, clean, positions, caches=None, rows=None, hand_on: bool = False):
        """`clean_kv`, and with hand_on also the clean states after block b's own layers (before the
        shared coda): the next block's clean input under `context: stacked`. -> (kv, states or None)."""
        cos, sin = self.rope(positions)
        layers, own, out, handed = self.layers_of(b), len(self.blocks[b]), [], None
        for i, layer in enumerate(layers):
            cache = caches[i] if caches else None
            need = i + 1 < len(layers) or (hand_on and i + 1 == own)
            clean, k, v = self.run_layer(layer.clean, clean, cos, sin, cache, rows, need)
            out.append((k, v))
            if hand_on and i + 1 == own:
                handed = clean
        return out, handed

    def run_layer(self, fn, *args):
        """fn(*args), recomputed in backward instead of keeping its activations when
        model.activation_checkpointing is on and a gradient is being recorded (training)."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def feeder(self, b: int) -> int | None:
        """context stacked: the block whose clean states block b's clean stream continues; None for the
        first block of stack_order (and for every block with context independent)."""
        if not self.stacked:
            return None
        i = self.stack_order.index(b)
        return self.stack_order[i - 1] if i else None

    def fed(self, b: int) -> int | None:
        """context stacked: the block that continues from block b's clean states, or None."""
        if not self.stacked:
            return None
        i = self.stack_order.index(b)
        return self.stack_order[i + 1] if i + 1 < len(self.stack_order) else None

    def own_forward(self, b: int, clean, positions) -> torch.Tensor:
        """Block b's own layers on the clean stream (no cache, no K/V kept): what `context: stacked`
        hands to the next block. Training runs it without gradient for the blocks before the step's."""
        cos, sin = self.rope(positions)
        for layer in self.blocks[b]:
            clean, _, _ = layer.clean(clean, cos, sin)
        return clean

    def block_input(self, b: int, clean, positions) -> torch.Tensor:
        """Block b's clean input from the shared one (`clean_inputs`): itself (context: independent, the
        paper), or its continuation through the blocks before b in stack_order, without gradient
        (stacked), so a prediction of block b has the context depth of every block up to its own while a
        step still backpropagates through one block (and holds one block's activations)."""
        if self.feeder(b) is None:
            return clean
        with torch.no_grad():
            for j in self.stack_order[:self.stack_order.index(b)]:
                clean = self.own_forward(j, clean, positions)
        return clean.detach()

    def fused_pass(self, b: int, clean, clean_pos, caches, rows, z, sigma, prev, noisy_pos, hand_on: bool = False,
                   slot_clean=None):
        """Decoding: block b's pending clean tokens (appended to `caches`) and the noisy slots z in one
        weight pass per layer (`TwoStreamLayer.fused`) -> (the slots' logits, the clean states after
        block b's own layers with hand_on, else None). Equal to `clean_pass` then `noisy_pass`.
        slot_clean: noisy_input clean_state's input, block b's clean input state at the slots' previous token."""
        h, cond, loglik = self.noisy_input(z, sigma, prev, slot_clean)
        clean_rope, noisy_rope = self.rope(clean_pos), self.rope(noisy_pos)
        layers, own, handed = self.layers_of(b), len(self.blocks[b]), None
        for i, (layer, cache) in enumerate(zip(layers, caches)):
            clean, h = layer.fused(clean, h, cond, clean_rope, noisy_rope, cache, rows, self.noisy_self,
                                   need_clean_output=i + 1 < len(layers) or (hand_on and i + 1 == own))
            if hand_on and i + 1 == own:
                handed = clean
        return self.denoise_logits(h, z, sigma, loglik), handed

    def noisy_pass(self, b: int, z, sigma, prev, noisy_pos, kv: list, mask, head: bool = True, clean=None):
        """THE noisy step: slots z (R, n, d) at sigma (R,) through block b against its clean K/V
        (one (k, v) per layer) -> logits (R, n, V), or the slots' states with head=False. clean (R, n, C):
        noisy_input clean_state's input, block b's clean input state at each slot's previous token."""
        h, cond, loglik = self.noisy_input(z, sigma, prev, clean)
        cos, sin = self.rope(noisy_pos)
        masks = {0: mask}  # by window: a local layer's (Gemma 3) hides the clean keys out of its window too
        for layer, (k, v) in zip(self.layers_of(b), kv):
            window = layer.attn.window
            if window not in masks:
                masks[window] = windowed_slot_mask(mask, noisy_pos, k.shape[2], window)
            h = self.run_layer(layer.noisy, h, cond, cos, sin, k, v, masks[window], self.noisy_self)
        return self.denoise_logits(h, z, sigma, loglik) if head else h
