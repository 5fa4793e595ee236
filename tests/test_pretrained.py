"""model.init_from: a Hugging Face Llama (built here with transformers' own classes, nothing downloaded)
or the project's own gpt export, into gpt, db_ar, looped_db and huginn; bad sources refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from looped_lm.config import config_from_dict
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.models import build_model
from looped_lm.pretrained import init_from_pretrained, read_source

V, D, HEADS, KV, FFN, LAYERS = 257, 32, 4, 2, 64, 4  # byte vocabulary; grouped-query K/V (2 of 4)


def make_llama(root, layers: int = LAYERS, kv: int = KV, seed: int = 0, **extra):
    """A random tiny LlamaForCausalLM saved with save_pretrained, plus the byte tokenizer's files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FFN, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=kv, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=64, tie_word_embeddings=True, eos_token_id=256, **extra)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a wrong norm mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(root, safe_serialization=True)
    get_tokenizer("byte").to_hf().save_pretrained(root)
    return model


def run_config(kind: str, root, **model):
    m = {"kind": kind, "n_layers": LAYERS, "d_model": D, "n_heads": HEADS, "ffn_hidden": FFN, "seq_len": 16,
         "vocab_size": V, "init_from": str(root), **model}
    diffusion = {"num_blocks": 2} if kind == "db_ar" else {"num_blocks": 1}
    if "diffusion" in m:
        diffusion.update(m.pop("diffusion"))
    return config_from_dict({"model": m, "diffusion": diffusion})


def converted(kind, root, **model):
    cfg = run_config(kind, root, **model)
    net = build_model(cfg, V)
    record = init_from_pretrained(net, cfg)
    return net.eval(), cfg, record


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return root, make_llama(root)


def tokens(T: int = 12, seed: int = 1):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def test_gpt_logits_equal_transformers(llama):
    root, hf = llama
    net, _, record = converted("gpt", root)
    x = tokens()
    with torch.no_grad():
        want = hf(x).logits
    torch.testing.assert_close(net(x)[0], want, atol=1e-5, rtol=0)
    assert record["sha256"] == read_source(root).sha256 and len(record["sha256"]) == 64


def clean_logits(net, x):
    """The db models' clean stream end to end: prelude, every block's own layers in turn, the coda."""
    pos = torch.arange(x.shape[1])
    h = net.clean_inputs(x)
    last = net.stack_order[-1] if net.stacked else len(net.blocks) - 1  # the block the clean stream ends in
    h = net.own_forward(last, net.block_input(last, h, pos), pos)
    cos, sin = net.rope(pos)
    for layer in net.coda:
        h, _, _ = layer.clean(h, cos, sin)
    return F.linear(net.norm(h), net.head_weight)


@pytest.mark.parametrize("split, order", [([2, 1], "high_noise_first"), ([1, 2], "high_noise_first"),
                                          ([2, 1], "low_noise_first")])  # uneven both ways; either stack order
def test_db_ar_stacked_clean_stream_is_the_source(llama, split, order):
    root, hf = llama
    net, cfg, record = converted("db_ar", root, n_layers=3, n_prelude=1, n_coda=0,
                                 diffusion={"context": "stacked", "layers_per_block": split, "stack_order": order})
    want_blocks = {"high_noise_first": [[1, 2], [3]] if split == [2, 1] else [[1], [2, 3]],
                   "low_noise_first": [[2, 3], [1]]}[order]  # low_noise_first: block 1 runs first, block 0 last
    assert record["layers"] == {"prelude": [0], "blocks": want_blocks, "coda": []}
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(clean_logits(net, x), hf(x).logits, atol=1e-5, rtol=0)
        d = D
        for layer in (l for block in net.blocks for l in block):  # gates open (NOISY_GATES), shift/scale 0
            assert not layer.ada.weight.any() and not layer.ada.bias[:2 * d].any() and not layer.ada.bias[3 * d:5 * d].any()
            assert (layer.ada.bias[2 * d:3 * d] == 1).all() and (layer.ada.bias[5 * d:] == 1).all()


def test_db_ar_blocks_own_their_layers(llama):
    root, hf = llama
    net, _, record = converted("db_ar", root, n_layers=2, n_prelude=1, n_coda=1, diffusion={"layers_per_block": [1, 1]})
    assert record["layers"] == {"prelude": [0], "blocks": [[1], [2]], "coda": [3]}
    src = hf.model.layers
    for layer, i in ((net.prelude[0], 0), (net.blocks[0][0], 1), (net.blocks[1][0], 2), (net.coda[0], 3)):
        torch.testing.assert_close(layer.mlp.down.weight, src[i].mlp.down_proj.weight, atol=0, rtol=0)
        torch.testing.assert_close(layer.attn.qkv.weight[:D], src[i].self_attn.q_proj.weight, atol=0, rtol=0)
    torch.testing.assert_close(net.tok_emb.weight, hf.model.embed_tokens.weight, atol=0, rtol=0)


def test_looped_db_clean_stream_is_the_source(llama):
    root, hf = llama
    net, _, record = converted("looped_db", root, n_layers=2, n_prelude=1, n_coda=1)
    assert record["layers"] == {"prelude": [0], "blocks": [[1, 2]], "coda": [3]}
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(clean_logits(net, x), hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("K", [1, 3])
def test_huginn_is_the_source_at_any_depth(llama, K):
    """The adapter starts as [0 | I]: the core reads the prelude's output, so every K gives the source."""
    root, hf = llama
    net, _, record = converted("huginn", root, n_layers=2, n_prelude=1, n_coda=1, mean_recurrence=2,
                               backprop_depth=2)
    assert record["layers"] == {"prelude": [0], "core": [1, 2], "coda": [3]}
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(net(x, K), hf(x).logits, atol=1e-5, rtol=0)


def test_core_start_drops_the_layers_between(llama):
    root, _ = llama
    _, _, record = converted("huginn", root, n_layers=1, n_prelude=1, n_coda=1, init_core_start=2,
                             mean_recurrence=2, backprop_depth=2)
    assert record["layers"] == {"prelude": [0], "core": [2], "coda": [3]}


def test_sharded_source_reads_the_same(tmp_path, llama):
    """A source split into shards by save_pretrained (an index + 2+ files) converts to the same weights."""
    _, hf = llama
    root = tmp_path / "sharded"
    hf.save_pretrained(root, max_shard_size="40KB")
    get_tokenizer("byte").to_hf().save_pretrained(root)
    assert (root / "model.safetensors.index.json").is_file() and len(list(root.glob("*.safetensors"))) > 1
    net, _, _ = converted("gpt", root)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(net(x)[0], hf(x).logits, atol=1e-5, rtol=0)


def test_project_gpt_export_round_trips(tmp_path):
    """`looped_lm export` of a gpt writes a stock Llama: init_from reads it back weight for weight."""
    from safetensors.torch import save_file

    from looped_lm.export import llama_config_dict, llama_state_dict

    cfg = config_from_dict({"model": {"kind": "gpt", "n_layers": 2, "d_model": D, "n_heads": HEADS, "seq_len": 16}})
    torch.manual_seed(3)
    src = build_model(cfg, V)
    root = tmp_path / "export"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(llama_config_dict(src, cfg, 256)))
    save_file(llama_state_dict(src), str(root / "model.safetensors"))
    get_tokenizer("byte").to_hf().save_pretrained(root)
    net, _, _ = converted("gpt", root, n_layers=2, ffn_hidden=src.layers[0].mlp.down.weight.shape[1])
    for (name, a), b in zip(src.state_dict().items(), net.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_tokenizer_comes_from_the_checkpoint(llama):
    root, _ = llama
    cfg = run_config("gpt", root)
    tok = get_tokenizer(cfg.data.tokenizer)
    assert tok.name == str(root / "tokenizer.json") and tok.vocab_size == V and tok.eot_id == 256
    assert tok.decode(tok.encode("In the beginning")) == "In the beginning"


# ------------------------------------------------------------------------------------------------
# through the trainer, and bad sources


def _train_config(write_config, tmp_path, source, **model):
    m = {"kind": "gpt", "n_layers": LAYERS, "d_model": D, "n_heads": HEADS, "ffn_hidden": FFN, "vocab_size": V,
         "init_from": str(source), **model}
    return write_config(tmp_path / "run.yaml", {
        "model": m, "data": {"cache_dir": str(tmp_path / "cache")},
        "train": {"out_dir": str(tmp_path / "out"), "max_steps": 1, "lr": 1e-9, "min_lr": 0.0}})


def test_a_run_starts_from_the_source_and_records_it(tmp_path, write_config, llama):
    from looped_lm import trainer
    from looped_lm.checkpoint import load_checkpoint

    root, hf = llama
    assert trainer.main(["--config", str(_train_config(write_config, tmp_path, root))]) == 0
    model, cfg, manifest = load_checkpoint(tmp_path / "out" / "step_0000001")
    assert manifest["base"]["sha256"] == read_source(root).sha256
    # the source's context (max_position_embeddings 64), not the run's seq_len (16), is what a server serves
    from looped_lm.serve.cli import served_context

    assert cfg.model.seq_len == 16 and cfg.model.max_positions == 64 and model.max_positions >= 64
    assert served_context(cfg.model.positions(), model.max_positions, None) == 64
    torch.testing.assert_close(model.layers[3].mlp.down.weight, hf.model.layers[3].mlp.down_proj.weight,
                               atol=1e-6, rtol=0)  # lr 1e-9: one step moves nothing measurable


def _copy(root, tmp_path):
    import shutil

    dst = tmp_path / "src"
    shutil.copytree(root, dst)
    return dst


def _edit_config(dst, **fields):
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))


def _gpt2(dst):
    _edit_config(dst, model_type="gpt2", architectures=["GPT2LMHeadModel"])


def _neox(dst):
    _edit_config(dst, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])


def _qwen2(dst):
    _edit_config(dst, model_type="qwen2", architectures=["Qwen2ForCausalLM"])


def _bias(dst):
    _edit_config(dst, attention_bias=True)


def _untied_without_a_head(dst):
    _edit_config(dst, tie_word_embeddings=False)  # and no lm_head tensor in the weights


def _sharded(dst):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(dst)
    (dst / "model.safetensors").unlink()
    model.save_pretrained(dst, max_shard_size="40KB")
    return sorted(dst.glob("model-*.safetensors"))


def _missing_shard(dst):
    _sharded(dst)[-1].unlink()


def _partial_shard(dst):
    shards = _sharded(dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    name = next(n for n, f in index["weight_map"].items() if f == shards[0].name)
    index["weight_map"][name] = shards[-1].name  # the index says the last shard has it; it does not
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def _no_weights(dst):
    (dst / "model.safetensors").unlink()


def _big_tokenizer(dst):  # a vocabulary larger than the embedding: another model's tokenizer
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(V + 50)} | {"</s>": V + 50}, unk_token="w0")).save(
        str(dst / "tokenizer.json"))


BAD = [  # (what, change to the source, run-config changes, words the one error line must hold)
    ("gpt2 learned positions", _gpt2, {}, ["GPT2LMHeadModel", "learned position", "config.json"]),
    ("layernorm", _neox, {}, ["GPTNeoXForCausalLM", "LayerNorm"]),
    ("qwen2 without its q/k/v biases", _qwen2, {}, ["has no tensor", "q_proj.bias"]),
    ("attention bias", _bias, {}, ["attention_bias", "config.json"]),
    ("untied without its head", _untied_without_a_head, {}, ["has no tensor lm_head.weight", "tie_word_embeddings"]),
    ("missing shard", _missing_shard, {}, ["is missing", ".safetensors"]),
    ("partial shard", _partial_shard, {}, ["does not hold", "partial"]),
    ("no weights", _no_weights, {}, ["model.safetensors"]),
    ("tokenizer too big", _big_tokenizer, {"tokenizer": "source", "vocab_size": 0}, ["model.vocab_size (257)", f"tokenizer's {V + 51}"]),
    ("width differs", None, {"d_model": 64, "n_heads": 4}, ["model.d_model is 64", "has 32", "leave model.d_model unset"]),
    ("vocab differs", None, {"vocab_size": 300}, ["model.vocab_size is 300", "has 257"]),
    ("db_ar split", None, {"kind": "db_ar", "n_layers": 2, "n_prelude": 1, "diffusion": {"num_blocks": 2}},
     ["4 layers", "model.n_prelude"]),
    ("core past the coda", None, {"kind": "huginn", "n_layers": 2, "n_prelude": 1, "n_coda": 1,
                                  "init_core_start": 2, "mean_recurrence": 2, "backprop_depth": 2},
     ["model.init_core_start", "without overlap"]),
]


@pytest.mark.parametrize("what, change, model, needles", BAD, ids=[b[0] for b in BAD])
def test_bad_sources_are_one_line_and_write_nothing(tmp_path, write_config, llama, capsys, one_line_error,
                                                    what, change, model, needles):
    from looped_lm import cli

    src = _copy(llama[0], tmp_path)
    if change is not None:
        change(src)
    import yaml

    model = dict(model)
    tokenizer, diffusion = model.pop("tokenizer", None), model.pop("diffusion", None)
    path = _train_config(write_config, tmp_path, src, **model)
    raw = yaml.safe_load(path.read_text())
    if tokenizer:  # the source's own tokenizer.json instead of the test's byte tokenizer
        raw["data"]["tokenizer"] = str(src)
    if diffusion:
        raw["diffusion"] = diffusion
    path.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert cli.main(["train", "--config", str(path)]) == 2
    one_line_error(capsys.readouterr(), *needles)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_open_gates_start_the_noisy_stream_as_the_source_layers(llama, monkeypatch):
    """pretrained.NOISY_GATES "open" (the default): each two-stream layer's gates are 1, so a noisy
    vector equal to a clean one goes through the layer as the clean one does (attending the same keys)."""
    from looped_lm import pretrained

    assert pretrained.NOISY_GATES == "open"
    root, _ = llama
    net, cfg, _ = converted("db_ar", root, n_layers=4, diffusion={"num_blocks": 1})
    layer = net.blocks[0][0]
    d = D
    assert (layer.ada.bias[2 * d:3 * d] == 1).all() and (layer.ada.bias[5 * d:6 * d] == 1).all()
    assert not layer.ada.weight.any() and not layer.ada.bias[:2 * d].any()
    x = net.tok_emb(tokens())
    pos = torch.arange(x.shape[1])
    cos, sin = net.rope(pos)
    with torch.no_grad():
        out, k, v = layer.clean(x, cos, sin)
        cond = net.noise_emb(torch.zeros(2))
        from looped_lm.models.two_stream import CAUSAL

        noisy = layer.noisy(x, cond, cos, sin, k, v, CAUSAL, attend_self=False)
        torch.testing.assert_close(noisy, out, atol=1e-5, rtol=0)
    monkeypatch.setattr(pretrained, "NOISY_GATES", "closed")
    net, _, _ = converted("db_ar", root, n_layers=4, diffusion={"num_blocks": 1})
    assert not net.blocks[0][0].ada.bias.any()  # closed: adaLN-Zero, as a fresh model


def test_the_shape_fields_left_unset_come_from_the_source():
    """config.with_source_shape: unset fields (and the 0 = work-it-out ones) take the source's values; equal
    numbers after float32 rounding are equal (a GGUF stores its epsilon as float32); another value is refused in
    one line; n_layers is filled where the kind maps every source layer (gpt, db_ar), not for a looped core."""
    from looped_lm.config import with_source_shape
    from looped_lm.errors import UserError

    shape = {"d_model": 576, "n_heads": 9, "ffn_hidden": 1536, "norm_eps": 9.999999747378752e-06,
             "rope_theta": 100000.0, "vocab_size": 49152, "head_dim": 0, "qkv_bias": False, "qk_norm": False,
             "tie_embeddings": True, "n_source_layers": 30}
    source = lambda path: dict(shape)
    filled = with_source_shape({"model": {"kind": "gpt", "init_from": "x", "norm_eps": 1e-5, "vocab_size": 0}}, source)
    assert filled["model"] == {"kind": "gpt", "init_from": "x", "norm_eps": 1e-5, "vocab_size": 49152, "d_model": 576,
                               "n_heads": 9, "ffn_hidden": 1536, "rope_theta": 100000.0, "head_dim": 0,
                               "qkv_bias": False, "qk_norm": False, "tie_embeddings": True, "n_layers": 30}
    db = with_source_shape({"model": {"kind": "db_ar", "init_from": "x", "n_prelude": 2, "n_coda": 1}}, source)
    assert db["model"]["n_layers"] == 27
    looped = with_source_shape({"model": {"kind": "looped_db", "init_from": "x", "n_layers": 4}}, source)
    assert looped["model"]["n_layers"] == 4
    assert with_source_shape({"model": {"kind": "gpt"}}, source) == {"model": {"kind": "gpt"}}  # no source: as is
    for key, value in (("d_model", 512), ("norm_eps", 1e-6), ("qkv_bias", True), ("n_layers", 12)):
        with pytest.raises(UserError, match=f"model.{key} is .* but model.init_from x has") as e:
            with_source_shape({"model": {"kind": "gpt", "init_from": "x", key: value}}, source)
        assert "\n" not in str(e.value)
