"""Untied heads: a source whose lm_head is separate from its embedding (tie_word_embeddings false, as most
Llama- and Mistral-family checkpoints above the smallest sizes) converts exactly into every language-model kind,
and the run goes through train, eval, generate, serve, export, merge and verify with the head kept apart."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_pretrained import D, FFN, HEADS, KV, LAYERS, V, clean_logits, tokens

from looped_lm import cli, trainer
from looped_lm.config import config_from_dict, with_source_shape
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.models import build_model
from looped_lm.pretrained import init_from_pretrained, source_shape

KINDS = {"gpt": {}, "db_ar": {"n_layers": 3, "n_prelude": 1},
         "looped_db": {"n_layers": 2, "n_prelude": 1, "n_coda": 1},
         "huginn": {"n_layers": 2, "n_prelude": 1, "n_coda": 1, "mean_recurrence": 2, "backprop_depth": 2}}
DIFFUSION = {"db_ar": {"num_blocks": 2, "context": "stacked", "layers_per_block": [2, 1]},
             "looped_db": {"num_blocks": 1}}


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """A random tiny Llama with its own lm_head (not the embedding), saved with the byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("untied")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=64, tie_word_embeddings=False, eos_token_id=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        model.lm_head.weight.normal_(0, 0.1)  # far from the embedding: a tied reading would show
    model.save_pretrained(root, safe_serialization=True)
    get_tokenizer("byte").to_hf().save_pretrained(root)
    assert "lm_head.weight" in load_file(str(root / "model.safetensors"))
    return root, model


def converted(kind: str, root, **diffusion):
    raw = {"model": {"kind": kind, "seq_len": 16, "init_from": str(root), **KINDS[kind]}}
    if kind in DIFFUSION:
        raw["diffusion"] = {**DIFFUSION[kind], **diffusion}
    cfg = config_from_dict(with_source_shape(raw, source_shape))
    net = build_model(cfg, V)
    init_from_pretrained(net, cfg)
    return net.eval(), cfg


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_converts_an_untied_source_exactly(untied, kind):
    root, hf = untied
    net, cfg = converted(kind, root)
    assert cfg.model.tie_embeddings is False and net.lm_head is not None
    torch.testing.assert_close(net.lm_head.weight, hf.lm_head.weight, atol=0, rtol=0)
    x = tokens()
    with torch.no_grad():
        got = {"gpt": lambda: net(x)[0], "huginn": lambda: net(x, 2)}.get(kind, lambda: clean_logits(net, x))()
        torch.testing.assert_close(got, hf(x).logits, atol=1e-5, rtol=0)


def test_a_run_config_that_ties_an_untied_source_is_refused(untied):
    from looped_lm.errors import UserError

    root, _ = untied
    with pytest.raises(UserError, match="model.tie_embeddings is True but model.init_from .* has False"):
        with_source_shape({"model": {"kind": "gpt", "init_from": str(root), "tie_embeddings": True}}, source_shape)


def _run(write_config, tmp_path, root, kind: str, out: str, **train):
    import yaml

    path = write_config(tmp_path / f"{out}.yaml", {"train": {"out_dir": str(tmp_path / out), "max_steps": 2,
                                                             "save_every": 2, **train}})
    raw = yaml.safe_load(path.read_text())
    raw["model"] = {"kind": kind, "seq_len": 16, "init_from": str(root), **KINDS[kind]}
    if kind in DIFFUSION:
        raw["diffusion"] = {**DIFFUSION[kind], "block_sampling": "round_robin"}
        if kind == "db_ar" and "blocks_to_train" in train:  # block jobs: independent blocks (stacked cannot merge)
            raw["diffusion"]["blocks_to_train"] = train.pop("blocks_to_train")
            raw["diffusion"].pop("context")
            raw["train"].pop("blocks_to_train")
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow  # every verb on every kind: about a minute
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_verb_keeps_the_head_apart(untied, kind, tmp_path, write_config, monkeypatch, capsys):
    root, hf = untied
    assert trainer.main(["--config", str(_run(write_config, tmp_path, root, kind, "run"))]) == 0
    ckpt = tmp_path / "run" / "step_0000002"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert "lm_head.weight" in weights and not torch.equal(weights["lm_head.weight"], weights["tok_emb.weight"])
    assert cli.main(["verify", str(ckpt)]) == 0
    ks = [] if kind == "gpt" else ["--num-iterations", "2", "--draws", "1"]
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--max-tokens", "64", "--no-progress", *ks]) == 0
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "And", "--max-tokens", "4"]) == 0
    import uvicorn
    from fastapi.testclient import TestClient

    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app))
    assert cli.main(["serve", "--checkpoint", str(ckpt), "--max-slots", "2"]) == 0
    with TestClient(started["app"]) as client:
        r = client.post("/v1/completions", json={"prompt": "And", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    if kind != "huginn":  # huginn exports nowhere (docs/export.md)
        out = tmp_path / "hf"
        assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
        config = json.loads((out / "config.json").read_text())
        assert config["tie_word_embeddings"] is False
        import looped_lm  # noqa: F401  (registers LoopedLMForCausalLM with transformers)
        from transformers import AutoModelForCausalLM

        from looped_lm.checkpoint import load_checkpoint

        back = AutoModelForCausalLM.from_pretrained(out).eval()
        native = load_checkpoint(ckpt)[0]
        head = back.lm_head.weight if kind == "gpt" else back.get_output_embeddings().weight
        torch.testing.assert_close(head, native.lm_head.weight, atol=0, rtol=0)
        if kind == "gpt":
            x = tokens()
            with torch.no_grad():
                torch.testing.assert_close(back(x).logits, native(x)[0], atol=1e-5, rtol=0)
    capsys.readouterr()


@pytest.mark.slow
def test_block_jobs_of_an_untied_source_merge_with_the_head(untied, tmp_path, write_config):
    root, _ = untied
    jobs = []
    for b in (0, 1):
        cfg = _run(write_config, tmp_path, root, "db_ar", f"job{b}", blocks_to_train=[b])
        assert trainer.main(["--config", str(cfg)]) == 0
        jobs.append(tmp_path / f"job{b}" / "step_0000002")
    out = tmp_path / "merged"
    assert cli.main(["merge", str(jobs[0]), str(jobs[1]), "--out", str(out)]) == 0
    assert cli.main(["verify", str(out)]) == 0
    merged, shared = load_file(str(out / "model.safetensors")), load_file(str(jobs[0] / "model.safetensors"))
    torch.testing.assert_close(merged["lm_head.weight"], shared["lm_head.weight"], atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["db_ar", "looped_db", "gpt"])
def test_the_compiled_decode_reads_the_separate_head(untied, kind, monkeypatch):
    """The engine's compiled step reads frozen copies of the inference tables: the head's must be lm_head's, the
    targets' the embedding's. Its tokens equal the eager engine's. (The DB kinds read z through the head alone,
    `parameterization: edm`: the likelihood term's <z, y_v> / sigma^2 would outweigh any head near sigma_min.)"""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from looped_lm.engine import compiled
    from looped_lm.engine.engine import Engine, Request
    from looped_lm.sampling import GREEDY

    root, _ = untied
    net, _ = converted(kind, root, **({} if kind == "gpt" else {"parameterization": "edm", "bridge": "hard"}))
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", CompileCounter())
    requests = lambda: [Request(prompt=list(range(1, 4 + i)), max_tokens=5, seed=i, sampling=GREEDY,
                                **({} if kind == "gpt" else {"num_iterations": 2})) for i in range(3)]
    eager = [o.token_ids for o in Engine(net, num_slots=4, max_len=32).run(requests())]
    engine = Engine(net, num_slots=4, max_len=32, compile_decode=True)
    if kind != "gpt":  # the frozen copies the compiled block step reads: the head's is lm_head's
        torch.testing.assert_close(net.head_t.value, net.lm_head.weight.T, atol=0, rtol=0)
        torch.testing.assert_close(net.targets_t.value, net._normalized(net.tok_emb.weight).T, atol=0, rtol=0)
    fast = [o.token_ids for o in engine.run(requests())]
    torch._dynamo.reset()
    assert fast == eager
