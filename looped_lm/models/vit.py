"""DiffusionBlocks ViT classifier (method.md §7; the paper's §5.1) and its end-to-end baseline.

The label is the diffused variable. Its clean point is y = label_table[label] (fixed random unit
vectors, one per class); training noises it, z = y + sigma*eps, and the noisy embedding c_in*z takes the
[CLS] slot in front of the image patches. Every layer is modulated by adaLN-Zero from c_noise.

    images (N, C, H, W) -> patches (N, P, C*p*p) -> patch_embed -> [slot | patches] + pos_emb
    block b (L/B AdaLN layers, untied) owns the sigma interval b (block 0 = highest sigma)
    h = c_out * normalize(F[slot]) + c_skip * z  ->  logits = head(norm(h))      (head: untied, zero init)
    loss = CE(logits, label) * w(sigma) / E_block[w]                            (loss_weight: edm)

Inference (`predict`) runs K >= B Euler steps from z ~ N(0, sigma_max^2 I) on the equal-probability
sigma grid, each routed to the block that owns sigma_k; with K = B each block runs once, the cost of one
pass through the whole network. The logits of the last call are the prediction.

`end_to_end: true` is the paper's baseline: the same patches, layers and head, a learned [CLS] token
in the slot, adaLN from a learned constant, all L layers in one pass, plain CE.

Public API (what phase-2 callers use):
    DiffusionViT(ViTSettings)
    training_loss(images, labels, step, seed) -> (loss, metrics)    one block per step (Trainable)
    validation_loss(images, labels, seed) -> CE of predict(K = B)
    predict(images, num_iterations=None, generator=None) -> logits (N, num_classes)
    accuracy(images, labels, num_iterations=None, batch_size=256, generator=None)
        -> {"accuracy", "examples", "num_iterations"}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from looped_lm import diffusion as dm
from looped_lm.errors import UserError
from looped_lm.models.adaln import (BLOCK_SAMPLING, AdaLNLayer, Blockwise, check_blocks, check_choice,
                                    check_image_size, check_images, check_iterations, check_labels,
                                    check_positive_ints, check_width, patchify)
from looped_lm.models.layers import ffn_width, init_weights
from looped_lm.models.two_stream import NoiseEmbedding


@dataclass
class ViTSettings:
    """The paper's CIFAR-100 ViT by default (12 layers, patch 4, d 128, 4 heads, B = 3, overlap 0.05)."""

    image_size: int = 32
    channels: int = 3
    num_classes: int = 100
    patch: int = 4
    n_layers: int = 12
    d_model: int = 128
    n_heads: int = 4
    ffn_hidden: int = 0  # 0: SwiGLU's 8/3 d rule
    num_blocks: int = 3
    overlap: float = 0.05
    end_to_end: bool = False  # the baseline: an ordinary ViT classifier over all layers
    partition: str = "equi_probability"
    block_sampling: str = "uniform"
    loss_weight: str = "edm"  # edm: w(sigma) / E_block[w]; none: plain CE
    bridge: str = "soft"  # inference: D = softmax(logits) @ label_table (soft) or label_table[argmax] (hard)
    parameterization: str = "edm"  # edm (the paper); likelihood: logits + <z, y_v>/sigma^2 (method.md §9) [ours]
    noise: dm.NoiseSchedule = field(default_factory=dm.NoiseSchedule)
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def validate(self) -> "ViTSettings":
        p = "vit"
        check_positive_ints(self, p, ("image_size", "channels", "patch", "n_layers", "d_model", "n_heads"))
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 2:
            raise UserError(f"{p}.num_classes must be an integer >= 2 (got {self.num_classes!r})")
        check_image_size(self.image_size, self.patch, p)
        check_width(self.d_model, self.n_heads, p)
        check_blocks(self.n_layers, self.num_blocks, p)
        check_choice(self.partition, dm.PARTITION_KINDS, f"{p}.partition")
        check_choice(self.block_sampling, BLOCK_SAMPLING, f"{p}.block_sampling")
        check_choice(self.loss_weight, ("edm", "none"), f"{p}.loss_weight")
        check_choice(self.bridge, ("soft", "hard"), f"{p}.bridge")
        check_choice(self.parameterization, ("edm", "likelihood"), f"{p}.parameterization")
        self.noise.validate()
        dm.widen([1.0, 2.0], self.overlap)  # checks the overlap's range
        return self


class DiffusionViT(nn.Module, Blockwise):
    def __init__(self, settings: ViTSettings):
        super().__init__()
        s = self.settings = settings.validate()
        self.sched, self.block_sampling = s.noise, s.block_sampling
        self.end_to_end = s.end_to_end
        num_blocks = 1 if s.end_to_end else s.num_blocks
        self.edges = dm.make_edges(s.partition, num_blocks, self.sched)
        self.train_ranges = dm.widen(self.edges, s.overlap)  # by block, block 0 = highest sigma
        d, per_block = s.d_model, s.n_layers // num_blocks
        ffn = ffn_width(d, s.ffn_hidden)
        self.patch_embed = nn.Linear(s.channels * s.patch**2, d)
        self.pos_emb = nn.Parameter(torch.zeros(1, 1 + (s.image_size // s.patch) ** 2, d))
        self.blocks = nn.ModuleList(nn.ModuleList(AdaLNLayer(d, s.n_heads, ffn, s.norm_eps) for _ in range(per_block))
                                    for _ in range(num_blocks))
        if s.end_to_end:
            self.cls = nn.Parameter(torch.zeros(1, 1, d))
            self.cond = nn.Parameter(torch.zeros(d))  # adaLN from a learned constant: no noise level here
        else:
            self.noise_emb = NoiseEmbedding(d)
        # Clean label points: fixed random unit vectors (no gradient into the targets, as in dblm)
        self.register_buffer("label_table", F.normalize(torch.randn(s.num_classes, d), dim=-1))
        self.norm = nn.RMSNorm(d, eps=s.norm_eps)
        self.head = nn.Linear(d, s.num_classes)
        init_weights(self, s.init_std, s.n_layers)
        nn.init.xavier_uniform_(self.patch_embed.weight)  # O(1) patch tokens from the first step (DiT's init)
        for layer in (layer for block in self.blocks for layer in block):
            nn.init.zeros_(layer.ada.weight)
            nn.init.zeros_(layer.ada.bias)  # adaLN-Zero: every layer starts as the identity
            if s.end_to_end:  # no noise level: start as an ordinary pre-norm layer (gates 1), or the
                layer.ada.bias.data.view(6, d)[[2, 5]] = 1.0  # constant [CLS] slot never sees the image
        nn.init.zeros_(self.head.weight)  # the zero-initialised, untied classifier
        nn.init.zeros_(self.head.bias)

    def checkpoint_state(self) -> dict:
        return {**super().checkpoint_state(), "end_to_end": self.end_to_end}

    # --- forward pieces -------------------------------------------------------------------------

    def embed_patches(self, images):
        check_images(images, self.settings.channels, self.settings.image_size)
        return self.patch_embed(patchify(images, self.settings.patch))  # (N, P, C)

    def run_layers(self, b: int, slot, patches, cond):
        """[slot | patches] (+ positions) through block b's layers -> the slot's output (N, C)."""
        x = torch.cat([slot[:, None], patches], dim=1) + self.pos_emb
        cond = F.silu(cond)
        for layer in self.blocks[b]:
            x = layer(x, cond)
        return x[:, 0]

    def block_logits(self, b: int, patches, z, sigma):
        """Block b's denoised label at noise sigma (N,) from z (N, C) -> logits (N, num_classes)."""
        c_skip, c_out, c_in, c_noise = (c.to(z.dtype)[:, None] for c in dm.edm_scalings(sigma, self.sched.sigma_data))
        out = self.run_layers(b, c_in * z, patches, self.noise_emb(c_noise[:, 0]))
        if self.settings.parameterization == "likelihood":
            # the exact log-likelihood of z under each label (unit-norm targets): the network only has to
            # supply the image's prior over labels, and what z already says is never lost
            return self.head(self.norm(out)) + (z @ self.label_table.T) / sigma[:, None] ** 2
        h = c_out * F.normalize(out, dim=-1) + c_skip * z
        return self.head(self.norm(h))

    def classify(self, patches):
        """The end-to-end classifier: learned [CLS], all layers, one pass."""
        N = patches.shape[0]
        out = self.run_layers(0, self.cls.expand(N, 1, -1)[:, 0], patches, self.cond.expand(N, -1))
        return self.head(self.norm(out))

    # --- training -------------------------------------------------------------------------------

    def training_loss(self, x, y, step: int, seed: int):
        """x: images (N, C, H, W) in [-1, 1]; y: labels (N,). One block per step (DB), or the whole
        classifier (end_to_end)."""
        check_labels(y, self.settings.num_classes)
        patches = self.embed_patches(x)
        if self.end_to_end:
            ce = F.cross_entropy(self.classify(patches).float(), y, reduction="none")
            return ce.mean(), {"block": 0, "loss_block0": float(ce.detach().mean())}
        b = self.choose_block(step, seed)
        sigma = dm.sample_sigma(x.shape[0], *self.train_ranges[b], self.sched, device=x.device)
        z = self.label_table[y] + sigma[:, None] * torch.randn(x.shape[0], self.settings.d_model, device=x.device)
        ce = F.cross_entropy(self.block_logits(b, patches, z, sigma).float(), y, reduction="none")
        loss = (ce * self.loss_weights(sigma, b)).mean()
        return loss, {"block": b, f"loss_block{b}": float(ce.detach().mean()), "sigma_mean": float(sigma.mean())}

    def loss_weights(self, sigma, b: int):
        if self.settings.loss_weight == "none":
            return torch.ones_like(sigma)
        w = dm.edm_weight(sigma, self.sched.sigma_data)
        return (w / dm.edm_loss_weight_normaliser(*self.train_ranges[b], self.sched)).to(sigma.dtype)

    @torch.no_grad()
    def validation_loss(self, x, y, seed: int):
        g = torch.Generator(device=x.device).manual_seed(seed)
        check_labels(y, self.settings.num_classes)
        return F.cross_entropy(self.predict(x, generator=g).float(), y)

    # --- inference ------------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, images, num_iterations: int | None = None, generator: torch.Generator | None = None):
        """Logits (N, num_classes). DB: K = num_iterations (default B, at least B) routed Euler steps
        from pure noise; the end-to-end classifier ignores K."""
        patches = self.embed_patches(images)
        if self.end_to_end:
            return self.classify(patches)
        K = self.num_blocks if num_iterations is None else num_iterations
        check_iterations(K, self.num_blocks)
        sigmas = dm.inference_sigmas(K, self.sched, lo=self.edges[0], hi=self.edges[-1])
        N, d = images.shape[0], self.settings.d_model
        z = sigmas[0] * torch.randn(N, d, generator=generator, device=generator.device if generator else None)
        z = z.to(images.device)
        for k in range(K):
            sigma = torch.full((N,), sigmas[k], device=images.device)
            logits = self.block_logits(dm.route_sigma(sigmas[k], self.edges), patches, z, sigma)
            if k + 1 < K:
                z = dm.euler_step(z, self.bridge(logits), sigmas[k], sigmas[k + 1])
        return logits

    def bridge(self, logits):
        """Logits -> a denoised point among the label embeddings."""
        if self.settings.bridge == "hard":
            return self.label_table[logits.argmax(-1)]
        return logits.float().softmax(-1) @ self.label_table

    @torch.no_grad()
    def accuracy(self, images, labels, num_iterations: int | None = None, batch_size: int = 256,
                 generator: torch.Generator | None = None) -> dict:
        """Top-1 accuracy over (images, labels), in batches: what `looped_lm eval` prints for vit."""
        check_labels(labels, self.settings.num_classes)
        K = self.num_blocks if num_iterations is None else num_iterations
        correct = 0
        for i in range(0, images.shape[0], batch_size):
            logits = self.predict(images[i:i + batch_size], K, generator)
            correct += int((logits.argmax(-1) == labels[i:i + batch_size]).sum())
        n = int(images.shape[0])
        return {"accuracy": correct / max(n, 1), "examples": n, "num_iterations": 1 if self.end_to_end else K}
