"""The model contract, checked for every registered kind (the built-in ones and the out-of-tree plugin of
tests/plugins): built from its config through its plugin, fed by its own data functions, a training step
moves only the units it declares, its checkpoint state is JSON it accepts back, and its capabilities
agree with the interfaces its model implements."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from looped_lm.data.tokenizer import run_vocab
from looped_lm.config import config_from_dict
from looped_lm.data.batches import open_batches, prepare_data
from looped_lm.kinds import registered
from looped_lm.models import build_model
from looped_lm.models.contract import CachedDecoding, Iterative, Scorable, Trainable

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))
import bigram_kind  # noqa: E402,F401  (registers model.kind bigram)

TINY = {"n_layers": 2, "d_model": 32, "n_heads": 2}
SECTIONS = {  # kind -> (its model fields beyond TINY, the other sections it needs)
    "db_ar": ({"seq_len": 16}, {"diffusion": {"num_blocks": 2}}),
    "looped_db": ({"seq_len": 16, "n_prelude": 1, "n_coda": 1}, {"diffusion": {"num_blocks": 1}}),
    "huginn": ({"seq_len": 16, "n_prelude": 1, "n_coda": 1, "mean_recurrence": 3, "backprop_depth": 2}, {}),
    "vit": ({"image_size": 8, "channels": 1, "patch": 2}, {"diffusion": {"num_blocks": 2}, "data": {"source": "digits"}}),
    "dit": ({"image_size": 8, "channels": 1, "patch": 2}, {"diffusion": {"num_blocks": 2}, "data": {"source": "digits"}}),
    "mdm": ({"seq_len": 16}, {"diffusion": {"num_blocks": 2}}),
    "bigram": ({"seq_len": 16, "rank": 4}, {}),
}


def tiny_config(kind, cache_dir):
    fields, others = SECTIONS.get(kind.name, ({"seq_len": 16}, {}))
    model = {"kind": kind.name, **({k: v for k, v in TINY.items() if k in kind.section.model_fields}), **fields}
    diffusion = {"block_sampling": "uniform", **others.get("diffusion", {})}
    data = {"tokenizer": "byte", "cache_dir": str(cache_dir), **others.get("data", {})}
    return config_from_dict({"model": model, "diffusion": diffusion, "data": data})


def test_every_builtin_kind_has_a_tiny_config():
    assert set(SECTIONS) >= set(registered()) - {"gpt"}


@pytest.mark.parametrize("name", list(registered()))
def test_the_contract_of_every_kind(name, data_cache):
    kind = registered()[name]
    cfg = tiny_config(kind, data_cache)
    vocab, _ = run_vocab(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, vocab)
    assert isinstance(model, Trainable)

    # capabilities agree with the interfaces the model implements
    assert kind.offers("language_model") == (isinstance(model, CachedDecoding) and isinstance(model, Scorable))
    assert kind.offers("iterative") == isinstance(model, Iterative)
    if kind.offers("iterative"):
        limits = model.iteration_limits()
        assert limits.max_iterations == cfg.model.max_iterations, "the K bound is the config's model.max_iterations"
        # the tiny configs set no default K: DB kinds run one call per block, huginn its mean recurrence
        want = cfg.model.mean_recurrence if name == "huginn" else kind.num_blocks(cfg)
        assert limits.default_iterations == want
    assert len(kind.block_layers(cfg)) == kind.num_blocks(cfg) or not kind.offers("layer_split")

    # the kind's data functions feed it; a step moves only the units it declares
    batches = open_batches(cfg, prepare_data(cfg, vocab), "train")
    x, y = batches.get_batch(4, 0, 0, 0, 0)
    for step in range(3):
        model.zero_grad()
        loss, metrics = model.training_loss(x, y, step, seed=0)
        assert loss.dim() == 0 and math.isfinite(loss.item())
        assert all(math.isfinite(float(v)) for v in metrics.values())
        loss.backward()
        units = model.step_units(step, 0)
        moved = {model.param_unit(n) for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert moved, "a training step moves some parameters"
        if units is not None:
            assert moved <= units, f"step {step} moved {moved - units}, which it did not declare"
    # every parameter belongs to a unit a step can move (else it would never train)
    all_units = {model.param_unit(n) for n, _ in model.named_parameters()}
    declared = set().union(*[model.step_units(s, 0) or all_units for s in range(64)])
    assert all_units <= declared

    model.eval()
    a, b = model.validation_loss(x, y, seed=3), model.validation_loss(x, y, seed=3)
    assert torch.equal(a, b), "validation is deterministic for a seed"

    # checkpoint state: JSON, accepted back
    state = json.loads(json.dumps(model.checkpoint_state()))
    model.restore_state(state)
    if "num_blocks" in state:
        assert state["num_blocks"] == kind.num_blocks(cfg) and len(state["edges"]) == state["num_blocks"] + 1
        with pytest.raises(Exception, match="cannot resume|blocks"):
            model.restore_state({**state, "num_blocks": 99})
