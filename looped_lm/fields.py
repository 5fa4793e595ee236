"""The building blocks of the typed config: strict pydantic sections and documented fields.

Every config section (config.py's and each model kind's `model:` section, looped_lm/kinds) is a
`Section`: unknown keys, wrong types and non-finite numbers are refused; every field carries a
one-line reason (its pydantic `description`), which `looped_lm train --help-config` prints.
"""

from __future__ import annotations

import argparse
import math
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _number_from_text(value):
    """YAML 1.1 reads `3e-4` (no dot) as a string: accept it where a number is expected."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _text_from_number(value):
    """`--set train.out_dir=2024` arrives as an int: a string field takes it as written."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


# what a user types for a switch: YAML 1.1 reads on/off, yes/no and true/false as booleans, in a file and after --set
SWITCH_WORDS = {"on": "on", "true": "on", "yes": "on", "off": "off", "false": "off", "no": "off", "auto": "auto"}


def switch_word(value):
    """An auto / on / off switch from what a user typed: a YAML boolean or any of SWITCH_WORDS, in any case."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return SWITCH_WORDS.get(value.strip().lower(), value)
    return value


# one spelling for each bound and choice that config, settings, the CLI and the server share
SEED_MAX = 2 ** 62 - 1  # train.seed's bound: seeds and their offsets fit torch's and the data hash's 64 bits
MAX_ITERATIONS = 4096  # the hard ceiling of model.max_iterations (K at inference) and of any K or draw count
DEFAULT_KIND = "gpt"  # the model.kind of a config that names none
MAX_DRAWS = 4096  # estimates per token (eval's chains per ppl@k, `--draws`): each is an antithetic pair of chains
Bridge = Literal["soft", "hard", "sample"]  # logits -> denoised embedding between a chain's steps
BRIDGES = get_args(Bridge)
# the splits of a run's data: train; val, held out (validation loss, eval's default); test, held out apart
# (data.test_fraction > 0, scored only by `looped_lm eval --split test`)
TRAIN, VAL, TEST = "train", "val", "test"
SPLITS = (TRAIN, VAL, TEST)
TRAINING_SPLITS = (TRAIN, VAL)  # what every prepared corpus holds and training reads
HELD_OUT_SPLITS = (VAL, TEST)  # what `looped_lm eval --split` scores


def token_file(split: str) -> str:
    """A split's token file in a prepared directory, by nanoGPT's names: train.bin / val.bin / test.bin."""
    return f"{split}.bin"


Float = Annotated[float, BeforeValidator(_number_from_text)]
Str = Annotated[str, BeforeValidator(_text_from_number)]
Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(switch_word)]


def field(default, doc: str):
    """A field with a one-line doc (its description)."""
    if isinstance(default, list):
        return Field(default_factory=lambda: list(default), description=doc)
    return Field(default, description=doc)


class Section(BaseModel):
    # strict: no silent int->bool or "1"->1; ints are still taken where floats are expected
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    def check(self) -> None:
        """Impossible values among this section's own fields: raise UserError naming the key. (Checks
        that read other sections belong to the kind, `Kind.validate`, or to config.validate.)"""


# --- argparse types: a flag follows the same rules as a config field -----------------------------


def finite_float(text: str) -> float:
    """A float flag: NaN and Inf are refused (argparse prints `argument --x: ...`, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def switch(text: str) -> str:
    """An auto / on / off flag, which takes the same words as a switch field of the config."""
    word = switch_word(text)
    if word not in ("auto", "on", "off"):
        raise argparse.ArgumentTypeError(f"must be one of auto, on, off (or true / false, yes / no), got {text!r}")
    return word


def seed(text: str) -> int:
    """A --seed flag: an integer in 0..SEED_MAX (torch's generators take 64-bit seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be in 0..2**62 - 1, got {text}")
    return value
