"""`looped_lm serve` with no memory flags: the KV budget is a stated fraction of the memory free on the device
(as vLLM sizes its cache), and a context that one slot of it cannot hold is lowered to what fits, with one line,
unless --max-model-len asked for it (then the one-line refusal stays). The SmolLM2-135M conversion, whose
8,192-token context once needed a flag, starts with the defaults and answers a chat."""

from __future__ import annotations

import pytest
import torch

from looped_lm import devices
from looped_lm.checkpoint import load_checkpoint
from looped_lm.engine.runner import kv_bytes_per_token
from looped_lm.serve.cli import KV_MEMORY_FRACTION
from test_server import serve_in_process


def test_the_default_budget_is_a_fraction_of_the_free_memory(tiny_run, monkeypatch, capsys):
    ckpt = str(tiny_run[1])
    model = load_checkpoint(ckpt)[0]
    one_slot = kv_bytes_per_token(model) * model.max_positions
    monkeypatch.setattr(devices, "available_memory", lambda device: int(3.5 * one_slot / KV_MEMORY_FRACTION))
    code, app = serve_in_process(monkeypatch, "--checkpoint", ckpt, "--max-model-len", str(model.max_positions))
    assert code == 0 and app.state.serving.engine.stats.num_slots == 3
    assert "note:" not in capsys.readouterr().err


def test_a_context_the_budget_cannot_hold_is_lowered_unless_asked_for(tiny_run, monkeypatch, capsys):
    ckpt = str(tiny_run[1])
    model, cfg, _ = load_checkpoint(ckpt)
    per_token = kv_bytes_per_token(model)
    trained = cfg.model.seq_len
    monkeypatch.setattr(devices, "available_memory", lambda device: int(10 * per_token / KV_MEMORY_FRACTION))
    code, app = serve_in_process(monkeypatch, "--checkpoint", ckpt)
    err = capsys.readouterr().err
    assert code == 0 and app.state.serving.engine.max_len == 10 < trained
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and f"holds one sequence of 10 tokens, not the model's {trained}" in notes[0]
    code, app = serve_in_process(monkeypatch, "--checkpoint", ckpt, "--max-model-len", str(trained))
    err = capsys.readouterr().err.strip()
    assert code == 2 and app is None and err.startswith("error: a KV budget of") and "holds no sequence" in err
    assert "\n" not in err


def test_the_free_memory_of_a_gpu_is_asked_of_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (7 * 2 ** 30, 80 * 2 ** 30))
    assert devices.available_memory(torch.device("cuda", 0)) == 7 * 2 ** 30
    assert 0 < devices.available_memory(torch.device("cpu"))


@pytest.mark.slow  # the GGUF dequantised and the conversion written (~1 min), then one chat
def test_the_smollm2_conversion_serves_a_chat_with_no_memory_flags(tmp_path, monkeypatch, one_thread):
    """A config with only the kind, the layout and init_from converts SmolLM2 from its GGUF (the shape comes from
    the source); `serve --checkpoint` starts on it with no memory flag, at the source's 8,192-token context."""
    from fastapi.testclient import TestClient

    from looped_lm import trainer
    from looped_lm.pretrained import smollm2_gguf

    import yaml

    out, cfg = tmp_path / "smollm2", tmp_path / "convert.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"kind": "db_ar", "seq_len": 64, "init_from": str(smollm2_gguf())},
        "diffusion": {"num_blocks": 2, "context": "stacked", "stack_order": "low_noise_first",
                      "noisy_input": "clean_state"},
        "data": {"cache_dir": str(tmp_path / "data")},
        "train": {"out_dir": str(out), "max_steps": 0, "progress": False}}))
    assert trainer.main(["--config", str(cfg)]) == 0
    code, app = serve_in_process(monkeypatch, "--checkpoint", str(out))
    engine = app.state.serving.engine
    assert code == 0 and engine.max_len == 8192 and engine.stats.num_slots >= 1
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
            "temperature": 0}
    with TestClient(app) as client:
        replies = {k: client.post("/v1/chat/completions", json={**chat, "num_iterations": k}) for k in (1, 2)}
    for r in replies.values():
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
        assert r.json()["choices"][0]["message"]["content"].strip()
