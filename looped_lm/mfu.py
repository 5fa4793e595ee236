"""Model FLOPs utilisation: a training step's matmul FLOPs (looped_lm/cost.py, from the run's config) over the
hardware's peak, as nanoGPT prints it.

    flops = StepFlops(cfg, vocab_size)                   # the kind's cost of each kind of step, cached
    flops(key)                                           # FLOPs of one optimizer step on one rank
    peak_flops(device, dtype, override_tflops)           # the device's dense peak, FLOP/s

What decides a step's cost (`key`): the block a DiffusionBlocks step trains, huginn's sampled recurrence r,
nothing for gpt; each kind maps its config to the cost model (`Kind.step_flops`, looped_lm/kinds/).
Attention is charged over the pairs a causal kernel computes. A LoRA run (train.lora_rank > 0) is charged what
runs: the frozen base's weight gradients are left out (the adapters' own rank-r matmuls, a few percent, are not
counted), while the equal-FLOPs benches charge a LoRA step as full fine-tuning (`Kind.step_flops` without `frozen`).

Peaks are the vendors' dense (no sparsity) tensor-core numbers: bf16 / fp16, and TF32 for fp32 matmuls
(torch uses TF32 on these GPUs only with `torch.backends.cuda.matmul.allow_tf32`; otherwise fp32 runs at
a small fraction of it and the MFU printed is an upper bound). Other hardware: `train.peak_tflops`. On a
CPU the peak is measured: the best of a few fp32 matmuls at torch's thread count.
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch

from looped_lm import cost
from looped_lm.kinds import kind_of

# dense peak TFLOP/s by (a name fragment of torch.cuda.get_device_name, matmul precision)
PEAK_TFLOPS = {
    ("H200", "bf16"): 989.0, ("H200", "tf32"): 494.5,
    ("H100", "bf16"): 989.0, ("H100", "tf32"): 494.5,  # SXM; the PCIe card is ~0.76x
    ("A100", "bf16"): 312.0, ("A100", "tf32"): 156.0,
}


class StepFlops:
    """FLOPs of one optimizer step on one rank (grad_accum micro-batches of batch_size sequences), by key (the
    DB block, huginn's r: the kind's `step_flops`), cached. None for kinds without a cost model."""

    def __init__(self, cfg, vocab_size: int):
        self.cfg, self.vocab_size, self.kind = cfg, vocab_size, kind_of(cfg)
        self._cache: dict = {}

    def __call__(self, key=None) -> float | None:
        if key not in self._cache:
            t = self.cfg.train
            frozen = cost.FROZEN_UNDER_LORA if t.lora_rank else ()  # what runs: no weight grads of a frozen base
            flops = self.kind.step_flops(self.cfg, self.vocab_size, t.batch_size, key, frozen=frozen)
            self._cache[key] = None if flops is None else t.grad_accum * flops
        return self._cache[key]

    def curve(self) -> float | None:
        """FLOPs of one CE(sigma) curve refresh (measured on rank 0 only, on one batch of batch_size)."""
        if "curve" not in self._cache:
            self._cache["curve"] = self.kind.curve_flops(self.cfg, self.vocab_size, self.cfg.train.batch_size)
        return self._cache["curve"]


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float = 0.0) -> float:
    """The dense matmul peak in FLOP/s: the override, the table for a known GPU, a measurement on CPU,
    0 where unknown (MFU then not logged)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        precision = "bf16" if dtype in (torch.bfloat16, torch.float16) else "tf32"
        for (fragment, p), tflops in PEAK_TFLOPS.items():
            if fragment in name and p == precision:
                return tflops * 1e12
        return 0.0
    if device.type == "cpu":
        return measured_cpu_peak(torch.get_num_threads())
    return 0.0


@lru_cache(maxsize=None)
def measured_cpu_peak(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """fp32 matmul FLOP/s on this CPU at `threads` threads: the best of `repeats` n x n products."""
    g = torch.Generator().manual_seed(0)  # never the global RNG: a run's noise draws must not depend on this
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b  # warm-up: the first call allocates and picks a kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


def mfu(flops: float, seconds: float, peak: float) -> float | None:
    """Achieved FLOP/s over the peak; None where either is unknown."""
    if not peak or not seconds or flops is None:
        return None
    return flops / seconds / peak
