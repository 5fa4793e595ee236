"""train_step: the one training step the trainer (DeepSpeed) and the benchmarks (plain PyTorch) share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from looped_lm import trainer
from looped_lm.config import load_config
from looped_lm.data.bin_dataset import TokenStream
from looped_lm.models import build_model
from looped_lm.optim import BlockwiseAdamW, adamw_implementation, cosine_with_warmup, param_groups
from looped_lm.training import TorchRunner, train_step

REPO = Path(__file__).resolve().parents[1]


def _torch_run(cfg, data_dir: Path, steps: int) -> list[float]:
    """The trainer's run replayed with train_step + TorchRunner (the benchmarks' path)."""
    t = cfg.train
    stream = TokenStream(str(data_dir / "train.bin"), cfg.model.seq_len)
    torch.manual_seed(t.seed)
    model = build_model(cfg, 257)
    torch.manual_seed(t.seed + 1)  # the trainer's noise seed of rank 0
    opt = BlockwiseAdamW(param_groups(model, t.weight_decay), adamw_implementation("cpu"), lr=t.lr,
                         betas=(t.beta1, t.beta2), eps=1e-8)  # the trainer's implementation on this device
    runner = TorchRunner(model, opt, grad_accum=t.grad_accum, grad_clip=t.grad_clip, seed=t.seed)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_with_warmup(step, t.warmup_steps, t.max_steps, t.lr, t.min_lr)
        batches = [stream.get_batch(t.batch_size, t.seed, step, micro, 0) for micro in range(t.grad_accum)]
        losses.append(float(train_step(model, opt, runner, batches, step, t.seed).loss))
    return losses, model


def test_torch_runner_reproduces_the_deepspeed_trainer(tmp_path, write_config, one_thread):
    """Same step function, two runners: the losses the trainer logs under DeepSpeed (accumulation 2,
    clipping, a DB model training one block per step) are the ones TorchRunner gives."""
    out = tmp_path / "out"
    cfg_path = write_config(tmp_path / "run.yaml", {
        "model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
        "diffusion": {"num_blocks": 2, "block_sampling": "round_robin"},
        "train": {"out_dir": str(out), "max_steps": 4, "grad_accum": 2, "lr": 1.0e-2, "grad_clip": 0.5}})
    assert trainer.main(["--config", str(cfg_path)]) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["loss"], r["block"]) for r in logged if "loss" in r]
    cfg = load_config(str(cfg_path))
    manifest = json.loads((out / "step_0000004" / "manifest.json").read_text())
    losses, model = _torch_run(cfg, Path(manifest["data"]["dir"]), 4)
    assert len({b for _, b in logged}) == 2  # both blocks trained: the active units switched
    for step, ((want, _), got) in enumerate(zip(logged, losses)):
        assert abs(want - got) < 1e-5, (step, want, got)
    from safetensors.torch import load_file

    saved = load_file(str(out / "step_0000004" / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, atol=1e-5, rtol=0)


def test_the_trainer_runs_as_a_file(tmp_path, write_config, clean_env):
    """`python looped_lm/train.py` (what `deepspeed looped_lm/train.py` runs on each rank) works without
    any sys.path edit in the trainer."""
    assert "sys.path" not in (REPO / "looped_lm" / "train.py").read_text()
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(tmp_path / "out"), "max_steps": 1}})
    proc = subprocess.run([sys.executable, str(REPO / "looped_lm" / "train.py"), "--config", str(cfg)],
                          cwd=tmp_path, env=clean_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "step_0000001" / "manifest.json").is_file()
