"""Block-parallel training (`train.mode: block_parallel`, db_ar): which rank trains which DiffusionBlocks
block, and the gradient exchange that replaces data parallelism's all-reduce.

Blocks train apart (one block per forward pass, no gradient crosses blocks), so ranks can train different
blocks at once. With T trained blocks (`diffusion.blocks_to_train`, or all B) and W ranks, one a
multiple of the other:

    W >= T   rank r trains block blocks[r mod T] every step; the W / T ranks of one block split its batch
    W <  T   rank r owns blocks[r], blocks[r + W], ...; each step it trains one of them
             (`diffusion.block_sampling` uniform or round_robin, among its own)

Each rank builds the whole model but only its own blocks train there (the trainer builds it with
`blocks_to_train` = its blocks), so it keeps optimiser state for them and the shared parameters only.
After the step's backward, before the optimiser (`BlockParallel.reduce`):

    1. the ranks of one block average its gradients and the shared parameters' (only if W > T)
    2. clip to train.grad_clip by their joint norm: exactly the clipping a one-rank step of that block
       on the block's whole batch would do
    3. every rank averages the shared parameters' gradients (embeddings, prelude, coda, noise embedding,
       norm), so they stay identical everywhere

With one rank per block only step 3 communicates: the shared parameters' gradients, nothing of the
blocks. A rank's copy of another rank's block goes stale; `sync_blocks` brings every block from its
first rank before anything reads the whole model (validation, the CE curve, a checkpoint).

`dist` is `deepspeed.comm` (the trainer's); nothing here imports DeepSpeed, and the ownership functions
need no torch (preflight uses them before anything is built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from looped_lm.config import Config
from looped_lm.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: the ownership functions need none
    import torch


def check_world(cfg: Config, world: int) -> None:
    """A world size block-parallel training can use: a multiple of the trained blocks, or a divisor."""
    if cfg.train.mode != "block_parallel":
        return
    n = len(cfg.diffusion.trained_blocks())
    if world % n and n % world:
        raise UserError(f"train.mode block_parallel: world size {world} does not fit {n} trained blocks (one must be "
                        f"a multiple of the other: e.g. {n} or {2 * n} ranks)")
    # one block per rank: block_sampling has nothing to choose; several: a curve rule's shared draw cannot apply
    rule = cfg.diffusion.block_sampling
    if world < n and rule in ("loss_share", "network_gain"):
        raise UserError(f"train.mode block_parallel on {world} rank(s) for {n} blocks: each rank trains one of its "
                        f"{n // world} blocks per step, which diffusion.block_sampling {rule}"
                        f"{' (the default)' if rule == type(cfg.diffusion).model_fields['block_sampling'].default else ''}"
                        " cannot choose; set "
                        f"diffusion.block_sampling=uniform (or round_robin), or use {n} ranks")


def ranks_of_blocks(cfg: Config, world: int) -> dict[int, list[int]]:
    """{block: the ranks that train it}, first rank first (it writes the block's checkpoint state)."""
    blocks = cfg.diffusion.trained_blocks()
    if world >= len(blocks):
        return {b: [r for r in range(world) if r % len(blocks) == i] for i, b in enumerate(blocks)}
    return {b: [i % world] for i, b in enumerate(blocks)}


def blocks_of_rank(cfg: Config, rank: int, world: int) -> list[int]:
    return [b for b, ranks in ranks_of_blocks(cfg, world).items() if rank in ranks]


def rank_config(cfg: Config, rank: int, world: int) -> Config:
    """The config rank `rank` builds its model from: only its own blocks train there."""
    mine = cfg.model_copy(deep=True)
    mine.diffusion.blocks_to_train = blocks_of_rank(cfg, rank, world)
    return mine


def unit_writers(cfg: Config, world: int) -> dict[str, int]:
    """{optimiser unit: the rank that writes its state into a checkpoint}. Data parallel: rank 0 holds
    everything; block parallel: a block's first rank."""
    units = {"shared": 0}  # every other unit: rank 0
    if cfg.train.mode == "block_parallel":
        units.update({f"block{b}": ranks[0] for b, ranks in ranks_of_blocks(cfg, world).items()})
    return units


class BlockParallel:
    """The gradient exchange and block broadcast of one block-parallel run (every rank builds one)."""

    def __init__(self, cfg: Config, model, dist):
        self.dist, self.rank, self.world = dist, dist.get_rank(), dist.get_world_size()
        self.grad_clip = cfg.train.grad_clip
        self.owners = ranks_of_blocks(cfg, self.world)
        self.units: dict[str, list] = {}  # unit -> its parameters
        for name, p in model.named_parameters():
            self.units.setdefault(model.param_unit(name), []).append(p)
        # one process group per block with several ranks (every rank creates every group, in order)
        self.groups = {b: dist.new_group(ranks) for b, ranks in self.owners.items() if len(ranks) > 1}
        self.bytes_sent = 0  # gradient payload this rank handed to all-reduce (the benchmark reads it)

    def reduce(self, active_units) -> None:
        """Average, clip and share this step's gradients (after the last micro-batch's backward)."""
        import torch  # torch: seconds at start-up

        shared = self._grads("shared")
        blocks = [int(u.removeprefix("block")) for u in active_units if u.startswith("block")]
        block = self._grads(f"block{blocks[0]}") if blocks else []
        group = self.groups.get(blocks[0]) if blocks else None
        if group is not None:  # several ranks on this block: their joint batch's gradient
            self._mean(shared + block, group, len(self.owners[blocks[0]]))
        if self.grad_clip:
            norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in shared + block]))
            scale = (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_
            for g in shared + block:
                g.mul_(scale.to(g.dtype))
        self._mean(shared, None, self.world)

    def _grads(self, unit: str) -> list[torch.Tensor]:
        """The unit's gradients, zeros where a parameter got none (every rank must send the same sizes)."""
        import torch  # torch: seconds at start-up

        out = []
        for p in self.units.get(unit, []):
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                out.append(p.grad)
        return out

    def _mean(self, tensors: list[torch.Tensor], group, size: int) -> None:
        import torch  # torch: seconds at start-up

        if not tensors or size == 1:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.bytes_sent += flat.numel() * flat.element_size()
        self.dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def sync_blocks(self) -> None:
        """Every block's current weights, from its first rank, on every rank."""
        import torch  # torch: seconds at start-up

        for b, ranks in self.owners.items():
            params = self.units.get(f"block{b}", [])
            if not params:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            self.dist.broadcast(flat, src=ranks[0])
            offset = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def block_losses(self, loss, block: int, device) -> dict:
        """{block: its mean training loss this step over the ranks that trained it}, device tensors (NaN for
        a block no rank trained this step): one all-reduce, nothing read back to the host."""
        import torch  # torch: seconds at start-up

        blocks = sorted(self.owners)
        sums = torch.zeros(2, len(blocks), dtype=torch.float64, device=device)
        sums[0, blocks.index(block)] = loss
        sums[1, blocks.index(block)] = 1
        self.dist.all_reduce(sums)
        means = sums[0] / sums[1]  # 0 / 0: NaN, a block not trained this step
        return {b: means[i] for i, b in enumerate(blocks)}
