"""Pieces the non-autoregressive DiffusionBlocks modules (vit, dit, mdm) share.

- `TimestepEmbedding`: the noise level's smooth embedding (DiT's timestep embedder).
- `AdaLNLayer`: a bidirectional transformer layer (the parts of `TransformerLayer`) modulated by
  adaLN-Zero from a conditioning vector (the noise level, a label, a masking time).
- `Blockwise`: the `Trainable` half every such module has in common, the one of `models/blockwise.py`.
  `self.blocks` holds B untied denoisers (DiffusionBlocks) or one stack of all layers (the end-to-end
  baseline, B = 1); a training step runs one block, chosen by the module's `BlockSchedule`
  (`module_schedule`), and only that block's parameter unit plus "shared" are stepped by the optimiser.
- `finish_build`: what every module's `build(args, state)` (the registry's entry) does once the network
  exists: freeze the blocks it does not train, check a checkpoint's saved partition.

Shapes: N batch, T tokens (patches or characters), C model width.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from looped_lm.errors import UserError
from looped_lm.models.blockwise import BlockSchedule, BlockwiseTrainable
from looped_lm.models.layers import TransformerLayer, apply_rope
from looped_lm.models.two_stream import modulate


class TimestepEmbedding(nn.Module):
    """c_noise (N,) -> conditioning vector (N, C): DiT's timestep embedder (sinusoids at periods 2*pi to
    2*pi*10^4, then an MLP), as the official DiffusionBlocks ViT uses it. c_noise = ln(sigma)/4 spans about
    [-1.6, 1.1], so every sinusoid turns less than a quarter of a period across the whole sigma range: nearby
    noise levels get nearby embeddings, and a block generalises across its interval."""

    def __init__(self, d_model: int, frequencies: int = 256, max_period: float = 10_000.0):
        super().__init__()
        self.n_freqs, self.max_period = frequencies // 2, max_period
        self.mlp = nn.Sequential(nn.Linear(2 * self.n_freqs, d_model), nn.SiLU(), nn.Linear(d_model, d_model))

    @property
    def freqs(self) -> torch.Tensor:
        """Computed in fp32 whatever the module's dtype (as the noise embedding of models/two_stream.py)."""
        half = self.n_freqs
        return torch.exp(-math.log(self.max_period) * torch.arange(half, device=self.mlp[0].weight.device) / half)

    def forward(self, c_noise: torch.Tensor) -> torch.Tensor:
        angles = c_noise.float()[:, None] * self.freqs[None]
        return self.mlp(torch.cat([angles.cos(), angles.sin()], dim=-1).to(self.mlp[0].weight.dtype))


class AdaLNLayer(TransformerLayer):
    """Pre-norm bidirectional attention + SwiGLU, each branch shifted, scaled and gated by adaLN-Zero
    (DiT): the modulation is zero-initialised, so at init the layer is the identity."""

    def __init__(self, d_model: int, n_heads: int, ffn_hidden: int, eps: float):
        super().__init__(d_model, n_heads, ffn_hidden, eps)
        self.ada = nn.Linear(d_model, 6 * d_model)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, h, cond, cos=None, sin=None):
        """h (N, T, C), cond (N, C) already through SiLU; cos/sin: RoPE tables, or None for none."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(cond).unsqueeze(1).chunk(6, dim=-1)
        x = modulate(self.norm1(h), shift1, scale1)
        N, T, C = x.shape
        q, k, v = self.attn.qkv(x).view(N, T, 3, self.attn.n_heads, self.attn.head_dim).permute(2, 0, 3, 1, 4)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        h = h + gate1 * self.attn.merge(F.scaled_dot_product_attention(q, k, v))
        return h + gate2 * self.mlp(modulate(self.norm2(h), shift2, scale2))


def check_labels(labels: torch.Tensor, num_classes: int, what: str = "label") -> None:
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise UserError(f"{what} ids must be integers (got {labels.dtype})")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        bad = int(labels.min()) if int(labels.min()) < 0 else int(labels.max())
        raise UserError(f"{what} id {bad} is out of range: expected 0 .. {num_classes - 1}")


class Blockwise(BlockwiseTrainable):
    """The block-wise training of a module with `self.blocks` (an nn.ModuleList of layer lists) and its
    `self.block_schedule` (`module_schedule`): `BlockwiseTrainable`, except that one block (the end-to-end
    baseline) steps as a plain network."""

    def step_units(self, step: int, seed: int) -> set[str] | None:
        if self.num_blocks == 1:
            return None  # end-to-end: everything moves every step
        return super().step_units(step, seed)


def module_schedule(args, edges, train_ranges) -> BlockSchedule:
    """A module's block schedule from its args. The modules walk `blocks_to_train` in ascending order (the
    language models in the order listed), and one block (end-to-end) has nothing to choose from."""
    chosen = sorted(args.blocks_to_train) if len(edges) > 2 else ()
    return BlockSchedule(edges, train_ranges, chosen, args.block_sampling, args.block_weights)


def finish_build(model: Blockwise, args, state: dict | None):
    """Freeze the blocks outside `args.blocks_to_train` (before any optimiser exists), and check the
    partition a checkpoint saved against the one these args build (ValueError naming the difference)."""
    model.block_schedule.freeze_untrained(model.blocks)
    if state:
        mine = model.checkpoint_state()
        for key, value in state.items():
            if key in mine and mine[key] != value:
                raise ValueError(f"the saved {key} {value} differs from this config's {mine[key]}")
    return model


# --- images -------------------------------------------------------------------------------------


def check_images(images: torch.Tensor, channels: int, image_size: int) -> None:
    """A batch must be float (N, channels, image_size, image_size): the shape the model was built for."""
    want = (channels, image_size, image_size)
    if images.dim() != 4 or tuple(images.shape[1:]) != want:
        raise UserError(f"images must have shape (N, {channels}, {image_size}, {image_size}) "
                        f"(got {tuple(images.shape)})")
    if not images.is_floating_point():
        raise UserError(f"images must be floating point, scaled to [-1, 1] (got {images.dtype})")


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, H/p * W/p, C*p*p), patches in row-major order."""
    N, C, H, W = images.shape
    x = images.reshape(N, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(N, (H // p) * (W // p), C * p * p)


def unpatchify(patches: torch.Tensor, p: int, channels: int, image_size: int) -> torch.Tensor:
    """The inverse of `patchify`: (N, T, C*p*p) -> (N, C, H, W)."""
    N, g = patches.shape[0], image_size // p
    x = patches.reshape(N, g, g, channels, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(N, channels, image_size, image_size)
