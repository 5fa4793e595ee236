"""Qwen2 / Qwen2.5 and Qwen3 as sources (model.init_from), built here with transformers' own classes from config
objects (nothing downloaded): q/k/v biases (Qwen2), per-head q/k RMSNorms and a head width apart from
d_model / n_heads (Qwen3), grouped-query K/V. Every language-model kind converts exactly, decodes with its cache as
it recomputes, and a gpt conversion exports back to the stock architecture with equal logits."""

from __future__ import annotations

import pytest
import torch
from tiny_models import perturb_adaln, uncached_next_logits

from looped_lm.config import config_from_dict
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.generate import generate
from looped_lm.models import build_model
from looped_lm.pretrained import init_from_pretrained, read_source, source_shape
from looped_lm.sampling import GREEDY, SharedGenerator
from looped_lm.settings import RowBatch, resolve_settings
from test_pretrained import clean_logits

V, D, HEADS, KV, FFN, LAYERS = 257, 32, 4, 2, 64, 4
FAMILIES = {"qwen2": {"head_dim": 0, "qkv_bias": True, "qk_norm": False},
            "qwen3": {"head_dim": 16, "qkv_bias": False, "qk_norm": True}}  # Qwen3: 4 heads x 16 > d_model / 4


def make_qwen(root, family: str, seed: int = 0):
    """A random tiny Qwen2ForCausalLM / Qwen3ForCausalLM saved with save_pretrained, with the byte tokenizer."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=64, tie_word_embeddings=True, eos_token_id=256, use_sliding_window=False)
    if family == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.Qwen3Config(**common, head_dim=16, attention_bias=False), transformers.Qwen3ForCausalLM
    model = cls(config).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(root, safe_serialization=True)
    get_tokenizer("byte").to_hf().save_pretrained(root)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def qwen(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, root, make_qwen(root, request.param)


def converted(kind: str, root, **model):
    """`kind` from the source at root; the shape fields left unset come from the source (config.with_source_shape)."""
    from looped_lm.config import with_source_shape

    m = {"kind": kind, "seq_len": 16, "init_from": str(root), **model}
    diffusion = {"num_blocks": 2} if kind == "db_ar" else {"num_blocks": 1}
    diffusion.update(m.pop("diffusion", {}))
    raw = {"model": m, **({"diffusion": diffusion} if kind in ("db_ar", "looped_db") else {})}
    cfg = config_from_dict(with_source_shape(raw, source_shape))
    net = build_model(cfg, V)
    init_from_pretrained(net, cfg)
    return net.eval(), cfg


def tokens(T: int = 12, seed: int = 1):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def test_the_shape_and_attention_come_from_the_source(qwen):
    family, root, _ = qwen
    shape = source_shape(str(root))
    assert {k: shape[k] for k in FAMILIES[family]} == FAMILIES[family]
    assert shape["d_model"] == D and shape["n_heads"] == HEADS and shape["n_source_layers"] == LAYERS
    assert read_source(root).heads == (HEADS, KV)


def test_gpt_logits_equal_transformers(qwen):
    family, root, hf = qwen
    net, cfg = converted("gpt", root)
    assert {k: getattr(cfg.model, k) for k in FAMILIES[family]} == FAMILIES[family]  # read from the source
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(net(x)[0], hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model, diffusion", [
    ({"n_layers": 3, "n_prelude": 1}, {"context": "stacked", "layers_per_block": [2, 1], "stack_order": "low_noise_first"}),
    ({"n_layers": 4}, {"context": "stacked", "layers_per_block": [2, 2]})])
def test_db_ar_clean_stream_is_the_source(qwen, model, diffusion):
    _, root, hf = qwen
    net, _ = converted("db_ar", root, **model, diffusion=diffusion)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(clean_logits(net, x), hf(x).logits, atol=1e-5, rtol=0)


def test_looped_db_clean_stream_is_the_source(qwen):
    _, root, hf = qwen
    net, _ = converted("looped_db", root, n_layers=2, n_prelude=1, n_coda=1)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(clean_logits(net, x), hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("K", [1, 3])
def test_huginn_is_the_source_at_any_depth(qwen, K):
    _, root, hf = qwen
    net, _ = converted("huginn", root, n_layers=2, n_prelude=1, n_coda=1, mean_recurrence=2, backprop_depth=2)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(net(x, K), hf(x).logits, atol=1e-5, rtol=0)


def test_gpt_decodes_with_its_cache_as_it_recomputes(qwen):
    _, root, _ = qwen
    net, _ = converted("gpt", root)
    prompt = tokens(5)
    out, logits = generate(net, prompt, 8, resolve_settings(None, sampling=GREEDY), return_logits=True)
    with torch.no_grad():
        full = net(out[:, :-1])[0]
    torch.testing.assert_close(logits, full[:, 4:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind, K", [("db_ar", 2), ("db_ar", 4), ("looped_db", 3)])
def test_db_kinds_decode_with_their_cache_as_they_recompute(qwen, kind, K):
    """The two-stream decode step (both streams in one weight pass, `TwoStreamLayer.fused`) norms q and k as the
    separate clean and noisy paths do."""
    _, root, _ = qwen
    shape = {"n_layers": 4, "diffusion": {"layers_per_block": [2, 2]}} if kind == "db_ar" else \
        {"n_layers": 2, "n_prelude": 1, "n_coda": 1}
    net, _ = converted(kind, root, **shape)
    net = perturb_adaln(net).eval()
    prompt = tokens(4)
    settings = resolve_settings(net.iteration_limits(), num_iterations=K, bridge="hard", sampling=GREEDY)
    g = SharedGenerator(torch.Generator().manual_seed(3))
    noise = [net.initial_noise(2, 1, g) for _ in range(4)]
    out, logits = generate(net, prompt, 4, settings, return_logits=True, noise=noise)
    for i in range(4):
        ref = uncached_next_logits(net, out[:, :4 + i], settings, noise[i])
        scale = ref.abs().amax(-1, keepdim=True)
        assert ((logits[:, i] - ref).abs() <= 1e-5 + 4e-7 * scale).all()


def test_huginn_decodes_with_its_cache_as_it_recomputes(qwen):
    _, root, _ = qwen
    net, _ = converted("huginn", root, n_layers=2, n_prelude=1, n_coda=1, mean_recurrence=2, backprop_depth=2)
    x = tokens(10)
    s0 = torch.randn(2, 10, D)
    with torch.no_grad():
        full = net(x, 2, s0=s0)
        caches = net.new_cache(2, 16)
        settings = resolve_settings(net.iteration_limits(), num_iterations=2, sampling=GREEDY)
        step = lambda ids, noise: net.forward_cached(ids, caches, None, RowBatch.uniform(settings, 2, SharedGenerator(None), noise))
        parts = [step(x[:, :4], s0[:, :4])] + [step(x[:, t:t + 1], s0[:, t:t + 1]) for t in range(4, 10)]
    torch.testing.assert_close(torch.stack(parts[1:], 1), full[:, 4:], atol=1e-5, rtol=0)


def test_a_gpt_conversion_exports_back_to_the_stock_architecture(qwen, tmp_path):
    """`export --format llama` of the gpt conversion: transformers loads it as Qwen2ForCausalLM /
    Qwen3ForCausalLM with no project code, and its logits equal the source's."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from looped_lm.export import llama_config_dict, llama_state_dict

    family, root, hf = qwen
    net, cfg = converted("gpt", root)
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(llama_config_dict(net, cfg, 256)))
    save_file(llama_state_dict(net), str(out / "model.safetensors"))
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == type(hf).__name__
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attend_self", [False, True])
def test_the_fused_decode_step_norms_q_and_k_as_the_separate_streams(attend_self):
    """`TwoStreamLayer.fused` (the engine's decode step: both streams in one weight pass) equals `clean` then
    `noisy` on a Qwen3-style layer: per-head q/k norms, a head width apart, q/k/v biases."""
    from looped_lm.models.layers import AttentionOptions, KVCache, RotaryEmbedding
    from looped_lm.models.two_stream import TwoStreamLayer

    torch.manual_seed(0)
    layer = TwoStreamLayer(D, HEADS, FFN, 1e-5, AttentionOptions(head_dim=16, qkv_bias=True, qk_norm=True)).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    R, n, hd = 2, 3, 16
    rope = RotaryEmbedding(hd, 32, 10000.0)
    x, h, cond = torch.randn(R, n, D), torch.randn(R, 1, D), torch.randn(R, D)
    clean_pos, noisy_pos = torch.arange(n), torch.tensor([n - 1])
    rows = torch.arange(R)
    with torch.no_grad():
        fused_cache = KVCache(R, HEADS, 8, hd, "cpu", torch.float32)
        x_f, h_f = layer.fused(x, h, cond, rope(clean_pos), rope(noisy_pos), fused_cache, rows, attend_self, True)
        cache = KVCache(R, HEADS, 8, hd, "cpu", torch.float32)
        x_s, k, v = layer.clean(x, *rope(clean_pos), cache, rows)
        mask = torch.ones(1, n + 1, dtype=torch.bool) if attend_self else None
        h_s = layer.noisy(h, cond, *rope(noisy_pos), k, v, mask, attend_self=attend_self)
    torch.testing.assert_close(x_f, x_s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_f, h_s, atol=1e-5, rtol=1e-5)
