"""train.max_steps 0: the model as built (a conversion, or the init) written as a weights-only step-0
checkpoint that every verb reads, and that a run resumes from exactly as a fresh run would start."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import DIST_VARS

DB = {"model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
      "diffusion": {"num_blocks": 2, "block_sampling": "uniform"}}


def run(write_config, root, name, **train):
    from looped_lm import trainer

    cfg = write_config(root / f"{name}.yaml", {**DB, "train": {"out_dir": str(root / name), **train}})
    before = {k: os.environ.get(k) for k in DIST_VARS}
    try:
        return trainer.main(["--config", str(cfg)])
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_a_zero_step_run_writes_the_model_as_built_and_a_resume_continues_as_a_fresh_run(tmp_path, write_config,
                                                                                         capsys):
    from looped_lm import cli

    assert run(write_config, tmp_path, "conv", max_steps=0) == 0
    step0 = tmp_path / "conv" / "step_0000000"
    manifest = json.loads((step0 / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors"} and manifest["conversion"] == {"init_from": None}
    assert "weights only" in capsys.readouterr().out
    assert cli.main(["verify", str(step0)]) == 0
    assert "the model as built" in capsys.readouterr().out
    assert cli.main(["eval", "--checkpoint", str(step0), "--max-tokens", "32", "--draws", "1", "--no-progress"]) == 0
    assert cli.main(["generate", "--checkpoint", str(step0), "--prompt", "In", "--max-tokens", "2"]) == 0
    # the same config, 2 steps: resumed from the conversion, and directly; the weights agree bit for bit
    assert run(write_config, tmp_path, "conv", max_steps=2) == 0
    assert "resumed from" in capsys.readouterr().out
    assert run(write_config, tmp_path, "direct", max_steps=2) == 0
    a = load_file(str(tmp_path / "conv" / "step_0000002" / "model.safetensors"))
    b = load_file(str(tmp_path / "direct" / "step_0000002" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    before = load_file(str(step0 / "model.safetensors"))
    assert any(not torch.equal(a[k], before[k]) for k in a), "two steps moved no weight"


@pytest.mark.parametrize("steps", ["-1"])
def test_a_negative_step_count_is_one_line(steps, one_line_error, capsys):
    from looped_lm import cli

    assert cli.main(["train", "--config", "configs/quickstart.yaml", "--set", f"train.max_steps={steps}"]) == 2
    one_line_error(capsys.readouterr(), "train.max_steps must be in 0..", "0 writes the model as built")
