"""DiffusionBlocks DiT (method.md §7; the paper's §5.2) and its end-to-end baseline.

A class-conditional EDM denoiser on image pixels (or VAE latents: any (C, H, W) array):

    z = y + sigma*eps  ->  patches of c_in*z -> patch_embed + pos_emb
    cond = silu(noise_emb(c_noise) + label_emb(label))      (DiT's timestep embedder; label = num_classes: null)
    block b (L/B AdaLN layers, untied) owns the sigma interval b (block 0 = highest sigma)
    F = final adaLN + linear (zero init) -> unpatchify;  D = c_skip*z + c_out*F
    loss = w(sigma) * mean((D - y)^2)                       (EDM: w = 1/c_out^2, so the loss is O(1))

Training draws sigma from the block's widened interval and replaces 10% of the labels with the null
class, so one network serves the conditional and unconditional halves of classifier-free guidance.
`end_to_end: true` is the baseline: the same network as one block of all L layers over the whole
sigma range (B = 1).

Sampling (`sample`) runs the K-step chain of the language models (`diffusion/chain.py`) on the grid of
`blocks.ChainGrid`: `steps` calls equally spaced in the noise CDF from sigma_top (a high quantile of block
0's training law, `sample_top_quantile`; 1 = sigma_max) down to sigma_min, each routed to the block that
owns sigma_k; with `last_call: sigma_min` the last call runs at sigma_min and its D is the sample. On the
equi-probability partition every block gets about steps/B calls. Guidance: D = D_null + s*(D_label - D_null).

Public API:
    build(args, state)  the registry's entry (`model.kind: dit`)
    DiffusionDiT(args)  its frozen args (`DitArgs`: the kind builds them from the run config)
    training_loss(images, labels, step, seed) -> (loss, metrics)      one block per step (Trainable)
    validation_loss(images, labels, seed) -> the EDM loss at sigmas drawn per block (deterministic)
    sample(labels, steps=None, cfg_scale=None, generator=None) -> images (N, C, H, W) in [-1, 1]
        (latents: unclipped)
        (defaults: the settings' sample_steps, else 50 (settings.resolve_steps), and cfg_scale 2.0: the paper's)
    frechet_distance(features_a, features_b) -> float   (FID's formula; `looped_lm.data.images.
        write_png_grid` writes samples as a PNG grid with Pillow)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from looped_lm import diffusion as dm
from looped_lm.diffusion.blocks import chain_grid
from looped_lm.diffusion.chain import run_chain
from looped_lm.errors import UserError
from looped_lm.models.adaln import (AdaLNLayer, Blockwise, TimestepEmbedding, check_images, check_labels, finish_build,
                                    module_schedule, patchify, unpatchify)
from looped_lm.models.args import DitArgs
from looped_lm.models.blockwise import noise_partition
from looped_lm.models.contract import ImageGenerator
from looped_lm.models.layers import ffn_width, init_weights
from looped_lm.models.two_stream import modulate
from looped_lm.settings import DIT_SAMPLE_STEPS, InferenceSettings, resolve_steps


class DiffusionDiT(nn.Module, Blockwise, ImageGenerator):
    def __init__(self, args: DitArgs):
        super().__init__()
        self.args = args
        self.sched, self.end_to_end = args.schedule, args.end_to_end
        self.clip_samples = args.clip_samples  # pixels are in [-1, 1]; latents are not bounded
        num_blocks = 1 if args.end_to_end else args.num_blocks
        self.block_schedule = module_schedule(args, *noise_partition(args, num_blocks))  # edges, train_ranges
        d, per_block = args.d_model, args.n_layers // num_blocks
        ffn, patch_dim = ffn_width(d, args.ffn_hidden), args.channels * args.patch**2
        self.patch_embed = nn.Linear(patch_dim, d)
        self.pos_emb = nn.Parameter(torch.zeros(1, (args.image_size // args.patch) ** 2, d))
        self.noise_emb = TimestepEmbedding(d)
        self.label_emb = nn.Embedding(args.num_classes + 1, d) if args.num_classes else None  # last row: null
        self.blocks = nn.ModuleList(nn.ModuleList(AdaLNLayer(d, args.n_heads, ffn, args.norm_eps)
                                                  for _ in range(per_block))
                                    for _ in range(num_blocks))
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False, eps=args.norm_eps)
        self.final_ada = nn.Linear(d, 2 * d)  # shift, scale of the output layer
        self.out = nn.Linear(d, patch_dim)
        init_weights(self, args.init_std, args.n_layers)
        nn.init.xavier_uniform_(self.patch_embed.weight)
        for layer in (layer for block in self.blocks for layer in block):  # adaLN-Zero
            nn.init.zeros_(layer.ada.weight)
            nn.init.zeros_(layer.ada.bias)
        for lin in (self.final_ada, self.out):  # DiT's zero output layer: F = 0, D = c_skip*z at init
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.grid = chain_grid(self.edges, self.train_ranges, self.sched, args.sample_top_quantile, args.last_call,
                               args.extra_calls)

    @property
    def null_label(self) -> int:
        return self.args.num_classes

    @property
    def num_classes(self) -> int:
        return self.args.num_classes

    # --- the denoiser -----------------------------------------------------------------------------

    def denoise(self, b: int, z, sigma, labels):
        """Block b's D(z; sigma, label): z (N, C, H, W), sigma (N,), labels (N,) (null allowed)."""
        c_skip, c_out, c_in, c_noise = (c.to(z.dtype)[:, None, None, None]
                                        for c in dm.edm_scalings(sigma, self.sched.sigma_data))
        x = self.patch_embed(patchify(c_in * z, self.args.patch)) + self.pos_emb
        cond = self.noise_emb(c_noise.flatten())
        if self.label_emb is not None:
            cond = cond + self.label_emb(labels)
        cond = F.silu(cond)
        for layer in self.blocks[b]:
            x = layer(x, cond)
        shift, scale = self.final_ada(cond).unsqueeze(1).chunk(2, dim=-1)
        a = self.args
        out = unpatchify(self.out(modulate(self.final_norm(x), shift, scale)), a.patch, a.channels, a.image_size)
        return c_skip * z + c_out * out

    def check_batch(self, images, labels):
        check_images(images, self.args.channels, self.args.image_size)
        if labels is not None and self.label_emb is not None:
            check_labels(labels, self.args.num_classes)

    # --- training -------------------------------------------------------------------------------

    def training_loss(self, x, y, step: int, seed: int):
        """x: clean images (N, C, H, W) in [-1, 1]; y: labels (N,) (ignored when unconditional)."""
        self.check_batch(x, y)
        b = self.choose_block(step, seed)
        N = x.shape[0]
        sigma = dm.sample_sigma(N, *self.train_ranges[b], self.sched, device=x.device)
        labels = self.drop_labels(y, N, x.device)
        loss = self.edm_loss(b, x, sigma, torch.randn_like(x), labels)
        metrics = {"block": b, f"loss_block{b}": loss.detach().mean(), "sigma_mean": sigma.detach().mean()}  # on the device
        return loss.mean(), metrics

    def drop_labels(self, y, N: int, device):
        if self.label_emb is None:
            return torch.zeros(N, dtype=torch.long, device=device)
        keep = torch.rand(N, device=device) >= self.args.label_dropout
        return torch.where(keep, y, torch.full_like(y, self.null_label))

    def edm_loss(self, b: int, x, sigma, noise, labels):
        """Per-sample w(sigma) * mean((D - y)^2) -> (N,)."""
        D = self.denoise(b, x + sigma[:, None, None, None] * noise, sigma, labels)
        w = dm.edm_weight(sigma, self.sched.sigma_data).to(x.dtype)
        return w * (D.float() - x).pow(2).flatten(1).mean(1)

    @torch.no_grad()
    def validation_loss(self, x, y, seed: int):
        """The EDM loss with sigma drawn from each block's own interval in turn (equal shares), on a
        seeded generator: the same number for the same weights and batch."""
        self.check_batch(x, y)
        g = torch.Generator(device=x.device).manual_seed(seed)
        labels = y if self.label_emb is not None else torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        total = 0.0
        for b, (lo, hi) in enumerate(dm.block_intervals(self.edges)):
            sigma = dm.sample_sigma(x.shape[0], lo, hi, self.sched, generator=g).to(x.device)
            noise = torch.randn(x.shape, generator=g, device=g.device).to(x.device)
            total = total + self.edm_loss(b, x, sigma, noise, labels).mean()
        return total / self.num_blocks

    # --- sampling -------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, labels: torch.Tensor, steps: int | None = None, cfg_scale: float | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Images (N, C, H, W) in [-1, 1] for `labels` (N,): `steps` routed Euler steps from pure noise.
        cfg_scale 1 = plain conditional sampling (one pass per step); > 1 adds the null-label pass."""
        steps = self.resolve_steps(steps)
        cfg_scale = self.args.cfg_scale if cfg_scale is None else cfg_scale
        if isinstance(cfg_scale, bool) or not isinstance(cfg_scale, (int, float)) or cfg_scale < 0:
            raise UserError(f"cfg_scale must be a number >= 0 (got {cfg_scale!r})")
        device = labels.device
        if self.label_emb is not None:
            check_labels(labels, self.args.num_classes)
        N = labels.shape[0]
        shape = (N, self.args.channels, self.args.image_size, self.args.image_size)
        z = self.grid.sigma_top * torch.randn(shape, generator=generator, device=generator.device if generator else None)
        guided = self.label_emb is not None and cfg_scale != 1

        def denoise(b, z_rows, sigma, rows):  # the chain's rows are images, flattened: (R', 1, C*H*W)
            zz, own = z_rows.view(len(rows), *shape[1:]), labels[rows]
            if guided:
                zz, sigma, own = torch.cat([zz, zz]), torch.cat([sigma, sigma]), \
                    torch.cat([own, torch.full_like(own, self.null_label)])
            D = self.denoise(b, zz, sigma, own)
            if guided:
                cond, uncond = D.chunk(2)
                D = uncond + cfg_scale * (cond - uncond)
            return D.flatten(1)[:, None]

        settings = [InferenceSettings(num_iterations=steps)] * N
        out = run_chain(denoise, self.grid, settings, z.to(device).flatten(1)[:, None], None, None, None,
                        points=lambda D, rows: D)  # D is already the denoised point: no bridge
        images = out.logits.view(shape)  # the last call's D
        return images.clamp(-1, 1) if self.clip_samples else images

    def resolve_steps(self, steps: int | None) -> int:
        """The Euler steps a sample runs: `steps`, else the config's diffusion.sample_steps, else 50."""
        return resolve_steps(steps, self.num_blocks, self.args.sample_steps, DIT_SAMPLE_STEPS,
                             "num_iterations (sampler steps)")

    def steps_per_block(self, steps: int) -> list[int]:
        """How many of `steps` sampling calls each block runs (block 0 first)."""
        return self.grid.steps_per_block(steps)


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2) between Gaussians fitted to two
    feature sets (n, f): FID's formula, in float64 through symmetric eigendecompositions."""
    a, b = a.double(), b.double()
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or min(a.shape[0], b.shape[0]) < 2:
        raise UserError(f"frechet_distance needs two (n >= 2, f) feature sets of equal width "
                        f"(got {tuple(a.shape)} and {tuple(b.shape)})")
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = torch.cov(a.T).reshape(a.shape[1], -1), torch.cov(b.T).reshape(b.shape[1], -1)

    def sqrtm(m):
        vals, vecs = torch.linalg.eigh((m + m.T) / 2)
        return (vecs * vals.clamp_min(0).sqrt()) @ vecs.T

    root_a = sqrtm(cov_a)
    inner = root_a @ cov_b @ root_a
    cross = torch.linalg.eigvalsh((inner + inner.T) / 2).clamp_min(0).sqrt().sum()
    return float((mu_a - mu_b).pow(2).sum() + cov_a.trace() + cov_b.trace() - 2 * cross)


def build(args: DitArgs, state: dict | None = None) -> DiffusionDiT:
    """`model.kind: dit` from its args (the shape, the blocks, noise and sampling: `DitArgs.from_config`)."""
    return finish_build(DiffusionDiT(args), args, state)
