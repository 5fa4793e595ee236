"""Model kinds are plugins: the registry's contract for every kind, and a kind defined outside the
package (tests/plugins/bigram_kind.py) that registers, trains, checkpoints, evaluates and serves
through the same verbs as the built-in ones; a capability it lacks is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looped_lm import cli
from looped_lm.config import config_from_dict, describe_fields, load_config
from looped_lm.errors import UserError
from looped_lm.kinds import CAPABILITIES, Kind, get_kind, register, registered, require
from looped_lm.kinds.builtin import BUILTIN

PLUGINS = Path(__file__).resolve().parent / "plugins"
sys.path.insert(0, str(PLUGINS))
import bigram_kind  # noqa: E402  (registers model.kind bigram, as LOOPED_LM_PLUGINS would)

BIGRAM = {"model": {"kind": "bigram", "rank": 8, "seq_len": 32}}


# --- the registry's contract, for every registered kind -------------------------------------------------

@pytest.mark.parametrize("kind", list(registered().values()), ids=lambda k: k.name)
def test_every_kind_describes_itself(kind):
    assert kind.section.model_fields["kind"].default == kind.name
    assert set(kind.capabilities) <= set(CAPABILITIES)
    assert kind.data_sources, "a kind reads some data.source"
    diffusion = {"num_blocks": 1, "block_sampling": "uniform"} if "num_blocks" in kind.diffusion.model_fields else {}
    cfg = config_from_dict({"model": {"kind": kind.name}, "data": {"source": next(iter(kind.data_sources)), "path": "x"},
                            "diffusion": diffusion})
    assert type(cfg.model) is kind.section
    assert kind.num_blocks(cfg) >= 1 and sum(kind.block_layers(cfg)) >= 1
    # the section's dump loads back as the same kind
    assert config_from_dict(cfg.to_dict()) == cfg
    assert type(cfg.diffusion) is kind.diffusion
    # --help-config lists the kind's own fields; --help-config KIND only those
    text, own = describe_fields(), describe_fields(kind=kind.name)
    for section in (kind.section, kind.diffusion):
        assert all(f"  {name} (" in text and f"  {name} (" in own for name in section.model_fields)
    others = {name for k in registered().values() for name in k.diffusion.model_fields} - set(kind.diffusion.model_fields)
    assert not any(f"  {name} (" in own.split("data:")[0].split("diffusion:")[1] for name in others)


def test_a_plugin_brings_its_own_diffusion_option_and_data_source(tmp_path):
    from looped_lm.data.tokenizer import run_vocab
    from looped_lm.data.batches import open_batches, prepare_data
    from looped_lm.models import build_model

    raw = {**BIGRAM, "diffusion": {"target_noise": 0.5},
           "data": {"source": "alphabet", "tokenizer": "byte", "cache_dir": str(tmp_path)}}
    cfg = config_from_dict(raw)
    assert cfg.diffusion.target_noise == 0.5
    vocab, _ = run_vocab(cfg)
    x, y = open_batches(cfg, prepare_data(cfg, vocab), "train").get_batch(4, 0, 0, 0, 0)
    assert set(x.flatten().tolist()) <= set(b"abcdefghijklmnopqrstuvwxyz \n")  # the plugin's corpus
    model = build_model(cfg, vocab)
    noisy = model.training_loss(x, y, 0, seed=0)[0]
    model.target_noise = 0.0
    assert not torch.equal(noisy, model.training_loss(x, y, 0, seed=0)[0])  # the option reaches the model
    # the option and the source are the plugin's: refused, naming it, on a kind that has neither
    with pytest.raises(UserError, match="diffusion.target_noise is a field of model.kind bigram, not of gpt"):
        load_config(None, ["diffusion.target_noise=0.1"])
    with pytest.raises(UserError, match="model.kind gpt reads data.source .* \\(got alphabet\\)"):
        load_config(None, ["data.source=alphabet"])
    with pytest.raises(UserError, match=r"diffusion.target_noise must be in \[0, 1\)"):
        load_config(None, ["model.kind=bigram", "diffusion.target_noise=1.5"])


def test_the_builtin_kinds_are_registered_first():
    assert list(registered())[:len(BUILTIN)] == [k.name for k in BUILTIN]


def test_register_refuses_a_malformed_kind():
    class NoTag(bigram_kind.BigramKind):
        name = "other"
    with pytest.raises(TypeError, match="must default to 'other'"):
        register(NoTag())
    class Unknown(bigram_kind.BigramKind):
        capabilities = frozenset({"language_model", "teleport"})
    with pytest.raises(TypeError, match="unknown capabilities"):
        register(Unknown())
    with pytest.raises(TypeError, match="Kind instance"):
        register(bigram_kind.BigramKind)


def test_require_names_the_kind_and_the_missing_capability():
    with pytest.raises(UserError, match="model.kind bigram does not offer merge .* which looped_lm merge needs"):
        require(get_kind("bigram"), "merge", "looped_lm merge")
    require(get_kind("db_ar"), "merge", "looped_lm merge")


# --- a kind from outside the package ----------------------------------------------------------------------

def test_plugin_config_section_is_typed_and_its_own(tmp_path):
    cfg = config_from_dict(BIGRAM)
    assert cfg.model.rank == 8 and isinstance(get_kind("bigram"), Kind)
    with pytest.raises(UserError, match="model.rank must be an integer"):
        config_from_dict({"model": {"kind": "bigram", "rank": "wide"}})
    with pytest.raises(UserError, match="model.rank must be >= 1"):
        config_from_dict({"model": {"kind": "bigram", "rank": 0}})
    with pytest.raises(UserError, match="model.rank is a field of model.kind bigram, not of gpt"):
        load_config(None, ["model.rank=4"])
    with pytest.raises(UserError, match="model.kind 'bigrm' is not a registered kind .have: gpt, db_ar"):
        config_from_dict({"model": {"kind": "bigrm"}})


@pytest.mark.parametrize("sets, needle", [
    (["train.mode=block_parallel"], "model.kind bigram does not offer block_parallel"),
    (["diffusion.context=stacked"], "diffusion.context is a field of model.kind db_ar, not of bigram"),
    (["model.init_from=somewhere"], "model.kind bigram does not offer init_from"),
    (["diffusion.layers_per_block=1"], "diffusion.layers_per_block is a field of model.kind db_ar, not of bigram"),
    (["data.source=digits"], "model.kind bigram reads data.source bible / shakespeare"),
])
def test_plugin_lacking_a_capability_is_refused_in_one_line(tmp_path, sets, needle, one_line_error, capsys):
    path = tmp_path / "bigram.yaml"
    path.write_text(json.dumps({**BIGRAM, "train": {"out_dir": str(tmp_path / "out")}}))
    assert cli.main(["train", "--config", str(path), *[a for s in sets for a in ("--set", s)]]) == 2
    one_line_error(capsys.readouterr(), needle)


@pytest.fixture(scope="module")
def bigram_run(tmp_path_factory, write_config):
    from looped_lm import trainer

    root = tmp_path_factory.mktemp("bigram")
    cfg = write_config(root / "run.yaml", {**BIGRAM, "train": {
        "out_dir": str(root / "out"), "max_steps": 40, "batch_size": 8, "lr": 3e-2, "warmup_steps": 0}})
    before = dict(os.environ)
    try:
        assert trainer.main(["--config", str(cfg)]) == 0
    finally:
        os.environ.clear()
        os.environ.update(before)
    return cfg, root / "out" / "step_0000040"


def test_plugin_trains_and_checkpoints(bigram_run):
    from looped_lm.checkpoint import load_checkpoint

    _, ckpt = bigram_run
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["model_kind"] == "bigram" and manifest["config"]["model"]["rank"] == 8
    rows = [json.loads(line) for line in (ckpt.parent / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, "the bigram table learns (byte unigram -> bigram statistics)"
    model, cfg, _ = load_checkpoint(ckpt)
    assert isinstance(model, bigram_kind.Bigram) and cfg.model.rank == 8


def test_plugin_evaluates_and_refuses_what_it_lacks(bigram_run, tmp_path, capsys, one_line_error):
    _, ckpt = bigram_run
    out = tmp_path / "ppl.json"
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--max-tokens", "512", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model_kind"] == "bigram" and 1 < report["ppl"] < 40  # bytes: unigram ~20, bigram ~10
    capsys.readouterr()
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    one_line_error(capsys.readouterr(), "model.kind bigram does not offer export_native")
    assert not (tmp_path / "hf").exists()
    assert cli.main(["merge", str(ckpt), str(ckpt), "--out", str(tmp_path / "merged")]) == 2
    one_line_error(capsys.readouterr(), "model.kind bigram does not offer merge")
    assert not (tmp_path / "merged").exists()


def test_plugin_serves_through_the_openai_client(bigram_run):
    from test_server import Served

    _, ckpt = bigram_run
    with Served(ckpt, "bigram") as s:
        r = s.client.completions.create(model="bigram", prompt="And God said", max_tokens=8, temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens == 8
        # greedy decoding of a bigram model: each token is the argmax after the one before
        ids = s.tok.encode("And God said")
        import torch
        expect = []
        for _ in range(8):
            nxt = int(s.model(torch.tensor([ids[-1]])).argmax())
            expect.append(nxt)
            ids.append(nxt)
        assert r.choices[0].text == s.tok.decode(expect)


def test_plugin_loads_in_a_fresh_process_from_the_environment(bigram_run, clean_env, tmp_path):
    """A launcher's workers and every verb find the kind through LOOPED_LM_PLUGINS."""
    _, ckpt = bigram_run
    env = {**clean_env, "LOOPED_LM_PLUGINS": "bigram_kind", "PYTHONPATH": str(PLUGINS)}
    out = tmp_path / "ppl.json"
    run = subprocess.run([sys.executable, "-m", "looped_lm", "eval", "--checkpoint", str(ckpt), "--max-tokens", "256",
                          "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())["model_kind"] == "bigram"
    env.pop("LOOPED_LM_PLUGINS")
    run = subprocess.run([sys.executable, "-m", "looped_lm", "eval", "--checkpoint", str(ckpt)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "model.kind 'bigram' is not a registered kind" in run.stderr
    assert len([line for line in run.stderr.splitlines() if line.startswith("error:")]) == 1
