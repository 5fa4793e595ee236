"""The supporting modules through the product's own machinery: `looped_lm train` (the same trainer,
checkpoints, config and preflight as the language models), `looped_lm eval` (vit accuracy, mdm bits per
character) and `looped_lm generate` (dit PNG grids, mdm samples), on tiny configs and a few steps;
bad input is one line and exit 2, with nothing half-written."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from looped_lm import cli
from looped_lm import trainer
from looped_lm.data.text8 import ALPHABET

from conftest import DIST_VARS

SHAPE = {"n_layers": 2, "d_model": 32, "n_heads": 2}
IMAGES = {**SHAPE, "image_size": 8, "channels": 1, "patch": 2, "num_classes": 10}
MODULES = {
    "vit": {"model": {"kind": "vit", **IMAGES}, "data": {"source": "digits", "augment": False},
            "diffusion": {"parameterization": "edm", "loss_weight": "edm", "sample_top_quantile": 1.0}},
    "dit": {"model": {"kind": "dit", **IMAGES}, "data": {"source": "digits", "augment": False},
            "diffusion": {"sample_steps": 4}},
    "mdm": {"model": {"kind": "mdm", **SHAPE, "seq_len": 32}, "data": {"source": "bible"}, "diffusion": {}},
}


def module_config(path: Path, kind: str, out: Path, **sections) -> Path:
    raw = {k: dict(v) for k, v in MODULES[kind].items()}
    raw["diffusion"].update(num_blocks=2, block_sampling="uniform", overlap=0.05)
    raw["train"] = {"max_steps": 3, "batch_size": 8, "warmup_steps": 0, "save_every": 0, "eval_every": 3,
                    "eval_batches": 1, "log_every": 1, "progress": False, "out_dir": str(out), "lr": 3e-3}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_trainer(argv) -> int:
    before = {k: os.environ.get(k) for k in DIST_VARS}
    try:
        return trainer.main(argv)
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """One tiny trained checkpoint per module (B = 2), and the end-to-end vit: {name: run dir}."""
    root = tmp_path_factory.mktemp("modules")
    out = {}
    for name, kind, extra in (("vit", "vit", {}), ("dit", "dit", {}), ("mdm", "mdm", {}),
                              ("vit_e2e", "vit", {"model": {"end_to_end": True}})):
        cfg = module_config(root / f"{name}.yaml", kind, root / name, **extra)
        assert run_trainer(["--config", str(cfg)]) == 0
        out[name] = root / name
    return out


def main(argv, capsys):
    code = cli.main(argv)
    return code, capsys.readouterr()


# --- train: the same trainer, checkpoints and manifest ------------------------------------------


def test_modules_train_through_the_trainer_one_block_per_step(runs):
    for name, blocks, vocab, tokenizer, source in (("vit", 2, 10, "none", "digits"), ("dit", 2, 10, "none", "digits"),
                                                   ("mdm", 2, 27, "text8", "bible"), ("vit_e2e", 1, 10, "none", "digits")):
        ckpt = runs[name] / "step_0000003"
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["model_kind"] == name.split("_")[0]
        assert manifest["model_state"]["num_blocks"] == blocks
        assert (manifest["vocab_size"], manifest["tokenizer"], manifest["data"]["dir"]) == (vocab, tokenizer, source)
        rows = [json.loads(line) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "loss" in r]
        assert len(steps) == 3 and all(0 <= r["block"] < blocks for r in steps)
        assert any("val_loss" in r for r in rows)


def test_module_resume_is_exact(tmp_path):
    """A vit run stopped after 2 steps and resumed ends with the weights of an uninterrupted run (image
    batches, augmented here, block choice and noise draws included)."""
    from safetensors.torch import load_file

    def run(out, stop):
        cfg = module_config(tmp_path / f"{out}.yaml", "vit", tmp_path / out, data={"augment": True},
                            train={"max_steps": 4, "eval_every": 0})
        for s in stop:
            assert run_trainer(["--config", str(cfg), "--stop-after", str(s)]) == 0
        return load_file(tmp_path / out / "step_0000004" / "model.safetensors")

    whole, split = run("whole", [0]), run("split", [2, 2])
    assert whole.keys() == split.keys()
    for k in whole:
        torch.testing.assert_close(whole[k], split[k], rtol=0, atol=0)


# --- eval ------------------------------------------------------------------------------------------


def test_vit_eval_prints_accuracy_json_for_the_k_asked(runs, tmp_path, capsys):
    code, out = main(["eval", "--checkpoint", str(runs["vit"]), "--num-iterations", "4",
                      "--json", str(tmp_path / "acc.json"), "--max-tokens", "100"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert rep["num_iterations"] == 4 and rep["examples"] == 100 and 0 <= rep["accuracy"] <= 1
    assert json.loads((tmp_path / "acc.json").read_text()) == rep
    code, out = main(["eval", "--checkpoint", str(runs["vit"])], capsys)
    rep = json.loads(out.out)
    assert code == 0 and rep["num_iterations"] == 2 and rep["examples"] == 359  # K = B; the held-out 20%
    assert f"{rep['accuracy']:.4f}" in out.err
    code, out = main(["eval", "--checkpoint", str(runs["vit_e2e"])], capsys)
    assert code == 0 and json.loads(out.out)["num_iterations"] == 1


def test_vit_eval_is_the_models_accuracy(runs, capsys):
    """The number eval prints is the model's accuracy on the digits' held-out split, recomputed here."""
    from looped_lm.checkpoint import load_checkpoint, resolve_checkpoint
    from looped_lm.data.images import load_digits

    model, _, _ = load_checkpoint(resolve_checkpoint(runs["vit"]))
    data = load_digits()
    correct = model.accuracy(data.test_x, data.test_y, 2, generator=torch.Generator().manual_seed(0))["accuracy"]
    code, out = main(["eval", "--checkpoint", str(runs["vit"]), "--num-iterations", "2"], capsys)
    assert code == 0 and json.loads(out.out)["accuracy"] == pytest.approx(correct)


def test_mdm_eval_reports_bpc_as_an_upper_bound_with_block_shares(runs, capsys):
    code, out = main(["eval", "--checkpoint", str(runs["mdm"]), "--max-tokens", "256", "--draws", "2",
                      "--batch-size", "4"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert rep["upper_bound"] is True and "upper bound" in rep["bound"] and "upper bound" in out.err
    assert rep["characters"] == 256 and len(rep["per_block"]) == 2
    assert rep["t_intervals"] == [[0.5, 1.0], [0.0, 0.5]]  # block 0 owns the highest masking times
    assert rep["bpc"] == pytest.approx(sum(rep["per_block"]))
    assert sum(rep["share"]) == pytest.approx(1.0)
    # a barely trained model sits near the uniform log2(27) = 4.75 bits (measured 5.05): a leak would
    # give ~0, a bound summed wrongly over blocks would double it
    assert 0.5 * math.log2(27) < rep["bpc"] < 1.5 * math.log2(27)
    code, out = main(["eval", "--checkpoint", str(runs["mdm"]), "--max-tokens", "256", "--draws", "2",
                      "--split", "test"], capsys)
    assert code == 0 and json.loads(out.out)["split"] == "test"


def test_module_eval_errors_are_one_line(runs, capsys, one_line_error):
    for argv, needles in (
            (["--checkpoint", str(runs["vit"]), "--num-iterations", "1"], ("num_iterations (1)", "blocks (2)")),
            (["--checkpoint", str(runs["vit"]), "--num-iterations", "2,4"], ("one integer",)),
            (["--checkpoint", str(runs["vit"]), "--data", "bible"], ("vit reads",)),
            (["--checkpoint", str(runs["vit"]), "--data", "cifar10:/nowhere"], ("cifar-10-python.tar.gz",)),
            (["--checkpoint", str(runs["mdm"]), "--num-iterations", "2"], ("does not apply",)),
            (["--checkpoint", str(runs["mdm"]), "--max-tokens", "10"], ("less than one window",)),
            (["--checkpoint", str(runs["mdm"]), "--batch-size", "0"], ("--batch-size must be >= 1",)),
            (["--checkpoint", str(runs["dit"])], ("--features VIT_CHECKPOINT",)),
            (["--checkpoint", str(runs["dit"]), "--features", str(runs["mdm"])], ("mdm checkpoint, not a classifier",)),
            (["--checkpoint", str(runs["dit"]), "--features", str(runs["vit"]), "--num-iterations", "1"],
             ("num_iterations (sampler steps) (1)",))):
        code, out = main(["eval", *argv], capsys)
        assert code == 2, argv
        one_line_error(out, *needles)
        assert out.out == ""


def test_dit_eval_is_a_frechet_distance_in_a_vit_s_features_not_fid(runs, capsys):
    from looped_lm.checkpoint import load_checkpoint, resolve_checkpoint
    from looped_lm.data.images import load_digits
    from looped_lm.models.dit import frechet_distance

    code, out = main(["eval", "--checkpoint", str(runs["dit"]), "--features", str(runs["vit"]), "--max-tokens", "40",
                      "--num-iterations", "2", "--cfg-scale", "1.5"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert "NOT FID" in rep["metric"] and "NOT FID" in out.err
    assert (rep["samples"], rep["reference_images"], rep["num_iterations"], rep["cfg_scale"]) == (40, 1438, 2, 1.5)
    assert rep["steps_per_block"] == [1, 1] and rep["frechet_distance"] > 0
    # the floor: the first 40 held-out digits against all training digits, in the vit's features
    vit, _, _ = load_checkpoint(resolve_checkpoint(runs["vit"]))
    data = load_digits()
    feats = [vit.features(x, generator=torch.Generator().manual_seed(0)) for x in (data.test_x[:40], data.train_x)]
    assert rep["floor"] == pytest.approx(frechet_distance(*feats), rel=1e-4)


# --- generate --------------------------------------------------------------------------------------


def test_dit_generate_writes_a_png_grid_seeded_with_guidance_per_call(runs, tmp_path, capsys):
    base = ["generate", "--checkpoint", str(runs["dit"]), "--num-iterations", "6"]
    code, out = main([*base, "--out", str(tmp_path / "a.png"), "--labels", "0,1,2,3,4,5,6,7,8,9,3,3"], capsys)
    assert code == 0, out.err
    assert "per block [3, 3]" in out.err and "cfg scale 2.0" in out.err
    grid = np.asarray(Image.open(tmp_path / "a.png"))
    assert grid.shape == (4 * (2 * 9 + 1), 4 * (10 * 9 + 1))  # 12 samples, 10 a row, 1-pixel gaps; 8x8 shown 4x
    main([*base, "--out", str(tmp_path / "b.png"), "--labels", "0,1,2,3,4,5,6,7,8,9,3,3"], capsys)
    main([*base, "--out", str(tmp_path / "c.png"), "--labels", "0,1,2,3,4,5,6,7,8,9,3,3", "--cfg-scale", "4"], capsys)
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert (tmp_path / "a.png").read_bytes() != (tmp_path / "c.png").read_bytes()
    code, out = main(["generate", "--checkpoint", str(runs["dit"]), "--out", str(tmp_path / "d.png")], capsys)
    assert code == 0 and "4 steps" in out.err  # the config's sample_steps
    assert np.asarray(Image.open(tmp_path / "d.png")).shape == (4 * (4 * 9 + 1), 4 * (10 * 9 + 1))  # 4 per class


def test_mdm_generate_prints_samples_in_the_alphabet(runs, capsys):
    code, out = main(["generate", "--checkpoint", str(runs["mdm"]), "--num-samples", "3", "--length", "20",
                      "--num-iterations", "5"], capsys)
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert len(lines) == 3 and all(len(line) == 20 and set(line) <= set(ALPHABET) for line in lines)
    assert "per block [3, 2]" in out.err


def test_module_generate_errors_are_one_line_and_write_nothing(runs, tmp_path, capsys, one_line_error):
    png = tmp_path / "x.png"
    for argv, needles in (
            (["--checkpoint", str(runs["dit"]), "--out", str(png), "--num-iterations", "1"],
             ("num_iterations (sampler steps) (1)", "blocks (2)")),
            (["--checkpoint", str(runs["dit"]), "--out", str(png), "--labels", "3,10"], ("class id 10", "0 .. 9")),
            (["--checkpoint", str(runs["dit"]), "--out", str(png), "--labels", "a"], ("--labels",)),
            (["--checkpoint", str(runs["dit"])], ("--out FILE.png",)),
            (["--checkpoint", str(runs["dit"]), "--out", str(png), "--prompt", "x"], ("--prompt",)),
            (["--checkpoint", str(runs["mdm"]), "--num-iterations", "1"], ("blocks (2)",)),
            (["--checkpoint", str(runs["mdm"]), "--length", "33"], ("length", "1 .. 32")),
            (["--checkpoint", str(runs["mdm"]), "--out", str(png)], ("for dit",)),
            (["--checkpoint", str(runs["vit"])], ("vit checkpoint does neither",))):
        code, out = main(["generate", *argv], capsys)
        assert code == 2, argv
        one_line_error(out, *needles)
        assert not png.exists() and not list(tmp_path.glob(".*.tmp"))


# --- bad input at train time: one line, exit 2, no checkpoint ---------------------------------------


@pytest.mark.parametrize("kind, sections, needles", [
    ("vit", {"model": {"patch": 3}}, ("model.image_size (8) is not divisible by model.patch (3)",)),
    ("dit", {"diffusion": {"num_blocks": 4}}, ("diffusion.num_blocks (4) is larger than model.n_layers (2)",)),
    ("vit", {"model": {"image_size": 16}}, ("8x8 images with 1 channel", "model.image_size: 8")),
    ("vit", {"model": {"num_classes": 7}}, ("10 classes", "model.num_classes: 10")),
    ("dit", {"data": {"source": "cifar10", "path": "/nowhere/cifar"}}, ("cifar-10-python.tar.gz", "data_batch_1")),
    ("dit", {"data": {"source": "latents", "path": "/nowhere/latents"}}, ("meta.json", "train/ and val/")),
    ("mdm", {"data": {"source": "digits"}}, ("model.kind mdm reads data.source bible / text8",)),
    ("vit", {"diffusion": {"block_sampling": "loss_share"}}, ("diffusion.block_sampling must be one of uniform, round_robin, fixed",)),
    ("dit", {"diffusion": {"sample_steps": 1}}, ("diffusion.sample_steps (1)", "blocks (2)")),
])
def test_bad_module_runs_are_one_line_and_leave_no_checkpoint(tmp_path, capsys, one_line_error, kind, sections,
                                                              needles):
    cfg = module_config(tmp_path / "run.yaml", kind, tmp_path / "out", **sections)
    assert run_trainer(["--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), *needles)
    assert not list(tmp_path.glob("out/step_*"))


def test_text8_and_cifar_content_errors_name_the_file(tmp_path, capsys, one_line_error):
    from test_image_data import write_cifar

    bad_text = tmp_path / "text8"
    bad_text.write_text("the quick brown fox Jumps over the lazy dog " * 50)
    cfg = module_config(tmp_path / "t.yaml", "mdm", tmp_path / "out_t",
                        data={"source": "text8", "path": str(bad_text)})
    assert run_trainer(["--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), str(bad_text), "b'J'", "offset 20", "alphabet")
    bad_text.write_text("the quick brown fox jumps over the lazy dog " * 10)  # 440: val holds 22 characters
    assert run_trainer(["--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), "the val split holds 22 characters, fewer than model.seq_len (32)")
    write_cifar(tmp_path / "cifar", which=10, bad_label=True)
    cfg = module_config(tmp_path / "c.yaml", "vit", tmp_path / "out_c",
                        model={"image_size": 32, "channels": 3, "patch": 4},
                        data={"source": "cifar10", "path": str(tmp_path / "cifar")})
    assert run_trainer(["--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), "data_batch_1", "label 10 outside 0 .. 9")
    assert not list(tmp_path.glob("out_*/step_*"))


def test_vit_trains_on_a_cifar_archive(tmp_path):
    from test_image_data import write_cifar

    write_cifar(tmp_path / "cifar", which=100, per_batch=8)
    cfg = module_config(tmp_path / "c.yaml", "vit", tmp_path / "out",
                        model={"image_size": 32, "channels": 3, "patch": 8, "num_classes": 100},
                        data={"source": "cifar100", "path": str(tmp_path / "cifar"), "augment": True},
                        train={"max_steps": 2, "eval_every": 0})
    assert run_trainer(["--config", str(cfg)]) == 0
    manifest = json.loads((tmp_path / "out" / "step_0000002" / "manifest.json").read_text())
    assert manifest["data"]["dir"] == f"cifar100:{(tmp_path / 'cifar').resolve()}"


def test_export_and_serve_refuse_module_checkpoints_in_one_line(runs, tmp_path, capsys, one_line_error):
    code, out = main(["export", "--checkpoint", str(runs["vit"]), "--out", str(tmp_path / "hf")], capsys)
    assert code == 2
    one_line_error(out, "looped_lm export is for language models", "vit checkpoint")
    assert not (tmp_path / "hf").exists()
    code, out = main(["serve", "--checkpoint", str(runs["mdm"])], capsys)
    assert code == 2
    one_line_error(out, "looped_lm serve is for language models", "mdm checkpoint")


@pytest.mark.parametrize("zero", [0, 1])
def test_modules_train_in_bf16_under_autocast(tmp_path, zero):
    """deepspeed.bf16 (the paper recipes): images and noise levels are float inputs, so the modules run
    bf16 compute under autocast over fp32 weights; a resume continues from the saved state."""
    from safetensors.torch import load_file

    cfg = module_config(tmp_path / "run.yaml", "dit", tmp_path / "out", deepspeed={"bf16": True, "zero_stage": zero},
                        train={"max_steps": 3, "eval_every": 0})
    assert run_trainer(["--config", str(cfg), "--stop-after", "2"]) == 0
    assert run_trainer(["--config", str(cfg)]) == 0
    weights = load_file(tmp_path / "out" / "step_0000003" / "model.safetensors")
    assert all(w.dtype == torch.float32 for w in weights.values())
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
