"""Batches for every model kind behind one interface, so the trainer's loop, its validation and
preflight never ask which kind they train: a new kind is a model plus a data source.

    module_vocab(cfg) -> (vocab_size, tokenizer)   a module's output vocabulary, from its config alone
    check_module_data(cfg) -> source string         preflight: a module's data, checked against the model
    open_batches(cfg, data_dir, split) -> batches   split "train" or "val"; data_dir: what preflight found
    batches.get_batch(batch_size, seed, step, micro_step, rank) -> (x, y)
        a pure function of the five numbers (a resumed run sees the batches an uninterrupted one would)
    batches.unit, batches.units_per_example          what throughput counts: tokens, images, characters

  language models   token files (nanoGPT's train.bin / val.bin, `TokenStream`): x, y = y shifted by one
  vit / dit         images or VAE latents and their labels; "val" is the held-out split (the test split of
                    digits and CIFAR, whose archives have no other; val/ of a latents directory), never
                    augmented; training images get data.augment's random crop and flip (digits: no flip)
  mdm               windows of model.seq_len characters in text8's alphabet; y is None (the targets are x)
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from looped_lm.config import MODULE_KINDS, Config
from looped_lm.data.bin_dataset import batch_seed
from looped_lm.errors import UserError

SPLITS = ("train", "val")


def module_source(cfg: Config) -> str:
    """The loader string of a module's data: digits, cifar10:PATH, cifar100:PATH, latents:PATH, bible,
    text8:PATH (paths made absolute, so a checkpoint names the same files from any directory)."""
    d = cfg.data
    return d.source if d.source in ("digits", "bible") else f"{d.source}:{Path(d.path).resolve()}"


@lru_cache(maxsize=4)
def load_module_data(source: str):
    """The ImageData / LatentData / CharSplits of a source string, loaded once per process."""
    kind, _, path = source.partition(":")
    if kind in ("bible", "text8"):
        from looped_lm.data.text8 import load_chars

        return load_chars(source)
    if kind == "latents":
        from looped_lm.data.latents import load_latents

        return load_latents(path)
    from looped_lm.data.images import load_images

    return load_images(source)


def module_vocab(cfg: Config) -> tuple[int, str]:
    """(output vocabulary, tokenizer name for the manifest) of a module: its classes (vit, dit) or
    text8's 27 characters (mdm)."""
    if cfg.model.kind == "mdm":
        from looped_lm.data.text8 import VOCAB_SIZE

        return VOCAB_SIZE, "text8"
    return cfg.model.num_classes, "none"


def check_module_data(cfg: Config) -> str:
    """Load a module's data and check it against model.*: image side and channels, classes, and enough
    characters for one window. One line naming the mismatch and the setting to change. Returns the
    source string (`module_source`): what the manifest records and `open_batches` reads."""
    m, source = cfg.model, module_source(cfg)
    data = load_module_data(source)
    if m.kind == "mdm":
        for split in SPLITS:
            n = len(data.split(split))
            if n < m.seq_len:
                raise UserError(f"data.source {cfg.data.source}: the {split} split holds {n} characters, fewer than "
                                f"model.seq_len ({m.seq_len})")
        return source
    what = f"data.source {cfg.data.source} holds {data.image_size}x{data.image_size} images with {data.channels} " \
           f"channel{'s' if data.channels > 1 else ''} and {data.num_classes} classes"
    if (data.image_size, data.channels) != (m.image_size, m.channels):
        raise UserError(f"{what}; set model.image_size: {data.image_size} and model.channels: {data.channels} "
                        f"(got {m.image_size} and {m.channels})")
    allowed = (data.num_classes, 0) if m.kind == "dit" else (data.num_classes,)
    if m.num_classes not in allowed:
        raise UserError(f"{what}; set model.num_classes: {data.num_classes}{' (or 0: unconditional)' if m.kind == 'dit' else ''} "
                        f"(got {m.num_classes})")
    return source


class TokenBatches:
    """A language model's token file (see `bin_dataset.TokenStream`)."""

    unit = "tokens"

    def __init__(self, path: str, seq_len: int):
        from looped_lm.data.bin_dataset import TokenStream

        self.stream = TokenStream(path, seq_len)
        self.units_per_example = seq_len

    def get_batch(self, batch_size: int, seed: int, step: int, micro_step: int, rank: int):
        return self.stream.get_batch(batch_size, seed, step, micro_step, rank)


class ImageBatches:
    """Random (images, labels) batches of one split: images float32 (N, C, H, W), labels int64 (N,)."""

    unit, units_per_example = "images", 1

    def __init__(self, images, labels, augment: bool = False, flip: bool = True):
        self.images, self.labels, self.augment, self.flip = images, labels, augment, flip

    def get_batch(self, batch_size: int, seed: int, step: int, micro_step: int, rank: int):
        import torch

        from looped_lm.data.images import augment

        g = torch.Generator().manual_seed(batch_seed(seed, step, micro_step, rank))
        idx = torch.randint(len(self.labels), (batch_size,), generator=g)
        x = self.images[idx] if torch.is_tensor(self.images) else torch.from_numpy(self.images.take(idx.numpy()))
        return (augment(x, g, flip=self.flip) if self.augment else x), self.labels[idx]


class CharBatches:
    """Random windows (N, seq_len) int64 of one split of a character corpus; y is None."""

    unit = "characters"

    def __init__(self, chars, split: str, seq_len: int):
        self.chars, self.split, self.units_per_example = chars, split, seq_len

    def get_batch(self, batch_size: int, seed: int, step: int, micro_step: int, rank: int):
        import torch

        g = torch.Generator().manual_seed(batch_seed(seed, step, micro_step, rank))
        return self.chars.batch(batch_size, self.units_per_example, g, self.split), None


def open_batches(cfg: Config, data_dir: str, split: str):
    """The `split` batches of a run whose data preflight found (`Plan.data_dir`: a token directory, or a
    module's source string)."""
    if split not in SPLITS:
        raise UserError(f"split must be train or val (got {split!r})")
    if cfg.model.kind not in MODULE_KINDS:
        return TokenBatches(str(Path(data_dir) / f"{split}.bin"), cfg.model.seq_len)
    data = load_module_data(data_dir)
    if cfg.model.kind == "mdm":
        return CharBatches(data, split, cfg.model.seq_len)
    train = split == "train"
    images, labels = (data.train_x, data.train_y) if train else (data.test_x, data.test_y)
    # augmentation is for pixels: a flipped or shifted latent is not the latent of the shifted image
    augment = train and cfg.data.augment and cfg.data.source != "latents"
    return ImageBatches(images, labels, augment=augment, flip=cfg.data.source != "digits")
