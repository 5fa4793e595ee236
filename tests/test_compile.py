"""train.compile (looped_lm/compile.py): what is compiled for each LM kind traces with no graph break, computes
the eager loss and gradients, and compiles once per DB block, never again as steps switch blocks.

Most checks use dynamo with the `aot_eager` backend (the graphs and autograd that inductor would receive,
without its code generation, which takes tens of seconds per graph on this CPU); one test runs inductor
itself on the gpt loss."""

import pytest
import torch
import torch._dynamo

from looped_lm import compile as lc
from looped_lm import trainer
from looped_lm.config import config_from_dict
from looped_lm.kinds import get_kind
from looped_lm.models import build_model

MODELS = {
    "gpt": ({}, None),
    "db_ar": ({}, {"num_blocks": 2, "block_sampling": "round_robin", "clean_lm_weight": 1.0}),
    "looped_db": ({"n_prelude": 1, "n_coda": 1}, {"num_blocks": 1}),
    "huginn": ({"n_prelude": 1, "n_coda": 1, "mean_recurrence": 3, "backprop_depth": 2}, None),
}


def build(kind):
    extra, diffusion = MODELS[kind]
    raw = {"model": {"kind": kind, "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16, **extra}}
    if diffusion:
        raw["diffusion"] = diffusion
    torch.manual_seed(0)
    return build_model(config_from_dict(raw), 257).train()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 257, (2, 16), generator=g), torch.randint(0, 257, (2, 16), generator=g)


@pytest.fixture(autouse=True)
def fresh_dynamo(one_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_compiled_region_has_no_graph_break(kind):
    model, (x, y) = build(kind), batch()
    if kind == "gpt":
        explained = torch._dynamo.explain(lambda: model.training_loss(x, y, 0, 0)[0])()
    elif kind == "huginn":
        from looped_lm.models.layers import RotaryEmbedding  # noqa: F401  (the layer's own rope tables)

        cos, sin = model.rope(torch.arange(16))
        h = model.tok_emb(x)
        explained = torch._dynamo.explain(lambda: model.core[0](h, cos, sin))()
    else:
        explained = torch._dynamo.explain(lambda: model.objective.block_loss(x, y, 0)[0])()
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("kind", list(MODELS))
def test_compiled_losses_and_gradients_equal_eager(kind):
    compiled, eager, (x, y) = build(kind), build(kind), batch()
    assert lc.compile_for_training(compiled, get_kind(kind), backend="aot_eager")
    for step in range(4):  # both DB blocks, twice
        losses = []
        for model in (compiled, eager):
            model.zero_grad()
            torch.manual_seed(step)
            loss, _ = model.training_loss(x, y, step, 0)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind,graphs", [("gpt", 1), ("db_ar", 2), ("looped_db", 1)])
def test_one_graph_per_block_and_no_recompilation_as_steps_switch(kind, graphs):
    model, (x, y) = build(kind), batch()
    lc.compile_for_training(model, get_kind(kind), backend="eager")
    counters = torch._dynamo.utils.counters
    counters.clear()
    for step in range(8):  # round robin: blocks 0, 1, 0, 1, ...
        model.training_loss(x, y, step, 0)[0].backward()
    assert counters["stats"]["unique_graphs"] == graphs


def test_compile_setting():
    assert lc.compile_enabled("auto", torch.device("cuda")) and not lc.compile_enabled("auto", torch.device("cpu"))
    assert lc.compile_enabled("on", torch.device("cpu")) and not lc.compile_enabled("off", torch.device("cuda"))
    assert not lc.compile_for_training(object(), get_kind("vit"))  # a kind that says nothing runs eager


def test_the_trainer_trains_compiled(tmp_path, write_config, monkeypatch):
    """train.compile: on, a DB run through DeepSpeed: the same losses as the eager run."""
    monkeypatch.setattr(lc, "BACKEND", "aot_eager")
    logged = {}
    for setting in ("off", "on"):
        out = tmp_path / setting
        cfg = write_config(tmp_path / f"{setting}.yaml", {
            "model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
            "diffusion": {"num_blocks": 2, "block_sampling": "round_robin"},
            "train": {"out_dir": str(out), "max_steps": 4, "log_every": 1, "compile": setting}})
        assert trainer.main(["--config", str(cfg)]) == 0
        import json
        logged[setting] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                           if '"loss"' in line]
    assert len(logged["on"]) == 4
    assert logged["on"] == pytest.approx(logged["off"], rel=1e-5, abs=1e-6)


@pytest.mark.slow  # inductor generates and compiles C++ for the graph: about a minute on 2 cores
def test_inductor_compiles_the_gpt_loss_to_the_eager_value():
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True
    compiled, eager, (x, y) = build("gpt"), build("gpt"), batch()
    lc.compile_for_training(compiled, get_kind("gpt"), backend="inductor")
    a, b = compiled.training_loss(x, y, 0, 0)[0], eager.training_loss(x, y, 0, 0)[0]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    a.backward()
    b.backward()
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_compile_graphs_gives_each_function_room_for_its_graphs(monkeypatch):
    """Where torch.compile takes recompile_limit (2.12+), each compiled function gets its own count of graphs + 1;
    on older torch (the H200 image's 2.11) the process-wide limit grows by each call's graphs, since every model
    a process compiles shares one count per code object."""
    seen = []

    def new_compile(fn, *, backend=None, dynamic=None, recompile_limit=None, isolate_recompiles=False, **kw):
        seen.append((recompile_limit, isolate_recompiles))
        return fn

    monkeypatch.setattr(torch, "compile", new_compile)
    lc.compile_graphs(len, 4)
    assert seen == [(5, True)]

    def old_compile(fn, *, backend=None, dynamic=None, **kw):
        return fn

    monkeypatch.setattr(torch, "compile", old_compile)
    monkeypatch.setattr(lc, "_PROMISED", 0)
    # dynamo's own patch restores the key on exit; pytest 9.2's monkeypatch.undo hides it (every later
    # torch.compile in the process then fails)
    with torch._dynamo.config.patch(recompile_limit=8):
        lc.compile_graphs(len, 4)
        lc.compile_graphs(len, 4)
        lc.compile_graphs(len, 4)
        assert torch._dynamo.config.recompile_limit == 13
