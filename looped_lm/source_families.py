"""The pretrained families `model.init_from` maps: their architectures, the ones refused and why, and the
config.json checks that name, in one line, the field a source sets that the project's layers do not do
(Gemma 3's layer types and RoPE by layer type, Mistral's sliding window included). Reading and copying a source's tensors is
`looped_lm.pretrained`'s; export writes the same families back.
"""

from __future__ import annotations

from looped_lm.errors import UserError

# model_type -> its architecture: Llama's layers, with Qwen2's q/k/v biases, Qwen3's per-head q/k norms and head
# width, or Gemma 3's layer (looped_lm.models.layers.AttentionOptions, LayerOptions)
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
ARCHITECTURES = tuple(FAMILIES.values())
GEMMA3 = "gemma3_text"
MISTRAL = "mistral"
MISTRAL_DEFAULT_WINDOW = 4096  # MistralConfig's sliding_window where config.json has none
# why the architectures people ask for do not map (the first clause names what differs)
REFUSED = {
    "gpt2": "learned position embeddings and LayerNorm (the project uses RoPE and RMSNorm)",
    "gpt_neox": "LayerNorm and partial rotary embeddings",
    "phi": "LayerNorm, partial rotary embeddings and biases",
    "gemma": "Gemma 1's layers (no sandwich or q/k norms) are not mapped; Gemma 3's text model (Gemma3ForCausalLM) is",
    "gemma2": "softcapped attention scores and logits",
    "gemma3": "the multimodal Gemma 3 (a vision tower beside the text model); its text model, Gemma3ForCausalLM "
              "(model_type gemma3_text), maps",
    "opt": "learned position embeddings and LayerNorm",
}
GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # transformers' default_theta
LAYER_TYPES = ("full_attention", "sliding_attention")


def source_error(where, what: str) -> UserError:
    """One line about model.init_from: where (the source, or its file) and what is wrong with it."""
    return UserError(f"model.init_from {where}: {what}")


def check_architecture(config: dict, where) -> None:
    """One line naming the config.json field that makes the architecture impossible to map."""
    model_type = config.get("model_type", "")
    arch = (config.get("architectures") or ["?"])[0]
    if model_type in REFUSED:
        raise source_error(where, f"architecture {arch} does not map: {REFUSED[model_type]}; looped_lm takes "
                           f"{', '.join(ARCHITECTURES)}")
    if arch not in ARCHITECTURES or FAMILIES.get(model_type) != arch:
        raise source_error(where, f"architecture {arch} (model_type {model_type!r}) is not one looped_lm maps; it "
                           f"takes {', '.join(ARCHITECTURES)}")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise source_error(where, f"{key} is {config.get(key)!r}: expected a positive integer")
    for key in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases are its architecture's, not this flag's
        if config.get(key):
            raise source_error(where, f"{key} is true: the project's output projection and MLP have no biases")
    if model_type == GEMMA3:
        _check_gemma3(config, where)
    else:
        if config.get("hidden_act", "silu") != "silu":
            raise source_error(where, f"hidden_act is {config['hidden_act']!r}: the project's MLP is SwiGLU (silu)")
        rope = config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        params = config.get("rope_parameters") or {}
        rope_type = params.get("rope_type", rope_type) if isinstance(params, dict) else rope_type
        if rope_type != "default":
            raise source_error(where, f"rope_scaling {rope_type!r}: the project's RoPE is unscaled")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    if model_type not in ("qwen3", GEMMA3) and head_dim * heads != hidden:
        raise source_error(where, f"head_dim {config.get('head_dim')} x {heads} heads != hidden_size {hidden}: "
                           f"{arch}'s heads split the width exactly")
    if model_type == MISTRAL:
        window = mistral_window(config)
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise source_error(where, f"sliding_window is {window!r}: expected a positive integer (every layer local) "
                               "or null (full causal)")
        return
    windowed = config.get("use_sliding_window", True) if model_type.startswith("qwen") else model_type != GEMMA3
    if config.get("sliding_window") and windowed:
        raise source_error(where, f"sliding_window is {config['sliding_window']}: {arch}'s layers are full causal in the "
                           "project (only Gemma 3's local layers and Mistral's have a window)")


def mistral_window(config: dict):
    """Mistral's sliding window, as transformers reads it: config.json's sliding_window (null: full causal), 4096
    (MistralConfig's default) where the key is absent. Every layer attends within it, with the one RoPE base."""
    return config.get("sliding_window", MISTRAL_DEFAULT_WINDOW)


def _check_gemma3(config: dict, where) -> None:
    """What Gemma 3's text model may set that the project's layers do not do, refused in one line naming it."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise source_error(where, f"hidden_activation is {act!r}: the project's Gemma MLP is GeGLU with gelu's tanh "
                           "approximation (gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise source_error(where, f"{key} is {config[key]}: the project's attention and head have no softcapping")
    if config.get("use_bidirectional_attention"):
        raise source_error(where, "use_bidirectional_attention is true: the project's language models attend causally")
    for layer_type, params in gemma3_rope(config).items():
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise source_error(where, f"rope_scaling {rope_type!r} of the {layer_type} layers: the project's RoPE is unscaled")
    scalar = config.get("query_pre_attn_scalar", 256)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or scalar <= 0:
        raise source_error(where, f"query_pre_attn_scalar is {scalar!r}: expected a positive number")
    if "sliding_attention" in gemma3_layer_types(config, where):
        window = config.get("sliding_window")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise source_error(where, f"sliding_window is {window!r} but layer_types has sliding_attention layers: expected "
                               "a positive integer")


def gemma3_layer_types(config: dict, where="config.json") -> list[str]:
    """Gemma 3's layer types, one per layer: config.json's layer_types, or (older configs) every
    sliding_window_pattern-th layer global and the others local, as transformers reads them."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        pattern = int(config.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise source_error(where, f"layer_types is {types!r}: expected {n} entries, each one of {', '.join(LAYER_TYPES)}")
    return types


def gemma3_rope(config: dict) -> dict[str, dict]:
    """Gemma 3's RoPE parameters by layer type: transformers 5's rope_parameters (keyed by layer type), or the
    older rope_theta, rope_local_base_freq and rope_scaling (which applies to the global layers)."""
    params = config.get("rope_parameters") or {}
    rope = {t: dict(params.get(t) or {}) if isinstance(params, dict) else {} for t in LAYER_TYPES}
    if config.get("rope_scaling"):
        rope["full_attention"].update(config["rope_scaling"])
    old_names = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
    for layer_type, name in old_names.items():
        rope[layer_type].setdefault("rope_theta", config.get(name) or GEMMA3_DEFAULT_THETA[layer_type])
    return rope
