"""The default gpt export, a stock LlamaForCausalLM, served by vLLM's own Llama (no plugin involved):
greedy tokens equal the native engine's and their log-probs agree to 1e-4 (fp32), two prompts batched.
Run by `.ci/vllm`."""

import torch

from looped_lm.checkpoint import load_checkpoint
from looped_lm.engine.generate import generate
from looped_lm.export import export

from test_vllm_plugin import N, PROMPTS, make_checkpoint, run_vllm


def test_vllm_serves_the_llama_export_like_the_native_engine(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run")
    hf_dir = export(ckpt, tmp_path / "hf")  # gpt: format llama by default
    assert '"model_type": "llama"' in (hf_dir / "config.json").read_text()
    got = run_vllm(hf_dir)
    model, _, _ = load_checkpoint(ckpt)
    for i, prompt in enumerate(PROMPTS):
        tokens, logits = generate(model, torch.tensor([prompt]), N, return_logits=True)
        new = tokens[0, len(prompt):].tolist()
        assert got["tokens"][i] == new, (i, got["tokens"][i], new)
        ref = logits[0].float().log_softmax(-1).gather(-1, torch.tensor(new)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got["logprobs"][i]), ref, atol=1e-4), (got["logprobs"][i], ref.tolist())
