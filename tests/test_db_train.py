"""DiffusionBlocks models through the real trainer, checkpoints and CLI verbs."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from looped_lm import checkpoint as ckpt_io
from looped_lm import cli
from looped_lm import trainer

DB = {"model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
      "diffusion": {"num_blocks": 2}}


def db_config(write_config, tmp_path, name="run", **sections):
    raw = {"model": dict(DB["model"]), "diffusion": dict(DB["diffusion"]),
           "train": {"out_dir": str(tmp_path / name), "max_steps": 6, "batch_size": 4, "log_every": 1,
                     "lr": 3.0e-3}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return write_config(tmp_path / f"{name}.yaml", raw)


@pytest.fixture(scope="module")
def db_run(tmp_path_factory, write_config):
    """A 40-step DB-AR run (B = 2): (config, checkpoint dir)."""
    root = tmp_path_factory.mktemp("db_run")
    cfg = db_config(write_config, root, train={"max_steps": 40, "batch_size": 8, "save_every": 20,
                                               "eval_every": 20, "eval_batches": 2, "warmup_steps": 4})
    assert trainer.main(["--config", str(cfg)]) == 0
    return cfg, root / "run" / "step_0000040"


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_idle_block_is_bit_identical_across_a_step(tmp_path, write_config, zero_stage):
    """Under DeepSpeed (ZeRO 0 and 2) a step of block b leaves the other block's weights untouched."""
    from looped_lm.config import load_config
    from looped_lm.models import build_model

    steps = 3
    cfg_path = db_config(write_config, tmp_path, deepspeed={"zero_stage": zero_stage},
                         train={"max_steps": steps, "save_every": 1, "keep_last": 5})
    assert trainer.main(["--config", str(cfg_path)]) == 0
    model = build_model(load_config(str(cfg_path)), 257)
    out = tmp_path / "run"
    weights = [load_file(str(out / f"step_{s:07d}" / "model.safetensors")) for s in range(1, steps + 1)]
    for s in range(1, steps):  # step index s (0-based) moved weights[s-1] -> weights[s]
        trained = model.choose_block(s, 1337)
        idle = 1 - trained
        for name in weights[s]:
            unit = model.param_unit(name)
            same = torch.equal(weights[s][name], weights[s - 1][name])
            if unit == f"block{idle}":
                assert same, f"{name} (idle block {idle}) moved at step {s}"
        assert any(not torch.equal(weights[s][n], weights[s - 1][n]) for n in weights[s]
                   if model.param_unit(n) == f"block{trained}")


@pytest.mark.slow
def test_a_zero_checkpoint_saved_before_a_block_stepped_resumes_exactly(tmp_path, write_config):
    """ZeRO 1, blocks trained apart: the first checkpoint holds one unit DeepSpeed has never stepped (its
    state is gathered and restored through DeepSpeed's public safe_* functions); resuming from it gives
    the uninterrupted run's weights."""
    from looped_lm.config import load_config
    from looped_lm.models import build_model

    sets = {"deepspeed": {"zero_stage": 1}, "diffusion": {"block_sampling": "round_robin"},
            "train": {"max_steps": 4, "save_every": 1, "keep_last": 5}}
    whole = db_config(write_config, tmp_path, "whole", **sets)
    assert trainer.main(["--config", str(whole)]) == 0
    model = build_model(load_config(str(whole)), 257)
    assert [model.choose_block(s, 1337) for s in range(4)] == [0, 1, 0, 1]  # step_0000001: block 1 unstepped
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "step_0000001", resumed / "step_0000001")
    part = db_config(write_config, tmp_path, "resumed", **sets)
    assert trainer.main(["--config", str(part)]) == 0
    want = load_file(str(tmp_path / "whole" / "step_0000004" / "model.safetensors"))
    got = load_file(str(resumed / "step_0000004" / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
def test_db_run_logs_loss_per_block_and_saves_edges(db_run):
    cfg, ckpt = db_run
    rows = [json.loads(line) for line in (ckpt.parent / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert {r["block"] for r in train_rows} == {0, 1}
    for r in train_rows:
        assert r[f"loss_block{r['block']}"] == pytest.approx(r["loss"])
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert [round(e, 3) for e in manifest["model_state"]["edges"]] == [0.002, 0.301, 80.0]
    firsts = [r["loss"] for r in train_rows[:6]]
    lasts = [r["loss"] for r in train_rows[-6:]]
    assert sum(lasts) < sum(firsts)  # it learns


def test_resume_with_other_blocks_is_refused(db_run, tmp_path, capsys, one_line_error, write_config):
    cfg, ckpt = db_run
    assert trainer.main(["--config", str(cfg), "--set", "diffusion.num_blocks=1",
                         "--set", "train.max_steps=50"]) == 2
    one_line_error(capsys.readouterr(), "diffusion.num_blocks")


@pytest.mark.slow
def test_eval_reports_ppl_at_k(db_run, tmp_path, capsys):
    _, ckpt = db_run
    out = tmp_path / "ppl.json"
    # 16 draws: K = 4 resolved (at 2 draws its Jensen bias bound is 1.6 nats, at 8 0.27: printed unresolved)
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--num-iterations", "1,2,4", "--draws", "16",
                     "--max-tokens", "600", "--json", str(out), "--no-progress"]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["ppl_at_k"]) == {"0", "1", "2", "4"} and rep["draws"] == 16
    assert rep["ppl"] == rep["ppl_at_k"]["0"] and rep["nll"] == pytest.approx(math.log(rep["ppl"]))
    ppl = {int(k): v for k, v in rep["ppl_at_k"].items()}
    # ppl@0 is the trainer's validation loss on other held-out windows (measured: 55.8 vs exp(4.034) = 56.5):
    # a wrong sum or token count moves it far off
    val = [json.loads(line) for line in (ckpt.parent / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["val_loss"] for r in val if r.get("step") == 40 and "val_loss" in r][0]
    assert ppl[0] == pytest.approx(math.exp(val_loss), rel=0.15)
    # the chains of this 40-step model stay near ppl@0 (measured ratios 1.007, 1.005, 1.155)
    assert ppl[1] / ppl[0] < 1.05 and ppl[2] / ppl[0] < 1.05 and ppl[4] / ppl[0] < 1.4
    assert all(0 < rep["ppl_se"][k] < 0.1 * v for k, v in rep["ppl_at_k"].items())
    assert "| 4 |" in capsys.readouterr().out


def test_generate_db_is_seeded_and_checks_k(db_run, capsys, one_line_error):
    _, ckpt = db_run
    args = ["generate", "--checkpoint", str(ckpt), "--prompt", "And", "--max-tokens", "12", "--seed", "4",
            "--num-iterations", "4"]
    assert cli.main(args) == 0
    first = capsys.readouterr().out
    assert cli.main(args) == 0
    assert capsys.readouterr().out == first and first.startswith("And")
    assert cli.main(args[:-1] + ["0"]) == 2
    one_line_error(capsys.readouterr(), "num_iterations")


def test_gpt_checkpoint_refuses_db_flags(tiny_run, capsys, one_line_error):
    _, ckpt, _ = tiny_run
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--num-iterations", "3"]) == 2
    one_line_error(capsys.readouterr(), "no K")
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--num-iterations", "3", "--no-progress"]) == 2
    one_line_error(capsys.readouterr(), "gpt")


@pytest.mark.parametrize("sets,needle", [
    (["diffusion.num_blocks=3"], "must divide model.n_layers"),
    (["diffusion.blocks_to_train=[2]"], "blocks_to_train"),
    (["diffusion.blocks_to_train=[0,0]"], "duplicates"),
    (["diffusion.overlap=0.7"], "diffusion.overlap"),
])
def test_bad_db_configs_write_nothing(tmp_path, write_config, capsys, one_line_error, sets, needle):
    cfg = db_config(write_config, tmp_path)
    args = ["train", "--config", str(cfg)]
    for s in sets:
        args += ["--set", s]
    assert cli.main(args) == 2
    one_line_error(capsys.readouterr(), needle)
    assert not (tmp_path / "run").exists()


def test_blocks_to_train_keeps_no_optimizer_state_for_frozen_blocks(tmp_path, write_config):
    cfg = db_config(write_config, tmp_path, diffusion={"blocks_to_train": [1]}, train={"max_steps": 2})
    assert trainer.main(["--config", str(cfg)]) == 0
    ckpt = tmp_path / "run" / "step_0000002"
    assert sorted(p.name for p in (ckpt / "optimizer").iterdir()) == ["block1.safetensors", "shared.safetensors"]
    from looped_lm.config import load_config
    from looped_lm.models import build_model

    model = build_model(load_config(str(cfg)), 257)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    saved = set()
    for unit in ("shared", "block1"):
        _, tensors = ckpt_io.read_unit_state(ckpt, unit)
        saved |= {k.split("/", 1)[1] for k in tensors}
        assert {k.split("/", 1)[0] for k in tensors} == {"exp_avg", "exp_avg_sq"}
    assert saved == trained and not any(n.startswith("blocks.0.") for n in saved)
    assert json.loads((ckpt / "manifest.json").read_text())["ownership"] == {"blocks": [1]}


@pytest.mark.slow
def test_looped_db_and_huginn_train_and_eval(tmp_path, write_config, capsys):
    for kind, extra in (("looped_db", {"diffusion": {"num_blocks": 1}}),
                        ("huginn", {"model": {"mean_recurrence": 3, "backprop_depth": 2}})):
        model = {"kind": kind, "n_prelude": 1, "n_layers": 1, "n_coda": 1, "d_model": 32, "n_heads": 2,
                 "seq_len": 16, **extra.get("model", {})}
        cfg = write_config(tmp_path / f"{kind}.yaml", {"model": model, "diffusion": extra.get("diffusion", {}),
                                                       "train": {"out_dir": str(tmp_path / kind), "max_steps": 3}})
        assert trainer.main(["--config", str(cfg)]) == 0
        out = tmp_path / f"{kind}.json"
        assert cli.main(["eval", "--checkpoint", str(tmp_path / kind / "step_0000003"), "--num-iterations", "1,4",
                         "--draws", "1", "--max-tokens", "200", "--json", str(out), "--no-progress"]) == 0
        rep = json.loads(out.read_text())
        if kind == "huginn":
            assert set(rep["ppl_at_k"]) == {"1", "4"}
        else:
            assert set(rep["ppl_at_k"]) == {"0", "1", "4"}
        assert cli.main(["generate", "--checkpoint", str(tmp_path / kind / "step_0000003"), "--prompt", "A",
                         "--max-tokens", "5", "--num-iterations", "4"]) == 0
    capsys.readouterr()


@pytest.mark.slow
def test_measured_curve_resumes_exactly(tmp_path, write_config):
    """loss_share re-measures a CE curve during training: a killed and resumed run matches an uninterrupted
    one, curve included."""
    options = {"block_sampling": "loss_share", "curve_every": 2, "noisy_input": "prev_token"}
    runs = {}
    for name, stops in (("straight", [0]), ("resumed", [4, 0])):
        cfg = db_config(write_config, tmp_path, name=name, diffusion=options,
                        train={"max_steps": 8, "save_every": 4})
        for stop in stops:
            args = ["--config", str(cfg)] + (["--stop-after", str(stop)] if stop else [])
            assert trainer.main(args) == 0
        out = tmp_path / name
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([r["loss"] for r in rows if "loss" in r],
                      json.loads((out / "step_0000008" / "manifest.json").read_text())["model_state"])
    (loss_a, state_a), (loss_b, state_b) = runs["straight"], runs["resumed"]
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    assert state_a["curve"]["ce"] == pytest.approx(state_b["curve"]["ce"], rel=1e-9)
    assert state_a["edges"] == pytest.approx([0.002, 0.301, 80.0], rel=1e-3)  # fixed by the config
