"""What the trainer and the engine decide on a GPU, decided on this CPU: the pure policy functions of
looped_lm/devices.py called with "cuda", and the code behind CUDA checks run here with the check taken (a stub
records the CUDA-only calls that have no CPU meaning)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from looped_lm import compile as lc
from looped_lm import devices
from looped_lm import trainer
from looped_lm.engine import compiled
from looped_lm.engine.engine import Engine, Request
from looped_lm.sampling import GREEDY, SamplingParams
from tiny_models import build_tiny


def test_the_decisions_taken_on_a_gpu():
    assert devices.dist_backend("cuda") == "nccl" and devices.dist_backend("cpu") == "gloo"
    assert devices.fp32_matmul_precision("cuda", bf16=True) == "high"  # TF32 beside bf16, as nanoGPT
    assert devices.fp32_matmul_precision("cuda", bf16=False) == "highest"  # fp32 runs stay fp32
    assert devices.fp32_matmul_precision("cpu", bf16=True) == "highest"
    assert devices.adamw_implementation("cuda") == "fused" and devices.adamw_implementation("cpu") == "foreach"
    assert devices.compile_enabled("auto", "cuda") and not devices.compile_enabled("auto", "cpu")
    assert devices.compile_enabled("on", "cpu") and not devices.compile_enabled("off", "cuda")
    assert devices.decode_compile_mode("cuda", "inductor") == "reduce-overhead"
    assert devices.decode_compile_mode("cuda", "aot_eager") is None  # CUDA graphs are inductor's
    assert devices.decode_compile_mode("cpu", "inductor") is None
    assert devices.rank_device(True, 3) == torch.device("cuda", 3)
    assert devices.rank_device(False, 3) == torch.device("cpu")


def test_the_rng_of_a_gpu_is_forked_around_a_compile(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert devices.rng_devices("cuda") == [5] and devices.rng_devices("cpu") == []


def test_a_rank_with_a_gpu_joins_over_nccl_on_its_own_device(monkeypatch):
    """init_distributed's CUDA branch, taken on this CPU: NCCL, the rank's GPU set, no CPU accelerator forced."""
    import deepspeed

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.setdefault("backend", kw["dist_backend"]))
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv(trainer.RENDEZVOUS_FILE, raising=False)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    assert trainer.init_distributed() == torch.device("cuda", 1)
    assert seen == {"backend": "nccl", "set_device": torch.device("cuda", 1)}
    import os

    assert "DS_ACCELERATOR" not in os.environ


def test_the_trainer_sets_the_matmul_precision_its_device_asks_for(tmp_path, write_config, monkeypatch):
    """train() runs the precision decision on every device (a NameError here once killed every bf16 GPU run at
    start-up), and `--set train.compile=on` (YAML reads `on` as true) trains compiled."""
    seen, compiled_runs = [], []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", seen.append)
    monkeypatch.setattr(lc, "BACKEND", "aot_eager")
    from looped_lm.trainer import run as trainer_run

    compile_for_training = lc.compile_for_training
    monkeypatch.setattr(trainer_run, "compile_for_training", lambda *a: compiled_runs.append(1) or compile_for_training(*a))
    cfg = write_config(tmp_path / "run.yaml", {
        "model": {"kind": "gpt", "n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": 8},
        "train": {"out_dir": str(tmp_path / "out"), "max_steps": 1, "batch_size": 2}})
    assert trainer.main(["--config", str(cfg), "--set", "train.compile=on"]) == 0
    assert seen == ["highest"] and compiled_runs == [1]
    assert (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_compiled_decode_takes_its_cuda_graph_path_on_this_cpu(monkeypatch, fresh_dynamo):
    """With CUDA graphs on (forced here): the pool's tensors are marked static, each bucket is warmed twice (a
    CUDA graph is recorded on its second call), outputs are copied out of the graph's memory; the tokens equal
    the eager engine's."""
    counter = CompileCounter()
    monkeypatch.setattr(compiled, "BACKEND", counter)
    monkeypatch.setattr(devices, "uses_cuda_graphs", lambda device_type, backend: True)
    monkeypatch.setattr(devices, "decode_compile_mode", lambda device_type, backend: None)
    static = []
    monkeypatch.setattr(torch._dynamo, "mark_static_address", static.append)
    model = build_tiny("gpt").eval()
    requests = lambda: [Request(prompt=[1, 2, 3 + i], max_tokens=5, seed=i,
                                sampling=GREEDY if i % 2 else SamplingParams(temperature=0.9)) for i in range(3)]
    eager = [o.token_ids for o in Engine(model, num_slots=4, max_len=32).run(requests())]
    engine = Engine(model, num_slots=4, max_len=32, compile_decode=True)
    runner = engine.runner.compiled
    assert runner.cuda_graphs and static  # every tensor of the pool
    step, calls = runner.step, []
    monkeypatch.setattr(runner, "step", lambda *a: calls.append(1) or step(*a))
    runner.warm_up()
    assert len(calls) == 2 * len(runner.buckets)
    outs = engine.run(requests())
    assert [o.token_ids for o in outs] == eager


def test_cpu_ranks_get_the_cores_over_the_ranks_with_idle_threads_asleep():
    assert devices.cpu_thread_env({}, cores=2, nproc=1) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    assert devices.cpu_thread_env({}, cores=2, nproc=2)["OMP_NUM_THREADS"] == "1"
    assert devices.cpu_thread_env({}, cores=2, nproc=3)["OMP_NUM_THREADS"] == "1"
    assert devices.cpu_thread_env({"OMP_NUM_THREADS": "4"}, cores=2, nproc=1) == {}  # the user's setting wins
    assert devices.cpu_thread_env({"OMP_WAIT_POLICY": "ACTIVE"}, cores=8, nproc=2) == {"OMP_NUM_THREADS": "4"}


def test_the_train_verb_hands_its_cpu_ranks_their_threads(tmp_path, write_config, monkeypatch):
    from looped_lm import cli, launch

    seen = {}
    monkeypatch.setattr(launch, "run_launcher", lambda cmd, env, verbose=False: seen.update(cmd=cmd, env=env) or 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = write_config(tmp_path / "run.yaml", {
        "model": {"kind": "gpt", "n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": 8},
        "train": {"out_dir": str(tmp_path / "out"), "max_steps": 1, "batch_size": 2}})
    assert cli.main(["train", "--config", str(cfg), "--nproc", "2"]) == 0
    import os

    cores = len(os.sched_getaffinity(0))
    assert seen["env"]["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert seen["env"]["OMP_WAIT_POLICY"] == "PASSIVE" and seen["env"]["DS_ACCELERATOR"] == "cpu"
    assert seen["cmd"][seen["cmd"].index("--num_gpus") + 1] == "2"


def test_a_cuda_device_flag_is_checked_against_the_gpus_there(monkeypatch):
    """--device cuda / cuda:N on a machine without GPUs, with 2 GPUs (stubbed), and an index past them."""
    from looped_lm.devices import check_device
    from looped_lm.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no CUDA device is available here; use --device cpu"):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1" and check_device("cuda") == "cuda"
    with pytest.raises(UserError, match=r"this machine has 2 CUDA device\(s\) \(cuda:0..cuda:1\)"):
        check_device("cuda:2")
    with pytest.raises(UserError, match="looped_lm runs on cpu, cuda or mps"):
        check_device("meta")


@pytest.mark.parametrize("name, dtype, tflops", [("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
                                                 ("NVIDIA A100-SXM4-40GB", torch.float32, 156.0),
                                                 ("NVIDIA GeForce RTX 4090", torch.bfloat16, 0.0)])
def test_the_peak_of_a_known_gpu_comes_from_the_table(monkeypatch, name, dtype, tflops):
    from looped_lm.mfu import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), dtype) == tflops * 1e12
    assert peak_flops(torch.device("cuda", 0), dtype, override_tflops=100.0) == 100e12


def test_a_gpu_machine_measures_memory_against_its_smallest_gpu(monkeypatch):
    from types import SimpleNamespace

    from looped_lm import preflight

    sizes = {0: 80 * 2 ** 30, 1: 40 * 2 ** 30}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=sizes[i]))
    assert preflight.memory_limit() == (40 * 2 ** 30, "memory of one GPU")
