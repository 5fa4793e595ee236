"""The DiffusionBlocks training objective (docs/method.md §3): ONE block per step, ONE forward pass.

A step picks block b from (step, seed) alone (every rank agrees), draws sigma per sample from b's
widened interval, noises the next-token targets, runs b's two streams, and takes the noisy slots' CE.
The block's choice is the network's `BlockSchedule` (models/blockwise.py): `block_sampling: loss_share` and
`network_gain` take their weights from the CE(sigma) curve `measure_curve` gives, which the trainer re-measures
every `diffusion.curve_every` steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looped_lm import diffusion as dm
from looped_lm.diffusion import ce_curve
from looped_lm.models.args import DBArgs
from looped_lm.models.db.contexts import WindowContext
from looped_lm.models.layers import chunked, token_cross_entropy
from looped_lm.models.two_stream import slot_mask


class BlockObjective:
    def __init__(self, net, args: DBArgs):
        self.net, self.args = net, args

    # --- which block (the network's BlockSchedule), which sigma --------------------------------------

    def choose_block(self, step: int, seed: int) -> int:
        return self.net.block_schedule.choose_block(step, seed)

    def uses_curve(self) -> bool:
        return self.net.block_schedule.uses_curve()

    @property
    def curve(self) -> dict | None:
        """The measured CE(sigma) curve, held by the block schedule (read and set here by bench/ and tests/)."""
        return self.net.block_schedule.curve

    @curve.setter
    def curve(self, curve: dict | None) -> None:
        self.net.block_schedule.curve = curve

    def loss_weights(self, sigma, b: int):
        kind = self.args.loss_weight
        if kind == "none":
            return torch.ones_like(sigma)
        w = dm.edm_weight(sigma, self.net.sched.sigma_data).to(sigma.dtype) / dm.edm_loss_weight_normaliser(
            *self.net.train_ranges[b], self.net.sched)
        return w if kind == "edm" else w.mean().expand_as(w)

    # --- the loss ---------------------------------------------------------------------------------------

    def slot_losses(self, x, y, b: int, sigma, noise, slots=None, clean_lm: bool = False):
        """CE (B, n) of block b's noisy slots predicting y at the given slots (None = every position),
        with z = y_target + sigma * noise. Deterministic given its inputs: the leak tests perturb x and y
        elsewhere and check a slot's loss does not move. With clean_lm, also the clean stream's own
        next-token CE (B, T)."""
        net = self.net
        T = x.shape[1]
        full_window = slots is None
        if slots is None:
            slots = torch.arange(T, device=x.device)
            targets, prev = y, x
        else:
            targets, prev = y.gather(1, slots), x.gather(1, slots)
        z = net.targets(targets) + sigma[:, None, None] * noise
        positions = torch.arange(T, device=x.device)
        if net.feeder(b) is not None:  # the blocks before b only hand their clean states on: no graph is kept
            with torch.no_grad():
                clean = net.block_input(b, net.clean_inputs(x), positions)
        else:
            clean = net.clean_inputs(x)
        kv = net.clean_kv(b, clean, positions) if not clean_lm else None
        if clean_lm:  # the clean stream's output is needed too: run the layers in full
            kv, h_clean = [], clean
            cos, sin = net.rope(positions)
            for layer in net.layers_of(b):
                h_clean, k, v = net.run_layer(layer.clean, h_clean, cos, sin)
                kv.append((k, v))
        mask = slot_mask(slots, T, net.noisy_self, full_window)
        # noisy_input clean_state: the slot starts from block b's clean input at its previous token. Stacked
        # (a feeder): computed above without gradient, so the step still trains one block; otherwise (the
        # first block of the stack, context independent, looped_db) it is the shared embedding + prelude,
        # which get a gradient through it as through the clean stream (and as prev_token's E[x_t] does).
        slot_clean = None
        if net.clean_state:
            slot_clean = clean if full_window else clean.gather(1, slots[..., None].expand(-1, -1, clean.shape[-1]))
        if net.chunking():  # the slots' states, then head + CE chunk by chunk
            h = net.noisy_pass(b, z, sigma, prev, slots + 1, kv, mask, head=False, clean=slot_clean)
            ce = chunked(lambda h_, z_, t_: token_cross_entropy(net.denoise_logits(h_, z_, sigma), t_),
                         net.loss_chunk, h, z, targets)
        else:
            ce = token_cross_entropy(net.noisy_pass(b, z, sigma, prev, slots + 1, kv, mask, clean=slot_clean),
                                     targets)
        if not clean_lm:
            return ce
        clean_ce = lambda h_, y_: token_cross_entropy(F.linear(net.norm(h_), net.head_weight), y_)  # noqa: E731
        # model.loss_chunk: the clean stream's (B, T, V) logits never exist whole either
        return ce, chunked(clean_ce, net.loss_chunk, h_clean, y) if net.chunking() else clean_ce(h_clean, y)

    def clean_losses(self, x, y, b: int):
        """Block b's clean stream's next-token CE (B, T), as training sees it: its input (context stacked:
        through the blocks before it, without gradient), its own layers and the shared coda, the tied head."""
        net = self.net
        positions = torch.arange(x.shape[1], device=x.device)
        if net.feeder(b) is not None:  # the blocks before b only hand their clean states on
            with torch.no_grad():
                h = net.block_input(b, net.clean_inputs(x), positions)
        else:
            h = net.clean_inputs(x)
        cos, sin = net.rope(positions)
        for layer in net.layers_of(b):
            h, _, _ = net.run_layer(layer.clean, h, cos, sin)
        ce = lambda h_, y_: token_cross_entropy(F.linear(net.norm(h_), net.head_weight), y_)  # noqa: E731
        return chunked(ce, net.loss_chunk, h, y) if net.chunking() else ce(h, y)

    def training_loss(self, x, y, step: int, seed: int):
        return self.block_loss(x, y, self.choose_block(step, seed))

    def block_loss(self, x, y, b: int):
        """One micro-batch's loss of block b (what `train.compile` compiles: the step number stays out of
        the graph, the block is one graph each)."""
        Bsz, T = x.shape
        if self.args.denoise_weight == 0:  # the control arm: the clean next-token loss alone, no noisy stream
            ce = self.clean_losses(x, y, b).mean()
            return self.args.clean_lm_weight * ce, {"block": b, f"loss_block{b}": ce.detach()}
        sigma = dm.sample_sigma(Bsz, *self.net.train_ranges[b], self.net.sched, device=x.device)
        if b == 0 and self.args.top_share > 0:  # z carries nothing there, as at a chain's first call (sigma_top)
            at_top = torch.rand(Bsz, device=x.device) < self.args.top_share
            sigma = torch.where(at_top, torch.full_like(sigma, self.net.sched.sigma_max), sigma)
        n = max(1, round(self.args.target_fraction * T))
        slots = None if n == T else torch.rand(Bsz, T, device=x.device).argsort(dim=1)[:, :n].sort(dim=1).values
        noise = torch.randn(Bsz, n, self.net.tok_emb.weight.shape[1], device=x.device)
        clean_w = self.args.clean_lm_weight
        out = self.slot_losses(x, y, b, sigma, noise, slots, clean_lm=bool(clean_w))
        ce, clean_ce = out if clean_w else (out, None)
        ce = ce.mean(dim=1)  # (B,)
        loss = self.args.denoise_weight * (ce * self.loss_weights(sigma, b)).mean()
        # values stay on the device (0-d tensors): the trainer reads them at log steps only
        metrics = {"block": b, f"loss_block{b}": ce.detach().mean(), "sigma_mean": sigma.detach().mean()}
        if clean_w:  # an ordinary next-token loss on the block's clean stream
            loss = loss + clean_w * clean_ce.mean()
            metrics["clean_lm_loss"] = clean_ce.detach().mean()
        return loss, metrics

    # --- the measured CE(sigma) curve ------------------------------------------------------------------

    @torch.no_grad()
    def measure_curve(self, x, y, seed: int, n_sigma: int = 24) -> dict:
        """Held-out CE at each sigma of a log grid, each from the block that owns it, one draw."""
        net = self.net
        g = torch.Generator(device=x.device).manual_seed(seed)
        window, y_emb = WindowContext(net, x), net.targets(y)
        sigmas, ce, ce_z = ce_curve.sigma_grid(net.sched, n_sigma), [], []
        for s in sigmas:
            z = y_emb + s * torch.randn(y_emb.shape, device=x.device, generator=g)
            sigma = torch.full((x.shape[0],), s, device=x.device)
            logits = window.denoise(dm.route_sigma(s, net.edges), z, sigma)
            ce.append(float(token_cross_entropy(logits, y).mean()))
            # z's own likelihood, no context: what the network's prediction is measured against (network_gain)
            ce_z.append(float(token_cross_entropy(net.token_loglik(z, sigma), y).mean()))
        return {"sigmas": sigmas, "ce": ce, "ce_z": ce_z}
