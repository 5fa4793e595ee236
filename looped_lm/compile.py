"""`train.compile`: torch.compile of the training computation, as nanoGPT does (on by default on CUDA).

Each kind says what it compiles (`Kind.compile_for_training`, looped_lm/kinds/): gpt its whole
`training_loss`; db_ar and looped_db the loss of the block the host chose (`BlockObjective.block_loss`: one
graph per block, never recompiled as steps switch blocks, and the step number stays out of the graph);
huginn each layer (its loss loops over a recurrence drawn on the host each step, and the core layer is one
graph that every iteration reuses); vit, dit, mdm and plugins that say nothing run eager.

The model is compiled here rather than through DeepSpeed's `engine.compile()`: DeepSpeed's hook compiles
the engine's module forward (for gpt the same `training_loss` call) but takes the step number into the
graph for the DB kinds and cannot compile huginn's layers apart, so the kinds own the choice.
"""

from __future__ import annotations

import inspect

import torch
from torch import _dynamo

from looped_lm import devices

BACKEND = "inductor"  # torch.compile's default (Triton kernels on GPUs, C++ on CPU)
_PROMISED = 0  # graphs promised so far in this process (torch without a per-function recompile limit)


def compile_graphs(fn, graphs: int, backend: str | None = None, **kwargs):
    """torch.compile(fn) that may hold `graphs` graphs (one per DB block, one per decode bucket) plus one, with
    a count of its own where torch offers one (torch.compile's recompile_limit, 2.12+): dynamo's default of 8
    per code object would send a 9th graph silently back to eager. Older torch: the process-wide limit is
    raised by `graphs` at each call instead (its count is per code object, shared by every model a process
    compiles: on the first H200 run, the third DB model's blocks fell back to eager)."""
    global _PROMISED
    if {"recompile_limit", "isolate_recompiles"} <= set(inspect.signature(torch.compile).parameters):
        kwargs.update(recompile_limit=graphs + 1, isolate_recompiles=True)
    else:  # every function compiled in this process shares the raised limit (gpt's loss too)
        name = "recompile_limit" if hasattr(_dynamo.config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
        _PROMISED += graphs
        setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), _PROMISED + 1))
    return torch.compile(fn, backend=backend or BACKEND, dynamic=False, **kwargs)


def compile_enabled(setting: str, device: torch.device) -> bool:
    """train.compile on `device` (devices.compile_enabled)."""
    return devices.compile_enabled(setting, device.type)


def compile_for_training(model, kind, backend: str | None = None) -> bool:
    """Compile what `kind` (a looped_lm.kinds.Kind) trains through, in place; -> whether anything was."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.random.fork_rng(devices=devices.rng_devices(device_type)):  # importing the compiler draws from the global RNG: the noise
        return kind.compile_for_training(model, backend or BACKEND)  # draws of a compiled run must be an eager run's
