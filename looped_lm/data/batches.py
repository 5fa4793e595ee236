"""Batches for every model kind behind one interface, so the trainer's loop, its validation and
preflight never ask which kind they train: each kind's plugin names its data functions (`Kind.prepare`,
`Kind.batches`), and these are the built-in ones.

    prepare_data(cfg, vocab_size) -> location       preflight: the kind's data, found and checked
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

from looped_lm.config import Config
from looped_lm.data.bin_dataset import TokenStream, batch_seed
from looped_lm.data.latents import load_latents
from looped_lm.data.prepare import ensure_prepared
from looped_lm.errors import UserError
from looped_lm.fields import TEST, TRAIN, TRAINING_SPLITS, token_file
from looped_lm.kinds import kind_of, resolve


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
        from looped_lm.data.text8 import load_chars  # imports torch: seconds at start-up

        return load_chars(source)
    if kind == "latents":
        return load_latents(path)
    from looped_lm.data.images import load_images  # imports torch: seconds at start-up

    return load_images(source)


def check_module_data(cfg: Config) -> str:
    """Load a module's data and check it against model.*: image side and channels, classes, and enough
    characters for one window. One line naming the mismatch and the setting to change. Returns the
    source string (`module_source`): what the manifest records and `open_batches` reads."""
    m, source = cfg.model, module_source(cfg)
    data = load_module_data(source)
    if kind_of(cfg).batches == CHARS:
        for split in TRAINING_SPLITS:
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
    unconditional = getattr(kind_of(cfg), "unconditional", False)  # the kind may ignore the labels
    allowed = (data.num_classes, 0) if unconditional else (data.num_classes,)
    if m.num_classes not in allowed:
        raise UserError(f"{what}; set model.num_classes: {data.num_classes}{' (or 0: unconditional)' if unconditional else ''} "
                        f"(got {m.num_classes})")
    return source


class TokenBatches:
    """A language model's token file (see `bin_dataset.TokenStream`)."""

    unit = "tokens"

    def __init__(self, path: str, seq_len: int):
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
        import torch  # torch: seconds at start-up

        from looped_lm.data.images import augment  # imports torch: seconds at start-up

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
        import torch  # torch: seconds at start-up

        g = torch.Generator().manual_seed(batch_seed(seed, step, micro_step, rank))
        return self.chars.batch(batch_size, self.units_per_example, g, self.split), None


CHARS = "looped_lm.data.batches:char_batches"  # mdm's `Kind.batches`


def token_batches(cfg: Config, data_dir: str, split: str) -> TokenBatches:
    """A language model's `split` token file in the directory preflight prepared."""
    return TokenBatches(str(Path(data_dir) / token_file(split)), cfg.model.seq_len)


def char_batches(cfg: Config, source: str, split: str) -> CharBatches:
    return CharBatches(load_module_data(source), split, cfg.model.seq_len)


def image_batches(cfg: Config, source: str, split: str) -> ImageBatches:
    data = load_module_data(source)
    train = split == TRAIN
    images, labels = (data.train_x, data.train_y) if train else (data.test_x, data.test_y)
    # augmentation is for pixels: a flipped or shifted latent is not the latent of the shifted image
    augment = train and cfg.data.augment and cfg.data.source != "latents"
    return ImageBatches(images, labels, augment=augment, flip=cfg.data.source != "digits")


def open_batches(cfg: Config, data_dir: str, split: str):
    """The `split` batches of a run whose data preflight found (`Plan.data_dir`: a token directory, or a
    module's source string), through the kind's `batches` function."""
    if split not in TRAINING_SPLITS:
        raise UserError(f"split must be {' or '.join(TRAINING_SPLITS)} (got {split!r})")
    return resolve(kind_of(cfg).batches)(cfg, data_dir, split)


def prepare_data(cfg: Config, vocab_size: int) -> str:
    """Where the run's data is, checked against the model (the kind's `prepare` function)."""
    return resolve(kind_of(cfg).prepare)(cfg, vocab_size)


def prepare_module_data(cfg: Config, vocab_size: int) -> str:
    """A module's images, latents or characters: their source string (`module_source`), checked."""
    return check_module_data(cfg)


def prepare_tokens(cfg: Config, vocab_size: int) -> str:
    """A language model's corpus, tokenized once into the cache: its absolute directory."""
    cache = Path(cfg.data.cache_dir)
    existing = next((p for p in [cache, *cache.parents] if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserError(f"data.cache_dir {cache}: {existing} is a file, not a directory")
    if cfg.data.source == "bin":
        root = Path(cfg.data.path)
        for split in map(token_file, TRAINING_SPLITS):
            if not (root / split).is_file():
                raise UserError(f"data.path {root} has no {split} (expected nanoGPT's train.bin / val.bin)")
    data_dir = Path(ensure_prepared(data_source_string(cfg), cfg.data.cache_dir, cfg.data.tokenizer,
                                    cfg.data.val_fraction, split_seed(cfg),
                                    test_fraction=cfg.data.test_fraction)).resolve()
    for split in TRAINING_SPLITS + ((TEST,) if cfg.data.test_fraction > 0 else ()):
        TokenStream(str(data_dir / token_file(split)), cfg.model.seq_len, vocab_size)
    return str(data_dir)


def split_seed(cfg: Config) -> int:
    """The seed of the train / validation document split: data.split_seed, or train.seed when it is -1
    (every run before the field existed), so seeds can vary without moving the held-out documents."""
    return cfg.train.seed if cfg.data.split_seed < 0 else cfg.data.split_seed


def data_source_string(cfg: Config) -> str:
    d = cfg.data
    return {"bible": "bible", "shakespeare": "shakespeare", "files": d.path, "hf": f"hf:{d.path}",
            "bin": d.path}[d.source]
