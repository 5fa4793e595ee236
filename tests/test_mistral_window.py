"""Mistral with a sliding window (Mistral-7B-v0.1 and much of its family ship `sliding_window: 4096`) as a source
(model.init_from), built here with transformers' own MistralForCausalLM from a tiny config object (nothing
downloaded). Its window applies to every layer, as transformers' sliding_window_overlay applies it (query p sees
keys p - W < j <= p), so the conversion makes every layer local (model.layer_types all sliding_attention, the
source's window, rope_local_theta = its rope_theta). Every language-model kind converts exactly within the window
and beyond it; cached decode equals recompute beyond it; a gpt conversion exports back to MistralForCausalLM with the
window set; a window of null stays full causal; what is not Mistral's (a mix of local and global layers outside
Gemma 3, Qwen2's use_sliding_window) is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from tiny_models import perturb_adaln, uncached_next_logits

from looped_lm.config import config_from_dict, with_source_shape
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.generate import generate
from looped_lm.errors import UserError
from looped_lm.models import build_model
from looped_lm.pretrained import init_from_pretrained, read_source, source_shape
from looped_lm.sampling import GREEDY, SharedGenerator
from looped_lm.settings import RowBatch, resolve_settings
from looped_lm.source_families import check_architecture
from test_pretrained import clean_logits

pytestmark = pytest.mark.usefixtures("one_thread")

V, D, HEADS, KV, FFN, LAYERS, WINDOW, THETA = 257, 64, 4, 2, 128, 4, 8, 5000.0  # a RoPE base apart from 10000
INSIDE, BEYOND = 6, 20  # contexts within the window and past it
LOCAL = {"layer_types": ["sliding_attention"] * LAYERS, "sliding_window": WINDOW, "rope_local_theta": THETA}


def make_mistral(root, window: int | None = WINDOW, seed: int = 0):
    """A random tiny MistralForCausalLM (untied head, as Mistral ships) saved with save_pretrained, with the byte
    tokenizer."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.MistralConfig(
        vocab_size=V, hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, sliding_window=window, rms_norm_eps=1e-5, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": THETA}, tie_word_embeddings=False,
        eos_token_id=256, bos_token_id=256, pad_token_id=0)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(root, safe_serialization=True)
    get_tokenizer("byte").to_hf().save_pretrained(root)
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral")
    return root, make_mistral(root)


def converted(kind: str, root, **model):
    """`kind` from the source at root; the shape fields left unset come from the source (config.with_source_shape)."""
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


def test_the_window_makes_every_layer_local(mistral):
    root, hf = mistral
    shape = source_shape(str(root))
    assert {k: shape[k] for k in LOCAL} == LOCAL and shape["rope_theta"] == THETA
    assert not (shape["sandwich_norm"] or shape["qk_norm"] or shape["qkv_bias"] or shape["tie_embeddings"])
    net, cfg = converted("gpt", root)
    assert cfg.model.layer_types == LOCAL["layer_types"] and cfg.model.sliding_window == WINDOW
    assert [layer.attn.window for layer in net.layers] == [WINDOW] * LAYERS
    assert hf.config.sliding_window == WINDOW and hf.config._attn_implementation in ("sdpa", "eager")


@pytest.mark.parametrize("T", [INSIDE, BEYOND])
def test_gpt_logits_equal_transformers(mistral, T):
    root, hf = mistral
    net, _ = converted("gpt", root)
    x = tokens(T)
    with torch.no_grad():
        torch.testing.assert_close(net(x)[0], hf(x).logits, atol=1e-5, rtol=0)


def test_the_window_is_what_makes_it_exact_beyond_it(mistral):
    """Without the window the conversion still matches inside it but not beyond: the comparison above sees it."""
    root, hf = mistral
    net, _ = converted("gpt", root)
    for layer in net.layers:
        layer.attn.window = 0
    with torch.no_grad():
        torch.testing.assert_close(net(tokens(INSIDE))[0], hf(tokens(INSIDE)).logits, atol=1e-5, rtol=0)
        assert (net(tokens(BEYOND))[0] - hf(tokens(BEYOND)).logits).abs().max() > 1e-3


@pytest.mark.parametrize("T", [INSIDE, BEYOND])
@pytest.mark.parametrize("model, diffusion", [
    ({"n_layers": 3, "n_prelude": 1}, {"context": "stacked", "layers_per_block": [2, 1], "stack_order": "low_noise_first"}),
    ({"n_layers": 4}, {"context": "stacked", "layers_per_block": [2, 2]})])
def test_db_ar_clean_stream_is_the_source(mistral, model, diffusion, T):
    root, hf = mistral
    net, _ = converted("db_ar", root, **model, diffusion=diffusion)
    x = tokens(T)
    with torch.no_grad():
        torch.testing.assert_close(clean_logits(net, x), hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("T", [INSIDE, BEYOND])
def test_looped_db_clean_stream_is_the_source(mistral, T):
    root, hf = mistral
    net, _ = converted("looped_db", root, n_layers=2, n_prelude=1, n_coda=1)
    x = tokens(T)
    with torch.no_grad():
        torch.testing.assert_close(clean_logits(net, x), hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("K, T", [(1, BEYOND), (3, INSIDE), (3, BEYOND)])
def test_huginn_is_the_source_at_any_depth(mistral, K, T):
    root, hf = mistral
    net, _ = converted("huginn", root, n_layers=2, n_prelude=1, n_coda=1, mean_recurrence=2, backprop_depth=2)
    x = tokens(T)
    with torch.no_grad():
        torch.testing.assert_close(net(x, K), hf(x).logits, atol=1e-5, rtol=0)


def test_gpt_decodes_with_its_cache_as_it_recomputes_past_the_window(mistral):
    root, hf = mistral
    net, _ = converted("gpt", root)
    prompt = tokens(5)
    out, logits = generate(net, prompt, 16, resolve_settings(None, sampling=GREEDY), return_logits=True)
    with torch.no_grad():
        full = net(out[:, :-1])[0]
        torch.testing.assert_close(logits, full[:, 4:], atol=1e-5, rtol=0)
        torch.testing.assert_close(logits, hf(out[:, :-1]).logits[:, 4:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind, K", [("db_ar", 2), ("looped_db", 3)])
def test_db_kinds_decode_with_their_cache_as_they_recompute_past_the_window(mistral, kind, K):
    root, _ = mistral
    shape = {"n_layers": 4, "diffusion": {"layers_per_block": [2, 2]}} if kind == "db_ar" else \
        {"n_layers": 2, "n_prelude": 1, "n_coda": 1}
    net, _ = converted(kind, root, **shape)
    net = perturb_adaln(net).eval()
    prompt, steps = tokens(4), 9  # the last tokens are predicted from 12 positions: past the window of 8
    settings = resolve_settings(net.iteration_limits(), num_iterations=K, bridge="hard", sampling=GREEDY)
    g = SharedGenerator(torch.Generator().manual_seed(3))
    noise = [net.initial_noise(2, 1, g) for _ in range(steps)]
    out, logits = generate(net, prompt, steps, settings, return_logits=True, noise=noise)
    for i in range(steps):
        ref = uncached_next_logits(net, out[:, :4 + i], settings, noise[i])
        scale = ref.abs().amax(-1, keepdim=True)
        assert ((logits[:, i] - ref).abs() <= 1e-5 + 4e-7 * scale).all(), i


def test_huginn_decodes_with_its_cache_as_it_recomputes_past_the_window(mistral):
    root, _ = mistral
    net, _ = converted("huginn", root, n_layers=2, n_prelude=1, n_coda=1, mean_recurrence=2, backprop_depth=2)
    T = 14
    x, s0 = tokens(T), torch.randn(2, T, D)
    with torch.no_grad():
        full = net(x, 2, s0=s0)
        caches = net.new_cache(2, 16)
        settings = resolve_settings(net.iteration_limits(), num_iterations=2, sampling=GREEDY)
        step = lambda ids, noise: net.forward_cached(ids, caches, None, RowBatch.uniform(settings, 2, SharedGenerator(None), noise))
        parts = [step(x[:, :4], s0[:, :4])] + [step(x[:, t:t + 1], s0[:, t:t + 1]) for t in range(4, T)]
    torch.testing.assert_close(torch.stack(parts[1:], 1), full[:, 4:], atol=1e-5, rtol=0)


def test_a_gpt_conversion_trains_and_exports_back_to_mistral(mistral, tmp_path, write_config):
    """A run from the source (every shape field read from config.json), its checkpoint loaded back, and
    `looped_lm export` of it: transformers loads MistralForCausalLM with sliding_window set, no project code, with
    the source's logits past the window."""
    from transformers import AutoModelForCausalLM

    from looped_lm import trainer
    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.export import export

    root, hf = mistral
    path = write_config(tmp_path / "run.yaml", {
        "data": {"cache_dir": str(tmp_path / "cache")},
        "train": {"out_dir": str(tmp_path / "out"), "max_steps": 1, "lr": 1e-9, "min_lr": 0.0}})
    raw = yaml.safe_load(path.read_text())
    raw["model"] = {"kind": "gpt", "seq_len": 16, "init_from": str(root)}
    path.write_text(yaml.safe_dump(raw))
    assert trainer.main(["--config", str(path)]) == 0
    model, cfg, _ = load_checkpoint(tmp_path / "out" / "step_0000001")
    assert cfg.model.layer_types == LOCAL["layer_types"] and cfg.model.sliding_window == WINDOW
    out = export(tmp_path / "out" / "step_0000001", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == WINDOW
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "MistralForCausalLM" and back.config.sliding_window == WINDOW
    x = tokens(BEYOND)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model.eval()(x)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-4, rtol=0)  # lr 1e-9: nothing measurable
    assert source_shape(str(out))["layer_types"] == LOCAL["layer_types"]  # and it converts again as the source did


def test_a_null_window_stays_full_causal(tmp_path):
    root = tmp_path / "full"
    hf = make_mistral(root, window=None)
    shape = source_shape(str(root))
    assert (shape["layer_types"], shape["sliding_window"], shape["rope_local_theta"]) == ([], 0, 0.0)
    net, _ = converted("gpt", root)
    x = tokens(BEYOND)
    with torch.no_grad():
        torch.testing.assert_close(net(x)[0], hf(x).logits, atol=1e-5, rtol=0)


def _config(root, tmp_path, **fields):
    dst = tmp_path / "src"
    shutil.copytree(root, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    for key in [k for k, v in fields.items() if v is ...]:
        del cfg[key]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_an_absent_window_is_transformers_default(mistral, tmp_path):
    """MistralConfig's sliding_window defaults to 4096 where config.json has no key: read as transformers reads it."""
    import transformers

    src = _config(mistral[0], tmp_path, sliding_window=...)
    assert transformers.AutoConfig.from_pretrained(src).sliding_window == 4096
    assert source_shape(str(src))["sliding_window"] == 4096


@pytest.mark.parametrize("window", [0, -8, "8", 8.5])
def test_a_window_that_is_no_positive_integer_is_refused_in_one_line(mistral, tmp_path, window):
    src = _config(mistral[0], tmp_path, sliding_window=window)
    with pytest.raises(UserError, match=f"sliding_window is {window!r}: expected a positive integer") as e:
        read_source(src)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"model.init_from {src}")


def test_qwen2_use_sliding_window_stays_refused():
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 4, "intermediate_size": 128, "sliding_window": 4096, "max_window_layers": 2}
    check_architecture({**config, "use_sliding_window": False}, "src")  # off, as every released Qwen2 ships
    with pytest.raises(UserError, match="sliding_window is 4096: Qwen2ForCausalLM's layers are full causal") as e:
        check_architecture({**config, "use_sliding_window": True}, "src")
    assert "\n" not in str(e.value)


def _stock(**model):
    from looped_lm.export import stock_family

    return stock_family(config_from_dict({"model": {"kind": "gpt", "n_layers": 3, **model}}))


def test_export_takes_every_layer_local_as_mistral_and_refuses_other_local_layers():
    local = {"layer_types": ["sliding_attention"] * 3, "sliding_window": 4}
    assert _stock(**local) == ("MistralForCausalLM", "mistral")
    assert _stock(**local, rope_local_theta=10000.0) == ("MistralForCausalLM", "mistral")  # the one base, spelt out
    assert _stock(layer_types=["full_attention"] * 3) == ("LlamaForCausalLM", "llama")  # no local layer: Llama's
    for wrong in ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 4},
                  {**local, "rope_local_theta": 1000.0}, {**local, "qkv_bias": True}, {**local, "qk_norm": True}):
        with pytest.raises(UserError, match="only as Mistral .* or Gemma 3") as e:
            _stock(**wrong)
        assert "--format looped_lm" in str(e.value) and "\n" not in str(e.value)
