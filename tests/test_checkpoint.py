"""Checkpoints: bit-exact round trips, the manifest's integrity record, refusal of damaged checkpoints
(every file, every manifest field), atomic saves, pruning, run directories."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from looped_lm import checkpoint as ckpt_io
from looped_lm import cli
from looped_lm import trainer
from looped_lm.config import load_config
from looped_lm.errors import UserError
from looped_lm.tensor_files import save_weights


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, write_config):
    """A 2-step run saving after each step: (config path, out dir)."""
    root = tmp_path_factory.mktemp("two_step")
    out = root / "out"
    cfg_path = write_config(root / "run.yaml", {"train": {"out_dir": str(out), "save_every": 1, "keep_last": 5,
                                                          "lr": 1.0e-2}})
    assert trainer.main(["--config", str(cfg_path)]) == 0
    return cfg_path, out


def test_checkpoint_layout_and_integrity_record(two_step_run):
    _, out = two_step_run
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000001", "step_0000002"]
    ckpt = out / "step_0000002"
    for rel in ("model.safetensors", "manifest.json", "rng/rank0.pt", "optimizer/shared.safetensors"):
        assert (ckpt / rel).is_file(), rel
    assert not list(out.glob(".tmp-*"))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [f for f in on_disk if f != "manifest.json"]  # every file, listed
    for rel, rec in manifest["files"].items():
        assert rec == {"size": (ckpt / rel).stat().st_size, "sha256": ckpt_io.sha256_file(ckpt / rel)}
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    import hashlib

    want = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert manifest["manifest_sha256"] == want


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
    # the optimizer state is kept under the same names: both moments of every parameter, at step 2
    step, moments = ckpt_io.read_unit_state(ckpt, "shared")
    assert step == 2
    assert set(moments) == {f"{k}/{n}" for n, _ in model.named_parameters() for k in ("exp_avg", "exp_avg_sq")}
    assert all(moments[f"exp_avg_sq/{n}"].shape == p.shape and bool(moments[f"exp_avg_sq/{n}"].gt(0).any())
               for n, p in model.named_parameters())
    # the two checkpoints differ (training moved the weights), so equality above is not vacuous
    older, _, _ = ckpt_io.load_checkpoint(out / "step_0000001")
    assert not torch.equal(older.state_dict()["tok_emb.weight"], state["tok_emb.weight"])
    # save -> load of a model is exact too
    path = tmp_path / "again.safetensors"
    save_weights(model, path)
    again = load_file(str(path))
    assert all(torch.equal(again[k], state[k]) for k in state)
    # and the loaded model computes what the saved weights compute
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    model2, _, _ = ckpt_io.load_checkpoint(ckpt)
    with torch.no_grad():
        assert torch.equal(model(x)[0], model2(x)[0])


def test_tied_and_flat_buffer_weights_round_trip(tmp_path):
    """Tied tensors are stored once and restored as one; parameters that are views of one flat buffer
    (what ZeRO 1/2 make of them) are saved whole."""
    from safetensors.torch import load_model

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    model = Tied()
    save_weights(model, tmp_path / "tied.safetensors")
    assert len(load_file(str(tmp_path / "tied.safetensors"))) == 1
    fresh = Tied()
    load_model(fresh, str(tmp_path / "tied.safetensors"))
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, model.emb.weight)

    flat_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    flat = torch.cat([p.detach().flatten() for p in flat_model.parameters()])
    offset = 0
    for p in flat_model.parameters():
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    save_weights(flat_model, tmp_path / "flat.safetensors")
    saved = load_file(str(tmp_path / "flat.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in flat_model.state_dict().items())
    assert flat_model[0].weight.data_ptr() == flat.data_ptr()  # the model itself was left as it was


def test_manifest_contents(two_step_run):
    cfg_path, out = two_step_run
    ckpt = out / "step_0000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 2
    assert manifest["tokenizer"] == "byte" and manifest["vocab_size"] == 257 and manifest["model_kind"] == "gpt"
    assert manifest["config"] == load_config(str(cfg_path)).to_dict()
    assert manifest["data"]["position"] == {"step": 2, "tokens_seen": 2 * 4 * 16}
    assert (Path(manifest["data"]["dir"]) / "val.bin").is_file()
    assert manifest["world_size"] == 1 and manifest["format_version"] == 2
    assert "looped_lm_version" in manifest


# ------------------------------------------------------------------------------------------------
# damaged files: resume refuses any of them; inference refuses what it loads


def _copy_run(ckpt: Path, tmp_path: Path) -> Path:
    """A fresh out_dir holding a copy of `ckpt`; returns the copy."""
    dst = tmp_path / "out" / ckpt.name
    shutil.copytree(ckpt, dst)
    return dst


def _resume(write_config, tmp_path, *sets) -> int:
    cfg = write_config(tmp_path / "resume.yaml", {"train": {"out_dir": str(tmp_path / "out"), "max_steps": 3,
                                                            "lr": 1.0e-2}})
    argv = ["--config", str(cfg)]
    for s in sets:
        argv += ["--set", s]
    return trainer.main(argv)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit in the middle: a tensor's exponent, a pickle's payload
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped bit": (_flip, "does not match the sha256 in its manifest: the file is corrupted"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-7]), "bytes but its manifest records"),
    "deleted": (lambda p: p.unlink(), "is missing (its manifest lists it)"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_refuses_each_damaged_file(two_step_run, tmp_path, write_config, capsys, one_line_error, damage):
    """Every file of the checkpoint in turn: the weights, the optimizer state and the RNG state. Exit 2,
    one line naming the file, nothing trained or written."""
    harm, needle = DAMAGE[damage]
    src = two_step_run[1] / "step_0000002"
    files = sorted(json.loads((src / "manifest.json").read_text())["files"])
    assert {"model.safetensors", "optimizer/shared.safetensors", "rng/rank0.pt"} <= set(files)
    for rel in files:
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        ckpt = _copy_run(src, tmp_path)
        harm(ckpt / rel)
        capsys.readouterr()
        assert _resume(write_config, tmp_path) == 2, rel
        one_line_error(capsys.readouterr(), "cannot resume", str(ckpt / rel), needle)
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step_0000002"], rel


def test_resume_refuses_an_unlisted_file(two_step_run, tmp_path, write_config, capsys, one_line_error):
    ckpt = _copy_run(two_step_run[1] / "step_0000002", tmp_path)
    (ckpt / "optimizer" / "block9.safetensors").write_bytes(b"planted")
    assert _resume(write_config, tmp_path) == 2
    one_line_error(capsys.readouterr(), "block9.safetensors", "not in its checkpoint's manifest")


def test_inference_verifies_what_it_loads(two_step_run, tmp_path, capsys, one_line_error):
    src = two_step_run[1] / "step_0000002"
    ckpt = _copy_run(src, tmp_path)
    _flip(ckpt / "optimizer" / "shared.safetensors")  # not read by inference
    ckpt_io.load_checkpoint(ckpt)
    for harm, needle in DAMAGE.values():
        shutil.rmtree(tmp_path / "out")
        ckpt = _copy_run(src, tmp_path)
        harm(ckpt / "model.safetensors")
        with pytest.raises(UserError, match=re.escape(needle)):
            ckpt_io.load_checkpoint(ckpt)
        argv = ["generate", "--checkpoint", str(ckpt), "--prompt", "And", "--max-tokens", "2"]
        assert cli.main(argv) == 2
        one_line_error(capsys.readouterr(), str(ckpt / "model.safetensors"), needle)
        argv = ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]
        assert cli.main(argv) == 2
        one_line_error(capsys.readouterr(), str(ckpt / "model.safetensors"))
    # --no-verify skips the hash (and says so), not the sizes
    shutil.rmtree(tmp_path / "out")
    ckpt = _copy_run(src, tmp_path)
    _flip(ckpt / "model.safetensors")
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "And", "--max-tokens", "2",
                     "--no-verify"]) == 0
    assert "--no-verify: skip the sha256" in capsys.readouterr().err
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:-7])
    with pytest.raises(UserError, match="bytes but its manifest records"):
        ckpt_io.load_checkpoint(ckpt, verify=False)


# ------------------------------------------------------------------------------------------------
# edited manifests


def _edit(ckpt: Path, fn, rehash: bool = False) -> None:
    path = ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    fn(manifest)
    if rehash:  # a careful forger, or a hand edit with --no-verify: the field checks must still hold
        manifest["manifest_sha256"] = ckpt_io.manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def db_ckpt(tmp_path_factory, write_config):
    """A 2-step DB-AR checkpoint (B = 2): it records edges."""
    root = tmp_path_factory.mktemp("db_ckpt")
    cfg = write_config(root / "run.yaml", {
        "model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
        "diffusion": {"num_blocks": 2}, "train": {"out_dir": str(root / "out")}})
    assert trainer.main(["--config", str(cfg)]) == 0
    return root / "out" / "step_0000002"


def test_every_edited_manifest_field_is_refused(db_ckpt, tmp_path, capsys, one_line_error):
    """Any change to any field breaks the manifest's own hash: refused by inference and by resume."""
    fields = [k for k in json.loads((db_ckpt / "manifest.json").read_text())
              if k not in ("manifest_sha256", "format_version")]  # an unknown format is refused first
    assert {"step", "config", "model_state", "files", "vocab_size", "tokenizer", "data", "world_size"} <= set(fields)

    def change(value):
        if isinstance(value, bool):
            return not value
        if isinstance(value, (int, float)):
            return value + 1
        if isinstance(value, str):
            return value + "x"
        if isinstance(value, dict):
            return {**value, "edited": 1}
        return value
    for key in fields + ["manifest_sha256"]:
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        ckpt = _copy_run(db_ckpt, tmp_path)
        if key == "manifest_sha256":
            _edit(ckpt, lambda m: m.pop(key))
        else:
            _edit(ckpt, lambda m: m.__setitem__(key, change(m[key])))
        with pytest.raises(UserError, match="modified after it was written"):
            ckpt_io.load_checkpoint(ckpt)
        assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "A", "--max-tokens", "2"]) == 2, key
        one_line_error(capsys.readouterr(), "manifest.json", "modified after it was written", "--no-verify")


@pytest.mark.parametrize("name, edit, needle", [
    ("step below the directory", lambda m: m.update(step=1), "says step 1, but the directory is step_0000002"),
    ("step above the directory", lambda m: m.update(step=100), "says step 100"),
    ("non-integer step", lambda m: m.update(step="2"), "'step' must be a non-negative integer, got '2'"),
    ("dropped edge", lambda m: m["model_state"].update(edges=m["model_state"]["edges"][:-1]), "edges"),
    ("non-numeric edge", lambda m: m["model_state"].update(edges=[0.002, "x", 80.0]), "'model_state.edges' must be"),
    ("shapes", lambda m: m["config"]["model"].update(d_model=64), "but the model in its manifest has"),
    ("unreadable config", lambda m: m["config"]["model"].update(d_model="wide"), "model.d_model must be an integer"),
    ("no weights record", lambda m: m["files"].pop("model.safetensors"), "does not list model.safetensors"),
    ("bad file record", lambda m: m["files"].__setitem__("model.safetensors", {"size": 1}), "the record of model.safetensors"),
    ("path outside", lambda m: m["files"].__setitem__("../x", m["files"]["rng/rank0.pt"]), "a path outside the checkpoint"),
    ("unknown format", lambda m: m.update(format_version=9), "format_version 9"),
    ("emptied", lambda m: m.clear(), "format_version None"),
])
def test_field_checks_hold_without_the_hash(db_ckpt, tmp_path, capsys, one_line_error, name, edit, needle):
    """With the hash recomputed (or --no-verify), each field is still checked against the directory
    and the weights: exit 2, one line, never a traceback."""
    ckpt = _copy_run(db_ckpt, tmp_path)
    _edit(ckpt, edit, rehash=True)
    with pytest.raises(UserError) as err:
        ckpt_io.load_checkpoint(ckpt, verify=False)
    assert needle in str(err.value), str(err.value)
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "A", "--max-tokens", "2"]) == 2
    one_line_error(capsys.readouterr(), needle)


def test_edited_edges_are_refused_even_with_no_verify(db_ckpt, tmp_path, capsys, one_line_error):
    """--no-verify skips the hashes, not the agreement: edges that are not the config's partition are
    never used for routing."""
    ckpt = _copy_run(db_ckpt, tmp_path)
    _edit(ckpt, lambda m: m["model_state"].update(edges=[0.002, 1.5, 80.0]))
    with pytest.raises(UserError, match="modified after it was written"):
        ckpt_io.load_checkpoint(ckpt)
    with pytest.raises(UserError, match="'model_state.edges' are .*diffusion.partition"):
        ckpt_io.load_checkpoint(ckpt, verify=False)


def test_resume_refuses_edited_manifests(db_ckpt, tmp_path, write_config, capsys, one_line_error):
    db = {"model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
          "diffusion": {"num_blocks": 2}, "train": {"out_dir": str(tmp_path / "out"), "max_steps": 3}}
    cfg = write_config(tmp_path / "db.yaml", db)
    for edit, rehash, needle in (
        (lambda m: m.update(step=1), False, "modified after it was written"),
        (lambda m: m.update(step=1), True, "says step 1"),
        (lambda m: m["model_state"].update(edges=[0.002, 1.5, 80.0]), False, "modified after it was written"),
        (lambda m: m["files"].pop("rng/rank0.pt"), True, "does not list rng/rank0.pt"),
        (lambda m: m["model_state"].update(edges=m["model_state"]["edges"][:-1]), True, "'model_state.edges' has 2"),
    ):
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        ckpt = _copy_run(db_ckpt, tmp_path)
        _edit(ckpt, edit, rehash)
        assert trainer.main(["--config", str(cfg)]) == 2
        one_line_error(capsys.readouterr(), "cannot resume", needle)


def test_legacy_manifest_loads_for_inference_only(two_step_run, tmp_path, write_config, capsys, one_line_error):
    """A format-1 manifest (weights hash only) serves inference; resuming from it needs --no-verify."""
    ckpt = _copy_run(two_step_run[1] / "step_0000002", tmp_path)

    def to_v1(m):
        m["weights_sha256"] = m["files"]["model.safetensors"]["sha256"]
        for key in ("files", "manifest_sha256", "world_size"):
            m.pop(key)
        m["format_version"] = 1
    _edit(ckpt, to_v1)
    ckpt_io.load_checkpoint(ckpt)
    assert _resume(write_config, tmp_path) == 2
    one_line_error(capsys.readouterr(), "format_version 1", "--no-verify")


# ------------------------------------------------------------------------------------------------
# run directories, orphans and half-written saves


def test_missing_or_damaged_manifest_is_refused(two_step_run, tmp_path):
    ckpt = _copy_run(two_step_run[1] / "step_0000002", tmp_path)
    manifest = ckpt / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(UserError, match="manifest.json: corrupted"):
        ckpt_io.load_checkpoint(ckpt)
    manifest.unlink()
    with pytest.raises(UserError, match="manifest.json is missing"):
        ckpt_io.load_checkpoint(ckpt)
    assert ckpt_io.latest_checkpoint(tmp_path / "out") is None  # a directory without a manifest is not a checkpoint


def test_missing_directory_is_refused(tmp_path):
    with pytest.raises(UserError, match="checkpoint directory not found"):
        ckpt_io.load_checkpoint(tmp_path / "step_0000099")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        ckpt_io.load_checkpoint(tmp_path / "file")


def test_a_run_directory_resolves_to_its_newest_complete_checkpoint(two_step_run, tmp_path, capsys,
                                                                   one_line_error):
    run = tmp_path / "run"
    shutil.copytree(two_step_run[1] / "step_0000001", run / "step_0000001")
    shutil.copytree(two_step_run[1] / "step_0000002", run / "step_0000002")
    (run / "step_0000003").mkdir()  # no manifest: skipped, and said so
    assert ckpt_io.resolve_checkpoint(run) == run / "step_0000002"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"checkpoint: {run / 'step_0000002'}" in err and "step_0000003" in err
    assert ckpt_io.resolve_checkpoint(run / "step_0000001") == run / "step_0000001"  # passes through
    assert capsys.readouterr().err == ""
    assert cli.main(["generate", "--checkpoint", str(run), "--prompt", "And", "--max-tokens", "3"]) == 0
    assert f"checkpoint: {run / 'step_0000002'}" in capsys.readouterr().err
    assert cli.main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert f"exported {run / 'step_0000002'}" in capsys.readouterr().out
    empty = tmp_path / "empty_run"
    (empty / "step_0000004").mkdir(parents=True)
    assert cli.main(["generate", "--checkpoint", str(empty), "--prompt", "x"]) == 2
    one_line_error(capsys.readouterr(), "holds no complete checkpoint", "step_0000004")


def test_a_deleted_manifest_never_restarts_from_scratch(two_step_run, tmp_path, write_config, capsys,
                                                         one_line_error):
    src = two_step_run[1]
    run = tmp_path / "out"
    shutil.copytree(src / "step_0000002", run / "step_0000002")
    (run / "step_0000002" / "manifest.json").unlink()
    assert _resume(write_config, tmp_path) == 2
    one_line_error(capsys.readouterr(), "step_0000002 has no manifest.json", "train.resume: never")
    assert sorted(p.name for p in run.iterdir()) == ["step_0000002"]  # nothing trained, nothing overwritten
    # with an older complete checkpoint the line names it
    shutil.copytree(src / "step_0000001", run / "step_0000001")
    assert _resume(write_config, tmp_path) == 2
    one_line_error(capsys.readouterr(), "step_0000002 has no manifest.json", f"train.resume={run / 'step_0000001'}")


def test_half_written_checkpoints_are_reported_and_pruned(two_step_run, tmp_path, write_config, capsys):
    """A crash mid-save leaves `.tmp-step_*`; an interrupted prune leaves an older step dir without a
    manifest. Neither is ever resumed from; both are removed, with a note, once a newer checkpoint exists."""
    out = two_step_run[1]
    run = tmp_path / "out"
    shutil.copytree(out / "step_0000002", run / "step_0000002")
    shutil.copytree(out / "step_0000002", run / ".tmp-step_0000009")  # complete-looking, but never renamed
    shutil.copytree(out / "step_0000001", run / ".tmp-step_0000003")  # a crashed earlier save of step 3
    (run / ".tmp-step_0000003" / "stale.txt").write_text("left by a crash")
    shutil.copytree(out / "step_0000001", run / "step_0000001")
    (run / "step_0000001" / "manifest.json").unlink()  # an interrupted prune
    assert ckpt_io.latest_checkpoint(run) == run / "step_0000002"
    assert [p.name for p in ckpt_io.list_checkpoints(run)] == ["step_0000002"]
    capsys.readouterr()
    assert _resume(write_config, tmp_path) == 0
    printed = capsys.readouterr().out
    assert f"resumed from {run / 'step_0000002'} at step 2" in printed
    for gone in (".tmp-step_0000009", ".tmp-step_0000003", "step_0000001"):
        assert f"note: removed {run / gone}" in printed
    assert sorted(p.name for p in run.iterdir() if "step" in p.name) == ["step_0000002", "step_0000003"]
    assert json.loads((run / "step_0000003" / "manifest.json").read_text())["step"] == 3
    ckpt_io.load_checkpoint(run / "step_0000003")  # hash verified


def test_keep_last_prunes_old_checkpoints(tmp_path, write_config):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out), "max_steps": 4, "save_every": 1,
                                                         "keep_last": 2}})
    assert trainer.main(["--config", str(cfg)]) == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", ".tmp", ".old"))) == \
        ["step_0000003", "step_0000004"]


def test_finalize_is_atomic_and_prunes(tmp_path):
    """finalize() on a prepared temp dir: the step dir appears complete or not at all; keep_last holds."""
    from looped_lm.models.args import GPTArgs
    from looped_lm.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTArgs(vocab_size=257, n_layers=1, d_model=32, n_heads=2, seq_len=16))
    cfg = load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.seq_len=16",
                             "data.tokenizer=byte"])
    for step in (1, 2, 3):
        tmp = ckpt_io.tmp_dir_for(tmp_path, step)
        tmp.mkdir(parents=True)
        assert ckpt_io.latest_checkpoint(tmp_path) == (tmp_path / ckpt_io.step_dir_name(step - 1) if step > 1 else None)
        final = ckpt_io.finalize(tmp_path, step, model, {"config": cfg.to_dict(), "vocab_size": 257,
                                                         "tokenizer": "byte", "world_size": 1}, keep_last=2)
        assert final == tmp_path / f"step_{step:07d}" and not tmp.exists()
    assert [p.name for p in ckpt_io.list_checkpoints(tmp_path)] == ["step_0000002", "step_0000003"]
    loaded, _, _ = ckpt_io.load_checkpoint(tmp_path / "step_0000003")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    # a save of an existing step replaces it whole; later steps (an earlier run's) are not pruned
    (tmp_path / "step_0000003" / "junk").write_text("x")
    ckpt_io.tmp_dir_for(tmp_path, 1).mkdir()
    ckpt_io.finalize(tmp_path, 1, model, {"config": cfg.to_dict(), "vocab_size": 257, "tokenizer": "byte",
                                          "world_size": 1}, keep_last=1)
    assert [p.name for p in ckpt_io.list_checkpoints(tmp_path)] == ["step_0000001", "step_0000002", "step_0000003"]


def test_serve_takes_a_run_directory_and_no_verify(two_step_run, tmp_path, monkeypatch, capsys):
    """`looped_lm serve --checkpoint RUN_DIR` serves the newest complete checkpoint (uvicorn stubbed)."""
    uvicorn = pytest.importorskip("uvicorn")
    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw))
    run = tmp_path / "run"
    shutil.copytree(two_step_run[1] / "step_0000002", run / "step_0000002")
    _flip(run / "step_0000002" / "model.safetensors")
    assert cli.main(["serve", "--checkpoint", str(run), "--max-slots", "2"]) == 2
    assert "does not match the sha256" in capsys.readouterr().err and not served
    assert cli.main(["serve", "--checkpoint", str(run), "--max-slots", "2", "--no-verify"]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint: {run / 'step_0000002'}" in err and "--no-verify" in err and "serving run " in err
    assert served and served[0]["port"] == 8000
