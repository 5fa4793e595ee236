"""Optional vLLM backend: the `vllm.general_plugins` entry point
`looped_lm = looped_lm.serve.vllm_plugin:register`.

vLLM calls `register()` in every process it starts (API server, engine core, workers). It makes the
exported Hugging Face layout (`looped_lm export`) loadable: model_type "looped_lm" is registered with
transformers' AutoConfig, and the architecture "LoopedLMForCausalLM" with vLLM's ModelRegistry.
Only this package imports vllm; `serve/vllm_plugin/model.py` is imported lazily by vLLM.

What runs in vLLM: model.kind gpt, exactly (same weights, RoPE, SwiGLU; vLLM's paged KV cache), and the
DiffusionBlocks kinds db_ar / looped_db trained with `diffusion.noisy_self: false`, at a K fixed per server
(`serve/vllm_plugin/db_model.py`). huginn, and DB models whose slots attend their own key, are refused at
load with the reason: see docs/export.md.
"""

from looped_lm.hf import register as register_hf

ARCH = "LoopedLMForCausalLM"


def register() -> None:
    from vllm import ModelRegistry  # optional: the vllm extra

    register_hf()  # AutoConfig knows model_type "looped_lm" (vLLM reads the config through it)
    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "looped_lm.serve.vllm_plugin.model:LoopedLMForCausalLM")
