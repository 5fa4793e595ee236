"""Block-wise training, written once for every DiffusionBlocks network (db_ar, looped_db, vit, dit, mdm).

A DiffusionBlocks network splits into B blocks, each the denoiser of one interval of noise levels; a training
step trains ONE block. `BlockSchedule` holds all a network knows of its blocks as training sees them:

    the partition        edges (ascending, B + 1 values) and each block's training interval (widened), by block
                         index, block 0 the highest noise
    the trainable blocks `blocks_to_train` (all when empty), in the order round_robin walks them; the others
                         are frozen before any optimiser exists (`freeze_untrained`)
    the sampling rule    uniform, round_robin, fixed (one weight per block), or the shares of a measured
                         CE(sigma) curve (loss_share, network_gain: the language models; `curve`)
    choose_block         the block a step trains, from (step, seed) alone, so every rank agrees without talking
    step_units           the parameter units that step updates: "shared" + "block{b}"
    state / restore      what a checkpoint records: edges, num_blocks, the curve where there is one

`noise_partition` builds the sigma partition from the args' noise schedule (db_ar, looped_db, vit, dit); mdm
partitions masking time instead (`models/mdm.py`) and hands its edges to the same schedule. `BlockwiseTrainable`
is the `Trainable` half every such network shares: each method delegates to `self.block_schedule`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from looped_lm import diffusion as dm
from looped_lm.diffusion import ce_curve
from looped_lm.diffusion.blocks import choose_block
from looped_lm.errors import UserError
from looped_lm.models.contract import Trainable

CURVE_RULES = ("loss_share", "network_gain")  # block_sampling rules driven by a measured CE(sigma) curve
CURVE_FLOOR = 1e-3  # added to every curve share, so no block ever starves


def noise_partition(args, num_blocks: int, saved_edges=None) -> tuple[list[float], list[tuple[float, float]]]:
    """(edges, training intervals by block) of a network whose args carry `schedule` (a NoiseSchedule),
    `partition` and `overlap`: a checkpoint's saved edges (checked) where given, else the args' partition."""
    if saved_edges is not None:
        edges = dm.check_edges(saved_edges)
        if len(edges) != num_blocks + 1:
            raise UserError(f"saved edges have {len(edges) - 1} blocks but the model has {num_blocks}")
    else:
        edges = dm.make_edges(args.partition, num_blocks, args.schedule)
    return edges, dm.widen(edges, args.overlap)


class BlockSchedule:
    """Which block each training step trains, and the partition and state that go with it (module docstring)."""

    def __init__(self, edges, train_ranges, blocks_to_train=(), sampling: str = "uniform", block_weights=()):
        self.set_partition(edges, train_ranges)
        self.trainable = list(blocks_to_train) or list(range(self.num_blocks))
        self.sampling = sampling
        self.block_weights = list(block_weights)  # fixed: one per block, block 0 first
        self.curve: dict | None = None  # {"sigmas", "ce", "ce_z"} once measured (curve rules only)

    @property
    def num_blocks(self) -> int:
        return len(self.edges) - 1

    def set_partition(self, edges, train_ranges) -> None:
        self.edges, self.train_ranges = list(edges), list(train_ranges)

    # --- which block a step trains ----------------------------------------------------------------------

    def uses_curve(self) -> bool:
        """Whether the rule needs a measured CE(sigma) curve (with one trainable block there is no choice)."""
        return self.sampling in CURVE_RULES and len(self.trainable) > 1

    def shares(self) -> list[float]:
        """Each block's share of the steps under the curve rules, by block index (`diffusion/ce_curve.py`)."""
        c = self.curve
        if self.sampling == "network_gain":
            return ce_curve.gain_shares(self.edges, c["sigmas"], c["ce"], c["ce_z"])
        return ce_curve.block_shares(self.edges, c["sigmas"], c["ce"])

    def weights(self):
        """The draw's weights, one per trainable block, or None for a uniform draw (a curve rule before its
        first curve, fixed without weights)."""
        if self.sampling == "fixed" and self.block_weights:
            return [self.block_weights[b] for b in self.trainable]
        if self.uses_curve() and self.curve is not None:
            shares = self.shares()
            return torch.tensor([shares[b] for b in self.trainable], dtype=torch.float64) + CURVE_FLOOR
        return None

    def choose_block(self, step: int, seed: int) -> int:
        """The block trained at `step`: the same on every rank (it depends on step and seed only)."""
        return choose_block(step, seed, self.trainable, self.sampling, self.weights())

    def step_units(self, step: int, seed: int) -> set[str]:
        return {"shared", f"block{self.choose_block(step, seed)}"}

    @staticmethod
    def param_unit(name: str) -> str:
        """blocks.<b>.* belong to unit block<b>; every other parameter is shared."""
        return f"block{name.split('.')[1]}" if name.startswith("blocks.") else "shared"

    def freeze_untrained(self, blocks: nn.ModuleList) -> None:
        """No gradient, so no optimiser state, for the blocks this run does not train."""
        for b, block in enumerate(blocks):
            if b not in self.trainable:
                block.requires_grad_(False)

    # --- what a checkpoint records ------------------------------------------------------------------------

    def state(self) -> dict:
        state = {"edges": [float(e) for e in self.edges], "num_blocks": self.num_blocks}
        if self.curve is not None:
            state["curve"] = self.curve
        return state

    def restore(self, saved: dict) -> None:
        """A resumed checkpoint's blocks and edges must be these; its measured curve is adopted."""
        if saved.get("num_blocks") != self.num_blocks or [float(e) for e in saved.get("edges", [])] != self.edges:
            raise UserError(f"cannot resume: the checkpoint has {saved.get('num_blocks')} blocks with edges "
                            f"{saved.get('edges')}, this run {self.num_blocks} with {self.edges}")
        self.curve = saved.get("curve")


class BlockwiseTrainable(Trainable):
    """The `Trainable` methods of a network with `self.blocks` (one entry per block) and `self.block_schedule`."""

    block_schedule: BlockSchedule

    @property
    def num_blocks(self) -> int:
        return self.block_schedule.num_blocks

    @property
    def edges(self) -> list[float]:
        return self.block_schedule.edges

    @property
    def train_ranges(self) -> list[tuple[float, float]]:
        return self.block_schedule.train_ranges

    def choose_block(self, step: int, seed: int) -> int:
        return self.block_schedule.choose_block(step, seed)

    def step_units(self, step: int, seed: int) -> set[str] | None:
        return self.block_schedule.step_units(step, seed)

    def param_unit(self, name: str) -> str:
        return self.block_schedule.param_unit(name)

    def checkpoint_state(self) -> dict:
        return self.block_schedule.state()

    def uses_curve(self) -> bool:
        return self.block_schedule.uses_curve()

    def apply_curve(self, curve: dict) -> None:
        self.block_schedule.curve = curve
