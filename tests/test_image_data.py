"""Image data with no download (looped_lm/data/images.py): digits, CIFAR pickles, augmentation, PNG grids."""

import io
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from looped_lm.data import images
from looped_lm.errors import UserError


def write_cifar(root, which=10, per_batch=3, bad_label=False):
    """A synthetic archive in CIFAR's python format: pickled dicts of uint8 rows (R, G, B planes of
    1024 pixels each) and labels, under the folder name the real archive unpacks to."""
    _, folder, train, test, key = images.CIFAR_LAYOUT[which]
    base = root / folder
    base.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i, name in enumerate(train + test):
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        data[0, :] = 0
        data[0, 1024:2048] = 255  # first image of each batch: pure green
        labels = [(i + j) % which for j in range(per_batch)]
        if bad_label and name == train[0]:
            labels[1] = which
        with open(base / name, "wb") as f:
            pickle.dump({b"data": data, key: labels, b"batch_label": name.encode()}, f)
    return base


def test_digits_split_and_scale():
    d = images.load_digits()
    assert d.train_x.shape == (1438, 1, 8, 8) and d.test_x.shape == (359, 1, 8, 8)
    assert d.train_x.min() == -1 and d.train_x.max() == 1 and d.num_classes == 10
    assert set(d.train_y.tolist()) == set(range(10))
    assert torch.equal(images.load_digits().test_y, d.test_y)  # a fixed split
    x, y = d.batch(16, torch.Generator().manual_seed(0), augmented=False)
    assert x.shape == (16, 1, 8, 8) and y.shape == (16,)


@pytest.mark.parametrize("which", [10, 100])
def test_cifar_from_folder_parent_and_tarball(tmp_path, which):
    base = write_cifar(tmp_path / "unpacked", which)
    n_train = 3 * len(images.CIFAR_LAYOUT[which][2])
    for path in (base, base.parent):
        d = images.load_cifar(path, which)
        assert d.train_x.shape == (n_train, 3, 32, 32) and d.test_x.shape == (3, 3, 32, 32)
        assert d.num_classes == which and d.train_y.max() < which
        green = d.train_x[0]
        assert (green[0] == -1).all() and (green[1] == 1).all() and (green[2] == -1).all()  # channel planes
    archive = tmp_path / images.CIFAR_LAYOUT[which][0]
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(base, arcname=base.name)
    from_tar = images.load_images(f"cifar{which}:{archive}")
    assert torch.equal(from_tar.train_x, d.train_x) and torch.equal(from_tar.test_y, d.test_y)


def test_cifar_bad_archives_name_the_file_and_layout(tmp_path):
    with pytest.raises(UserError, match="does not exist.*cifar-10-batches-py/ folder holding data_batch_1"):
        images.load_cifar(tmp_path / "missing", 10)
    base = write_cifar(tmp_path / "a", 10)
    os.remove(base / "data_batch_3")
    with pytest.raises(UserError, match="data_batch_3 is missing; expected CIFAR-10's python version"):
        images.load_cifar(base, 10)
    (base / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="data_batch_3 is not a CIFAR pickle"):
        images.load_cifar(base, 10)
    # a pickle that would run code when loaded is refused, not executed
    (base / "data_batch_3").write_bytes(pickle.dumps(os.system))
    with pytest.raises(UserError, match="refusing to load"):
        images.load_cifar(base, 10)
    with open(base / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), dtype=np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(UserError, match=r"holds data uint8 \(2, 100\)"):
        images.load_cifar(base, 10)
    with pytest.raises(UserError, match="label 10 outside 0 .. 9"):
        images.load_cifar(write_cifar(tmp_path / "b", 10, bad_label=True), 10)
    with pytest.raises(UserError, match="cifar-100-python"):
        images.load_cifar(tmp_path / "b", 100)  # a CIFAR-10 folder is not CIFAR-100
    broken = tmp_path / "x.tar.gz"
    broken.write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(UserError, match="not a readable tar archive"):
        images.load_cifar(broken, 10)
    with pytest.raises(UserError, match="unknown image source"):
        images.load_images("imagenet")


def test_augment_crops_from_the_padded_image_and_flips():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4)
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), value=-1.0)
    out = images.augment(x, torch.Generator().manual_seed(0), pad=1, flip=True)
    assert out.shape == x.shape
    for i in range(2):  # each output is some 4x4 window of the padded image, possibly mirrored
        windows = [padded[i, :, r:r + 4, c:c + 4] for r in range(3) for c in range(3)]
        assert any(torch.equal(out[i], w) or torch.equal(out[i], w.flip(-1)) for w in windows)
    a = images.augment(x, torch.Generator().manual_seed(5))
    assert torch.equal(a, images.augment(x, torch.Generator().manual_seed(5)))
    same = images.augment(x, torch.Generator().manual_seed(5), pad=0, flip=False)
    assert torch.equal(same, x)
    many = images.augment(x.repeat(200, 1, 1, 1), torch.Generator().manual_seed(1), pad=0, flip=True)
    flipped = (many == x.repeat(200, 1, 1, 1).flip(-1)).flatten(1).all(1).float().mean()
    assert 0.4 < float(flipped) < 0.6


def test_png_grid(tmp_path):
    from PIL import Image

    x = torch.linspace(-1, 1, 12 * 3 * 8 * 8).view(12, 3, 8, 8)
    grid = images.image_grid(x, nrow=5)
    assert grid.shape == (3 * 9 + 1, 5 * 9 + 1, 3) and grid.dtype == np.uint8
    assert grid[1, 1, 0] == 0 and grid[26, 17, 2] == 255  # first pixel black; image 11 (row 2, col 1) ends bright
    path = images.write_png_grid(x[:, :1], tmp_path / "out" / "grid.png", nrow=4, scale=2)
    with Image.open(io.BytesIO(path.read_bytes())) as im:
        assert im.size == (2 * (4 * 9 + 1), 2 * (3 * 9 + 1)) and im.mode == "L"
