"""Labelled images for the vit and dit modules, with no download.

Sources:
  digits                 scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes, one
                         channel; the `vision` extra), split 80/20 with a fixed permutation
  cifar10:PATH           CIFAR-10 python-pickle archive: PATH is `cifar-10-python.tar.gz`, the
                         `cifar-10-batches-py/` folder it unpacks to, or the folder holding either
  cifar100:PATH          CIFAR-100 likewise (`cifar-100-python.tar.gz`, `cifar-100-python/`)

Images come back as float32 (N, C, H, W) scaled to [-1, 1] with int64 labels. `augment` does the
standard random crop (from a copy padded with black by 1/8 of the width: CIFAR's 4 pixels) and
horizontal flip on a batch; digits should not be flipped (a mirrored 2 is not a 2), so flip is a
switch. `write_png_grid` saves a grid of images as a PNG with Pillow (the `vision` extra).

The CIFAR pickles are read with an unpickler that only builds numpy arrays, so a tampered archive
cannot run code.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from looped_lm.errors import UserError

CIFAR_LAYOUT = {
    10: ("cifar-10-python.tar.gz", "cifar-10-batches-py",
         [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels"),
    100: ("cifar-100-python.tar.gz", "cifar-100-python", ["train"], ["test"], b"fine_labels"),
}
DIGITS_TEST_FRACTION = 0.2


@dataclass
class ImageData:
    """Train and test images (N, C, H, W) float32 in [-1, 1], labels (N,) int64."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    @property
    def channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[-1])

    def batch(self, batch_size: int, generator: torch.Generator, augmented: bool = True, flip: bool = True,
              pad: int | None = None):
        """A random training batch (images, labels), augmented when asked (see `augment`)."""
        idx = torch.randint(self.train_x.shape[0], (batch_size,), generator=generator)
        x = self.train_x[idx]
        return (augment(x, generator, pad=pad, flip=flip) if augmented else x), self.train_y[idx]


def load_images(source: str) -> ImageData:
    """`digits`, `cifar10:PATH` or `cifar100:PATH` (see the module docstring)."""
    if source == "digits":
        return load_digits()
    kind, sep, path = source.partition(":")
    if sep and kind in ("cifar10", "cifar100") and path:
        return load_cifar(path, int(kind[5:]))
    raise UserError(f"unknown image source {source!r}: expected digits, cifar10:PATH or cifar100:PATH")


def load_digits(test_fraction: float = DIGITS_TEST_FRACTION, seed: int = 0) -> ImageData:
    try:
        from sklearn.datasets import load_digits as sk_digits  # optional: the vision extra
    except ImportError:
        raise UserError("the digits images need scikit-learn: pip install 'looped_lm[vision]'") from None
    d = sk_digits()
    images = torch.from_numpy(d.images.astype(np.float32) / 8.0 - 1.0)[:, None]  # 0..16 -> [-1, 1]
    labels = torch.from_numpy(d.target.astype(np.int64))
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = round(test_fraction * len(labels))
    test, train = perm[:n_test], perm[n_test:]
    return ImageData("digits", images[train], labels[train], images[test], labels[test], 10)


# --- CIFAR python-pickle archives ------------------------------------------------------------------


class _ArrayUnpickler(pickle.Unpickler):
    """Builds dicts, lists, bytes and numpy arrays only."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _cifar_error(which: int, where, problem: str) -> UserError:
    archive, folder, train, test, key = CIFAR_LAYOUT[which]
    return UserError(f"{where}: {problem}; expected CIFAR-{which}'s python version: {archive} or a {folder}/ "
                     f"folder holding {', '.join(train + test)} (pickled dicts with b'data' uint8 (N, 3072) and "
                     f"{key!r})")


def _read_member(which: int, path: Path, name: str) -> bytes | None:
    """The bytes of `name` from the archive or folder at `path` (None when it is not there)."""
    archive, folder, *_ = CIFAR_LAYOUT[which]
    if path.is_file():
        try:
            with tarfile.open(path, "r:*") as tar:
                try:
                    member = tar.getmember(f"{folder}/{name}")
                except KeyError:
                    return None
                f = tar.extractfile(member)
                return None if f is None else f.read()
        except tarfile.TarError as e:
            raise _cifar_error(which, path, f"not a readable tar archive ({e})") from None
    for candidate in (path / name, path / folder / name):
        if candidate.is_file():
            return candidate.read_bytes()
    return None


def _read_batch(which: int, path: Path, name: str):
    raw = _read_member(which, path, name)
    if raw is None:
        raise _cifar_error(which, path, f"{name} is missing")
    key = CIFAR_LAYOUT[which][4]
    try:
        batch = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # truncated, not a pickle, or not arrays
        raise _cifar_error(which, path, f"{name} is not a CIFAR pickle ({type(e).__name__}: {e})") from None
    if not isinstance(batch, dict) or b"data" not in batch or key not in batch:
        raise _cifar_error(which, path, f"{name} has no b'data' / {key!r} entries")
    data, labels = np.asarray(batch[b"data"]), np.asarray(batch[key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise _cifar_error(which, path, f"{name} holds data {data.dtype} {data.shape} with {len(labels)} labels")
    if len(labels) and (labels.min() < 0 or labels.max() >= which):
        raise _cifar_error(which, path, f"{name} has label {int(labels.max())} outside 0 .. {which - 1}")
    return data, labels


def load_cifar(path, which: int) -> ImageData:
    """CIFAR-10 or CIFAR-100 (which = 10 / 100) from its python-pickle archive or unpacked folder."""
    if which not in CIFAR_LAYOUT:
        raise UserError(f"CIFAR comes in 10 or 100 classes (got {which})")
    path = Path(path)
    if not path.exists():
        raise _cifar_error(which, path, "does not exist")
    _, _, train_names, test_names, _ = CIFAR_LAYOUT[which]

    def split(names):
        parts = [_read_batch(which, path, n) for n in names]
        data = np.concatenate([p[0] for p in parts]).reshape(-1, 3, 32, 32)
        images = torch.from_numpy(data.astype(np.float32) / 127.5 - 1.0)
        return images, torch.from_numpy(np.concatenate([p[1] for p in parts]).astype(np.int64))

    train_x, train_y = split(train_names)
    test_x, test_y = split(test_names)
    return ImageData(f"cifar{which}", train_x, train_y, test_x, test_y, which)


# --- augmentation and output ------------------------------------------------------------------------


def augment(images: torch.Tensor, generator: torch.Generator, pad: int | None = None,
            flip: bool = True) -> torch.Tensor:
    """Random crop of each image from its copy padded with black (-1) by `pad` pixels (default: 1/8 of
    the width, CIFAR's 4 at 32x32), and a random horizontal flip."""
    N, C, H, W = images.shape
    pad = max(1, W // 8) if pad is None else pad
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad), value=-1.0)
    dy = torch.randint(2 * pad + 1, (N,), generator=generator)  # top-left corner of each crop
    dx = torch.randint(2 * pad + 1, (N,), generator=generator)
    rows = (dy[:, None] + torch.arange(H))[:, None, :, None].expand(N, C, H, W + 2 * pad)
    cols = (dx[:, None] + torch.arange(W))[:, None, None, :].expand(N, C, H, W)
    out = padded.gather(2, rows).gather(3, cols)
    if flip:
        mirror = torch.rand(N, generator=generator) < 0.5
        out = torch.where(mirror[:, None, None, None], out.flip(-1), out)
    return out


def image_grid(images: torch.Tensor, nrow: int = 10, pad: int = 1) -> np.ndarray:
    """Images (N, C, H, W) in [-1, 1] -> one uint8 picture (rows*(H+pad)+pad, nrow*(W+pad)+pad, C)."""
    N, C, H, W = images.shape
    rows = -(-N // nrow)
    grid = np.zeros((rows * (H + pad) + pad, nrow * (W + pad) + pad, C), dtype=np.uint8)
    pixels = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i in range(N):
        r, c = divmod(i, nrow)
        grid[pad + r * (H + pad):pad + r * (H + pad) + H, pad + c * (W + pad):pad + c * (W + pad) + W] = pixels[i]
    return grid


def write_png_grid(images: torch.Tensor, path, nrow: int = 10, scale: int = 1) -> Path:
    """Save `image_grid(images)` as a PNG (Pillow), each pixel blown up `scale` times."""
    try:
        from PIL import Image  # optional: the vision extra
    except ImportError:
        raise UserError("writing PNG grids needs Pillow: pip install 'looped_lm[vision]'") from None
    grid = image_grid(images, nrow)
    picture = Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid)
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # renamed when complete: never a half-written PNG
    try:
        picture.save(tmp, format="PNG")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
