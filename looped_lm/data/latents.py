"""VAE latents for the dit module (the paper's ImageNet-256 setting): read from local shards, and written
by `looped_lm prepare --vae DIR`, which encodes images with diffusers' AutoencoderKL when its weights
are on this machine (the `latents` extra; nothing is downloaded).

Layout of a latents directory:
    meta.json                          {"format": "looped_lm-latents", "num_classes": 1000, "shape": [4, 32, 32],
                                        "scaling_factor": 0.18215, "vae": ..., "image_size": 256, ...}
    train/NAME.safetensors             tensors "latents" (n, C, H, W) float16/32 and "labels" (n,) int
    train/NAME.npy + NAME.labels.npy   the same as two numpy arrays (either format, or both, per shard)
    val/...                            the held-out split, same format
Latents are stored already multiplied by the VAE's scaling factor (so their spread is about 1) and are
read through memory maps: a batch reads only its own rows, so ImageNet's 1.28M latents (10 GB in
float16) never have to fit in memory.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from looped_lm.errors import UserError
from looped_lm.fields import TRAIN, TRAINING_SPLITS, VAL

FORMAT = "looped_lm-latents"
LAYOUT = ("expected a directory with meta.json ({\"format\": \"looped_lm-latents\", \"num_classes\": N}) and "
          "train/ and val/ holding NAME.safetensors (tensors 'latents' (n, C, H, W) and 'labels' (n,)) or "
          "NAME.npy with NAME.labels.npy; `looped_lm prepare --vae DIR` writes it")
_ST_DTYPES = {"F16": np.float16, "BF16": None, "F32": np.float32, "F64": np.float64, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "U8": np.uint8}


def _fail(where, problem: str) -> UserError:
    return UserError(f"{where}: {problem}; {LAYOUT}")


def _safetensors_arrays(path: Path) -> dict:
    """{name: read-only memmap} of a safetensors file, from its JSON header (8-byte length + JSON).

    Read by hand rather than with safetensors' `safe_open`, which copies each tensor it returns into
    memory: ImageNet-256 latents are about 10 GB per split, so they are memory-mapped instead."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n < (1 << 27) else None
    except (OSError, ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise _fail(path, "not a safetensors file")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise _fail(path, f"tensor {name!r} has dtype {info.get('dtype')}, not one of F16, F32, F64 or an integer")
        start, end = info["data_offsets"]
        out[name] = np.memmap(path, dtype=dtype, mode="r", offset=8 + n + start,
                              shape=tuple(info["shape"])) if end > start else np.zeros(info["shape"], dtype)
    return out


def _read_shard(path: Path):
    """(latents, labels) of one shard, both memory-mapped where possible."""
    if path.suffix == ".safetensors":
        arrays = _safetensors_arrays(path)
        if "latents" not in arrays or "labels" not in arrays:
            raise _fail(path, f"holds {sorted(arrays)}, not 'latents' and 'labels'")
        latents, labels = arrays["latents"], arrays["labels"]
    else:
        label_path = path.with_name(path.name[:-len(".npy")] + ".labels.npy")
        if not label_path.is_file():
            raise _fail(path, f"has no {label_path.name} beside it")
        try:
            latents, labels = np.load(path, mmap_mode="r"), np.load(label_path, mmap_mode="r")
        except ValueError as e:
            raise _fail(path, f"not a numpy array file ({e})") from None
    if latents.ndim != 4 or not np.issubdtype(latents.dtype, np.floating):
        raise _fail(path, f"latents must be floating point (n, C, H, W), got {latents.dtype} {latents.shape}")
    if labels.ndim != 1 or len(labels) != len(latents) or not np.issubdtype(labels.dtype, np.integer):
        raise _fail(path, f"labels must be integers (n,) = ({len(latents)},), got {labels.dtype} {labels.shape}")
    return latents, np.asarray(labels, dtype=np.int64)


class ShardedArray:
    """Rows of several memory-mapped (n_i, C, H, W) arrays seen as one (N, C, H, W) array."""

    def __init__(self, parts: list):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        self.shape = (int(self.starts[-1]), *parts[0].shape[1:])

    def __len__(self) -> int:
        return self.shape[0]

    def take(self, index) -> np.ndarray:
        """float32 rows `index` (any order, repeats allowed), reading only those rows."""
        index = np.asarray(index, dtype=np.int64)
        out = np.empty((len(index), *self.shape[1:]), dtype=np.float32)
        shard = np.searchsorted(self.starts, index, side="right") - 1
        for s in np.unique(shard):
            rows = np.flatnonzero(shard == s)
            out[rows] = self.parts[s][index[rows] - self.starts[s]]
        return out


@dataclass
class LatentData:
    """Train / held-out latents (ShardedArray) and labels (int64 tensors), like `images.ImageData`."""

    name: str
    train_x: ShardedArray
    train_y: object
    test_x: ShardedArray
    test_y: object
    num_classes: int
    meta: dict

    @property
    def channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[-1])


def _read_split(root: Path, split: str):
    folder = root / split
    if not folder.is_dir():
        raise _fail(root, f"{split}/ is missing")
    paths = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors"
                   or (p.name.endswith(".npy") and not p.name.endswith(".labels.npy")))
    if not paths:
        raise _fail(folder, "holds no .safetensors or .npy shard")
    shards = [_read_shard(p) for p in paths]
    shapes = {s[0].shape[1:] for s in shards}
    if len(shapes) > 1:
        raise _fail(folder, f"its shards hold latents of different shapes {sorted(shapes)}")
    return ShardedArray([s[0] for s in shards]), np.concatenate([s[1] for s in shards])


def load_latents(path) -> LatentData:
    """The latents directory at `path` (see the module docstring), checked: layout, shapes, labels."""
    import torch  # torch: seconds at start-up

    root = Path(path)
    if not root.is_dir():
        raise _fail(root, "does not exist or is not a directory")
    meta_path = root / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise _fail(root, "meta.json is missing") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise _fail(meta_path, f"not readable JSON ({e})") from None
    classes = meta.get("num_classes") if isinstance(meta, dict) else None
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 0:
        raise _fail(meta_path, f"num_classes must be an integer >= 0 (got {classes!r})")
    train_x, train_y = _read_split(root, TRAIN)
    test_x, test_y = _read_split(root, VAL)
    if train_x.shape[1:] != test_x.shape[1:]:
        raise _fail(root, f"train/ holds latents {train_x.shape[1:]} but val/ {test_x.shape[1:]}")
    if train_x.shape[-1] != train_x.shape[-2]:
        raise _fail(root, f"latents must be square, got {train_x.shape[1:]}")
    for split, labels in ((TRAIN, train_y), (VAL, test_y)):
        if len(labels) and (labels.min() < 0 or labels.max() >= max(classes, 1)):
            raise _fail(root / split, f"has label {int(labels.max() if labels.max() >= 0 else labels.min())} "
                                      f"outside 0 .. {max(classes, 1) - 1} (meta.json's num_classes {classes})")
    return LatentData(f"latents:{root}", train_x, torch.from_numpy(train_y), test_x, torch.from_numpy(test_y),
                      classes, meta)


# ---------------------------------------------------------------------------------------------
# writing: `looped_lm prepare --vae DIR --source ... --out DIR`


def write_shard(path: Path, latents: np.ndarray, labels: np.ndarray) -> None:
    """One safetensors shard (float16 latents, int64 labels), written under a temp name and renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"latents": np.ascontiguousarray(latents, dtype=np.float16),
               "labels": np.ascontiguousarray(labels, dtype=np.int64)}, str(tmp))
    tmp.replace(path)


VAE_FILES = "config.json and diffusion_pytorch_model.safetensors (or .bin)"


def load_vae(vae_dir, device: str = "cpu"):
    """diffusers' AutoencoderKL from a local directory; one line naming what is missing otherwise."""
    root = Path(vae_dir)
    weights = [root / "diffusion_pytorch_model.safetensors", root / "diffusion_pytorch_model.bin"]
    if not (root / "config.json").is_file() or not any(w.is_file() for w in weights):
        raise UserError(f"no VAE weights at {root}: expected a local diffusers AutoencoderKL directory with "
                        f"{VAE_FILES} (e.g. stabilityai/sd-vae-ft-ema, copied from a machine with a network)")
    try:
        from diffusers import AutoencoderKL  # optional: the latents extra
    except ImportError:
        raise UserError("encoding latents needs diffusers' AutoencoderKL: pip install 'looped_lm[latents]'") from None
    try:
        vae = AutoencoderKL.from_pretrained(str(root), local_files_only=True, low_cpu_mem_usage=False)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"cannot load the VAE at {root}: {str(e).strip().splitlines()[0]}") from None
    return vae.to(device).eval()


def _image_folder(root: Path, split: str):
    """(paths, labels, class names) of PATH/split/<class>/<image>: classes in sorted order, as ImageNet's."""
    folder = root / split
    if not folder.is_dir():
        raise UserError(f"{root}: {split}/ is missing; expected an image folder with train/<class>/*.JPEG and "
                        f"val/<class>/*.JPEG (ImageNet's layout)")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    suffixes = {".jpeg", ".jpg", ".png", ".bmp", ".webp"}
    items = [(p, c) for c, name in enumerate(classes) for p in sorted((folder / name).iterdir())
             if p.suffix.lower() in suffixes]
    if not items:
        raise UserError(f"{folder} holds no images in class folders (expected {split}/<class>/*.JPEG)")
    return [p for p, _ in items], np.array([c for _, c in items], dtype=np.int64), classes


def center_crop(image, size: int):
    """ADM's center crop (what DiT trains on): halve while large, resize the short side to `size` with
    bicubic, crop the middle."""
    from PIL import Image  # optional: the vision extra

    while min(image.size) >= 2 * size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = size / min(image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    left, top = (image.size[0] - size) // 2, (image.size[1] - size) // 2
    return image.crop((left, top, left + size, top + size))


def prepare_latents(source: str, out_dir, vae_dir, image_size: int = 256, batch_size: int = 32,
                    shard_size: int = 4096, device: str = "cpu", overwrite: bool = False, progress: bool = True) -> dict:
    """Encode `imagefolder:PATH` (train/ and val/ class folders) into a latents directory: each image
    center-cropped to image_size, encoded to the VAE posterior's mean, times the VAE's scaling factor.
    Written into a temp directory and renamed: an interrupted run leaves nothing that looks finished."""
    import torch  # torch, tqdm: seconds at start-up
    from PIL import Image  # optional: the vision extra
    from tqdm import tqdm

    kind, sep, path = source.partition(":")
    if kind != "imagefolder" or not sep or not path:
        raise UserError(f"--vae encodes --source imagefolder:PATH (train/ and val/ class folders), got {source!r}")
    out = Path(out_dir)
    if (out / "meta.json").exists() and not overwrite:
        raise UserError(f"{out} is already prepared (meta.json exists); pass --overwrite to replace it")
    if image_size < 8 or image_size % 8:
        raise UserError(f"--image-size must be a multiple of 8 (the VAE downsamples by 8), got {image_size}")
    splits = {s: _image_folder(Path(path), s) for s in TRAINING_SPLITS}
    vae = load_vae(vae_dir, device)
    factor = float(getattr(vae.config, "scaling_factor", 0.18215))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    counts = {}
    try:
        for split, (paths, labels, _) in splits.items():
            (tmp / split).mkdir(parents=True)
            buffer, n_shard = [], 0
            for i in tqdm(range(0, len(paths), batch_size), desc=f"encoding {split}", disable=not progress):
                pixels = []
                for p in paths[i:i + batch_size]:
                    try:
                        with Image.open(p) as im:
                            pixels.append(np.asarray(center_crop(im.convert("RGB"), image_size)))
                    except OSError as e:
                        raise UserError(f"cannot read image {p}: {e}") from None
                x = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float().div(127.5).sub(1).to(device)
                with torch.no_grad():
                    buffer.append(vae.encode(x).latent_dist.mean.mul(factor).float().cpu().numpy())
                done = sum(len(b) for b in buffer)
                if done >= shard_size or i + batch_size >= len(paths):
                    start = sum(counts.get(split, [0]))
                    write_shard(tmp / split / f"shard_{n_shard:05d}.safetensors", np.concatenate(buffer),
                                labels[start:start + done])
                    counts.setdefault(split, []).append(done)
                    buffer, n_shard = [], n_shard + 1
        meta = {"format": FORMAT, "num_classes": len(splits[TRAIN][2]), "classes": splits[TRAIN][2],
                "scaling_factor": factor, "vae": str(Path(vae_dir).resolve()), "image_size": image_size,
                "encoding": "posterior mean x scaling_factor, ADM center crop", "source": source,
                "splits": {s: sum(c) for s, c in counts.items()}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        meta["shape"] = list(load_latents(tmp).train_x.shape[1:])  # read back: the reader accepts what was written
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def decode_latents(vae, latents, factor: float):
    """Latents (N, C, H, W) as stored -> images (N, 3, 8H, 8W) in [-1, 1]."""
    import torch  # torch: seconds at start-up

    with torch.no_grad():
        return vae.decode(latents.to(next(vae.parameters()).device) / factor).sample.clamp(-1, 1).cpu()
