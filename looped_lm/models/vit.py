"""DiffusionBlocks ViT classifier (method.md §7; the paper's §5.1) and its end-to-end baseline.

The label is the diffused variable. Its clean point is y = label_table[label] (fixed random unit
vectors, one per class; `label_table: learned`, an option, learns them normalised to unit norm, as the
official code does); training noises it, z = y + sigma*eps, and the noisy embedding c_in*z takes the
[CLS] slot in front of the image patches. Every layer is modulated by adaLN-Zero from the noise level
through DiT's smooth timestep embedder. The recipe follows the official DiffusionBlocks code where it and
the paper disagree (docs/method.md §7):

    images (N, C, H, W) -> patches (N, P, C*p*p) -> patch_embed -> [slot | patches] + pos_emb
    block b (L/B AdaLN layers, untied) owns the sigma interval b (block 0 = highest sigma)
    h = c_out * LayerNorm(F[slot]) + c_skip * z   (the network's term has norm ~ c_out * sqrt(d), learnable gain)
    logits = head(adaLN(h))                        (final shift/scale from the noise level; head zero init)
    loss = CE(logits, label) * mean_batch(w(sigma)) / E_block[w]   (loss_weight: batch_mean, the official
           code's `loss * w[:, None]` broadcast: uniform within a block; edm: per-sample w; none: plain CE)

Inference (`predict`) runs the K-step chain of the language models (`diffusion/chain.py`) with one slot
per image: K >= B calls on the equal-probability grid of `blocks.ChainGrid`, each routed to the block that
owns sigma_k; with K = B each block runs once, the cost of one pass through the whole network. With
`last_call: sigma_min` (default; the official code's grid [sigma_max, ..., sigma_min]) the last call runs
at sigma_min and its logits are the prediction. Chains start at sigma_top, a high quantile of block 0's
training law (`sample_top_quantile`, as the language models; 1 = sigma_max, the official code). Between
calls the bridge maps the logits to a point among the label embeddings: soft (the expectation), hard
(the argmax's), sample (a drawn label's).

`end_to_end: true` is the paper's baseline: the same patches, layers and head, a learned [CLS] token
in the slot, adaLN from a learned constant, all L layers in one pass, plain CE.

Public API:
    build(args, state)  the registry's entry (`model.kind: vit`)
    DiffusionViT(args)  its frozen args (`VitArgs`: the kind builds them from the run config)
    training_loss(images, labels, step, seed) -> (loss, metrics)    one block per step (Trainable)
    validation_loss(images, labels, seed) -> CE of predict(K = B)
    predict(images, num_iterations=None, generator=None) -> logits (N, num_classes)
    features(images, num_iterations=None, generator=None) -> (N, d_model) what the head reads
    accuracy(images, labels, num_iterations=None, batch_size=256, generator=None)
        -> {"accuracy", "examples", "num_iterations"}
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from looped_lm import diffusion as dm
from looped_lm.diffusion.blocks import chain_grid
from looped_lm.diffusion.chain import run_chain
from looped_lm.models.adaln import (AdaLNLayer, Blockwise, TimestepEmbedding, check_images, check_labels, finish_build,
                                    module_schedule, patchify)
from looped_lm.models.args import VitArgs
from looped_lm.models.blockwise import noise_partition
from looped_lm.models.contract import Classifier
from looped_lm.models.layers import ffn_width, init_weights
from looped_lm.models.two_stream import modulate
from looped_lm.sampling import SharedGenerator
from looped_lm.settings import InferenceSettings, resolve_steps



class DiffusionViT(nn.Module, Blockwise, Classifier):
    def __init__(self, args: VitArgs):
        super().__init__()
        self.args = args
        self.sched, self.end_to_end = args.schedule, args.end_to_end
        num_blocks = 1 if args.end_to_end else args.num_blocks
        self.block_schedule = module_schedule(args, *noise_partition(args, num_blocks))  # edges, train_ranges
        d, per_block = args.d_model, args.n_layers // num_blocks
        ffn = ffn_width(d, args.ffn_hidden)
        self.patch_embed = nn.Linear(args.channels * args.patch**2, d)
        self.pos_emb = nn.Parameter(torch.zeros(1, 1 + (args.image_size // args.patch) ** 2, d))
        self.blocks = nn.ModuleList(nn.ModuleList(AdaLNLayer(d, args.n_heads, ffn, args.norm_eps)
                                                  for _ in range(per_block))
                                    for _ in range(num_blocks))
        if args.end_to_end:
            self.cls = nn.Parameter(torch.zeros(1, 1, d))
            self.cond = nn.Parameter(torch.zeros(d))  # adaLN from a learned constant: no noise level here
        else:
            self.noise_emb = TimestepEmbedding(d)
            self.final_ada = nn.Linear(d, 2 * d)  # shift, scale of h before the head (the official code's)
        # Clean label points: fixed random unit vectors (no gradient into the targets, as in dblm), or learned
        if args.label_table == "learned" and not args.end_to_end:
            self.label_emb = nn.Parameter(torch.randn(args.num_classes, d))
        else:
            self.register_buffer("label_table", F.normalize(torch.randn(args.num_classes, d), dim=-1))
        self.norm = nn.LayerNorm(d, eps=args.norm_eps)  # learnable gain: the network's term is not capped
        self.head = nn.Linear(d, args.num_classes)
        learned = self.label_emb.data.clone() if hasattr(self, "label_emb") else None
        init_weights(self, args.init_std, args.n_layers)
        if learned is not None:
            self.label_emb.data.copy_(learned)  # the same random start as the fixed table (unit after normalising)
        nn.init.xavier_uniform_(self.patch_embed.weight)  # O(1) patch tokens from the first step (DiT's init)
        for layer in (layer for block in self.blocks for layer in block):
            nn.init.zeros_(layer.ada.weight)
            nn.init.zeros_(layer.ada.bias)  # adaLN-Zero: every layer starts as the identity
            if args.end_to_end:  # no noise level: start as an ordinary pre-norm layer (gates 1), or the
                layer.ada.bias.data.view(6, d)[[2, 5]] = 1.0  # constant [CLS] slot never sees the image
        nn.init.zeros_(self.head.weight)  # the zero-initialised, untied classifier
        nn.init.zeros_(self.head.bias)
        if not args.end_to_end:
            nn.init.zeros_(self.final_ada.weight)
            nn.init.zeros_(self.final_ada.bias)
        self.grid = chain_grid(self.edges, self.train_ranges, self.sched, args.sample_top_quantile, args.last_call,
                               args.extra_calls)

    def checkpoint_state(self) -> dict:
        return {**super().checkpoint_state(), "end_to_end": self.end_to_end}

    # --- forward pieces -------------------------------------------------------------------------

    def labels(self):
        """The clean label points (num_classes, d_model), unit norm: the fixed table or the learned one."""
        return F.normalize(self.label_emb, dim=-1) if hasattr(self, "label_emb") else self.label_table

    def embed_patches(self, images):
        check_images(images, self.args.channels, self.args.image_size)
        return self.patch_embed(patchify(images, self.args.patch))  # (N, P, C)

    def run_layers(self, b: int, slot, patches, cond):
        """[slot | patches] (+ positions) through block b's layers -> the slot's output (N, C)."""
        x = torch.cat([slot[:, None], patches], dim=1) + self.pos_emb
        cond = F.silu(cond)
        for layer in self.blocks[b]:
            x = layer(x, cond)
        return x[:, 0]

    def block_logits(self, b: int, patches, z, sigma, with_features: bool = False):
        """Block b's denoised label at noise sigma (N,) from z (N, C) -> logits (N, num_classes), and with
        `with_features` the (N, C) representation the head reads them from."""
        c_skip, c_out, c_in, c_noise = (c.to(z.dtype)[:, None] for c in dm.edm_scalings(sigma, self.sched.sigma_data))
        cond = self.noise_emb(c_noise[:, 0])
        out = self.run_layers(b, c_in * z, patches, cond)
        if self.args.parameterization == "likelihood":
            # the exact log-likelihood of z under each label (unit-norm targets): the network only has to
            # supply the image's prior over labels, and what z already says is never lost
            features = self.norm(out)
            logits = self.head(features) + (z @ self.labels().T) / sigma[:, None] ** 2
        else:  # EDM's skip, as the official code: c_out * LayerNorm(F) + c_skip * z, adaLN, head
            shift, scale = self.final_ada(F.silu(cond)).unsqueeze(1).chunk(2, dim=-1)
            features = modulate((c_out * self.norm(out) + c_skip * z)[:, None], shift, scale)[:, 0]
            logits = self.head(features)
        return (logits, features) if with_features else logits

    def classify(self, patches, with_features: bool = False):
        """The end-to-end classifier: learned [CLS], all layers, one pass."""
        N = patches.shape[0]
        features = self.norm(self.run_layers(0, self.cls.expand(N, 1, -1)[:, 0], patches, self.cond.expand(N, -1)))
        return (self.head(features), features) if with_features else self.head(features)

    # --- training -------------------------------------------------------------------------------

    def training_loss(self, x, y, step: int, seed: int):
        """x: images (N, C, H, W) in [-1, 1]; y: labels (N,). One block per step (DB), or the whole
        classifier (end_to_end)."""
        check_labels(y, self.args.num_classes)
        patches = self.embed_patches(x)
        if self.end_to_end:
            ce = F.cross_entropy(self.classify(patches).float(), y, reduction="none")
            return ce.mean(), {"block": 0, "loss_block0": ce.detach().mean()}  # on the device: read at log steps
        b = self.choose_block(step, seed)
        sigma = dm.sample_sigma(x.shape[0], *self.train_ranges[b], self.sched, device=x.device)
        z = self.labels()[y] + sigma[:, None] * torch.randn(x.shape[0], self.args.d_model, device=x.device)
        ce = F.cross_entropy(self.block_logits(b, patches, z, sigma).float(), y, reduction="none")
        loss = (ce * self.loss_weights(sigma, b)).mean()
        return loss, {"block": b, f"loss_block{b}": ce.detach().mean(), "sigma_mean": sigma.detach().mean()}

    def loss_weights(self, sigma, b: int):
        """Per-sample CE weights (N,), O(1) on average over block b's sigma law."""
        kind = self.args.loss_weight
        if kind == "none":
            return torch.ones_like(sigma)
        w = (dm.edm_weight(sigma, self.sched.sigma_data) / dm.edm_loss_weight_normaliser(*self.train_ranges[b],
                                                                                          self.sched)).to(sigma.dtype)
        return w if kind == "edm" else w.mean().expand_as(w)

    @torch.no_grad()
    def validation_loss(self, x, y, seed: int):
        g = torch.Generator(device=x.device).manual_seed(seed)
        check_labels(y, self.args.num_classes)
        return F.cross_entropy(self.predict(x, generator=g).float(), y)

    # --- inference ------------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, images, num_iterations: int | None = None, generator: torch.Generator | None = None,
                with_features: bool = False, check: bool = True):
        """Logits (N, num_classes). DB: the K-step chain (K = num_iterations, default B, at least B) from
        z ~ N(0, sigma_top^2 I), one slot per image, on `self.grid`; the logits of its last call. The
        end-to-end classifier ignores K. With `with_features`: (logits, features of the last call (N, d_model))."""
        patches = self.embed_patches(images)
        if self.end_to_end:
            return self.classify(patches, with_features)
        K = self.resolve_steps(num_iterations) if check else num_iterations  # `features` runs one call (block 0)
        N, d = images.shape[0], self.args.d_model
        gen_device = generator.device if generator is not None else None
        z = self.grid.sigma_top * torch.randn(N, 1, d, generator=generator, device=gen_device)
        last = {}

        def denoise(b, z_rows, sigma, rows):  # one slot per image: (R', 1, d) -> (R', 1, num_classes)
            logits, last["features"] = self.block_logits(b, patches[rows], z_rows[:, 0], sigma, True)
            return logits[:, None]

        labels = self.labels()
        table = lambda: labels  # noqa: E731
        settings = [InferenceSettings(num_iterations=K, bridge=self.args.bridge)] * N
        out = run_chain(denoise, self.grid, settings, z.to(images.device), SharedGenerator(generator),
                        lambda ids: labels[ids], table)
        logits = out.logits[:, 0]
        return (logits, last["features"]) if with_features else logits

    @torch.no_grad()
    def features(self, images, num_iterations: int | None = None, generator: torch.Generator | None = None):
        """(N, d_model): what the head reads from the image alone, a feature space for the Frechet distance
        of generated images. End-to-end: the [CLS] slot's output. DB: block 0's at the top of the noise
        range, where z says nothing of the label (later calls mostly read back the label the chain chose,
        a 10-point cloud, not image features). K does not enter."""
        if self.end_to_end:
            return self.predict(images, with_features=True)[1]
        return self.predict(images, 1, generator, with_features=True, check=False)[1]

    def resolve_steps(self, num_iterations: int | None) -> int:
        """K of a prediction: the request's, else the config's diffusion.num_iterations, else B (the one rule
        of settings.resolve_steps: at least one call per block)."""
        return resolve_steps(num_iterations, self.num_blocks, self.args.num_iterations, self.num_blocks)

    def steps_per_block(self, K: int) -> list[int]:
        return self.grid.steps_per_block(K)

    @torch.no_grad()
    def accuracy(self, images, labels, num_iterations: int | None = None, batch_size: int = 256,
                 generator: torch.Generator | None = None) -> dict:
        """Top-1 accuracy over (images, labels), in batches: what `looped_lm eval` prints for vit."""
        check_labels(labels, self.args.num_classes)
        K = self.resolve_steps(num_iterations)
        correct = 0
        for i in range(0, images.shape[0], batch_size):
            logits = self.predict(images[i:i + batch_size], K, generator, check=False)  # K resolved above
            correct += int((logits.argmax(-1) == labels[i:i + batch_size]).sum())
        n = int(images.shape[0])
        return {"accuracy": correct / max(n, 1), "examples": n, "num_iterations": 1 if self.end_to_end else K}


def build(args: VitArgs, state: dict | None = None) -> DiffusionViT:
    """`model.kind: vit` from its args (the shape, the blocks, noise and inference: `VitArgs.from_config`)."""
    return finish_build(DiffusionViT(args), args, state)
