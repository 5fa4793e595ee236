"""Hugging Face integration: `LoopedLMConfig` / `LoopedLMForCausalLM`, registered with the Auto classes.

`import looped_lm` calls `install_hook()`, which costs nothing: transformers is not imported. The
registration runs when the program itself first imports transformers' auto-config module (what
`AutoConfig` / `AutoModelForCausalLM` load), or at once if transformers' auto classes are already
loaded. Importing transformers eagerly would add seconds to every `import looped_lm`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

_CONFIG_AUTO = "transformers.models.auto.configuration_auto"  # AutoConfig
_MODEL_AUTO = "transformers.models.auto.modeling_auto"  # AutoModelForCausalLM (imports the former)
_done: set[str] = set()


def _register_config(module) -> None:
    from looped_lm.hf.configuration import LoopedLMConfig  # imports torch: seconds at start-up

    module.AutoConfig.register(LoopedLMConfig.model_type, LoopedLMConfig, exist_ok=True)
    _done.add(_CONFIG_AUTO)


def _register_model(module) -> None:
    from looped_lm.hf.configuration import LoopedLMConfig  # imports torch: seconds at start-up
    from looped_lm.hf.modeling import LoopedLMForCausalLM

    module.AutoModelForCausalLM.register(LoopedLMConfig, LoopedLMForCausalLM, exist_ok=True)
    _done.add(_MODEL_AUTO)


_REGISTER = {_CONFIG_AUTO: _register_config, _MODEL_AUTO: _register_model}


def register() -> None:
    """Register the looped_lm classes with AutoConfig and AutoModelForCausalLM now (idempotent)."""
    for name, fn in _REGISTER.items():
        if name not in _done:
            fn(importlib.import_module(name))


class _RegisterAfterLoad(importlib.abc.Loader):
    """Wraps the loader of transformers' auto module: run it, then register."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        if module.__name__ not in _done:
            _REGISTER[module.__name__](module)
        if len(_done) == len(_REGISTER):
            _uninstall()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _REGISTER or fullname in _done:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterLoad(spec.loader)
                return spec
        return None


_finder = _Finder()


def _uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def install_hook() -> None:
    """Register with each auto module already loaded; the others register when they first load."""
    for name, fn in _REGISTER.items():
        if name in sys.modules and name not in _done:
            fn(sys.modules[name])
    if len(_done) < len(_REGISTER) and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
