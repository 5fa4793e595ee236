"""Every shipped config starts on this CPU: `looped_lm train --dry-run` checks it, builds its model on the meta
device (the paper-scale ones too), counts its FLOPs and memory, takes the trainer's decisions for CUDA and prints
the launcher command it would run on 8 GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from looped_lm import cli

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def dry_run(capsys, *argv) -> list[str]:
    assert cli.main(["train", *argv, "--dry-run"]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_starts_on_cpu_planned_for_8_gpus(config, capsys):
    raw = yaml.safe_load(config.read_text())
    lines = dry_run(capsys, "--config", str(config.relative_to(ROOT)), "--nproc", "8")
    text = "\n".join(lines)
    assert lines[0].startswith(f"dry run of configs/{config.name}: model.kind {raw['model']['kind']}, on 8 cuda")
    params = int(text.split("  model: ")[1].split(" parameters")[0].replace(",", ""))
    assert params > 10_000
    assert "TFLOP per optimizer step" in text or "no cost model" in text
    assert "GiB per rank" in text
    bf16 = raw.get("deepspeed", {}).get("bf16", False)
    assert f"dist backend nccl, fp32 matmul precision {'high' if bf16 else 'highest'}," in text
    assert "AdamW fused" in text
    compile_on = raw.get("train", {}).get("compile", "auto") in ("auto", "on", True)
    assert f"compile {'on' if compile_on else 'off'}" in text
    assert lines[-1] == f"  launch: deepspeed --num_gpus 8 --master_port 29500 --log_level error --module looped_lm.train " \
                        f"--config configs/{config.name}"


def test_a_paper_config_is_counted_exactly_on_the_meta_device(capsys):
    """gpt at GPT-2 small's shape: nanoGPT's 124M (123.6M with the tied head and no biases), and its FLOPs per
    step equal the cost model's 6N-style count for 12 x 1024 tokens x 40 micro-batches."""
    from looped_lm import cost

    text = "\n".join(dry_run(capsys, "--config", "configs/paper_gpt_owt.yaml", "--nproc", "8"))
    assert "123,587,328 parameters" in text
    shape = cost.Shape(d=768, layers=12, heads=12, vocab=50304, seq=1024, batch=12)
    assert f"{40 * cost.gpt_train(shape).total() / 1e12:,.3f} TFLOP" in text


def test_a_world_the_run_cannot_use_is_refused_in_one_line(capsys):
    """block_parallel puts one block on each rank: 3 ranks for 2 blocks is refused before anything is built."""
    code = cli.main(["train", "--config", "configs/quickstart_db.yaml", "--set", "train.mode=block_parallel",
                     "--set", "diffusion.block_sampling=round_robin", "--nproc", "3", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "block_parallel" in err[0]
