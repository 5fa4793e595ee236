"""Gemma 3's text model (Gemma3ForCausalLM) as a source (model.init_from), built here with transformers' own classes
from a config object (nothing downloaded): sandwich norms, (1 + w) RMSNorms, GeGLU, per-head q/k norms, a scaled
embedding, scores scaled by query_pre_attn_scalar, a head width apart from d_model / n_heads, grouped-query K/V,
and local sliding-window layers with a RoPE base of their own between global ones. Every language-model kind
converts exactly, within the window and beyond it; cached decode (eager and the engine's fixed-shape steps) equals
recompute past the window; a gpt conversion trains, and exports back to Gemma3ForCausalLM with equal logits; the
tokenizer path carries a Gemma-style tokenizer's specials and chat template; what the project does not do
(softcapping, bidirectional attention, scaled RoPE, ...) is refused in one line."""

from __future__ import annotations

import copy
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
from looped_lm.models.db.contexts import CachedContext
from looped_lm.pretrained import init_from_pretrained, read_source, source_shape
from looped_lm.sampling import GREEDY, SharedGenerator
from looped_lm.settings import RowBatch, resolve_settings
from test_pretrained import clean_logits

pytestmark = pytest.mark.usefixtures("one_thread")

V, D, HEADS, KV, HEAD_DIM, FFN, WINDOW = 257, 64, 4, 2, 24, 128, 8  # head_dim 24: apart from d_model / n_heads (16)
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
SCALAR, THETA, LOCAL_THETA = 20, 10000.0, 1000.0  # query_pre_attn_scalar apart from head_dim; two RoPE bases
INSIDE, BEYOND = 6, 20  # contexts within the window and past it
SHAPE = {"d_model": D, "n_heads": HEADS, "ffn_hidden": FFN, "head_dim": HEAD_DIM, "qkv_bias": False, "qk_norm": True,
         "attn_scalar": float(SCALAR), "sandwich_norm": True, "mlp_activation": "gelu_tanh", "embed_scale": True,
         "layer_types": LAYER_TYPES, "sliding_window": WINDOW, "rope_theta": THETA, "rope_local_theta": LOCAL_THETA,
         "norm_eps": 1e-6, "tie_embeddings": True, "vocab_size": V}


def make_gemma(root, seed: int = 0):
    """A random tiny Gemma3ForCausalLM saved with save_pretrained, with the byte tokenizer."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=FFN, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, sliding_window=WINDOW,
        layer_types=LAYER_TYPES, query_pre_attn_scalar=SCALAR, rms_norm_eps=1e-6, max_position_embeddings=64,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": THETA},
                         "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA}},
        tie_word_embeddings=True, eos_token_id=256, bos_token_id=256, pad_token_id=0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma's norms start at w = 0, i.e. (1 + w) = 1: away from it, so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(root, safe_serialization=True)
    get_tokenizer("byte").to_hf().save_pretrained(root)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return root, make_gemma(root)


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


def test_the_shape_and_the_layer_options_come_from_the_source(gemma):
    root, _ = gemma
    shape = source_shape(str(root))
    assert {k: shape[k] for k in SHAPE} == SHAPE and shape["n_source_layers"] == len(LAYER_TYPES)
    assert read_source(root).heads == (HEADS, KV)
    with pytest.raises(UserError, match=f"model.sliding_window is 4 but model.init_from .* has {WINDOW}") as e:
        with_source_shape({"model": {"kind": "gpt", "init_from": str(root), "sliding_window": 4}}, source_shape)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("T", [INSIDE, BEYOND])
def test_gpt_logits_equal_transformers(gemma, T):
    root, hf = gemma
    net, cfg = converted("gpt", root)
    assert [layer.attn.window for layer in net.layers] == [WINDOW, 0, WINDOW, WINDOW]
    x = tokens(T)
    with torch.no_grad():
        torch.testing.assert_close(net(x)[0], hf(x).logits, atol=1e-5, rtol=0)


def test_the_window_and_the_local_base_are_what_make_it_exact(gemma):
    """Without the window the conversion still matches inside it but not beyond; with the global RoPE base in the
    local layers it matches nowhere: both are exercised by the comparisons above."""
    root, hf = gemma
    net, _ = converted("gpt", root)
    for layer in net.layers:
        layer.attn.window = 0
    with torch.no_grad():
        torch.testing.assert_close(net(tokens(INSIDE))[0], hf(tokens(INSIDE)).logits, atol=1e-5, rtol=0)
        assert (net(tokens(BEYOND))[0] - hf(tokens(BEYOND)).logits).abs().max() > 1e-3
        for layer in net.layers:
            layer.attn.local = False
        assert (net(tokens(INSIDE))[0] - hf(tokens(INSIDE)).logits).abs().max() > 1e-3


@pytest.mark.parametrize("T", [INSIDE, BEYOND])
@pytest.mark.parametrize("model, diffusion", [
    ({"n_layers": 3, "n_prelude": 1}, {"context": "stacked", "layers_per_block": [2, 1], "stack_order": "low_noise_first"}),
    ({"n_layers": 4}, {"context": "stacked", "layers_per_block": [2, 2]})])
def test_db_ar_clean_stream_is_the_source(gemma, model, diffusion, T):
    root, hf = gemma
    net, _ = converted("db_ar", root, **model, diffusion=diffusion)
    x = tokens(T)
    with torch.no_grad():
        torch.testing.assert_close(clean_logits(net, x), hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("T", [INSIDE, BEYOND])
def test_looped_db_clean_stream_is_the_source(gemma, T):
    root, hf = gemma
    net, _ = converted("looped_db", root, n_layers=2, n_prelude=1, n_coda=1)
    x = tokens(T)
    with torch.no_grad():
        torch.testing.assert_close(clean_logits(net, x), hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("K, T", [(1, BEYOND), (3, INSIDE), (3, BEYOND)])
def test_huginn_is_the_source_at_any_depth(gemma, K, T):
    root, hf = gemma
    net, _ = converted("huginn", root, n_layers=2, n_prelude=1, n_coda=1, mean_recurrence=2, backprop_depth=2)
    x = tokens(T)
    with torch.no_grad():
        torch.testing.assert_close(net(x, K), hf(x).logits, atol=1e-5, rtol=0)


def test_gpt_decodes_with_its_cache_as_it_recomputes_past_the_window(gemma):
    root, _ = gemma
    net, _ = converted("gpt", root)
    prompt = tokens(5)
    out, logits = generate(net, prompt, 16, resolve_settings(None, sampling=GREEDY), return_logits=True)
    with torch.no_grad():
        full = net(out[:, :-1])[0]
    torch.testing.assert_close(logits, full[:, 4:], atol=1e-5, rtol=0)


@torch.no_grad()
def test_the_fixed_shape_step_keeps_the_window_on_ragged_rows(gemma):
    """gpt's engine step (`decode_fixed`: each row over the cache's whole length, masked) against the eager cached
    step, rows on both sides of the window; and a ragged prefill (KVCache.append's masked path) against recompute."""
    root, _ = gemma
    net, _ = converted("gpt", root)
    g = torch.Generator().manual_seed(3)
    lengths, rows = [3, 11, 1, 14, 7], torch.tensor([4, 1, 3, 0])
    histories = [torch.randint(0, V, (1, n), generator=g) for n in lengths]
    cache = net.new_cache(5, 32)
    for row, ids in enumerate(histories):
        net.forward_cached(ids, cache, torch.tensor([row]))
    eager_cache, fixed_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    ids = torch.randint(0, V, (4, 1), generator=g)
    eager = net.forward_cached(ids, eager_cache, rows)
    torch.testing.assert_close(net.decode_fixed(ids, fixed_cache, rows), eager, atol=1e-5, rtol=1e-5)
    for i, row in enumerate(rows.tolist()):  # the eager step against the whole sequence recomputed
        full = net(torch.cat([histories[row], ids[i:i + 1]], dim=1))[0][:, -1]
        torch.testing.assert_close(eager[i:i + 1], full, atol=1e-5, rtol=0)
    more = torch.randint(0, V, (2, 3), generator=g)  # rows at 11 and 1 tokens: a ragged three-token append
    ragged = net.decode(more, copy.deepcopy(cache), torch.tensor([1, 2]))
    for i, row in enumerate([1, 2]):
        full = net(torch.cat([histories[row], more[i:i + 1]], dim=1))[0][:, -3:]
        torch.testing.assert_close(ragged[i:i + 1], full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind, K, noisy_self", [("db_ar", 2, False), ("db_ar", 4, True), ("looped_db", 1, False),
                                                 ("looped_db", 1, True), ("looped_db", 3, False)])
def test_db_kinds_decode_with_their_cache_as_they_recompute_past_the_window(gemma, kind, K, noisy_self):
    """The decode step (both streams in one weight pass, `TwoStreamLayer.fused`, and the slot against the cache)
    windows the local layers' keys as the recomputed window does (`windowed_slot_mask`), with and without the
    slot's own key."""
    root, _ = gemma
    shape = {"n_layers": 4, "diffusion": {"layers_per_block": [2, 2]}} if kind == "db_ar" else \
        {"n_layers": 2, "n_prelude": 1, "n_coda": 1}
    shape.setdefault("diffusion", {})["noisy_self"] = noisy_self
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


def test_a_noisy_slot_sees_the_clean_keys_of_its_positions_window():
    """`windowed_slot_mask`: the slot at position p (predicting the token there) sees the clean keys p - W < j < p,
    as the source's query at p does (its own clean key aside), whatever form the mask had."""
    from looped_lm.models.two_stream import CAUSAL, CAUSAL_SELF, noisy_mask, slot_mask, windowed_slot_mask

    T, W = 12, 5
    positions = torch.arange(1, T + 1)
    keys = torch.arange(T)
    want = (keys < positions[:, None]) & (keys > positions[:, None] - W)
    own = torch.eye(T, dtype=torch.bool)
    assert torch.equal(windowed_slot_mask(CAUSAL, positions, T, W), want)
    assert torch.equal(windowed_slot_mask(CAUSAL_SELF, positions, T, W), torch.cat([want, own], -1))
    assert torch.equal(windowed_slot_mask(noisy_mask(positions - 1, T), positions, T, W), torch.cat([want, own], -1))
    slots = torch.tensor([[2, 7, 11], [0, 5, 9]])  # a subset of slots per row: (R, 1, n, T + n)
    got = windowed_slot_mask(slot_mask(slots, T, True, full_window=False), slots + 1, T, W)
    assert torch.equal(got[..., :T], want[slots].unsqueeze(1)) and torch.equal(got[..., T:], own[:3, :3].expand(2, 1, 3, 3))
    valid = torch.ones(2, 1, 1, T, dtype=torch.bool)  # decode: the next position's slot against a cache of T
    assert torch.equal(windowed_slot_mask(valid, torch.tensor([[T], [T]]), T, W)[:, 0, 0], keys.expand(2, T) > T - W)
    assert windowed_slot_mask(CAUSAL, positions[:W - 1], W - 1, W) == CAUSAL  # nothing out of reach: the flash path


@torch.no_grad()
def test_the_fixed_block_step_keeps_the_window_on_ragged_rows(gemma):
    """A DB model's engine step (`decode_block_fixed`: the fused pass with the pending token, then the slot against
    the cache, over the cache's whole length) against the eager block call, rows on both sides of the window."""
    root, _ = gemma
    net, _ = converted("db_ar", root, n_layers=4, diffusion={"layers_per_block": [2, 2], "noisy_self": True})
    net = perturb_adaln(net).eval()
    g = torch.Generator().manual_seed(3)
    state = net.new_cache(5, 32)
    settings = resolve_settings(net.iteration_limits(), num_iterations=2, sampling=GREEDY)
    for row, n in enumerate([3, 12, 1, 9, 6]):
        net.forward_cached(torch.randint(0, V, (1, n), generator=g), state, torch.tensor([row]),
                           RowBatch([settings], SharedGenerator(None)))
    state.append(net, torch.randint(0, V, (5, 1), generator=g), None)
    eager_state, fixed_state, rows = copy.deepcopy(state), copy.deepcopy(state), torch.tensor([4, 1, 3])
    for b in range(len(net.blocks)):
        for append in (True, False):
            z, sigma = torch.randn(3, 1, D, generator=g) * 3, torch.tensor([4.0, 1.5, 0.3])
            eager = CachedContext(net, eager_state, rows).denoise(b, z, sigma)
            fixed = net.decode_block_fixed(b, fixed_state, rows, z, sigma, append)
            torch.testing.assert_close(fixed, eager, atol=1e-4, rtol=1e-4)


def test_huginn_decodes_with_its_cache_as_it_recomputes(gemma):
    root, _ = gemma
    net, _ = converted("huginn", root, n_layers=2, n_prelude=1, n_coda=1, mean_recurrence=2, backprop_depth=2)
    T = 14
    x = tokens(T)
    s0 = torch.randn(2, T, D)
    with torch.no_grad():
        full = net(x, 2, s0=s0)
        caches = net.new_cache(2, 16)
        settings = resolve_settings(net.iteration_limits(), num_iterations=2, sampling=GREEDY)
        step = lambda ids, noise: net.forward_cached(ids, caches, None, RowBatch.uniform(settings, 2, SharedGenerator(None), noise))
        parts = [step(x[:, :4], s0[:, :4])] + [step(x[:, t:t + 1], s0[:, t:t + 1]) for t in range(4, T)]
    torch.testing.assert_close(torch.stack(parts[1:], 1), full[:, 4:], atol=1e-5, rtol=0)


def _train_config(write_config, tmp_path, source):
    path = write_config(tmp_path / "run.yaml", {
        "data": {"cache_dir": str(tmp_path / "cache")},
        "train": {"out_dir": str(tmp_path / "out"), "max_steps": 1, "lr": 1e-9, "min_lr": 0.0}})
    raw = yaml.safe_load(path.read_text())
    raw["model"] = {"kind": "gpt", "seq_len": 16, "init_from": str(source)}  # every shape field from the source
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_gpt_conversion_trains_and_exports_back_to_gemma3(gemma, tmp_path, write_config):
    """A run from the source (shape left unset: read from config.json), its checkpoint loaded back (the local
    layers placed again from model.layer_types), and `looped_lm export` of it: transformers loads
    Gemma3ForCausalLM with no project code (norms written back as w - 1), with the source's logits past the window."""
    from transformers import AutoModelForCausalLM

    from looped_lm import trainer
    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.export import export

    root, hf = gemma
    assert trainer.main(["--config", str(_train_config(write_config, tmp_path, root))]) == 0
    model, cfg, _ = load_checkpoint(tmp_path / "out" / "step_0000001")
    assert cfg.model.layer_types == LAYER_TYPES and cfg.model.sliding_window == WINDOW
    x = tokens(BEYOND)
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(model.eval()(x)[0], want, atol=1e-4, rtol=0)  # lr 1e-9: nothing measurable
    out = export(tmp_path / "out" / "step_0000001", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["layer_types"] == LAYER_TYPES
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(back(x).logits, want, atol=1e-4, rtol=0)


def test_export_refuses_a_partial_gemma_layer():
    from looped_lm.export import stock_family

    cfg = config_from_dict({"model": {"kind": "gpt", "sandwich_norm": True}})
    with pytest.raises(UserError, match="not model.mlp_activation gelu_tanh, model.embed_scale, model.qk_norm") as e:
        stock_family(cfg)
    assert "--format looped_lm" in str(e.value) and "\n" not in str(e.value)


GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
                  "else message['role'] %}<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_a_gemma_style_tokenizer_brings_its_specials_and_chat_template(tmp_path):
    """The generic tokenizer path reads a Gemma 3 directory's files: <bos> / <eos> / <pad> from
    tokenizer_config.json, the template from chat_template.jinja, <end_of_turn> (and generation_config.json's eos
    ids) as stops; the template renders as transformers renders it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from looped_lm.serve.text import chat_template

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "user", "model", "Hi", "there"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(words[:6])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    (tmp_path / "chat_template.jinja").write_text(GEMMA_TEMPLATE)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    tok = get_tokenizer(str(tmp_path))
    s = tok.specials
    assert (tok.eot_id, s.bos_token, s.bos_token_id, s.pad_token_id) == (1, "<bos>", 2, 0)
    assert s.stop_ids[:2] == (1, 5) and s.chat_template == GEMMA_TEMPLATE
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi there"},
                {"role": "user", "content": "there"}]
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for gen in (True, False):
        assert chat_template(tok).render(messages, gen) == hf.apply_chat_template(messages, tokenize=False,
                                                                                  add_generation_prompt=gen)


def _edit(root, tmp_path, **fields):
    dst = tmp_path / "src"
    shutil.copytree(root, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


BAD = [  # (what, config.json changes, words the one error line must hold)
    ("final logit softcapping", {"final_logit_softcapping": 30.0}, ["final_logit_softcapping is 30.0", "softcapping"]),
    ("attention softcapping", {"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping is 50.0"]),
    ("bidirectional", {"use_bidirectional_attention": True}, ["use_bidirectional_attention", "causally"]),
    ("scaled global rope", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     ["rope_scaling 'linear'", "full_attention", "unscaled"]),
    ("another activation", {"hidden_activation": "silu"}, ["hidden_activation is 'silu'", "gelu_pytorch_tanh"]),
    ("no window for the local layers", {"sliding_window": None}, ["sliding_window is None", "sliding_attention"]),
    ("layer types of another length", {"layer_types": ["full_attention"]}, ["layer_types is", "expected 4 entries"]),
    ("gemma 2", {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, ["Gemma2ForCausalLM", "softcapped"]),
    ("multimodal gemma 3", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     ["Gemma3ForConditionalGeneration", "gemma3_text"]),
]


@pytest.mark.parametrize("what, fields, needles", BAD, ids=[b[0] for b in BAD])
def test_what_the_project_does_not_do_is_refused_in_one_line(gemma, tmp_path, what, fields, needles):
    src = _edit(gemma[0], tmp_path, **fields)
    with pytest.raises(UserError) as e:
        read_source(src)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"model.init_from {src}")
    for needle in needles:
        assert needle in message, (needle, message)


def test_a_softcapped_source_stops_a_run_before_it_writes(gemma, tmp_path, write_config, capsys, one_line_error):
    from looped_lm import cli

    src = _edit(gemma[0], tmp_path, final_logit_softcapping=30.0)
    capsys.readouterr()
    assert cli.main(["train", "--config", str(_train_config(write_config, tmp_path, src))]) == 2
    one_line_error(capsys.readouterr(), "final_logit_softcapping", "softcapping")
    assert not (tmp_path / "out").exists()


def test_the_layer_options_are_checked_and_documented(capsys):
    from looped_lm import cli

    with pytest.raises(UserError, match="model.sliding_window .* must be >= 1 where model.layer_types has a"):
        config_from_dict({"model": {"kind": "gpt", "layer_types": ["sliding_attention"]}})
    with pytest.raises(UserError, match="model.sliding_window .* and 0 where it has none"):
        config_from_dict({"model": {"kind": "gpt", "sliding_window": 8}})
    assert cli.main(["train", "--help-config"]) == 0
    text = capsys.readouterr().out
    for name in ("attn_scalar", "sandwich_norm", "mlp_activation", "embed_scale", "layer_types", "sliding_window",
                 "rope_local_theta"):
        assert name in text, name
