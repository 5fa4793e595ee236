"""Edges that need a training loop or a trained checkpoint: a non-finite step never reaches a save
(stop in one line naming the step, or skip within train.skip_nonfinite), pruning never removes the
newest finite checkpoint, and weights that hold NaN / Inf, or were rewritten in another dtype, or a
manifest whose world_size disagrees with its files, are refused by every verb that loads a checkpoint
(even with every hash recomputed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from looped_lm import checkpoint as ckpt_io
from looped_lm import cli
from looped_lm import trainer
from looped_lm.training import TrainingModule
from test_manifest_agreement import _verbs


def _steps(out: Path) -> list[int]:
    return [ckpt_io.step_of(p) for p in ckpt_io.list_checkpoints(out)]


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / ckpt_io.WEIGHTS))


@pytest.fixture
def poison(monkeypatch):
    """poison(steps, how): the training loss of those steps (0-based, as the loop counts) is NaN ("loss"),
    or finite with an infinite gradient ("grad")."""

    class InfGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g * float("inf")

    def set_(steps, how="loss"):
        real = TrainingModule.forward

        def forward(self, x, y, step):
            loss = real(self, x, y, step)
            if step not in steps:
                return loss
            return loss * float("nan") if how == "loss" else InfGrad.apply(loss)
        monkeypatch.setattr(TrainingModule, "forward", forward)
    return set_


def _train(write_config, root: Path, **train) -> int:
    cfg = write_config(root / "run.yaml", {"train": {"out_dir": str(root / "out"), **train}})
    return trainer.main(["--config", str(cfg)])


# --- A1, A2: a non-finite step never reaches a save -------------------------------------------------


def test_a_nan_loss_stops_the_run_in_one_line_and_keeps_the_last_finite_checkpoint(
        tmp_path, write_config, poison, capsys, one_line_error):
    poison({2})  # the third step (done = 3)
    assert _train(write_config, tmp_path, max_steps=4, save_every=2, keep_last=1) == 1
    one_line_error(capsys.readouterr(), "step 3: loss is nan", "train.skip_nonfinite")
    out = tmp_path / "out"
    assert _steps(out) == [2]  # nothing after the bad step was saved
    assert all(torch.isfinite(t).all() for t in _weights(out / "step_0000002").values())
    assert not list(out.glob(".tmp-*"))


def test_an_infinite_gradient_with_a_finite_loss_stops_the_run(tmp_path, write_config, poison, capsys,
                                                             one_line_error):
    poison({1}, how="grad")
    assert _train(write_config, tmp_path, max_steps=3) == 1
    one_line_error(capsys.readouterr(), "step 2: gradient norm is", "before any save")
    assert _steps(tmp_path / "out") == []


def test_skip_nonfinite_skips_the_update_counts_and_logs_it(tmp_path, write_config, poison, capsys):
    poison({2})
    assert _train(write_config, tmp_path, max_steps=4, save_every=1, keep_last=10, skip_nonfinite=1) == 0
    out = tmp_path / "out"
    assert _steps(out) == [1, 2, 3, 4]
    before, after = _weights(out / "step_0000002"), _weights(out / "step_0000003")
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update at all (no weight decay either)
    assert not all(torch.equal(after[k], v) for k, v in _weights(out / "step_0000004").items())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if "skipped_nonfinite" in r]
    assert [(r["step"], r["skipped_nonfinite"]) for r in skipped] == [(3, 1)]
    assert "loss is nan" in skipped[0]["nonfinite"]
    assert not any(r["step"] == 3 and "loss" in r for r in records)  # no NaN in the loss curve
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 3: loss is nan")]
    assert len(said) == 1 and "skipped, no update (1 of train.skip_nonfinite 1)" in said[0], said


def test_skip_nonfinite_stops_when_the_budget_is_spent(tmp_path, write_config, poison, capsys, one_line_error):
    poison({1, 2})
    assert _train(write_config, tmp_path, max_steps=4, skip_nonfinite=1) == 1
    one_line_error(capsys.readouterr(), "step 3: loss is nan", "1 non-finite step skipped already")


def test_weights_made_non_finite_by_an_update_are_not_saved(tmp_path, write_config, monkeypatch, capsys,
                                                             one_line_error):
    from looped_lm.optim import BlockwiseAdamW

    real, calls = BlockwiseAdamW.step, []

    def step(self, closure=None):
        result = real(self, closure)
        calls.append(1)
        if len(calls) == 3:  # finite loss and gradient, but an update that overflows the weights
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("inf"))
        return result
    monkeypatch.setattr(BlockwiseAdamW, "step", step)
    assert _train(write_config, tmp_path, max_steps=4, save_every=1, keep_last=1) == 1
    one_line_error(capsys.readouterr(), "step 3: the weights hold NaN or Inf", "not saved", "step_0000002")
    assert _steps(tmp_path / "out") == [2]


def test_finalize_refuses_non_finite_weights_and_prunes_nothing(tiny_run, tmp_path):
    """keep_last 1: a save of NaN weights would have pruned the only finite checkpoint."""
    from looped_lm.models import build_model

    _, src, _ = tiny_run
    out = tmp_path / "out"
    shutil.copytree(src, out / src.name)
    manifest = ckpt_io.read_manifest(out / src.name)
    cfg = ckpt_io.config_of(manifest)
    model = build_model(cfg, manifest["vocab_size"])
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    ckpt_io.tmp_dir_for(out, 31).mkdir()
    with pytest.raises(ckpt_io.UserError, match="NaN or Inf"):
        ckpt_io.finalize(out, 31, model, {"config": manifest["config"]}, keep_last=1)
    assert _steps(out) == [30]


# --- A3, A4: loads refuse NaN weights, another dtype, a world_size that contradicts the files ---------


def _forge(src: Path, root: Path, weights=None, manifest_edit=None) -> Path:
    """A copy of a checkpoint with its weights rewritten (weights(tensors) edits them in place) and/or its
    manifest edited, every hash recomputed as the code writes them."""
    from safetensors.torch import save_file

    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    ckpt = out / src.name
    shutil.copytree(src, ckpt)
    manifest = json.loads((ckpt / ckpt_io.MANIFEST).read_text())
    if weights is not None:
        tensors = _weights(ckpt)
        weights(tensors)
        save_file(tensors, str(ckpt / ckpt_io.WEIGHTS), metadata={"format": "looped_lm"})
        manifest["files"][ckpt_io.WEIGHTS] = {"size": (ckpt / ckpt_io.WEIGHTS).stat().st_size,
                                              "sha256": ckpt_io.sha256_file(ckpt / ckpt_io.WEIGHTS)}
    if manifest_edit is not None:
        manifest_edit(manifest)
    manifest["manifest_sha256"] = ckpt_io.manifest_digest(manifest)
    (ckpt / ckpt_io.MANIFEST).write_text(json.dumps(manifest, indent=2))
    return ckpt


def _nan(tensors):
    tensors["norm.weight"][0] = float("nan")


def _inf(tensors):
    tensors["tok_emb.weight"][3, 1] = float("-inf")


def _fp16(tensors):
    tensors["norm.weight"] = tensors["norm.weight"].half()


def _int64(tensors):
    tensors["norm.weight"] = tensors["norm.weight"].long()


def _fp16_and_record(m):
    m["weights_dtypes"]["norm.weight"] = "F16"


FORGERIES = {  # name: (weights edit, manifest edit, fragments of the one line)
    "NaN": (_nan, None, ["norm.weight with NaN or Inf values"]),
    "-Inf": (_inf, None, ["tok_emb.weight with NaN or Inf values"]),
    "fp16": (_fp16, None, ["norm.weight as F16", "manifest records F32"]),
    "int64": (_int64, None, ["norm.weight as I64", "manifest records F32"]),
    "fp16, record rewritten too": (_fp16, _fp16_and_record, ["norm.weight as F16", "model in its manifest has F32"]),
    "world_size 2, one rank's RNG": (None, lambda m: m.update(world_size=2), ["'world_size' is 2", "1 rank"]),
    "world_size 0": (None, lambda m: m.update(world_size=0), ["'world_size' must be >= 1"]),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_every_verb_refuses_forged_weights(name, tiny_run, tmp_path, capsys, one_line_error, no_uvicorn):
    cfg, src, _ = tiny_run
    weights, edit, fragments = FORGERIES[name]
    ckpt = _forge(src, tmp_path, weights, edit)
    for verb, argv in _verbs(ckpt, tmp_path, cfg, resume_to=31).items():
        capsys.readouterr()
        code = cli.main(argv)
        err = capsys.readouterr()
        assert code == 2, (name, verb, err)
        one_line_error(err, *fragments)
        assert not (tmp_path / "hf").exists() and not (tmp_path / "merged").exists(), verb
        assert _steps(ckpt.parent) == [30], verb  # resume wrote nothing


def test_a_resume_on_another_world_size_is_said_not_silent(tiny_run, tmp_path):
    """A world size that agrees with the files, on a run of another size: allowed (the optimizer state is
    stored by parameter name), and the note says so."""
    from looped_lm.config import load_config
    from looped_lm.preflight import preflight

    cfg_path, src, _ = tiny_run
    ckpt = _forge(src, tmp_path)
    cfg = load_config(str(cfg_path), [f"train.out_dir={ckpt.parent}", "train.max_steps=31",
                                      "train.resume_changes=allow"])
    plan = preflight(cfg, world_size=2)
    assert any("world size 1 -> 2" in n and "re-sharded" in n for n in plan.notes), plan.notes


# --- E: a disk full at launch is one line, no TensorBoard thread traceback ------------------------------


def test_a_disk_full_at_launch_is_one_line_without_a_tensorboard_traceback(tmp_path, write_config, monkeypatch,
                                                                          capfd, one_line_error):
    """TensorBoard's first write (the file header, from its own thread) already fails: the run stops with
    one line naming the directory, and neither that thread nor the closing of the logs adds a traceback."""
    import errno
    import threading

    from tensorboard.summary.writer import record_writer

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # as in a fresh process
    assert _train(write_config, tmp_path, max_steps=2) == 1
    captured = capfd.readouterr()
    one_line_error(captured, f"{tmp_path / 'out' / 'tb'}", "No space left on device")
    assert "Exception in thread" not in captured.err
