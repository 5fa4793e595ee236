"""LoRA adapters with `peft` (train.lora_rank > 0): low-rank updates on a frozen pretrained base.

`build_model` calls `attach` whenever the config asks for LoRA, so every path that builds a model
(training, resume, eval, generate, serve, the checkpoint checks) sees the same parameter names
(`...attn.qkv.base_layer.weight`, `...attn.qkv.lora_A.default.weight`).

What a job trains (the rest is frozen and holds no optimiser state):
    adapters   on train.lora_targets (qkv, proj, gate_up, down) of the layers the job owns: gpt and
               huginn every layer; db_ar / looped_db the blocks of diffusion.blocks_to_train (all when
               empty), plus the shared prelude and coda when the job trains every block
    adaLN      `ada` (d -> 6d) of the owned two-stream layers, by train.lora_ada: `full` (the default) the
               whole Linear trained; `lora` a rank-lora_rank adapter on it, whose B = 0 keeps adaLN-Zero's
               start, its zero-initialised weight frozen and its bias trained fully
    new parts  the other parameters a causal LM does not have, trained fully when the job owns the shared
               part: the noise embedding, the cosine head's scale and huginn's adapter
A checkpoint stores `adapter_names`: what the job trains, plus every frozen new part the base cannot
rebuild (its init is not the base's: the noise embedding of a block job, an `ada` bias the gates opened),
but not a frozen `ada` weight: it is zero from the init (adaLN-Zero) in every model these jobs build,
so the init rebuilds it (`rebuilt_names`; a load still accepts one, as older checkpoints saved them).
The base weights come back from model.init_from, whose sha256 the manifest records and a load verifies
(looped_lm/pretrained.py `load_base`).
"""

from __future__ import annotations

import importlib.util
import re

import torch
import torch.nn as nn

from looped_lm.config import LORA_TARGETS, Config
from looped_lm.errors import UserError
from looped_lm.kinds import kind_of, require

TARGETS = {"qkv": r"attn\.qkv", "proj": r"attn\.proj", "gate_up": r"mlp\.gate_up", "down": r"mlp\.down"}
assert set(TARGETS) == set(LORA_TARGETS)  # the names config validation accepts
NEW = re.compile(r"(^|\.)ada\.|^noise_emb\.|^log_scale$|^adapter\.")  # not in a causal LM: trained fully
ADA = r"ada"  # the adaLN Linear of a two-stream layer: train.lora_ada lora adapts it like a target
ADA_WEIGHT = re.compile(r"(^|\.)ada\.(base_layer\.)?weight$")  # zero at init (adaLN-Zero): rebuilt when frozen


def _owned(model, cfg: Config) -> tuple[list[str], bool]:
    """(regex prefixes of the layer lists this job adapts, whether it owns the shared part): the kind's
    `lora_layers` (looped_lm/kinds/builtin.py)."""
    kind = kind_of(cfg)
    require(kind, "lora", "train.lora_rank")
    return kind.lora_layers(cfg)


def target_regex(model, cfg: Config) -> str:
    """peft's target_modules as one regex (full match on module names) over the owned layers (their `ada`
    too with train.lora_ada lora)."""
    prefixes, _ = _owned(model, cfg)
    modules = "|".join([TARGETS[t] for t in cfg.train.lora_targets] + ([ADA] if cfg.train.lora_ada == "lora" else []))
    return rf"({'|'.join(prefixes)})\.\d+\.({modules})"


def attach(model: nn.Module, cfg: Config) -> nn.Module:
    """Wrap the target Linears with peft LoRA layers and set what trains (module doc); in place."""
    # peft imports transformers: seconds at start-up, for train.lora_rank only
    from peft import LoraConfig, inject_adapter_in_model

    t = cfg.train
    regex = target_regex(model, cfg)
    _refuse_unmatched_targets(model, cfg)
    if not any(re.fullmatch(regex, name) for name, _ in model.named_modules()):
        raise UserError(f"train.lora_targets {t.lora_targets} match no layer this job owns (model.kind "
                        f"{cfg.model.kind}, diffusion.blocks_to_train {cfg.diffusion.blocks_to_train})")
    config = LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout, target_modules=regex,
                        bias="none")
    inject_adapter_in_model(config, model)
    prefixes, shared = _owned(model, cfg)
    owned = re.compile(rf"({'|'.join(prefixes)})\.\d+\.")
    low_rank_ada = t.lora_ada == "lora"
    for name, p in model.named_parameters():
        new = bool(NEW.search(name)) and "lora_" not in name
        in_owned_layer = bool(owned.match(name))
        ada_weight = bool(ADA_WEIGHT.search(name))
        p.requires_grad_(("lora_" in name and in_owned_layer)
                         or (new and not (low_rank_ada and ada_weight)
                             and (in_owned_layer if ".ada." in name else shared)))
    return model


def _refuse_unmatched_targets(model: nn.Module, cfg: Config) -> None:
    """Each of train.lora_targets must match a module of the layers this job owns: one that matches none
    would silently train no adapter. Named, with the targets that do exist there."""
    prefixes, _ = _owned(model, cfg)
    names = [name for name, _ in model.named_modules()]
    found = [t for t in TARGETS if any(re.fullmatch(rf"({'|'.join(prefixes)})\.\d+\.({TARGETS[t]})", n) for n in names)]
    for target in cfg.train.lora_targets:
        if target not in found:
            raise UserError(f"train.lora_targets has {target!r}, which matches no module of the layers this job owns "
                            f"(model.kind {cfg.model.kind}; they have: {', '.join(found) or 'none'})")


def is_adapted(model: nn.Module) -> bool:
    if importlib.util.find_spec("peft") is None:  # adapters are attached only through peft (e.g. the vLLM venv)
        return False
    from peft.tuners.lora import LoraLayer  # peft imports transformers: seconds at start-up, for train.lora_rank only

    return any(isinstance(m, LoraLayer) for m in model.modules())


def rebuilt_names(model: nn.Module) -> list[str]:
    """The frozen `ada` weights: zero from the init (adaLN-Zero) in every model `attach` adapts, so an
    adapter checkpoint leaves them out (a load accepts them: older checkpoints saved them)."""
    return [n for n, p in model.named_parameters() if ADA_WEIGHT.search(n) and not p.requires_grad]


def adapter_names(model: nn.Module) -> list[str]:
    """What an adapter checkpoint stores: every LoRA tensor and every new part but the rebuilt ones
    (module doc)."""
    rebuilt = set(rebuilt_names(model))
    return [n for n, _ in model.named_parameters() if ("lora_" in n or NEW.search(n)) and n not in rebuilt]


def adapter_state(model: nn.Module) -> dict:
    params = dict(model.named_parameters())
    for n in rebuilt_names(model):  # a frozen weight the init zeroed: still zero, or the save would lose it
        if params[n].detach().any():
            raise RuntimeError(f"{n} is frozen and left out of the adapter checkpoint as the init rebuilds it "
                               "(zero), but it is not zero")
    with torch.no_grad():
        return {n: params[n].detach().to("cpu", copy=True).contiguous() for n in adapter_names(model)}


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain Linear back (export); in place."""
    from peft.tuners.lora import LoraLayer  # peft imports transformers: seconds at start-up, for train.lora_rank only

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    return model
