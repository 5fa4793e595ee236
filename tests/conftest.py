"""Shared fixtures: tiny run configs, a session-wide token cache, a clean environment for launchers,
and one tiny trained checkpoint reused by the checkpoint / CLI tests.

`looped_lm.train.train()` writes RANK / WORLD_SIZE / MASTER_* into os.environ when they are absent (a
world of one). An autouse fixture puts those variables back as they were after every test, and
`clean_env` gives subprocesses an environment without them, so a launcher never inherits a stale rank.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

# DeepSpeed's logger binds a StreamHandler to sys.stdout when first imported. Import it now, under
# pytest's session-wide capture, and not inside a test whose capsys stream is closed afterwards
# (later DeepSpeed log calls would then print "--- Logging error ---" tracebacks into other tests' stderr).
import deepspeed  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")

# The smallest run that exercises the whole trainer: 1 layer, width 32, 16-token windows, byte tokens.
BASE_CONFIG = {
    "model": {"kind": "gpt", "n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
    "data": {"source": "bible", "tokenizer": "byte"},
    "train": {"max_steps": 2, "batch_size": 4, "warmup_steps": 0, "save_every": 0, "eval_every": 0,
              "log_every": 1, "progress": False},
}


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@pytest.fixture(autouse=True)
def _restore_dist_env():
    before = {k: os.environ.get(k) for k in DIST_VARS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def clean_env() -> dict:
    """os.environ without any torch.distributed rank variables (for subprocesses and launchers)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One token cache for the whole session: the Bible is tokenized once (~0.5 s), not per test."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def write_config(data_cache):
    """write_config(path, overrides) -> path of a YAML file: BASE_CONFIG + the shared cache + overrides.

    `overrides` must name train.out_dir (a per-test directory)."""

    def write(path: Path, overrides: dict | None = None) -> Path:
        raw = deep_merge(BASE_CONFIG, {"data": {"cache_dir": str(data_cache)}})
        raw = deep_merge(raw, overrides or {})
        assert "out_dir" in raw["train"], "give every test run its own train.out_dir"
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    return write


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, write_config):
    """A 30-step byte-level GPT run on the Bible: (config path, checkpoint dir, out dir)."""
    from looped_lm import trainer

    root = tmp_path_factory.mktemp("tiny_run")
    out = root / "out"
    cfg_path = write_config(root / "run.yaml", {
        "train": {"out_dir": str(out), "max_steps": 30, "batch_size": 8, "lr": 3.0e-3, "warmup_steps": 3}})
    before = {k: os.environ.get(k) for k in DIST_VARS}
    try:
        assert trainer.main(["--config", str(cfg_path)]) == 0
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ckpt = out / "step_0000030"
    assert (ckpt / "manifest.json").is_file()
    return cfg_path, ckpt, out


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _assert_one_line_error(captured, *needles: str) -> str:
    """stderr holds exactly one `error:` line, it is the last line, it names every needle, no traceback."""
    lines = [line for line in captured.err.splitlines() if line.strip()]
    errors = _error_lines(captured.err)
    assert len(errors) == 1, captured.err
    assert lines[-1] == errors[0], captured.err
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="session")
def one_line_error():
    """one_line_error(capsys.readouterr(), *needles) -> the single `error:` line, checked."""
    return _assert_one_line_error


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one intra-op thread, and a busy machine cannot stall its sync points."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_uvicorn(monkeypatch):
    """serve must refuse before it binds: a call to uvicorn.run fails the test."""
    uvicorn = pytest.importorskip("uvicorn")

    def run(*a, **k):
        raise AssertionError("serve started a server although its input should have been refused")
    monkeypatch.setattr(uvicorn, "run", run)
