"""`model.init_from: DIR`: start a run from a Hugging Face causal LM (or the project's own gpt export).

DIR is a local transformers directory: config.json and model.safetensors, or shards listed by
model.safetensors.index.json. What maps, and why:

    LlamaForCausalLM, MistralForCausalLM   pre-norm RMSNorm, RoPE with rotate-half pairs, SwiGLU, no
                                           biases: the project's TransformerLayer weight for weight
                                           (q/k/v_proj -> the fused qkv, gate/up_proj -> gate_up).
                                           Grouped-query K/V heads are repeated to one per query head
                                           (exact: Llama's own repeat_kv). Mistral only without a
                                           sliding window shorter than the run's positions.
    refused, one line naming the field     GPT-2 (learned positions, LayerNorm), Qwen2 (q/k/v biases:
                                           the project's attention has none), any attention/MLP bias,
                                           scaled RoPE, an untied lm_head (the project's head is the
                                           embedding, transposed).

The run config names the architecture (kind, blocks, prelude, coda) and must agree with config.json
(d_model, n_heads, ffn_hidden, norm_eps, rope_theta, vocab_size); a mismatch lists the values to set.
Which source layer goes where (`layer_plan`), L = the source's layer count:

    gpt          all L layers, in order (model.n_layers = L)
    db_ar        prelude = the first n_prelude, then block 0, block 1, ... (each its layers_per_block;
                 with context stacked and stack_order low_noise_first block B-1 first, ..., block 0
                 last: the order the clean stream runs), coda = the last n_coda (n_prelude +
                 model.n_layers + n_coda = L). The noisy stream's adaLN gates start open (NOISY_GATES:
                 its layers run as the source's, shift and scale zero); with diffusion.context stacked
                 the clean stream through every block is the source's forward pass exactly.
    looped_db,   prelude = the first n_prelude, core = model.n_layers layers from model.init_core_start
    huginn       (-1: right after the prelude), coda = the last n_coda; the layers in between are dropped
                 (retrofitted recurrence). huginn's adapter starts as [0 | I] (it passes the prelude's
                 output e and ignores the state), so at any K the converted model is the source with the
                 dropped layers removed, and training teaches the core to use its state.

The embedding and the final norm are the source's; the head is the embedding, transposed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from looped_lm.config import Config
from looped_lm.errors import UserError
from looped_lm.kinds import kind_of, require

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
# why the architectures people ask for do not map (the first clause names what differs)
REFUSED = {
    "gpt2": "learned position embeddings and LayerNorm (the project uses RoPE and RMSNorm)",
    "qwen2": "q/k/v projection biases (the project's attention has none)",
    "gpt_neox": "LayerNorm and partial rotary embeddings",
    "phi": "LayerNorm, partial rotary embeddings and biases",
    "gemma": "a scaled embedding, (1 + w) RMSNorm and GeLU",
    "opt": "learned position embeddings and LayerNorm",
}
# the noisy stream's adaLN gates at conversion: "open" (gate biases 1: its layers start as the source's;
# the default since bench/results/pretrained/study: lower PPL after fine-tuning at every B, 3 seeds) or
# "closed" (adaLN-Zero as in a fresh model: the noisy stream starts as identity). A module switch for
# bench/pretrained.py, not a config field: a load of a full-weight checkpoint never reads it, and an
# adapter checkpoint stores its `ada` (lora.NEW), which overwrites what the base load set.
NOISY_GATES = "open"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Source:
    """A checked pretrained directory: its config, where each tensor lives, and its content hash."""

    path: Path
    config: dict
    files: dict[str, Path]  # tensor name -> the safetensors file holding it
    sha256: str  # over the weight files, in name order: what adapters record as their base
    n_layers: int = 0
    heads: tuple[int, int] = (0, 0)  # (query heads, key/value heads)
    tokenizer: Path | None = None


def _fail(where, what: str) -> UserError:
    return UserError(f"model.init_from {where}: {what}")


def read_source(path: str | Path) -> Source:
    """Read DIR's config.json and the safetensors headers (no tensor data); refuse what does not map."""
    root = Path(path)
    if not root.is_dir():
        raise _fail(root, "is not a directory (expected a transformers directory with config.json)")
    cfg_file = root / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise _fail(cfg_file, "is missing") from None
    except (OSError, ValueError) as e:
        raise _fail(cfg_file, f"is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise _fail(cfg_file, "is not a JSON object")
    check_architecture(config, cfg_file)
    files = _tensor_files(root)
    source = Source(root, config, files, _weights_hash(files), n_layers=int(config["num_hidden_layers"]))
    n_heads = int(config["num_attention_heads"])
    source.heads = (n_heads, int(config.get("num_key_value_heads") or n_heads))
    _check_tensors(source)
    tok = root / "tokenizer.json"
    source.tokenizer = tok if tok.is_file() else None
    return source


def check_architecture(config: dict, where) -> None:
    """One line naming the config.json field that makes the architecture impossible to map."""
    model_type = config.get("model_type", "")
    arch = (config.get("architectures") or ["?"])[0]
    if model_type in REFUSED:
        raise _fail(where, f"architecture {arch} does not map: {REFUSED[model_type]}; looped_lm takes "
                           f"{', '.join(ARCHITECTURES)}")
    if arch not in ARCHITECTURES or model_type not in ("llama", "mistral"):
        raise _fail(where, f"architecture {arch} (model_type {model_type!r}) is not one looped_lm maps; it "
                           f"takes {', '.join(ARCHITECTURES)}")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise _fail(where, f"{key} is {config.get(key)!r}: expected a positive integer")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise _fail(where, f"{key} is true: the project's attention and MLP have no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise _fail(where, f"hidden_act is {config['hidden_act']!r}: the project's MLP is SwiGLU (silu)")
    rope = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    params = config.get("rope_parameters") or {}
    rope_type = params.get("rope_type", rope_type) if isinstance(params, dict) else rope_type
    if rope_type != "default":
        raise _fail(where, f"rope_scaling {rope_type!r}: the project's RoPE is unscaled")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if int(config.get("head_dim") or hidden // heads) * heads != hidden:
        raise _fail(where, f"head_dim {config.get('head_dim')} x {heads} heads != hidden_size {hidden}: the "
                           "project's heads split the width exactly")
    if config.get("sliding_window"):
        raise _fail(where, f"sliding_window is {config['sliding_window']}: the project's attention is full causal")


def _tensor_files(root: Path) -> dict[str, Path]:
    """tensor name -> file: one model.safetensors, or the shards an index lists (each must exist)."""
    from safetensors import SafetensorError, safe_open

    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise _fail(index, f"is not a safetensors index with a weight_map ({e})") from None
        shards = sorted(set(weight_map.values()))
    elif (root / SINGLE).is_file():
        weight_map, shards = None, [SINGLE]
    else:
        raise _fail(root, f"has neither {SINGLE} nor {INDEX}")
    files = {}
    for shard in shards:
        path = root / shard
        if not path.is_file():
            raise _fail(path, f"is missing (listed in {INDEX})")
        try:
            with safe_open(str(path), "pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise _fail(path, f"is not a readable safetensors file ({e})") from None
        files.update({name: path for name in names})
    if weight_map is not None:
        for name, shard in weight_map.items():
            if files.get(name) != root / shard:
                raise _fail(root / shard, f"does not hold {name}, which {INDEX} says it does (a partial shard?)")
    return files


def _weights_hash(files: dict[str, Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(set(files.values())):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _layer_names(i: int) -> list[str]:
    p = f"model.layers.{i}."
    return [p + n + ".weight" for n in ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
                                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def _check_tensors(source: Source) -> None:
    """Every tensor the mapping reads is there; nothing the project would drop silently (biases)."""
    need = ["model.embed_tokens.weight", "model.norm.weight",
            *(n for i in range(source.n_layers) for n in _layer_names(i))]
    for name in need:
        if name not in source.files:
            raise _fail(source.path, f"has no tensor {name} (a missing or partial shard?)")
    biases = [n for n in source.files if n.endswith(".bias")]
    if biases:
        raise _fail(source.files[biases[0]], f"holds {biases[0]}: the project's layers have no biases")
    tied = source.config.get("tie_word_embeddings", True)
    if "lm_head.weight" in source.files and not tied:
        raise _fail(source.path / "config.json", "tie_word_embeddings is false (a separate lm_head): the "
                    "project's head is the embedding, transposed; untied heads are not supported")


# ---------------------------------------------------------------------------------------------
# the run config against the source


def expected_model_fields(source: Source, vocab_rows: int) -> dict:
    c = source.config
    rope_theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return {"d_model": int(c["hidden_size"]), "n_heads": int(c["num_attention_heads"]),
            "ffn_hidden": int(c["intermediate_size"]), "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope_theta), "vocab_size": vocab_rows}


def check_run(cfg: Config, source: Source, vocab_size: int, tokenizer_size: int | None = None) -> None:
    """The run config must build the source's network: one line listing the values to set."""
    from safetensors import safe_open

    with safe_open(str(source.files["model.embed_tokens.weight"]), "pt") as f:
        rows = f.get_slice("model.embed_tokens.weight").get_shape()[0]
    if tokenizer_size is not None and tokenizer_size > rows:
        raise UserError(f"data.tokenizer has {tokenizer_size} tokens but {source.path}'s embedding has {rows} rows: "
                        "the tokenizer does not belong to this checkpoint")
    want = expected_model_fields(source, rows)
    have = {k: getattr(cfg.model, k) for k in want}
    have["vocab_size"] = vocab_size
    from looped_lm.models.layers import ffn_width

    have["ffn_hidden"] = ffn_width(cfg.model.d_model, cfg.model.ffn_hidden)  # 0 = Llama's 8/3 rule
    wrong = [f"model.{k}: {v}" for k, v in want.items() if have[k] != v]
    if wrong:
        raise UserError(f"model.init_from {source.path}: the run config does not match its config.json; set "
                        f"{', '.join(wrong)}")
    layer_plan(cfg, source.n_layers)  # raises if the layer counts cannot take the split


def layer_plan(cfg: Config, n_source: int) -> dict[str, list]:
    """Source layer indices per part: {"prelude": [...], "blocks": [[...], ...], "coda": [...]} (db kinds),
    {"core": [...]} (huginn: prelude/core/coda), {"layers": [...]} (gpt). The rule is the kind's own
    (`Kind.source_layers`, looped_lm/kinds/builtin.py), as the module doc describes."""
    kind = kind_of(cfg)
    require(kind, "init_from", "model.init_from")
    return kind.source_layers(cfg, n_source)


# ---------------------------------------------------------------------------------------------
# loading the weights


class _Tensors:
    """Tensors by name across the shards, opened once each, cast to the model's dtype."""

    def __init__(self, source: Source, dtype):
        from safetensors import safe_open

        self.source, self.dtype = source, dtype
        self.handles = {p: safe_open(str(p), "pt") for p in sorted(set(source.files.values()))}

    def __getitem__(self, name: str):
        return self.handles[self.source.files[name]].get_tensor(name).to(self.dtype)


def copy_layer(layer, tensors: _Tensors, i: int, heads: tuple[int, int]) -> None:
    """Source layer i into a TransformerLayer / TwoStreamLayer (its `ada` is left as it is: zero;
    `open_gates` sets the gates after)."""
    import torch

    norm1, q, k, v, o, norm2, gate, up, down = (tensors[n] for n in _layer_names(i))
    n_heads, n_kv = heads
    if n_kv != n_heads:  # grouped-query attention: query head h reads K/V head h // (n_heads / n_kv)
        k, v = (t.view(n_kv, -1, t.shape[-1]).repeat_interleave(n_heads // n_kv, dim=0).flatten(0, 1)
                for t in (k, v))
    with torch.no_grad():
        for dst, src in ((layer.norm1.weight, norm1), (layer.attn.qkv.weight, torch.cat([q, k, v])),
                         (layer.attn.proj.weight, o), (layer.norm2.weight, norm2),
                         (layer.mlp.gate_up.weight, torch.cat([gate, up])), (layer.mlp.down.weight, down)):
            if dst.shape != src.shape:
                raise UserError(f"model.init_from {tensors.source.path}: layer {i} has a tensor of shape "
                                f"{list(src.shape)} where the model has {list(dst.shape)}")
            dst.copy_(src)


def init_from_pretrained(model, cfg: Config, source: Source | None = None) -> dict:
    """Copy the source's weights into a freshly built `model` of cfg.model.kind; -> a record for the
    manifest ({"path", "sha256", "layers"})."""
    import torch

    source = source or read_source(cfg.model.init_from)
    plan = layer_plan(cfg, source.n_layers)
    tensors = _Tensors(source, model.tok_emb.weight.dtype)
    copy = lambda layers, idx: [copy_layer(l, tensors, i, source.heads) for l, i in zip(layers, idx, strict=True)]
    with torch.no_grad():
        emb = tensors["model.embed_tokens.weight"]
        if emb.shape != model.tok_emb.weight.shape:
            raise UserError(f"model.init_from {source.path}: embedding {list(emb.shape)} but the model's is "
                            f"{list(model.tok_emb.weight.shape)} (model.vocab_size, model.d_model)")
        model.tok_emb.weight.copy_(emb)
        model.norm.weight.copy_(tensors["model.norm.weight"])
    if "layers" in plan:  # gpt
        copy(model.layers, plan["layers"])
    else:
        copy(model.prelude, plan["prelude"])
        copy(model.coda, plan["coda"])
        if "core" in plan:  # huginn: the adapter passes e = the prelude's output, ignores the state
            copy(model.core, plan["core"])
            d = model.tok_emb.weight.shape[1]
            with torch.no_grad():
                model.adapter.weight.copy_(torch.cat([torch.zeros(d, d), torch.eye(d)], dim=1))
        else:
            for block, idx in zip(model.blocks, plan["blocks"], strict=True):
                copy(block, idx)
            if NOISY_GATES == "open":
                open_gates(model)
    return {"path": str(source.path.resolve()), "sha256": source.sha256, "layers": plan}


def open_gates(model) -> None:
    """Every two-stream layer's adaLN gates (chunks 2 and 5 of its shift/scale/gate x 2) biased to 1, the
    rest of `ada` zero: the noisy stream then runs each layer as the source does (its queries against
    the clean keys), instead of passing its input through."""
    import torch

    with torch.no_grad():
        for layer in [*model.coda, *(l for block in model.blocks for l in block)]:
            d = layer.ada.bias.shape[0] // 6
            layer.ada.bias[2 * d:3 * d] = 1.0
            layer.ada.bias[5 * d:6 * d] = 1.0


def check_source(cfg: Config, vocab_size: int) -> Source:
    """Preflight: the source maps onto this run (architecture, shards, tokenizer, sizes, layer split)."""
    from looped_lm.data.tokenizer import get_tokenizer

    source = read_source(cfg.model.init_from)
    check_run(cfg, source, vocab_size, get_tokenizer(cfg.data.tokenizer).vocab_size)
    return source


def load_base(model, cfg: Config, record: dict) -> None:
    """An adapter checkpoint's base weights, from the directory its manifest names, after checking the
    directory still holds the base the adapters were trained on (sha256 over its weight files)."""
    source = read_source(record["path"])
    if source.sha256 != record["sha256"]:
        raise UserError(f"model.init_from {record['path']}: its weights hash to {source.sha256[:16]}..., but the "
                        f"adapters were trained on {record['sha256'][:16]}...: a different base")
    init_from_pretrained(model, cfg, source)
