"""What a run checks before it trains (strict resume, out_dir, data: before the launcher starts), and
I/O failures while it trains: each case ends in one line and the right exit code, never a traceback."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from looped_lm import checkpoint as ckpt_io
from looped_lm import tensor_files
from looped_lm import cli
from looped_lm import trainer


def metrics(out: Path, key: str) -> list:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, write_config):
    """A finished 2-step run: its checkpoint is copied into each test's own out_dir."""
    root = tmp_path_factory.mktemp("base_run")
    cfg = write_config(root / "run.yaml", {"train": {"out_dir": str(root / "out")}})
    assert trainer.main(["--config", str(cfg)]) == 0
    return root / "out" / "step_0000002"


def _run_from(base_run, tmp_path, write_config, train=None, data=None):
    """(config path, out_dir): a copy of base_run's checkpoint, and a config that resumes it."""
    out = tmp_path / "out"
    shutil.copytree(base_run, out / base_run.name)
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out), **(train or {})}, **(data or {})})
    return cfg, out


# ------------------------------------------------------------------------------------------------
# strict resume


@pytest.mark.parametrize("name, overrides, needles", [
    ("seed", ["train.seed=7"], ["train.seed 1337 -> 7"]),
    ("batch", ["train.batch_size=8"], ["global batch 4 -> 8 sequences"]),
    ("grad_accum", ["train.grad_accum=2", "train.batch_size=2"], ["train.grad_accum 1 -> 2"]),
    ("data", ["data.val_fraction=0.1"], ["data.val_fraction 0.05 -> 0.1"]),
    ("all at once", ["train.seed=7", "train.batch_size=8"], ["train.seed 1337 -> 7", "global batch 4 -> 8"]),
])
def test_resume_refuses_changes_with_the_list(base_run, tmp_path, write_config, capsys, one_line_error,
                                              name, overrides, needles):
    cfg, out = _run_from(base_run, tmp_path, write_config, {"max_steps": 3})
    argv = ["--config", str(cfg)] + [a for o in overrides for a in ("--set", o)]
    assert trainer.main(argv) == 2
    one_line_error(capsys.readouterr(), "cannot resume", *needles, "train.resume_changes: allow")
    assert sorted(p.name for p in out.iterdir()) == ["step_0000002"]


def test_allowed_changes_are_logged_and_tokens_stay_right(base_run, tmp_path, write_config, capsys):
    cfg, out = _run_from(base_run, tmp_path, write_config, {"max_steps": 3, "resume_changes": "allow"})
    assert trainer.main(["--config", str(cfg), "--set", "train.batch_size=8"]) == 0
    printed = capsys.readouterr().out
    assert "note: resuming with changes (train.resume_changes: allow): global batch 4 -> 8" in printed
    saved = 2 * 4 * 16  # two steps of 4 sequences of 16 tokens, then one of 8
    assert metrics(out, "tokens") == [(3, saved + 8 * 16)]
    assert metrics(out, "resume_changes") == [(2, ["global batch 4 -> 8 sequences (batch_size x grad_accum x world size)"])]
    manifest = json.loads((out / "step_0000003" / "manifest.json").read_text())
    assert manifest["data"]["position"]["tokens_seen"] == saved + 8 * 16


@pytest.mark.parametrize("max_steps", [1, 2])
def test_max_steps_at_or_below_the_checkpoint_says_so(base_run, tmp_path, write_config, capsys, max_steps):
    cfg, out = _run_from(base_run, tmp_path, write_config, {"max_steps": max_steps})
    assert trainer.main(["--config", str(cfg)]) == 0
    assert f"nothing to train: {out / 'step_0000002'} is at step 2 and train.max_steps is {max_steps}" in \
        capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["step_0000002"]


def test_resume_from_a_run_directory(base_run, tmp_path, write_config, capsys):
    """train.resume may name another run's out_dir: its newest complete checkpoint."""
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(tmp_path / "new"), "max_steps": 3,
                                                         "resume": str(base_run.parent)}})
    assert trainer.main(["--config", str(cfg)]) == 0
    captured = capsys.readouterr()
    assert f"checkpoint: {base_run}" in captured.err and f"resumed from {base_run} at step 2" in captured.out


# ------------------------------------------------------------------------------------------------
# out_dir and I/O


def test_out_dir_problems_are_one_line(tmp_path, write_config, capsys, one_line_error, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, needles in ((afile, ["train.out_dir", "is a file, not a directory"]),
                         (afile / "sub", ["train.out_dir", "not writable", "Not a directory"])):
        cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out)}})
        assert trainer.main(["--config", str(cfg)]) == 2
        one_line_error(capsys.readouterr(), str(out), *needles)
    # a read-only file system (as root, permissions do not stop writes: the OS error is injected)
    real = Path.write_bytes

    def read_only(self, data):
        if self.name.startswith(".write-test"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(tmp_path / "ro")}})
    assert trainer.main(["--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), "train.out_dir", "not writable", "Read-only file system")


@pytest.mark.parametrize("where, exc", [
    ("weights", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
    ("rng", RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                         "data/0: file write failed")),
])
def test_a_failed_save_is_one_line_and_leaves_no_temp_dir(tmp_path, write_config, capsys, one_line_error,
                                                          monkeypatch, where, exc):
    """A full disk during a save (injected where safetensors or torch.save write): exit 1, the path and
    the OS reason, the temp directory removed, the previous checkpoint intact."""
    calls = {"n": 0}
    target = {"weights": "save_weights", "rng": "write_rank_files"}[where]
    real = getattr(tensor_files, target)

    def fail_second(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise exc
        return real(*args, **kw)

    monkeypatch.setattr(tensor_files, target, fail_second)
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out), "max_steps": 2, "save_every": 1}})
    assert trainer.main(["--config", str(cfg)]) == 1
    line = one_line_error(capsys.readouterr(), f"cannot write checkpoint {out / '.tmp-step_0000002'}")
    assert ("No space left on device" if where == "weights" else "file write failed") in line
    assert sorted(p.name for p in out.iterdir() if "step" in p.name) == ["step_0000001"]
    ckpt_io.load_checkpoint(out / "step_0000001")


def test_a_read_only_disk_mid_run_is_one_line(tmp_path, write_config, capsys, one_line_error, monkeypatch):
    real = trainer.MetricsLogger.log

    def log(self, step, values):
        if step == 2:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self.path))
        return real(self, step, values)

    monkeypatch.setattr(trainer.MetricsLogger, "log", log)
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out)}})
    assert trainer.main(["--config", str(cfg)]) == 1
    one_line_error(capsys.readouterr(), "I/O failure on", "metrics.jsonl", "Read-only file system")


# ------------------------------------------------------------------------------------------------
# `looped_lm train` checks before it starts the launcher


@pytest.fixture
def no_launcher(monkeypatch):
    """Fail the test if `looped_lm train` would start a process."""
    import subprocess

    def refuse(*args, **kw):
        raise AssertionError(f"the launcher was started: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_cli_train_checks_data_and_checkpoints_before_the_launcher(base_run, tmp_path, write_config, capsys,
                                                                   one_line_error, no_launcher):
    missing = tmp_path / "nope.txt"
    cfg = write_config(tmp_path / "data.yaml", {"data": {"source": "files", "path": str(missing)},
                                                "train": {"out_dir": str(tmp_path / "o1")}})
    assert cli.main(["train", "--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), "does not exist", "nope.txt")

    cfg, out = _run_from(base_run, tmp_path, write_config, {"max_steps": 3})
    assert cli.main(["train", "--config", str(cfg), "--set", "train.seed=3"]) == 2
    one_line_error(capsys.readouterr(), "train.seed 1337 -> 3")
    rng = out / "step_0000002" / "rng" / "rank0.pt"
    data = bytearray(rng.read_bytes())
    data[100] ^= 1
    rng.write_bytes(bytes(data))
    assert cli.main(["train", "--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), "cannot resume", "rank0.pt", "corrupted")


def test_cli_train_refuses_an_empty_test_split_before_the_launcher(tmp_path, write_config, capsys, one_line_error,
                                                                   no_launcher):
    """A held-out test split that would get no document is one line naming it, and nothing is launched."""
    corpus = tmp_path / "two.jsonl"
    corpus.write_text('{"text": "first document"}\n{"text": "second document"}\n')
    cfg = write_config(tmp_path / "t.yaml", {
        "data": {"source": "files", "path": str(corpus), "val_fraction": 0.3, "test_fraction": 0.3},
        "train": {"out_dir": str(tmp_path / "o")}})
    assert cli.main(["train", "--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), "split of", "got no document (2 documents")
    assert not (tmp_path / "o").exists()
