"""VAE latents for dit (looped_lm/data/latents.py): local .npy / safetensors shards read through memory
maps, `looped_lm prepare --vae` with a local AutoencoderKL (a tiny random one saved here: no download),
and the one-line errors when the layout, the labels or the VAE weights are wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.numpy import save_file

from looped_lm import cli
from looped_lm import trainer
from looped_lm.data.latents import load_latents
from looped_lm.errors import UserError

from conftest import DIST_VARS


def write_latents(root: Path, classes: int = 3, shape=(4, 4, 4), bad_label: bool = False) -> Path:
    """train/ as one safetensors shard and one .npy pair, val/ as one .npy pair; row i holds the value i."""
    rows = lambda start, n: np.arange(start, start + n, dtype=np.float32)[:, None, None, None] * np.ones(shape, np.float32)  # noqa: E731
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    save_file({"latents": rows(0, 5).astype(np.float16), "labels": np.arange(5) % classes}, str(root / "train" / "a.safetensors"))
    np.save(root / "train" / "b.npy", rows(5, 4))
    np.save(root / "train" / "b.labels.npy", np.array([0, 1, 2, classes if bad_label else 0]))
    np.save(root / "val" / "v.npy", rows(100, 3))
    np.save(root / "val" / "v.labels.npy", np.array([2, 1, 0]))
    (root / "meta.json").write_text(json.dumps({"format": "looped_lm-latents", "num_classes": classes}))
    return root


def test_shards_of_both_formats_read_as_one_array(tmp_path):
    data = load_latents(write_latents(tmp_path / "lat"))
    assert (len(data.train_x), data.channels, data.image_size, data.num_classes) == (9, 4, 4, 3)
    rows = data.train_x.take([8, 0, 5, 4, 4])  # across shards, any order, repeats
    assert rows.dtype == np.float32 and rows[:, 0, 0, 0].tolist() == [8, 0, 5, 4, 4]
    assert data.train_y.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 0]
    assert data.test_x.take([2])[0, 0, 0, 0] == 102


@pytest.mark.parametrize("damage, needles", [
    (lambda r: (r / "meta.json").unlink(), ("meta.json is missing",)),
    (lambda r: (r / "meta.json").write_text("{"), ("meta.json", "not readable JSON")),
    (lambda r: (r / "meta.json").write_text('{"num_classes": "x"}'), ("num_classes must be an integer",)),
    (lambda r: [p.unlink() for p in (r / "val").iterdir()], ("holds no .safetensors or .npy shard",)),
    (lambda r: (r / "train" / "b.labels.npy").unlink(), ("b.npy", "has no b.labels.npy")),
    (lambda r: (r / "train" / "a.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}"),
     ("a.safetensors", "not a safetensors file")),
    (lambda r: np.save(r / "val" / "v.npy", np.zeros((3, 4, 2, 2), np.float32)), ("train/ holds latents",)),
])
def test_malformed_latents_name_the_file_and_the_layout(tmp_path, damage, needles):
    root = write_latents(tmp_path / "lat")
    damage(root)
    with pytest.raises(UserError) as e:
        load_latents(root)
    for needle in needles:
        assert needle in str(e.value)
    assert "NAME.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_labels_out_of_range_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"has label 3 outside 0 \.\. 2"):
        load_latents(write_latents(tmp_path / "lat", bad_label=True))


# --- looped_lm prepare --vae -------------------------------------------------------------------------


def image_folder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory) -> Path:
    """A random 2-level AutoencoderKL (downsamples by 2) in diffusers' local format."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                        norm_num_groups=4, layers_per_block=1, sample_size=16)
    path = tmp_path_factory.mktemp("vae") / "vae"
    vae.save_pretrained(path)
    return path


def test_prepare_without_vae_weights_is_one_line_and_writes_nothing(tmp_path, capsys, one_line_error):
    src = image_folder(tmp_path / "imgs")
    (tmp_path / "empty_vae").mkdir()
    for vae in (tmp_path / "nowhere", tmp_path / "empty_vae"):
        code = cli.main(["prepare", "--vae", str(vae), "--source", f"imagefolder:{src}", "--out", str(tmp_path / "lat")])
        assert code == 2
        one_line_error(capsys.readouterr(), f"no VAE weights at {vae}", "config.json", "diffusion_pytorch_model")
    assert cli.main(["prepare", "--source", f"imagefolder:{src}", "--out", str(tmp_path / "lat")]) == 2
    one_line_error(capsys.readouterr(), "--vae DIR")
    assert cli.main(["prepare", "--vae", str(tmp_path / "nowhere"), "--source", f"imagefolder:{tmp_path / 'none'}",
                     "--out", str(tmp_path / "lat")]) == 2
    one_line_error(capsys.readouterr(), "train/ is missing", "train/<class>/*.JPEG")
    assert not (tmp_path / "lat").exists() and not list(tmp_path.glob(".lat*"))


def test_prepare_encodes_then_dit_trains_and_generate_decodes(tmp_path, tiny_vae, capsys, one_line_error):
    src = image_folder(tmp_path / "imgs")
    out = tmp_path / "lat"
    argv = ["prepare", "--vae", str(tiny_vae), "--source", f"imagefolder:{src}", "--out", str(out), "--image-size", "16"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "VAE latents [4, 8, 8]" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["num_classes"], meta["classes"], meta["splits"]) == (2, ["cat", "dog"], {"train": 4, "val": 4})
    data = load_latents(out)
    assert data.train_y.tolist() == [0, 0, 1, 1] and np.isfinite(data.train_x.take(range(4))).all()
    assert cli.main(argv) == 2  # already prepared
    one_line_error(capsys.readouterr(), "already prepared", "--overwrite")

    cfg = tmp_path / "dit.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"kind": "dit", "n_layers": 2, "d_model": 32, "n_heads": 2, "image_size": 8, "channels": 4,
                  "patch": 2, "num_classes": 2},
        "diffusion": {"num_blocks": 2, "block_sampling": "uniform"},
        "data": {"source": "latents", "path": str(out)},
        "train": {"max_steps": 2, "batch_size": 4, "warmup_steps": 0, "save_every": 0, "eval_every": 0,
                  "progress": False, "out_dir": str(tmp_path / "run")}}))
    before = {k: os.environ.get(k) for k in DIST_VARS}
    try:
        assert trainer.main(["--config", str(cfg)]) == 0
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    capsys.readouterr()
    gen = ["generate", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "s.png"), "--labels", "0,1,1",
           "--num-iterations", "4"]
    assert cli.main(gen) == 2
    one_line_error(capsys.readouterr(), "trained on VAE latents", "--vae DIR")
    assert not (tmp_path / "s.png").exists()
    assert cli.main([*gen, "--vae", str(tiny_vae)]) == 0, capsys.readouterr().err
    picture = np.asarray(Image.open(tmp_path / "s.png"))
    assert picture.shape == (2 * 18, 2 * (3 * 17 + 1), 3)  # three decoded 16x16 RGB samples in a row, shown 2x


def test_prepare_without_diffusers_names_the_extra(tmp_path, monkeypatch, capsys, one_line_error):
    import sys

    src = image_folder(tmp_path / "imgs")
    vae = tmp_path / "vae"
    vae.mkdir()
    (vae / "config.json").write_text("{}")
    (vae / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` now raises ImportError
    assert cli.main(["prepare", "--vae", str(vae), "--source", f"imagefolder:{src}", "--out", str(tmp_path / "lat")]) == 2
    one_line_error(capsys.readouterr(), "pip install 'looped_lm[latents]'")
    assert not (tmp_path / "lat").exists()
