"""The registry of model kinds: `model.kind` -> its `Kind` plugin (looped_lm/kinds/base.py).

    get_kind("db_ar")          the plugin (UserError naming the registered kinds if there is none)
    kind_of(cfg)               the plugin of a run config
    register(MyKind())         add a kind (an out-of-tree package does this when it is imported)
    registered()               {name: plugin}, the built-in kinds first

Out-of-tree kinds are found the way vLLM finds its plugins: every module named by the
`looped_lm.kinds` entry-point group of an installed package, and every module listed in the
LOOPED_LM_PLUGINS environment variable (comma-separated; it reaches the launcher's worker processes),
is imported once, on the first lookup, and registers its kinds.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points

from looped_lm.errors import UserError
from looped_lm.kinds.base import (CAPABILITIES, LANGUAGE_SOURCES, BlockDiffusion, DiffusionSection, IterationLimits,
                                  Kind, LanguageModelSection, ModelSection, NoiseDiffusion, SequenceSection, ensure, require,
                                  resolve)
from looped_lm.kinds.builtin import BUILTIN


__all__ = ["CAPABILITIES", "LANGUAGE_SOURCES", "BlockDiffusion", "DiffusionSection", "IterationLimits", "Kind", "LanguageModelSection",
           "ModelSection", "NoiseDiffusion", "SequenceSection", "ensure", "get_kind", "kind_of", "register", "registered",
           "require", "resolve"]

ENTRY_POINT_GROUP = "looped_lm.kinds"
PLUGINS_ENV = "LOOPED_LM_PLUGINS"

_KINDS: dict[str, Kind] = {kind.name: kind for kind in BUILTIN}
_loaded = False


def register(kind: Kind) -> Kind:
    """Add `kind` (an instance of a `Kind` subclass). Its section must tag itself with its name."""
    if not isinstance(kind, Kind):
        raise TypeError(f"register() takes a Kind instance, got {type(kind).__name__}")
    if not issubclass(kind.section, ModelSection):
        raise TypeError(f"kind {kind.name}: its section must subclass looped_lm.kinds.ModelSection")
    if kind.section.model_fields["kind"].default != kind.name:
        raise TypeError(f"kind {kind.name}: its section's `kind` field must default to {kind.name!r}")
    if not issubclass(kind.diffusion, DiffusionSection):
        raise TypeError(f"kind {kind.name}: its diffusion section must subclass looped_lm.kinds.DiffusionSection")
    if not isinstance(kind.data_sources, dict) or not all(isinstance(k, str) for k in kind.data_sources):
        raise TypeError(f"kind {kind.name}: data_sources must map each data.source name to what data.path names "
                        "('' for none)")
    unknown = set(kind.capabilities) - set(CAPABILITIES)
    if unknown:
        raise TypeError(f"kind {kind.name}: unknown capabilities {sorted(unknown)} (known: {', '.join(CAPABILITIES)})")
    _KINDS[kind.name] = kind
    return kind


def _load_plugins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()
    for name in filter(None, (part.strip() for part in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UserError(f"{PLUGINS_ENV} names module {name!r}, which cannot be imported: {e}") from None


def registered() -> dict[str, Kind]:
    _load_plugins()
    return dict(_KINDS)


def get_kind(name: str) -> Kind:
    kinds = registered()
    if name not in kinds:
        raise UserError(f"model.kind {name!r} is not a registered kind (have: {', '.join(kinds)}); a kind of your "
                        f"own registers from a module named in {PLUGINS_ENV} or the {ENTRY_POINT_GROUP!r} entry point")
    return kinds[name]


def kind_of(cfg) -> Kind:
    return get_kind(cfg.model.kind)
