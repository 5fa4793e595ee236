"""DiffusionBlocks masked diffusion over characters (MD4; method.md §7, the paper's §5.3) and its
end-to-end baseline.

The forward process masks each character independently with probability 1 - alpha(t), t in [0, 1]
(alpha(0) = 1: clean; alpha(1) = 0: all masked). The network sees x_t (masked positions hold the mask
id) and the time t, and predicts the clean character at every position; only masked positions count:

    x_t -> tok_emb -> block b (L/B bidirectional AdaLN layers with RoPE, adaLN-Zero from t) -> norm -> head
    NELBO = int_0^1 w(t) E[ sum_{masked n} -log p(x_n | x_t) ] dt / T      (nats per character)
    w(t) = -alpha'(t) / (1 - alpha(t))   (linear schedule: alpha = 1 - t, w = 1/t)

DiffusionBlocks partitions the masking schedule, not sigma: t_b = alpha^-1(1 - b/B) (= b/B for the
linear schedule), so each block owns an equal share of the masking rate. As everywhere in the project,
block 0 owns the noisiest interval [t_{B-1}, 1] and the first layers; block b trains on its interval
(widened by `overlap` of its width on each side), t drawn uniformly (stratified over the batch).
`end_to_end: true` is the baseline: the same network as one block of all layers over [0, 1].

Sampling (`sample`) starts from all-mask and walks a uniform t grid 1 -> 0 in `steps` steps; step
t -> s runs the block that owns t, and each still-masked character is revealed with probability
(alpha(s) - alpha(t)) / (1 - alpha(t)), drawn from the predicted distribution (revealed ones stay).

`elbo_bpc` estimates the NELBO in bits per character, block interval by block interval: an upper
bound on the model's true negative log-likelihood, with each interval's share reported.

Public API:
    build(args, state)  the registry's entry (`model.kind: mdm`)
    MaskedDiffusionLM(args)  its frozen args (`MdmArgs`: the kind builds them from the run config)
    training_loss(x, y, step, seed) -> (loss, metrics)   x: ids (N, T) < vocab_size; y unused
    validation_loss(x, y, seed) -> NELBO in nats per character (deterministic for a seed)
    sample(n, length, steps=None, generator=None) -> ids (n, length)   (steps default: sample_steps or length)
    elbo_bpc(x, samples_per_block=8, generator=None) -> {"bpc", "per_block", "share", ...}
"""

from __future__ import annotations

import bisect
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

from looped_lm.data.text8 import VOCAB_SIZE
from looped_lm.errors import UserError
from looped_lm.models.adaln import AdaLNLayer, Blockwise, check_labels, finish_build, module_schedule
from looped_lm.models.args import MdmArgs
from looped_lm.models.contract import TextDiffusion
from looped_lm.models.layers import RotaryEmbedding, ffn_width, init_weights
from looped_lm.models.two_stream import NoiseEmbedding
from looped_lm.settings import resolve_steps

T_FLOOR = 1e-6  # t is never exactly 0 (w(0) is infinite); no mask can be drawn below it anyway


# --- the masking schedule ---------------------------------------------------------------------------


def alpha(t, schedule: str):
    """Probability that a character is still clean at time t (tensor or float)."""
    if schedule == "linear":
        return 1 - t
    return 1 - (math.pi / 2 * (1 - t)).cos() if torch.is_tensor(t) else 1 - math.cos(math.pi / 2 * (1 - t))


def alpha_inverse(a: float, schedule: str) -> float:
    if schedule == "linear":
        return 1 - a
    return 1 - 2 / math.pi * math.acos(1 - a)


def elbo_weight(t: torch.Tensor, schedule: str) -> torch.Tensor:
    """-alpha'(t) / (1 - alpha(t)): linear 1/t, cosine (pi/2) tan(pi/2 (1 - t))."""
    if schedule == "linear":
        return 1 / t
    return math.pi / 2 * torch.tan(math.pi / 2 * (1 - t))


def time_edges(num_blocks: int, schedule: str) -> list[float]:
    """Ascending t_0 = 0 < t_1 < ... < t_B = 1 with t_b = alpha^-1(1 - b/B): equal masking-rate shares.
    Linear: exactly b/B, the same floats as the sampling grid, so K = B steps visit each block once."""
    if schedule == "linear":
        return [b / num_blocks for b in range(num_blocks + 1)]
    return [0.0, *(alpha_inverse(1 - b / num_blocks, schedule) for b in range(1, num_blocks)), 1.0]


def route_time(t: float, edges) -> int:
    """The block that owns t (block 0 = the highest t). On an inner edge t goes to the lower-t block, as
    `diffusion.route_sigma` does for sigma."""
    inner = list(edges[1:-1])
    return len(inner) - bisect.bisect_left(inner, float(t))


def time_intervals(edges, overlap: float = 0.0) -> list[tuple[float, float]]:
    """(lo, hi) per block index (block 0 the highest), widened by overlap * width, clipped to [0, 1]."""
    B = len(edges) - 1
    out = []
    for b in range(B):
        lo, hi = edges[B - 1 - b], edges[B - b]
        pad = overlap * (hi - lo)
        out.append((max(0.0, lo - pad), min(1.0, hi + pad)))
    return out


def masked_nelbo(logits: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-sequence w(t) * sum over masked positions of CE / T -> (N,). Unmasked positions' logits never
    enter (their CE is selected away, so they get no gradient)."""
    N, T, V = logits.shape
    ce = F.cross_entropy(logits.float().reshape(N * T, V), x.reshape(N * T), reduction="none").view(N, T)
    return weight * torch.where(mask, ce, torch.zeros_like(ce)).sum(1) / T


class MaskedDiffusionLM(nn.Module, Blockwise, TextDiffusion):
    def __init__(self, args: MdmArgs):
        super().__init__()
        self.args = args
        self.end_to_end = args.end_to_end
        self.mask_id = VOCAB_SIZE
        num_blocks = 1 if args.end_to_end else args.num_blocks
        edges = time_edges(num_blocks, args.schedule)  # masking time, not sigma: its own partition
        self.block_schedule = module_schedule(args, edges, time_intervals(edges, args.overlap))
        self.report_edges = time_edges(args.num_blocks, args.schedule)  # per-interval ELBO shares, both variants
        d, per_block = args.d_model, args.n_layers // num_blocks
        ffn = ffn_width(d, args.ffn_hidden)
        self.tok_emb = nn.Embedding(VOCAB_SIZE + 1, d)
        self.time_emb = NoiseEmbedding(d)
        self.rope = RotaryEmbedding(d // args.n_heads, args.seq_len, args.rope_theta)
        self.blocks = nn.ModuleList(nn.ModuleList(AdaLNLayer(d, args.n_heads, ffn, args.norm_eps)
                                                  for _ in range(per_block))
                                    for _ in range(num_blocks))
        self.norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.head = nn.Linear(d, VOCAB_SIZE)  # the clean characters only: the mask is never predicted
        init_weights(self, args.init_std, args.n_layers)
        for layer in (layer for block in self.blocks for layer in block):  # adaLN-Zero
            nn.init.zeros_(layer.ada.weight)
            nn.init.zeros_(layer.ada.bias)
        nn.init.zeros_(self.head.bias)

    def checkpoint_state(self) -> dict:
        return {**super().checkpoint_state(), "schedule": self.args.schedule}

    @property
    def seq_len(self) -> int:
        return self.args.seq_len

    # --- the denoiser -----------------------------------------------------------------------------

    def logits(self, b: int, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Block b's prediction of the clean characters: x_t (N, T) ids (mask = vocab_size), t (N,)
        -> logits (N, T, vocab_size)."""
        h = self.tok_emb(x_t)
        cos, sin = self.rope(torch.arange(x_t.shape[1], device=x_t.device))
        cond = F.silu(self.time_emb(t))
        for layer in self.blocks[b]:
            h = layer(h, cond, cos, sin)
        return self.head(self.norm(h))

    def corrupt(self, x, t, generator=None):
        """Mask each position of x (N, T) with probability 1 - alpha(t) -> (x_t, mask)."""
        u = torch.rand(x.shape, generator=generator, device=generator.device if generator else x.device)
        mask = u.to(x.device) < (1 - alpha(t, self.args.schedule))[:, None]
        return torch.where(mask, torch.full_like(x, self.mask_id), x), mask

    def check_ids(self, x):
        if x.dim() != 2:
            raise UserError(f"character ids must have shape (N, T) (got {tuple(x.shape)})")
        if x.shape[1] > self.args.seq_len:
            raise UserError(f"sequence length {x.shape[1]} exceeds mdm.seq_len ({self.args.seq_len})")
        check_labels(x, VOCAB_SIZE, "character")

    @staticmethod
    def stratified_times(n: int, lo: float, hi: float, generator=None, device=None) -> torch.Tensor:
        """n times in (lo, hi], one per equal sub-interval, in random order (lower variance than iid)."""
        u = torch.rand(1, generator=generator, device=generator.device if generator else None)
        u = (u + torch.arange(n, device=u.device) / n) % 1.0
        t = hi - (hi - lo) * u[torch.randperm(n, generator=generator, device=u.device)]
        return t.clamp_min(T_FLOOR).to(device)

    # --- training -------------------------------------------------------------------------------

    def training_loss(self, x, y, step: int, seed: int):
        """The MD4 loss on block b's t-range (one block per step). y is not used: the targets are x."""
        self.check_ids(x)
        b = self.choose_block(step, seed)
        t = self.stratified_times(x.shape[0], *self.train_ranges[b], device=x.device)
        x_t, mask = self.corrupt(x, t)
        loss = masked_nelbo(self.logits(b, x_t, t), x, mask, elbo_weight(t, self.args.schedule))
        return loss.mean(), {"block": b, f"loss_block{b}": loss.detach().mean(),  # on the device
                             "masked": mask.float().mean()}

    @torch.no_grad()
    def validation_loss(self, x, y, seed: int):
        g = torch.Generator(device=x.device).manual_seed(seed)
        return torch.tensor(self.elbo_bpc(x, samples_per_block=2, generator=g)["bpc"] * math.log(2))

    # --- evaluation -------------------------------------------------------------------------------

    @torch.no_grad()
    def elbo_bpc(self, x, samples_per_block: int = 8, generator: torch.Generator | None = None) -> dict:
        """The NELBO of x (N, T) in bits per character, estimated by stratified t on each interval of the
        reporting partition (the B intervals of the settings, for both variants), each t run by the block
        that owns it. An upper bound on -log2 p(x) per character, in expectation over the draws."""
        self.check_ids(x)
        schedule, per_block = self.args.schedule, []
        intervals = time_intervals(self.report_edges)
        for lo, hi in intervals:
            total = 0.0
            for _ in range(samples_per_block):
                t = self.stratified_times(x.shape[0], lo, hi, generator, device=x.device)
                x_t, mask = self.corrupt(x, t, generator)
                # t inside an interval of the reporting partition: run the block that owns it
                blocks = torch.tensor([route_time(float(v), self.edges) for v in t], device=x.device)
                nelbo = torch.zeros(x.shape[0], device=x.device)
                for b in blocks.unique().tolist():
                    rows = blocks == b
                    nelbo[rows] = masked_nelbo(self.logits(b, x_t[rows], t[rows]), x[rows], mask[rows],
                                               elbo_weight(t[rows], schedule))
                total += (hi - lo) * float(nelbo.mean())
            per_block.append(total / samples_per_block / math.log(2))
        bpc = sum(per_block)
        return {"bpc": bpc, "per_block": per_block, "share": [p / bpc if bpc else 0.0 for p in per_block],
                "t_edges": self.report_edges, "samples_per_block": samples_per_block,
                "characters": int(x.numel()), "upper_bound": True}

    # --- sampling -------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, n: int, length: int, steps: int | None = None, generator: torch.Generator | None = None,
               device=None) -> torch.Tensor:
        """n sequences of `length` character ids, unmasked over `steps` steps (at least one per block;
        default: the settings' sample_steps, else one step per character)."""
        steps = self.resolve_steps(steps, length)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"the number of samples must be an integer >= 1 (got {n!r})")
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= self.args.seq_len:
            raise UserError(f"length must be an integer in 1 .. {self.args.seq_len} (got {length!r})")
        device = device or self.head.weight.device
        gen_device = generator.device if generator is not None else device
        schedule = self.args.schedule
        x = torch.full((n, length), self.mask_id, dtype=torch.long, device=device)
        grid = [(steps - k) / steps for k in range(steps + 1)]
        for k in range(steps):
            t, s = grid[k], grid[k + 1]
            logits = self.logits(route_time(t, self.edges), x, torch.full((n,), t, device=device))
            draw = torch.multinomial(logits.float().softmax(-1).view(n * length, -1).to(gen_device), 1,
                                     generator=generator).view(n, length).to(device)
            reveal = (alpha(s, schedule) - alpha(t, schedule)) / (1 - alpha(t, schedule))
            u = torch.rand(n, length, generator=generator, device=gen_device).to(device)
            x = torch.where((x == self.mask_id) & (u < reveal), draw, x)
        return x

    def resolve_steps(self, steps: int | None, length: int) -> int:
        """The unmasking steps a sample of `length` runs: `steps`, else the config's diffusion.sample_steps,
        else one per character."""
        return resolve_steps(steps, self.num_blocks, self.args.sample_steps, length,
                             "num_iterations (sampler steps)")

    def steps_per_block(self, steps: int) -> list[int]:
        """How many of `steps` unmasking steps each block runs (block 0, the highest t, first)."""
        counts = [0] * self.num_blocks
        for k in range(steps):
            counts[route_time((steps - k) / steps, self.edges)] += 1
        return counts


def build(args: MdmArgs, state: dict | None = None) -> MaskedDiffusionLM:
    """`model.kind: mdm` from its args: characters in text8's 27-symbol alphabet (the shape, the blocks and
    the masking schedule: `MdmArgs.from_config`)."""
    return finish_build(MaskedDiffusionLM(args), args, state)
