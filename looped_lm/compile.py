"""`train.compile`: torch.compile of the training computation, as nanoGPT does (on by default on CUDA).

What is compiled, by kind:
  gpt                     the whole `training_loss`: one graph (the trainer's batches all have one shape)
  db_ar, looped_db        the loss of the block the host chose (`BlockObjective.block_loss`): one graph
                          per block, then no recompilation as steps switch blocks
  huginn                  each layer (prelude, core, coda): the loss loops over a recurrence r drawn on the
                          host each step, and a whole-loss graph would be one graph per r; the core layer
                          is one graph that every iteration reuses
  other kinds             nothing (vit, dit, mdm and plugins run eager)

Compiling the model here rather than through DeepSpeed's `engine.compile()`: DeepSpeed's hook compiles
the engine's module forward, which for these kinds is the same `training_loss` call, but offers no way to
compile huginn's layers apart, so one place owns the choice for every kind.
"""

from __future__ import annotations

import torch

DB_KINDS = ("db_ar", "looped_db")
BACKEND = "inductor"  # torch.compile's default (Triton kernels and CUDA graphs' building blocks on GPUs)


def compile_enabled(setting: str, device: torch.device) -> bool:
    """train.compile: "on", "off", or "auto" (on for CUDA, off elsewhere: on CPU inductor needs a C++
    compiler and tens of seconds per graph, which the quickstart does not repay)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def compile_for_training(model, kind: str, backend: str | None = None) -> bool:
    """Compile what `kind` trains through, in place; -> whether anything was compiled."""
    backend = backend or BACKEND
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # importing the compiler draws from the global RNG: the noise
        return _compile(model, kind, backend)      # draws of a compiled run must be an eager run's


def _compile(model, kind: str, backend: str) -> bool:
    if kind == "gpt":
        model.training_loss = torch.compile(model.training_loss, backend=backend, dynamic=False)
        return True
    if kind in DB_KINDS:  # after the host's choice of block: the step number never enters the graph
        model.objective.block_loss = torch.compile(model.objective.block_loss, backend=backend, dynamic=False)
        return True
    if kind == "huginn":
        for stack in (model.prelude, model.core, model.coda):
            for layer in stack:
                layer.compile(backend=backend, dynamic=False)
        return True
    return False
