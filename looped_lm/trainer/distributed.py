"""The DeepSpeed glue: joining the ranks (NCCL on GPUs, gloo on CPU; one process works too), the engine's config,
and train_step's runner over the engine (accumulation, clipping, the non-finite checks)."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before DeepSpeed picks its accelerator, which it does when imported
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
import deepspeed.ops  # noqa: E402

from looped_lm import devices
from looped_lm.config import Config
from looped_lm.errors import UserError
from looped_lm.kinds import kind_of
from looped_lm.trainer.args import RENDEZVOUS_FILE, free_port


def init_distributed():
    """Set up torch.distributed through DeepSpeed: NCCL on GPUs, gloo on CPU; one process works too."""
    cuda = torch.cuda.is_available()  # DS_ACCELERATOR was set for CPU when this module was imported
    if "RANK" not in os.environ:  # launched without the deepspeed launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    # init_distributed otherwise JIT-compiles a shared-memory comm op with g++ (~1 min, needs a compiler)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    backend = devices.dist_backend("cuda" if cuda else "cpu")
    store = os.environ.get(RENDEZVOUS_FILE)
    if store:  # one node: a file rendezvous, and gloo's and NCCL's own sockets on loopback
        if Path("/sys/class/net/lo").exists():
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        deepspeed.init_distributed(dist_backend=backend, init_method=f"file://{store}",
                                   rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        deepspeed.init_distributed(dist_backend=backend)
    device = devices.rank_device(cuda, int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # no CPU meaning: NCCL and every later allocation use this GPU
    return device


def on_rank0(fn):
    """fn() on rank 0, its result (or its UserError) on every rank: one rank reads and verifies."""
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except UserError as e:
            box[1] = str(e)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        err = UserError(box[1])
        err.quiet = dist.get_rank() != 0  # rank 0 prints it
        raise err
    return box[0]


def bf16_autocast(cfg: Config) -> bool:
    """bf16 as autocast over fp32 weights (not DeepSpeed's pure-bf16 weights): block parallel, and the
    supporting modules, whose float inputs (images, noise levels) meet the weights directly."""
    return cfg.deepspeed.bf16 and (cfg.train.mode == "block_parallel" or kind_of(cfg).offers("autocast"))


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * world_size,
        # block parallel: parallel.BlockParallel clips each block's gradient before the shared average
        "gradient_clipping": 0.0 if t.mode == "block_parallel" else t.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        # bf16 at ZeRO 0 is DeepSpeed's pure-bf16 path (bf16 weights and Adam state); block parallel (always
        # ZeRO 0) and the modules run bf16 compute under autocast instead: fp32 weights, gradients, optimizer state
        "bf16": {"enabled": cfg.deepspeed.bf16 and not bf16_autocast(cfg)},
        "torch_autocast": {"enabled": bf16_autocast(cfg), "dtype": "bfloat16"},
        "steps_per_print": 10 ** 9,  # our own logging
        "wall_clock_breakdown": False,
        # BlockwiseAdamW is torch AdamW plus per-unit skipping; ZeRO 1/2 keep its group dicts
        "zero_allow_untested_optimizer": True,
    }


class DeepSpeedRunner:
    """train_step's runner under DeepSpeed: the engine scales for accumulation, clips, reduces across
    ranks and steps the optimiser at the accumulation boundary. `before_update` runs just before that
    optimiser step (block parallel: the gradient exchange that replaces the engine's all-reduce).

    With `skip_each_step` (train.skip_nonfinite > 0), a step whose loss or gradient norm is not finite
    makes no update (`finite` is False afterwards): the optimiser is told that no unit is active, so NaN
    never reaches the weights or the optimizer state; deciding that needs the host, one read per step.
    Otherwise (the default: such a step stops the run) nothing is read: each step's flag is kept on the
    device and `first_nonfinite()` reads them at the trainer's log, eval and save steps, before anything
    is saved, so a step makes no host sync at all."""

    def __init__(self, engine, before_update=None, optimizer=None, skip_each_step: bool = True):
        self.engine, self.before_update, self.optimizer = engine, before_update, optimizer
        self.skip_each_step = skip_each_step
        self.step_loss = None  # the step's summed micro-batch losses, kept on the device (no host sync)
        self.finite, self.loss_value, self.grad_norm = True, None, None
        self.pending: list = []  # (step, ok, loss, norm) on the device, since the last first_nonfinite()
        self.step = 0

    def loss(self, x, y, step: int):
        loss = self.engine(x, y, step)
        return loss, self.engine.module.last_metrics

    def backward(self, loss) -> None:
        self.step_loss = loss.detach() if self.step_loss is None else self.step_loss + loss.detach()
        self.engine.backward(loss)

    def micro_step(self) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary:
            if self.before_update is not None:
                self.before_update()
            self.step += 1
            self.finite = self._finite_step() if self.skip_each_step else self._record_step()
            if not self.finite and self.optimizer is not None:
                self.optimizer.set_active_units(())  # BlockwiseAdamW: no unit active = no update at all
        self.engine.step()
        if boundary:
            # ZeRO 1/2 hold the gradients in their own partitions (not p.grad): their optimizer checks them
            # and skips the step itself on a non-finite one (its `overflow` flag, already on the host)
            if getattr(self.engine.optimizer, "overflow", False) is True and self.finite:
                self.finite, self.grad_norm = False, float("nan")
            self.step_loss = None

    def _flags(self):
        """(ok, loss, norm): this step's loss and gradient norm and whether both are finite on every rank
        (all-reduced), as device tensors."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)])) \
            if grads else torch.zeros((), device=self.step_loss.device)
        loss = self.step_loss.float().reshape(())
        ok = torch.isfinite(torch.stack([loss, norm.to(loss.device)])).all().float()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        return ok, loss, norm

    def _record_step(self) -> bool:
        """Stop mode: keep the flag for `first_nonfinite`; the update goes ahead (no host sync)."""
        self.pending.append((self.step, *self._flags()))
        return True

    def first_nonfinite(self) -> int | None:
        """The first step since the last call whose loss or gradient norm was not finite (None: every one
        was): ONE read for all of them. Its values are kept for `nonfinite_reason`."""
        pending, self.pending = self.pending, []
        if not pending:
            return None
        oks = torch.stack([ok for _, ok, _, _ in pending])
        if bool((oks == 1.0).all()):
            return None
        i = int((oks < 1.0).nonzero()[0, 0])
        step, _, loss, norm = pending[i]
        self.loss_value, self.grad_norm = float(loss), float(norm)
        return step

    def _finite_step(self) -> bool:
        """Are this step's loss and gradient norm finite, on every rank?

        THE ONE DELIBERATE HOST SYNC of an optimiser step: the loss and the gradient norm are fused into
        one flag on the device (all-reduced over ranks, so every rank skips or stops together) and read
        once. The values themselves are read only when the flag says something is wrong."""
        self.loss_value = self.grad_norm = None
        ok, loss, norm = self._flags()
        if ok.item() == 1.0:
            return True
        self.loss_value, self.grad_norm = float(loss), float(norm)
        return False

    def nonfinite_reason(self) -> str:
        """'loss is nan' / 'gradient norm is inf' (another rank's, when both are finite here)."""
        loss, norm = self.loss_value, self.grad_norm
        if loss is not None and not math.isfinite(loss):
            return f"loss is {loss}" + (f" (gradient norm {norm})" if norm is not None else "")
        if norm is not None and not math.isfinite(norm):
            return f"gradient norm is {norm} (loss {loss})" if loss is not None else f"gradient norm is {norm}"
        return "another rank's loss or gradient norm is not finite"


def lost_peer(e: RuntimeError) -> str | None:
    """The short reason of a collective that failed because another rank went away (gloo / NCCL), else None."""
    text = str(e).strip()
    if not re.search(r"gloo|NCCL|Connection (reset|closed) by peer|DistBackendError", text + type(e).__name__):
        return None
    first = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", text.splitlines()[0])  # drop the C++ source location
    return first.split(". This is typically")[0]
