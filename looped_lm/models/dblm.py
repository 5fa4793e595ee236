"""DiffusionBlocks language models (method.md §4-6): two streams, B blocks, routed decoding.

`db_ar`: B untied blocks. `looped_db`: one weight-tied core (B = 1) between a prelude and a coda,
trained on the whole sigma range with ONE forward pass (no BPTT) and run K times at inference.

    tokens x_0..x_{T-1} -> embedding -> [prelude, shared, clean only] -> clean input of every block
    block b (L/B two-stream layers, untied) owns the sigma interval b (block 0 = highest sigma):
      clean stream  causal over x, no sigma conditioning: its K/V never depend on sigma or K
      noisy stream  slot i holds z_i = y_i + sigma*eps for the target x_{i+1}, at RoPE position i+1;
                    it attends clean positions <= i and itself (one mask, no (2T)^2 matrix);
                    adaLN-Zero from c_noise
    h = c_out * s*normalize(F) + c_skip * z  ->  logits = final_norm(h) @ E^T   (tied head)

Training runs ONE block per step (`training_loss`), with sigma drawn from that block's widened
interval. Inference runs K Euler steps per token, each routed to the block that owns sigma_k, against
that block's KV cache of the clean stream (`forward_cached`), so KV bytes per token do not depend on K.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from looped_lm import diffusion as dm
from looped_lm.config import Config
from looped_lm.diffusion import ce_curve
from looped_lm.engine.sampling import sample
from looped_lm.errors import UserError
from looped_lm.models import register
from looped_lm.models.contract import Trainable
from looped_lm.models.db_decode import CachedDecoding, DecodeState
from looped_lm.models.layers import (KVCache, RotaryEmbedding, TransformerLayer, chunked, ffn_width, init_weights,
                                     positions_after, token_cross_entropy)
from looped_lm.models.two_stream import NoiseEmbedding, TwoStreamLayer, noisy_mask, slot_mask

__all__ = ["DiffusionBlocksLM", "DecodeState", "noisy_mask"]


class DiffusionBlocksLM(CachedDecoding, nn.Module, Trainable):
    uses_noise = True  # generation draws z from the request's generator

    def __init__(self, cfg: Config, vocab_size: int, state: dict | None = None):
        super().__init__()
        m, d = cfg.model, cfg.diffusion
        self.cfg, self.vocab_size, self.n_heads = cfg, vocab_size, m.n_heads
        self.seq_len, self.max_positions = m.seq_len, 4 * m.seq_len
        self.sched = dm.NoiseSchedule(d.p_mean, d.p_std, d.sigma_min, d.sigma_max, d.sigma_data).validate()
        num_blocks = 1 if m.kind == "looped_db" else d.num_blocks  # looped: one weight-tied core
        state = state or {}
        # equi_entropy starts from equal noise mass until a CE(sigma) curve has been measured
        first = "equi_probability" if d.partition == "equi_entropy" else d.partition
        edges = state.get("edges")
        self.set_edges(dm.check_edges(edges) if edges is not None else dm.make_edges(first, num_blocks, self.sched))
        if len(self.edges) != num_blocks + 1:
            raise UserError(f"saved edges have {len(self.edges) - 1} blocks but the model has {num_blocks}")
        self.curve = state.get("curve")  # {"sigmas": [...], "ce": [...]} once measured
        self.stacked = d.context == "stacked"
        self.noisy_self = d.noisy_self
        self.likelihood = d.parameterization == "likelihood"
        self.loss_chunk = m.loss_chunk  # training: (slots, V) tensors per chunk, recomputed in backward
        self.max_iterations = m.max_iterations
        self.target_scale = 1.0 if d.target_scale == "unit" else d.sigma_data * math.sqrt(m.d_model)
        self.trainable_blocks = list(d.blocks_to_train) or list(range(num_blocks))

        ffn = ffn_width(m.d_model, m.ffn_hidden)
        per_block = m.n_layers // num_blocks
        self.tok_emb = nn.Embedding(vocab_size, m.d_model)
        self.prelude = nn.ModuleList(TransformerLayer(m.d_model, m.n_heads, ffn, m.norm_eps) for _ in range(m.n_prelude))
        self.blocks = nn.ModuleList(
            nn.ModuleList(TwoStreamLayer(m.d_model, m.n_heads, ffn, m.norm_eps) for _ in range(per_block))
            for _ in range(num_blocks))
        # shared coda: more two-stream layers after whichever block ran (looped_db: after the core)
        self.coda = nn.ModuleList(TwoStreamLayer(m.d_model, m.n_heads, ffn, m.norm_eps) for _ in range(m.n_coda))
        self.noise_emb = NoiseEmbedding(m.d_model)
        self.norm = nn.RMSNorm(m.d_model, eps=m.norm_eps)
        self.rope = RotaryEmbedding(m.d_model // m.n_heads, self.max_positions + 1, m.rope_theta)
        init_weights(self, m.init_std, per_block + m.n_prelude + m.n_coda)
        for layer in [*self.coda, *(layer for block in self.blocks for layer in block)]:  # adaLN-Zero
            nn.init.zeros_(layer.ada.weight)
            nn.init.zeros_(layer.ada.bias)
        for b, block in enumerate(self.blocks):
            if b not in self.trainable_blocks:
                block.requires_grad_(False)  # frozen before the optimiser exists: no state for it

    # --- what the trainer and checkpoints ask -----------------------------------------------------

    def checkpoint_state(self) -> dict:
        state = {"edges": self.edges, "num_blocks": len(self.blocks)}
        if self.curve is not None:
            state["curve"] = self.curve
        return state

    def restore_state(self, saved: dict) -> None:
        """Fixed partitions must match the config's; measured ones (equi_entropy, a CE curve) are adopted."""
        mine = self.checkpoint_state()
        if self.uses_curve():
            if saved.get("num_blocks") != mine.get("num_blocks"):
                raise UserError(f"cannot resume: the checkpoint has {saved.get('num_blocks')} blocks, this run "
                                f"{mine.get('num_blocks')}")
            self.set_edges(saved["edges"])
            if saved.get("curve") is not None:
                self.apply_curve(saved["curve"])
                self.set_edges(saved["edges"])  # the saved edges are the ones training used
            return
        super().restore_state(saved)

    def chain_sigmas(self, K: int) -> list[float]:
        """The K + 1 grid points of a K-step chain: calls at the first K, sigma_K where it ends. The first
        is sigma_top; with last_call: sigma_min the K calls span [sigma_top, sigma_min] (the final Euler
        step is then a no-op)."""
        lo, hi = self.edges[0], self.edges[-1]
        if self.cfg.diffusion.last_call == "sigma_min" and K >= 2:
            sigmas = dm.inference_sigmas(K - 1, self.sched, lo=lo, hi=hi)
            sigmas.append(sigmas[-1])
        else:
            sigmas = dm.inference_sigmas(K, self.sched, lo=lo, hi=hi)
        sigmas[0] = self.sigma_top()  # the first call, where block 0 has really been trained
        return sigmas

    def sigma_top(self) -> float:
        """Where chains start: a high quantile of block 0's training sigma law (diffusion.
        sample_top_quantile), not sigma_max, which the log-normal almost never draws (method.md §8)."""
        lo, hi = self.train_ranges[0]
        q_lo, q_hi = dm.cdf_range(lo, hi, self.sched)
        top = dm.sigma_at_fraction(self.cfg.diffusion.sample_top_quantile, q_lo, q_hi, self.sched)
        return float(min(max(top, self.edges[-2]), self.edges[-1]))  # stays inside block 0's interval

    def set_edges(self, edges: list[float]) -> None:
        self.edges = list(edges)
        self.train_ranges = dm.widen(self.edges, self.cfg.diffusion.overlap)  # by block, block 0 = highest sigma

    # --- the measured CE(sigma) curve: equi_entropy edges, adaptive noise, loss_share sampling -----

    def uses_curve(self) -> bool:
        d = self.cfg.diffusion
        sharing = d.block_sampling == "loss_share" and len(self.trainable_blocks) > 1  # one block: nothing to share
        return d.partition == "equi_entropy" or d.noise == "adaptive" or sharing

    @torch.no_grad()
    def measure_curve(self, x, y, seed: int, n_sigma: int = 24) -> dict:
        """Held-out CE at each sigma of a log grid, each from the block that owns it, one draw."""
        g = torch.Generator(device=x.device).manual_seed(seed)
        call = self.window_call(x)
        y_emb = self.targets(y)
        sigmas, ce = ce_curve.sigma_grid(self.sched, n_sigma), []
        for s in sigmas:
            z = y_emb + s * torch.randn(y_emb.shape, device=x.device, generator=g)
            sigma = torch.full((x.shape[0],), s, device=x.device)
            logits = call(dm.route_sigma(s, self.edges), z, sigma)
            ce.append(float(token_cross_entropy(logits, y).mean()))
        return {"sigmas": sigmas, "ce": ce}

    def apply_curve(self, curve: dict) -> None:
        """Adopt a measured curve; with partition equi_entropy, move the edges to equal CE shares."""
        self.curve = curve
        if self.cfg.diffusion.partition == "equi_entropy":
            edges = ce_curve.equi_entropy_edges(curve["sigmas"], curve["ce"], len(self.blocks))
            if edges is not None:
                self.set_edges(edges)

    def param_unit(self, name: str) -> str:
        return f"block{name.split('.')[1]}" if name.startswith("blocks.") else "shared"

    def choose_block(self, step: int, seed: int) -> int:
        """The block trained at `step`: the same on every rank (it depends on step and seed only)."""
        sampling, blocks = self.cfg.diffusion.block_sampling, self.trainable_blocks
        if sampling == "round_robin":
            return blocks[step % len(blocks)]
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if sampling == "loss_share" and self.curve is not None:
            shares = ce_curve.block_shares(self.edges, self.curve["sigmas"], self.curve["ce"])
            weights = torch.tensor([shares[b] for b in blocks], dtype=torch.float64) + 1e-3  # never starve one
            return blocks[int(torch.multinomial(weights, 1, generator=g))]
        return blocks[int(torch.randint(len(blocks), (1,), generator=g))]

    def layers_of(self, b: int) -> list:
        """The denoiser for block b: its own layers, then the shared coda."""
        return [*self.blocks[b], *self.coda]

    def step_units(self, step: int, seed: int) -> set[str]:
        return {"shared", f"block{self.choose_block(step, seed)}"}

    # --- shared pieces ----------------------------------------------------------------------------

    def targets(self, ids: torch.Tensor) -> torch.Tensor:
        """y = s * normalize(E[ids]): the clean points of the noisy stream (no gradient into E)."""
        return self.target_scale * F.normalize(self.tok_emb.weight[ids].detach().float(), dim=-1)

    def target_table(self) -> torch.Tensor:
        return self.target_scale * F.normalize(self.tok_emb.weight.float(), dim=-1)

    def clean_inputs(self, idx: torch.Tensor, caches: list[KVCache] | None = None, rows=None) -> torch.Tensor:
        """Token ids -> the clean stream every block starts from (embedding + shared prelude)."""
        x = self.tok_emb(idx)
        if not self.prelude:
            return x
        positions = positions_after(caches[0].lengths, rows, idx.shape[1], idx.device) if caches else \
            torch.arange(idx.shape[1], device=idx.device)
        cos, sin = self.rope(positions)
        for i, layer in enumerate(self.prelude):
            x = layer(x, cos, sin, caches[i] if caches else None, rows)
        return x

    def token_loglik(self, z, sigma):
        """log p(z | token v) up to a constant, for every v: <z, y_v> / sigma^2 (B, n, V), exact because
        every target y_v has the same norm. With parameterization: likelihood this is added to the
        network's logits (Bayes: posterior = context prior x likelihood of z), so the network never has
        to read the token back from z, and a chain's last steps cannot lose what z already says."""
        table = self.target_table().detach()  # the noising process's targets, as in `targets`
        return (z.float() @ table.T) / sigma.float()[:, None, None] ** 2

    def denoise_logits(self, h_noisy, z, sigma, loglik=None):
        """Block output F (B, n, C) at noise sigma (B,) -> logits (B, n, V): through the EDM skip, or
        (parameterization: likelihood) the head's logits plus z's token log-likelihood `loglik`."""
        if loglik is not None:
            return F.linear(self.norm(h_noisy), self.tok_emb.weight).float() + loglik
        c_skip, c_out, _, _ = (c.to(z.dtype)[:, None, None] for c in dm.edm_scalings(sigma, self.sched.sigma_data))
        h = c_out * self.target_scale * F.normalize(h_noisy, dim=-1) + c_skip * z
        return F.linear(self.norm(h.to(self.tok_emb.weight.dtype)), self.tok_emb.weight)

    def noisy_input(self, z, sigma, prev=None):
        """The noisy stream's input, its conditioning vector from c_noise, and z's token log-likelihood
        (None with parameterization: edm, or when training with loss_chunk: the head recomputes it).
        Input: c_in*z (edm), or the embedding expected under z's likelihood (likelihood: no raw noise
        enters the residual stream); + the previous token's embedding with noisy_input: prev_token, so a
        slot needs no attention hop to find it."""
        _, _, c_in, c_noise = dm.edm_scalings(sigma, self.sched.sigma_data)
        loglik = None
        if self.likelihood and self.chunking():
            h = chunked(lambda z_: self.posterior_embedding(self.token_loglik(z_, sigma)), self.loss_chunk, z)
        elif self.likelihood:
            loglik = self.token_loglik(z, sigma)
            h = self.posterior_embedding(loglik)
        else:
            h = (c_in.to(z.dtype)[:, None, None] * z).to(self.tok_emb.weight.dtype)
        if prev is not None and self.cfg.diffusion.noisy_input == "prev_token":
            h = h + self.tok_emb(prev)
        return h, self.noise_emb(c_noise.to(z.device)), loglik

    def posterior_embedding(self, loglik):
        return loglik.softmax(-1).to(self.tok_emb.weight.dtype) @ self.tok_emb.weight

    def chunking(self) -> bool:
        return bool(self.loss_chunk) and torch.is_grad_enabled()

    def run_block(self, b, clean, z, sigma, noisy_pos, mask, caches=None, rows=None, prev=None,
                  return_clean: bool = False, head: bool = True):
        """Both streams through block b -> logits of the noisy slots (and the clean stream's output with
        return_clean). With `caches`, `clean` holds only the tokens the block has not cached yet
        (possibly none), and each noisy slot sees its row's whole cache and itself. `prev`: the token
        ids before each slot (for noisy_input: prev_token)."""
        h, cond, loglik = self.noisy_input(z, sigma, prev)
        cos_n, sin_n = self.rope(noisy_pos)
        has_clean = clean is not None and clean.shape[1] > 0
        if has_clean:
            positions = positions_after(caches[0].lengths, rows, clean.shape[1], z.device) if caches else \
                torch.arange(clean.shape[1], device=z.device)
            cos_c, sin_c = self.rope(positions)
        layers = self.layers_of(b)
        for i, layer in enumerate(layers):
            cache = caches[i] if caches else None
            if has_clean:
                last = i + 1 == len(layers)
                clean, k, v = layer.clean(clean, cos_c, sin_c, cache, rows, need_output=return_clean or not last)
            if cache is not None:  # rows may hold different lengths: mask each row's unfilled tail
                k, v, valid = cache.view(rows)
                mask = valid
                if valid is not None and self.noisy_self:
                    mask = torch.cat([valid, valid.new_ones(*valid.shape[:-1], 1)], -1)
            h = layer.noisy(h, cond, cos_n, sin_n, k, v, mask, self.noisy_self)
        out = self.denoise_logits(h, z, sigma, loglik) if head else h  # head=False: the slots' states
        return (out, clean) if return_clean else out

    def block_input(self, clean, b: int):
        """Block b's clean-stream input over a whole window: the embeddings (context: independent), or
        the clean output of blocks < b computed without gradient (context: stacked)."""
        if not self.stacked or b == 0:
            return clean
        cos, sin = self.rope(torch.arange(clean.shape[1], device=clean.device))
        with torch.no_grad():
            for prior in range(b):
                for layer in self.layers_of(prior):
                    clean, _, _ = layer.clean(clean, cos, sin)
        return clean

    # --- training -------------------------------------------------------------------------------

    def training_loss(self, x, y, step: int, seed: int):
        """One block, one forward pass: CE of the noisy slots' logits against the next tokens."""
        b = self.choose_block(step, seed)
        Bsz, T = x.shape
        lo, hi = self.train_ranges[b]
        if self.cfg.diffusion.noise == "adaptive" and self.curve is not None:
            sigma = ce_curve.sample_sigma_from_curve(Bsz, lo, hi, self.curve["sigmas"], self.curve["ce"],
                                                     device=x.device)
        else:
            sigma = dm.sample_sigma(Bsz, lo, hi, self.sched, device=x.device)
        n = max(1, round(self.cfg.diffusion.target_fraction * T))
        if n == T:
            slots = torch.arange(T, device=x.device)  # every slot: one mask shared by the batch
            targets, prev = y, x
        else:
            slots = torch.rand(Bsz, T, device=x.device).argsort(dim=1)[:, :n].sort(dim=1).values
            targets, prev = y.gather(1, slots), x.gather(1, slots)
        y_emb = self.targets(targets)
        z = y_emb + sigma[:, None, None] * torch.randn_like(y_emb)
        clean_w = self.cfg.diffusion.clean_lm_weight
        clean_in = self.block_input(self.clean_inputs(x), b)
        out = self.run_block(b, clean_in, z, sigma, slots + 1, slot_mask(slots, T, self.noisy_self), prev=prev,
                             return_clean=bool(clean_w), head=not self.chunking())
        out, clean = out if clean_w else (out, None)
        if self.chunking():  # out: the slots' states; head + CE chunk by chunk
            def slot_ce(h_, z_, t_):
                loglik = self.token_loglik(z_, sigma) if self.likelihood else None
                return token_cross_entropy(self.denoise_logits(h_, z_, sigma, loglik), t_)
            ce = chunked(slot_ce, self.loss_chunk, out, z, targets).mean(dim=1)
        else:
            ce = token_cross_entropy(out, targets).mean(dim=1)  # (B,)
        loss = (ce * self.loss_weights(sigma, b)).mean()
        metrics = {"block": b, f"loss_block{b}": float(ce.detach().mean()), "sigma_mean": float(sigma.mean())}
        if clean_w:  # an ordinary next-token loss on the block's clean stream
            clean_ce = token_cross_entropy(F.linear(self.norm(clean), self.tok_emb.weight), y).mean()
            loss = loss + clean_w * clean_ce
            metrics["clean_lm_loss"] = float(clean_ce.detach())
        return loss, metrics

    def loss_weights(self, sigma, b: int):
        kind = self.cfg.diffusion.loss_weight
        if kind == "none":
            return torch.ones_like(sigma)
        w = dm.edm_weight(sigma, self.sched.sigma_data).to(sigma.dtype) / dm.edm_loss_weight_normaliser(
            *self.train_ranges[b], self.sched)
        return w if kind == "edm" else w.mean().expand_as(w)

    @torch.no_grad()
    def validation_loss(self, x, y, seed: int):
        """ppl@0's loss: one call of block 0 at sigma_hi from pure noise (one draw)."""
        g = torch.Generator(device=x.device).manual_seed(seed)
        nll = self.eval_nll(x, y, k_grid=[], draws=1, generator=g)[0]
        return nll.mean()

    # --- scoring: ppl@k (method.md §6) ----------------------------------------------------------

    @torch.no_grad()
    def eval_nll(self, x, y, k_grid=None, draws: int = 4, generator=None, exit_rule=None, stats=None,
                 bridge: str | None = None) -> dict:
        """{k: -log mean_n p_k^(n)(y)} (B, T) for k in {0} + k_grid; k = 0 is one call at sigma_hi.

        ppl@k (k >= 1) scores the K = k sampler: k routed calls from pure noise on the K-grid, its
        token distribution the last call's softmax. The clean stream of each block is computed once.
        With `exit_rule`, each token stops early; `stats[k]` gets the mean iterations used. With the
        `sample` bridge, each draw of ppl@k (k >= 2) is `sample_chain_prob` (its first draw enumerated).
        """
        if k_grid is None:
            k_grid = [len(self.blocks)]
        ks = sorted({0, *k_grid})
        Bsz, T = x.shape
        call = self.window_call(x)
        bridge = bridge or self.cfg.diffusion.bridge
        probs = {k: torch.zeros(Bsz, T, device=x.device, dtype=torch.float64) for k in ks}
        for _ in range(draws):
            for k in ks:
                if bridge == "sample" and k >= 2 and exit_rule is None:
                    probs[k] += self.sample_chain_prob(call, k, y, generator)
                    continue
                chain_stats = {}
                logits = self.chain(call, max(k, 1), (Bsz, T), x.device, generator, bridge, exit_rule=exit_rule,
                                    stats=chain_stats)
                if stats is not None:
                    stats.setdefault(k, []).append(chain_stats["iterations"].float().mean().item())
                probs[k] += logits.float().log_softmax(-1).gather(-1, y[..., None])[..., 0].double().exp()
        return {k: -(p / draws).clamp_min(1e-300).log() for k, p in probs.items()}

    SAMPLE_CANDIDATES = 8  # first-step tokens enumerated by sample_chain_prob

    def sample_chain_prob(self, call, K: int, y, generator=None) -> torch.Tensor:
        """p_K(y) (B, T) of the K-step sampler with the `sample` bridge, Rao-Blackwellised over its first
        draw: sum over v in (top-m tokens of step 0) + {y} of p_0(v) * p_K(y | the bridge drew v), each
        continuation run once (later draws sampled). Dropping the other v makes it a lower bound on
        p_K(y): like ppl@k's draws, it never flatters. A plain N-draw average of a sampler that commits
        to one token needs thousands of draws to see p_0(y) when y is not the mode."""
        Bsz, T = y.shape
        sigmas = self.chain_sigmas(K)
        z = self.initial_noise(Bsz, T, generator, y.device)
        first = call(dm.route_sigma(sigmas[0], self.edges), z, torch.full((Bsz,), sigmas[0], device=y.device))
        p0 = first.float().softmax(-1)
        m = min(self.SAMPLE_CANDIDATES, p0.shape[-1])
        top = p0.topk(m, dim=-1).indices
        candidates = torch.cat([top, y[..., None]], dim=-1)  # (B, T, m + 1)
        weights = p0.gather(-1, candidates).double()
        weights[..., -1] *= ~(top == y[..., None]).any(-1)  # y among the top-m: count it once
        # with the last call at sigma_min and the exact likelihood, that call only reads back the last
        # bridge's token: score the last draw's probability instead (Rao-Blackwellised as well)
        readback = self.likelihood and self.cfg.diffusion.last_call == "sigma_min"
        total = torch.zeros(Bsz, T, dtype=torch.float64, device=y.device)
        for j in range(m + 1):
            if readback and K == 2:
                total += weights[..., j] * (candidates[..., j] == y).double()
                continue
            zj = dm.euler_step(z, self.targets(candidates[..., j]), sigmas[0], sigmas[1])
            logits = self.chain_from(call, sigmas[:-1] if readback else sigmas, 1, zj, generator)
            total += weights[..., j] * logits.float().log_softmax(-1).gather(-1, y[..., None])[..., 0].double().exp()
        return total

    def chain_from(self, call, sigmas: list[float], start: int, z, generator):
        """Steps start..K-1 of a sample-bridge chain on the grid `sigmas` from z at sigmas[start]."""
        Bsz = z.shape[0]
        K = len(sigmas) - 1
        for k in range(start, K):
            logits = call(dm.route_sigma(sigmas[k], self.edges), z, torch.full((Bsz,), sigmas[k], device=z.device))
            if k + 1 < K:
                z = dm.euler_step(z, self.bridge(logits, "sample", generator=generator), sigmas[k], sigmas[k + 1])
        return logits

    def window_call(self, x):
        """call(b, z, sigma) scoring every slot of the window x (B, T) in parallel; each block's
        clean stream is computed once, on its first call, and reused by every step."""
        T = x.shape[1]
        slots = torch.arange(T, device=x.device)
        mask = slot_mask(slots, T, self.noisy_self)
        inputs = {0: self.clean_inputs(x)}  # block -> its clean-stream input (stacked: built in order)
        kv = {}  # block -> per-layer (k, v) of the clean stream over the window
        cos, sin = self.rope(slots)

        def encode(b):
            if b not in inputs:
                encode(b - 1)  # only reached with context: stacked
            layers, c, per_layer = self.layers_of(b), inputs.get(b, inputs[0]), []
            for i, layer in enumerate(layers):
                c, k, v = layer.clean(c, cos, sin, need_output=self.stacked or i + 1 < len(layers))
                per_layer.append((k, v))
            kv[b] = per_layer
            if self.stacked:
                inputs[b + 1] = c

        def call(b, z, sigma):
            if b not in kv:
                encode(b)
            h, cond, loglik = self.noisy_input(z, sigma, x)
            cos_n, sin_n = self.rope(slots + 1)
            for layer, (k, v) in zip(self.layers_of(b), kv[b]):
                h = layer.noisy(h, cond, cos_n, sin_n, k, v, mask, self.noisy_self)
            return self.denoise_logits(h, z, sigma, loglik)

        return call

    def chain(self, call, K: int, shape, device, generator, bridge: str, z=None, exit_rule=None, stats=None,
              sampling=None):
        """K routed Euler steps from pure noise; returns the last call's logits. `call(b, z, sigma)`.
        `sampling`: the request's SamplingParams, which the `sample` bridge draws with (default: T = 1).

        With an `exit_rule`, each (row, slot) stops early, keeping its last logits; `stats["iterations"]`
        receives the calls each one used (Bsz, n).
        """
        sigmas = self.chain_sigmas(K)
        Bsz, n = shape
        if z is None:
            z = self.initial_noise(Bsz, n, generator, device)
        table = None  # the soft bridge's normalised target table, built on first use
        tracker = exit_rule.tracker() if exit_rule is not None else None
        done = torch.zeros(Bsz, n, dtype=torch.bool, device=device)
        used = torch.zeros(Bsz, n, dtype=torch.long, device=device)
        final = None
        for k in range(K):
            sigma = torch.full((Bsz,), sigmas[k], device=device)
            logits = call(dm.route_sigma(sigmas[k], self.edges), z, sigma)
            final = logits if final is None else torch.where(done[..., None], final, logits)
            used += (~done).long()
            if tracker is not None:
                done |= tracker.update(logits)
                if bool(done.all()):
                    break
            if k + 1 < K:
                if bridge == "soft" and table is None:
                    table = self.target_table()
                denoised = self.bridge(logits, bridge, table, generator, sampling)
                z_next = dm.euler_step(z, denoised, sigmas[k], sigmas[k + 1])
                z = torch.where(done[..., None], z, z_next)
        if stats is not None:
            stats["iterations"] = used
        return final

    def bridge(self, logits, kind: str, table=None, generator=None, sampling=None):
        """Logits -> a denoised point in target space: soft = E_p[y] over the target table; hard =
        y[argmax]; sample = y[a token drawn from p] (ancestral, like Block Diffusion's sampler), drawn
        with the request's temperature / top-k / top-p when `sampling` is given (the first steps decide
        the token, so that is where the request's sampler belongs).
        hard and sample normalise only the chosen rows: the full table costs a V x d pass per token."""
        if kind == "soft":
            return logits.float().softmax(-1) @ (self.target_table() if table is None else table)
        if kind == "sample":
            flat_logits = logits.float().reshape(-1, logits.shape[-1])
            if sampling is not None:
                flat = sample(flat_logits, sampling, generator)
            else:
                flat = torch.multinomial(flat_logits.softmax(-1), 1, generator=generator)[:, 0]
            return self.targets(flat.view(logits.shape[:-1]))
        return self.targets(logits.argmax(-1))

def _build(cfg: Config, vocab_size: int, state: dict | None):
    return DiffusionBlocksLM(cfg, vocab_size, state)


register("db_ar", _build)
register("looped_db", _build)  # one block (the weight-tied core), prelude and coda around it
