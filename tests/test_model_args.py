"""Networks are built from their own frozen args (looped_lm/models/args.py): from a literal as from a run config."""

import dataclasses
from pathlib import Path

import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.kinds import IterationLimits, kind_of
from looped_lm.models import build_model, build_network, network_args
from looped_lm.models.args import DBArgs, GPTArgs, RunConfigArgs
from looped_lm.models.db import DiffusionBlocksLM
from looped_lm.models.gpt import GPT
from looped_lm.models.layers import AttentionOptions, LayerOptions

V = 47


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_gpt_from_a_literal_equals_gpt_from_its_config():
    cfg = config_from_dict({"model": {"kind": "gpt", "n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16,
                                      "tie_embeddings": False, "qk_norm": True}})
    literal = GPTArgs(vocab_size=V, n_layers=2, d_model=32, n_heads=4, seq_len=16, tie_embeddings=False,
                      layer=LayerOptions(AttentionOptions(qk_norm=True)))
    assert network_args(cfg, V) == literal
    torch.manual_seed(0)
    from_config = build_model(cfg, V)
    torch.manual_seed(0)
    from_literal = GPT(literal)
    assert same_state(from_config, from_literal) and from_literal.max_positions == 64


def test_db_ar_from_a_literal_equals_db_ar_from_its_config():
    cfg = config_from_dict({"model": {"kind": "db_ar", "n_layers": 4, "d_model": 32, "n_heads": 4, "seq_len": 16,
                                      "n_prelude": 1},
                            "diffusion": {"layers_per_block": [3, 1], "noisy_input": "clean_state"}})
    limits = IterationLimits(default_iterations=2, max_iterations=64, num_blocks=2, default_bridge="sample",
                             adaptive_exit=True, extra_calls="block0")
    literal = DBArgs(vocab_size=V, n_layers=4, d_model=32, n_heads=4, seq_len=16, n_prelude=1, block_layers=(3, 1),
                     noisy_input="clean_state", limits=limits)
    assert network_args(cfg, V) == literal
    torch.manual_seed(0)
    from_config = build_model(cfg, V)
    torch.manual_seed(0)
    from_literal = DiffusionBlocksLM(literal)
    assert same_state(from_config, from_literal)
    assert [len(block) for block in from_literal.blocks] == [3, 1]
    assert from_literal.iteration_limits() == limits == kind_of(cfg).iteration_limits(cfg)
    assert from_literal.objective.args is literal  # the objective reads the same args


def test_args_are_frozen_and_hold_no_list():
    args = network_args(config_from_dict({"model": {"kind": "db_ar", "n_layers": 2},
                                          "diffusion": {"num_blocks": 2, "blocks_to_train": [1],
                                                        "block_sampling": "fixed", "block_weights": [1, 2]}}), V)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.d_model = 64
    assert args.blocks_to_train == (1,) and args.block_weights == (1.0, 2.0) and args.block_layers == (1, 1)
    hash(args)  # every field is immutable


def test_a_kind_without_args_builds_from_the_run_config(monkeypatch):
    """An out-of-tree kind written before args (tests/plugins/bigram_kind.py: no `args`) still builds: its
    builder takes the run config."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    import bigram_kind  # noqa: F401  (registers the kind)

    cfg = config_from_dict({"model": {"kind": "bigram", "rank": 4, "seq_len": 8}})
    args = network_args(cfg, V)
    assert isinstance(args, RunConfigArgs) and args.kind == "bigram"
    model = build_network(args)
    assert model.inp.weight.shape == (V, 4)
