"""A manifest that contradicts its config, its files or its tensors is refused by every verb that loads
a checkpoint (resume, eval, generate, serve, export, merge, verify), even with its own hash recomputed
(a hand- or tool-written manifest): one line naming the field, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from looped_lm import checkpoint as ckpt_io
from looped_lm import cli

DB = {"model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
      "diffusion": {"num_blocks": 2}}


@pytest.fixture(scope="module")
def db_run(tmp_path_factory, write_config):
    """A 2-step DB-AR run (B = 2, both blocks trained): (its config, its checkpoint)."""
    from looped_lm import trainer

    root = tmp_path_factory.mktemp("agreement")
    cfg = write_config(root / "run.yaml", {**DB, "train": {"out_dir": str(root / "out")}})
    assert trainer.main(["--config", str(cfg)]) == 0
    return cfg, root / "out" / "step_0000002"


def _forged(src: Path, dest_root: Path, edit) -> Path:
    """A copy of the run whose manifest is edited and its manifest_sha256 recomputed as the code does."""
    out = dest_root / "out"
    shutil.rmtree(out, ignore_errors=True)
    ckpt = out / src.name
    shutil.copytree(src, ckpt)
    path = ckpt / ckpt_io.MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest["manifest_sha256"] = ckpt_io.manifest_digest(manifest)
    path.write_text(json.dumps(manifest, indent=2))
    return ckpt


def _second_edge(m):
    m["model_state"]["edges"][1] *= 1.5


EDITS = {  # name: (edit, the field the refusal names, a fragment of the reason)
    "tokenizer": (lambda m: m.update(tokenizer="gpt2"), "'tokenizer'", "data.tokenizer gives 'byte'"),
    "model_kind": (lambda m: m.update(model_kind="gpt"), "'model_kind'", "model.kind is 'db_ar'"),
    "vocab_size": (lambda m: m.update(vocab_size=300), "vocab_size", "257"),  # resume: its own check
    "ownership": (lambda m: m.update(ownership={"blocks": [0]}), "'ownership'", "trains blocks [0, 1]"),
    "ownership type": (lambda m: m.update(ownership={"blocks": [0, 0]}), "'ownership'", "distinct block ids"),
    "edges moved": (_second_edge, "'model_state.edges'", "diffusion.partition"),
    "edges descending": (lambda m: m["model_state"]["edges"].reverse(), "'model_state.edges'", "ascending"),
    "edges count": (lambda m: m["model_state"]["edges"].pop(1), "'model_state.edges'", "2 blocks: 3 edges"),
    "num_blocks": (lambda m: m["model_state"].update(num_blocks=3), "'model_state.num_blocks'", "2 blocks"),
}


def _verbs(ckpt: Path, tmp: Path, cfg: Path, resume_to: int = 3) -> dict:
    """Every verb that reads a checkpoint, as argv (resume: train on to step `resume_to`)."""
    return {
        "resume": ["train", "--config", str(cfg), "--set", f"train.out_dir={ckpt.parent}", "--set",
                   f"train.max_steps={resume_to}"],
        "eval": ["eval", "--checkpoint", str(ckpt), "--max-tokens", "32", "--no-progress"],
        "generate": ["generate", "--checkpoint", str(ckpt), "--prompt", "A", "--max-tokens", "2"],
        "serve": ["serve", "--checkpoint", str(ckpt)],
        "export": ["export", "--checkpoint", str(ckpt), "--out", str(tmp / "hf")],
        "merge": ["merge", str(ckpt), "--out", str(tmp / "merged")],
        "verify": ["verify", str(ckpt)],
    }


@pytest.mark.parametrize("name", list(EDITS))
def test_every_verb_refuses_a_manifest_that_contradicts_its_weights(db_run, tmp_path, capsys, one_line_error,
                                                                    no_uvicorn, name):
    cfg, src = db_run
    edit, field, reason = EDITS[name]
    ckpt = _forged(src, tmp_path, edit)
    for verb, argv in _verbs(ckpt, tmp_path, cfg).items():
        capsys.readouterr()
        assert cli.main(argv) == 2, (name, verb)
        one_line_error(capsys.readouterr(), field, reason)
        assert not (tmp_path / "hf").exists() and not (tmp_path / "merged").exists(), verb
        assert not list(ckpt.parent.glob(".tmp-*")), verb


def test_no_verify_skips_hashes_not_agreement(db_run, tmp_path, capsys, one_line_error):
    cfg, src = db_run
    ckpt = _forged(src, tmp_path, lambda m: m.update(tokenizer="gpt2"))
    argv = ["generate", "--checkpoint", str(ckpt), "--prompt", "A", "--max-tokens", "2", "--no-verify"]
    assert cli.main(argv) == 2
    one_line_error(capsys.readouterr(), "'tokenizer'")


def test_verify_reports_a_good_checkpoint_and_names_damage(db_run, tmp_path, capsys, one_line_error):
    cfg, src = db_run
    assert cli.main(["verify", str(src.parent)]) == 0  # a run directory: its newest complete checkpoint
    out = capsys.readouterr().out
    assert f"{src}: ok" in out and "step 2, model.kind db_ar, tokenizer byte (257 tokens)" in out
    assert "trained blocks [0, 1]" in out and "a resume accepts it" in out
    # a hand edit without the hash: the manifest's own hash
    ckpt = _forged(src, tmp_path, lambda m: None)
    manifest = json.loads((ckpt / ckpt_io.MANIFEST).read_text())
    manifest["step"] = 1
    (ckpt / ckpt_io.MANIFEST).write_text(json.dumps(manifest))
    assert cli.main(["verify", str(ckpt)]) == 2
    one_line_error(capsys.readouterr(), "modified after it was written")
    # a corrupted optimizer file (inference never reads it; a resume does, and so does verify)
    ckpt = _forged(src, tmp_path, lambda m: None)
    unit = ckpt / "optimizer" / "block1.safetensors"
    data = bytearray(unit.read_bytes())
    data[-1] ^= 0xFF
    unit.write_bytes(bytes(data))
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "A", "--max-tokens", "1"]) == 0
    capsys.readouterr()
    assert cli.main(["verify", str(ckpt)]) == 2
    one_line_error(capsys.readouterr(), "block1.safetensors", "does not match the sha256")
    # a file added after the save
    ckpt = _forged(src, tmp_path, lambda m: None)
    (ckpt / "notes.txt").write_text("x")
    assert cli.main(["verify", str(ckpt)]) == 2
    one_line_error(capsys.readouterr(), "notes.txt", "not in its checkpoint's manifest")


def test_verify_accepts_a_merge_as_weights_only(db_run, tmp_path, capsys):
    cfg, src = db_run
    assert cli.main(["merge", str(src), "--out", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    assert cli.main(["verify", str(tmp_path / "merged")]) == 0
    assert "a merge of block jobs" in capsys.readouterr().out
