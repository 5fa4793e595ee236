"""Decisions taken on the device, as pure functions of the device type and the run's settings.

The trainer and the engine call these with their device's type; the CPU suite calls them with "cuda" too
(tests/test_devices.py), so no decision hides in a branch that only a GPU takes. What is left behind a CUDA
check elsewhere is either run on CPU by a test that takes the branch, or named with its reason in
.ci/cuda_only.txt (checked by .ci/cuda_lines.py against the suite's coverage).
"""

from __future__ import annotations

import os

import torch

from looped_lm.errors import UserError

SWITCH_WORDS = ("auto", "on", "off")


def dist_backend(device_type: str) -> str:
    """torch.distributed's backend: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def fp32_matmul_precision(device_type: str, bf16: bool) -> str:
    """torch.set_float32_matmul_precision for a run: "high" (TF32) for the fp32 matmuls left beside bf16 ones
    on CUDA (the DB kinds' likelihood terms), as nanoGPT does; "highest" (torch's default) otherwise, so fp32
    runs stay fp32 and CPU runs are unchanged."""
    return "high" if device_type == "cuda" and bf16 else "highest"


def compile_enabled(setting: str, device_type: str) -> bool:
    """train.compile and --compile-decode: "on", "off", or "auto" (on for CUDA, off elsewhere: on CPU inductor
    needs a C++ compiler and tens of seconds per graph, which a short run does not repay)."""
    return setting == "on" or (setting == "auto" and device_type == "cuda")


def adamw_implementation(device_type: str) -> str:
    """fused on CUDA (one kernel for every tensor), foreach elsewhere (a few multi-tensor ops instead of
    about ten kernels per parameter tensor; the plain for-loop is the reference the tests compare)."""
    return "fused" if device_type == "cuda" else "foreach"


def uses_cuda_graphs(device_type: str, backend: str) -> bool:
    """The compiled decode captures each bucket as a CUDA graph (torch.compile's "reduce-overhead") on CUDA
    with inductor: its pool's tensors are then marked static, its outputs copied out, its buckets warmed twice."""
    return device_type == "cuda" and backend == "inductor"


def decode_compile_mode(device_type: str, backend: str) -> str | None:
    """torch.compile's mode for the compiled decode."""
    return "reduce-overhead" if uses_cuda_graphs(device_type, backend) else None


def rank_device(cuda_available: bool, local_rank: int) -> torch.device:
    """The device a launched rank trains on: its own GPU, or the CPU."""
    return torch.device("cuda", local_rank) if cuda_available else torch.device("cpu")


def cpu_thread_env(env: dict, cores: int, nproc: int) -> dict:
    """The threads each CPU rank runs, as the launcher's environment for them: the cores over the ranks
    (DeepSpeed's --bind_cores_to_rank and vLLM's CPU workers do the same), with OpenMP's idle threads asleep
    instead of spinning (OMP_WAIT_POLICY=PASSIVE), so a machine loaded by other jobs is not made many times
    slower by threads that spin on a core someone else holds (bench/threads.py). What the user set wins."""
    if "OMP_NUM_THREADS" in env:
        return {}
    out = {"OMP_NUM_THREADS": str(max(1, cores // max(1, nproc)))}
    if "OMP_WAIT_POLICY" not in env:
        out["OMP_WAIT_POLICY"] = "PASSIVE"
    return out


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device`: the GPU's free memory, or the RAM the kernel can give without
    swapping (MemAvailable; this process's cgroup limit, if lower)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]

    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read().strip())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, free)


def rng_devices(device_type: str) -> list:
    """The devices whose generators torch.random.fork_rng must save and restore around a compile."""
    return [torch.cuda.current_device()] if device_type == "cuda" else []


def check_device(name: str) -> str:
    """A `--device` that exists here (cpu, cuda, cuda:N, mps), checked before a checkpoint is read."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--device {name}: no CUDA device is available here; use --device cpu")
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: MPS is not available here; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device {name}: looped_lm runs on cpu, cuda or mps")
    return name
