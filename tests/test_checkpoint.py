"""Checkpoints: bit-exact round trips, the manifest, refusal of damaged checkpoints, atomic saves, pruning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from looped_lm import checkpoint as ckpt_io
from looped_lm import train as trainer
from looped_lm.config import load_config
from looped_lm.errors import UserError


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, write_config):
    """A 2-step run saving after each step: (config path, out dir)."""
    root = tmp_path_factory.mktemp("two_step")
    out = root / "out"
    cfg_path = write_config(root / "run.yaml", {"train": {"out_dir": str(out), "save_every": 1, "keep_last": 5,
                                                          "lr": 1.0e-2}})
    assert trainer.main(["--config", str(cfg_path)]) == 0
    return cfg_path, out


def test_checkpoint_layout(two_step_run):
    _, out = two_step_run
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000001", "step_0000002"]
    ckpt = out / "step_0000002"
    for rel in ("model.safetensors", "manifest.json", "rng/rank0.pt", "optimizer/ds/mp_rank_00_model_states.pt"):
        assert (ckpt / rel).is_file(), rel
    assert not list(out.glob(".tmp-*"))


def test_load_checkpoint_round_trips_weights_bit_exactly(two_step_run, tmp_path):
    _, out = two_step_run
    ckpt = out / "step_0000002"
    model, cfg, manifest = ckpt_io.load_checkpoint(ckpt)
    assert not model.training and manifest["step"] == 2
    on_disk = load_file(str(ckpt / "model.safetensors"))
    state = model.state_dict()
    assert set(on_disk) == set(state)
    for name, tensor in on_disk.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(state[name], tensor), name
    # the weights are those DeepSpeed's engine held at the same step (its own module state file)
    ds = torch.load(ckpt / "optimizer" / "ds" / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")
    module = {k.removeprefix("model."): v for k, v in ds["module"].items()}
    assert set(module) == set(state)
    for name, tensor in module.items():
        assert torch.equal(state[name], tensor), name
    # the two checkpoints differ (training moved the weights), so equality above is not vacuous
    older, _, _ = ckpt_io.load_checkpoint(out / "step_0000001")
    assert not torch.equal(older.state_dict()["tok_emb.weight"], state["tok_emb.weight"])
    # save -> load of a state dict is exact too
    path = tmp_path / "again.safetensors"
    from safetensors.torch import save_file

    save_file(ckpt_io.state_dict_for_save(model), str(path))
    again = load_file(str(path))
    assert all(torch.equal(again[k], state[k]) for k in state)
    # and the loaded model computes what the saved weights compute
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    model2, _, _ = ckpt_io.load_checkpoint(ckpt)
    with torch.no_grad():
        assert torch.equal(model(x)[0], model2(x)[0])


def test_manifest_contents(two_step_run):
    cfg_path, out = two_step_run
    ckpt = out / "step_0000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 2
    assert manifest["tokenizer"] == "byte" and manifest["vocab_size"] == 257 and manifest["model_kind"] == "gpt"
    assert manifest["weights_sha256"] == ckpt_io.sha256_file(ckpt / "model.safetensors")
    assert manifest["config"] == load_config(str(cfg_path)).to_dict()
    assert manifest["data"]["position"] == {"step": 2, "tokens_seen": 2 * 4 * 16}
    assert (Path(manifest["data"]["dir"]) / "val.bin").is_file()
    assert manifest["world_size"] == 1 and manifest["format_version"] == 1
    assert "looped_lm_version" in manifest


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / ckpt.name
    shutil.copytree(ckpt, dst)
    return dst


def test_flipped_byte_is_refused(two_step_run, tmp_path):
    ckpt = _copy(two_step_run[1] / "step_0000002", tmp_path)
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, inside a tensor: safetensors itself would not notice
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupted") as err:
        ckpt_io.load_checkpoint(ckpt)
    assert "model.safetensors" in str(err.value)


def test_truncated_weights_are_refused(two_step_run, tmp_path):
    ckpt = _copy(two_step_run[1] / "step_0000002", tmp_path)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(UserError, match="truncated"):
        ckpt_io.load_checkpoint(ckpt)
    weights.unlink()
    with pytest.raises(UserError, match="model.safetensors is missing"):
        ckpt_io.load_checkpoint(ckpt)


def test_missing_or_damaged_manifest_is_refused(two_step_run, tmp_path):
    ckpt = _copy(two_step_run[1] / "step_0000002", tmp_path)
    manifest = ckpt / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(UserError, match="manifest.json is corrupted"):
        ckpt_io.load_checkpoint(ckpt)
    manifest.write_text(json.dumps({k: v for k, v in json.loads(text).items() if k != "weights_sha256"}))
    with pytest.raises(UserError, match="incomplete: no 'weights_sha256'"):
        ckpt_io.load_checkpoint(ckpt)
    manifest.unlink()
    with pytest.raises(UserError, match="manifest.json is missing"):
        ckpt_io.load_checkpoint(ckpt)
    assert ckpt_io.latest_checkpoint(tmp_path) is None  # a directory without a manifest is not a checkpoint


def test_missing_directory_is_refused(tmp_path):
    with pytest.raises(UserError, match="checkpoint directory not found"):
        ckpt_io.load_checkpoint(tmp_path / "step_0000099")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        ckpt_io.load_checkpoint(tmp_path / "file")


def test_half_written_checkpoints_are_ignored(two_step_run, tmp_path, write_config, capsys):
    """A crash mid-save leaves `.tmp-step_*` (or a step dir without manifest): never picked for resume."""
    cfg_path, out = two_step_run
    run = tmp_path / "out"
    shutil.copytree(out / "step_0000002", run / "step_0000002")
    shutil.copytree(out / "step_0000002", run / ".tmp-step_0000009")  # complete-looking, but never renamed
    shutil.copytree(out / "step_0000001", run / ".tmp-step_0000003")  # a crashed earlier save of step 3
    (run / ".tmp-step_0000003" / "stale.txt").write_text("left by a crash")
    (run / "step_0000010").mkdir()  # renamed without a manifest (cannot happen, but must not count)
    (run / "step_0000010" / "model.safetensors").write_bytes(b"junk")
    assert ckpt_io.latest_checkpoint(run) == run / "step_0000002"
    assert [p.name for p in ckpt_io.list_checkpoints(run)] == ["step_0000002"]
    # auto-resume picks step 2 and a new save of the same step number replaces the stale temp dir
    cfg2 = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(run), "max_steps": 3, "lr": 1.0e-2}})
    assert trainer.main(["--config", str(cfg2)]) == 0
    assert f"resumed from {run / 'step_0000002'} at step 2" in capsys.readouterr().out
    assert ckpt_io.latest_checkpoint(run) == run / "step_0000003"
    assert json.loads((run / "step_0000003" / "manifest.json").read_text())["step"] == 3
    assert not (run / "step_0000003" / "stale.txt").exists() and not (run / ".tmp-step_0000003").exists()
    ckpt_io.load_checkpoint(run / "step_0000003")  # hash verified


def test_keep_last_prunes_old_checkpoints(tmp_path, write_config):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out), "max_steps": 4, "save_every": 1,
                                                         "keep_last": 2}})
    assert trainer.main(["--config", str(cfg)]) == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", ".tmp"))) == \
        ["step_0000003", "step_0000004"]


def test_finalize_is_atomic_and_prunes(tmp_path):
    """finalize() on a prepared temp dir: the step dir appears complete or not at all; keep_last holds."""
    from looped_lm.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(1, 32, 2, 16, 257)
    cfg = load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"])
    for step in (1, 2, 3):
        tmp = ckpt_io.tmp_dir_for(tmp_path, step)
        tmp.mkdir(parents=True)
        assert ckpt_io.latest_checkpoint(tmp_path) == (tmp_path / ckpt_io.step_dir_name(step - 1) if step > 1 else None)
        final = ckpt_io.finalize(tmp_path, step, model,
                                 {"config": cfg.to_dict(), "vocab_size": 257, "tokenizer": "byte"}, keep_last=2)
        assert final == tmp_path / f"step_{step:07d}" and not tmp.exists()
    assert [p.name for p in ckpt_io.list_checkpoints(tmp_path)] == ["step_0000002", "step_0000003"]
    loaded, _, _ = ckpt_io.load_checkpoint(tmp_path / "step_0000003")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
