"""Words YAML turns into booleans: train.compile is auto / on / off, and YAML 1.1 reads `on`, `off`, `yes`, `no`,
`true` and `false` as booleans, in a file and after `--set`. Each is taken as the switch the user meant."""

from __future__ import annotations

import argparse

import pytest

from looped_lm import fields
from looped_lm.config import describe_fields, load_config
from looped_lm.errors import UserError
from looped_lm.kinds import registered

TYPED = {"on": "on", "off": "off", "true": "on", "false": "off", "yes": "on", "no": "off", "True": "on", "OFF": "off",
         "auto": "auto", "'on'": "on"}


@pytest.mark.parametrize("typed,meant", TYPED.items())
def test_train_compile_takes_what_a_user_types_in_a_file(tmp_path, typed, meant):
    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  kind: gpt\ntrain:\n  compile: {typed}\n")
    assert load_config(str(path)).train.compile == meant


@pytest.mark.parametrize("typed,meant", TYPED.items())
def test_train_compile_takes_what_a_user_types_after_set(typed, meant):
    assert load_config(None, ["model.kind=gpt", f"train.compile={typed}"]).train.compile == meant


@pytest.mark.parametrize("typed", ["maybe", "1", "[on]"])
def test_other_words_are_refused_naming_the_choices(typed):
    with pytest.raises(UserError, match="train.compile") as e:
        load_config(None, ["model.kind=gpt", f"train.compile={typed}"])
    assert "auto" in str(e.value) and "on" in str(e.value) and "\n" not in str(e.value)


def test_the_serve_flag_takes_the_same_words():
    assert [fields.switch(w) for w in ("on", "true", "yes", "Off", "no", "auto")] == ["on", "on", "on", "off", "off",
                                                                                      "auto"]
    with pytest.raises(argparse.ArgumentTypeError, match="auto, on, off"):
        fields.switch("sometimes")


@pytest.mark.parametrize("kind", sorted(registered()))
def test_help_config_lists_each_field_of_a_kind_once(kind):
    """A field a kind's section redefines (db_ar's block_sampling) is listed once, with the kind's default."""
    text = describe_fields(kind=kind)
    blocks, current = {}, None
    for line in text.splitlines():
        if not line.startswith(" "):
            current = line.rstrip(":")
            continue
        if line.lstrip().startswith("#"):
            continue
        name = line.split()[0]
        assert name not in blocks.setdefault(current, set()), (kind, current, name)
        blocks[current].add(name)
    if kind == "db_ar":
        assert "block_sampling (str, default 'network_gain')" in text
