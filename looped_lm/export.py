"""`looped_lm export`: a checkpoint -> a Hugging Face directory that transformers (and vLLM) load.

Two formats (`--format`; `auto`, the default, picks `llama` for gpt and `looped_lm` for the DB kinds):

`llama` (gpt only): a stock `LlamaForCausalLM` (`Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `Gemma3ForCausalLM` /
`MistralForCausalLM` for a gpt converted from one: q/k/v biases, per-head q/k norms, Gemma 3's layer with its
(1 + w) norms written back as w - 1, every layer local within Mistral's sliding_window), loaded with no project code. The gpt is Llama weight for
weight (pre-norm RMSNorm, RoPE with Llama's rotate-half pairs (x[:D/2], x[D/2:]), SwiGLU, tied head); the
fused qkv and gate_up Linears are split into q/k/v_proj and gate_proj/up_proj.

    HF_DIR/config.json              LlamaConfig (model_type "llama", tie_word_embeddings true)
    HF_DIR/model.safetensors        model.embed_tokens, model.layers.N.*, model.norm (lm_head only when untied)

`looped_lm` (every kind but huginn): the native module behind `LoopedLMForCausalLM`.

    HF_DIR/config.json              LoopedLMConfig (model_type "looped_lm"): the run config, vocab size,
                                    model state (block edges), kind, default K and bridge
    HF_DIR/model.safetensors        the native weights under "model.", the tied embedding stored once

Both also write

    HF_DIR/generation_config.json   eos = the end-of-text and end-of-turn ids, bos/pad = the model's (else
                                    end-of-text); DB models: num_iterations (K), bridge, seed
    HF_DIR/tokenizer.json ...       `Tokenizer.to_hf().save_pretrained`: tokenizer_config.json holds the
                                    model's eos/bos/unk/pad and chat template (else the server's plain one)

Load a `looped_lm` directory with `import looped_lm` then `transformers.AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from looped_lm.checkpoint import NO_VERIFY_HELP, add_set_argument, load_checkpoint, no_verify_note, resolve_checkpoint
from looped_lm.data.specials import PLAIN_CHAT_TEMPLATE, TOKENIZER_CLASS
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.errors import UserError
from looped_lm.hf import register
from looped_lm.kinds import kind_of, require
from looped_lm.preflight import check_output_path
from looped_lm.source_families import GEMMA3

FORMATS = ("auto", "llama", "looped_lm")


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory, or a run directory (its newest complete checkpoint)")
    p.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    add_set_argument(p)
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    p.add_argument("--num-iterations", type=int, default=None,
                   help="DB models: default K written to the configs (default: the run config's)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="llama: a stock LlamaForCausalLM (gpt only); looped_lm: the native model behind "
                        "LoopedLMForCausalLM (needs `import looped_lm`); auto: llama for gpt, else looped_lm")


def run(args) -> int:
    if args.no_verify:
        print(no_verify_note(), file=sys.stderr)
    checkpoint = resolve_checkpoint(args.checkpoint)
    out = export(checkpoint, args.out, overwrite=args.overwrite, num_iterations=args.num_iterations,
                 verify=not args.no_verify, format=args.format, overrides=args.set)
    print(f"exported {checkpoint} -> {out}")
    return 0


def stock_family(cfg) -> tuple[str, str]:
    """(architecture, model_type) of the stock transformers model a gpt is, weight for weight: Llama, or the
    Qwen family its attention options come from (Qwen2: q/k/v biases; Qwen3: per-head q/k norms), or Gemma 3
    (all of its layer options: sandwich norms, GeGLU, a scaled embedding, q/k norms; local layers or not), or
    Mistral (Llama's layers, every one local with the one window and RoPE base). Local layers otherwise (a mix of
    local and global ones, a RoPE base of their own, Qwen's options) are no stock architecture: refused."""
    m = cfg.model
    gemma = {"model.sandwich_norm": m.sandwich_norm, "model.mlp_activation gelu_tanh": m.mlp_activation == "gelu_tanh",
             "model.embed_scale": m.embed_scale, "model.qk_norm": m.qk_norm}
    if any(v for k, v in gemma.items() if k != "model.qk_norm") or m.attn_scalar:
        missing = [k for k, v in gemma.items() if not v] + (["no model.qkv_bias"] if m.qkv_bias else [])
        if missing:
            raise UserError(f"--format llama: a gpt with some of Gemma 3's layer options but not {', '.join(missing)} "
                            "is no stock transformers architecture; export it with --format looped_lm")
        return "Gemma3ForCausalLM", GEMMA3
    if "sliding_attention" in m.layer_types:
        if "full_attention" in m.layer_types or m.local_rope_theta() != m.rope_theta or m.qkv_bias or m.qk_norm:
            raise UserError("--format llama: a gpt with local layers (model.layer_types) is a stock transformers "
                            "architecture only as Mistral (every layer local, model.rope_local_theta 0 or "
                            "model.rope_theta, no model.qkv_bias or model.qk_norm) or Gemma 3 (with its layer "
                            "options); export it with --format looped_lm")
        return "MistralForCausalLM", "mistral"
    if m.qkv_bias and m.qk_norm:
        raise UserError("--format llama: a gpt with both model.qkv_bias and model.qk_norm is no stock transformers "
                        "architecture; export it with --format looped_lm")
    if m.qk_norm:
        return "Qwen3ForCausalLM", "qwen3"
    if m.qkv_bias:
        return "Qwen2ForCausalLM", "qwen2"
    return "LlamaForCausalLM", "llama"


def llama_config_dict(model, cfg, eot_id: int, bos_id: int | None = None, pad_id: int | None = None) -> dict:
    """The fields of a transformers LlamaConfig (Qwen2Config / Qwen3Config / MistralConfig: `stock_family`) for a native GPT
    (bos / pad default to eot_id). rope_theta is written both at the top level (transformers 4.x, llama.cpp,
    older tools) and in rope_parameters (transformers 5)."""
    m = cfg.model
    vocab, d = model.tok_emb.weight.shape
    ffn = model.layers[0].mlp.down.weight.shape[1]
    arch, model_type = stock_family(cfg)
    if model_type == GEMMA3:
        return gemma3_config_dict(model, cfg, eot_id, bos_id, pad_id)
    family = {"llama": {}, "mistral": {"sliding_window": m.sliding_window}}.get(
        model_type, {"use_sliding_window": False, "sliding_window": None, "max_window_layers": len(model.layers)})
    return {"architectures": [arch], "model_type": model_type, "vocab_size": vocab, **family,
            "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": len(model.layers),
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_heads, "head_dim": model.head_dim,
            "hidden_act": "silu", "max_position_embeddings": model.max_positions, "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "tie_word_embeddings": model.lm_head is None, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "initializer_range": m.init_std, "use_cache": True,
            "bos_token_id": eot_id if bos_id is None else bos_id, "eos_token_id": eot_id,
            "pad_token_id": eot_id if pad_id is None else pad_id, "dtype": "float32", "torch_dtype": "float32"}


def gemma3_config_dict(model, cfg, eot_id: int, bos_id: int | None = None, pad_id: int | None = None) -> dict:
    """The fields of a transformers Gemma3TextConfig for a native GPT with Gemma 3's layer options. The RoPE bases
    are written both in rope_parameters by layer type (transformers 5) and as rope_theta / rope_local_base_freq
    (transformers 4)."""
    m = cfg.model
    vocab, d = model.tok_emb.weight.shape
    local_theta = m.rope_local_theta or m.rope_theta
    scalar = m.attn_scalar or model.head_dim
    scalar = int(scalar) if float(scalar).is_integer() else scalar  # transformers 5 types the field int
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": GEMMA3, "vocab_size": vocab, "hidden_size": d,
            "intermediate_size": model.layers[0].mlp.down.weight.shape[1], "num_hidden_layers": len(model.layers),
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_heads, "head_dim": model.head_dim,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": model.max_positions,
            "rms_norm_eps": m.norm_eps, "query_pre_attn_scalar": scalar,
            "layer_types": list(m.layer_types) or ["full_attention"] * len(model.layers),
            "sliding_window": m.sliding_window or model.max_positions,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": m.rope_theta},
                                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
            "rope_theta": m.rope_theta, "rope_local_base_freq": local_theta,
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
            "tie_word_embeddings": model.lm_head is None, "attention_bias": False, "attention_dropout": 0.0,
            "initializer_range": m.init_std, "use_cache": True,
            "bos_token_id": eot_id if bos_id is None else bos_id, "eos_token_id": eot_id,
            "pad_token_id": eot_id if pad_id is None else pad_id, "dtype": "float32", "torch_dtype": "float32"}


def llama_state_dict(model) -> dict:
    """Native GPT weights under Llama's names: qkv -> q/k/v_proj (rows: q, then k, then v, heads
    contiguous within each, as `Attention.project` views them), gate_up -> gate_proj/up_proj (gate
    first, as `SwiGLU.forward` chunks it). The head is the embedding: no lm_head tensor. A gpt with sandwich
    norms is Gemma 3's layer (`stock_family` refuses the rest): its norms under Gemma 3's names, as w - 1."""
    gemma = model.layers[0].post_norm1 is not None
    norm = (lambda w: w - 1.0) if gemma else (lambda w: w)  # Gemma 3's RMSNorm multiplies by (1 + w)
    out = {"model.embed_tokens.weight": model.tok_emb.weight, "model.norm.weight": norm(model.norm.weight)}
    if model.lm_head is not None:  # untied: the source's separate head
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attn.qkv.weight.chunk(3, dim=0)
        if layer.attn.qkv.bias is not None:  # Qwen2
            out.update(zip((p + f"self_attn.{x}_proj.bias" for x in "qkv"), layer.attn.qkv.bias.chunk(3)))
        if layer.attn.q_norm is not None:  # Qwen3, Gemma 3
            out.update({p + "self_attn.q_norm.weight": norm(layer.attn.q_norm.weight),
                        p + "self_attn.k_norm.weight": norm(layer.attn.k_norm.weight)})
        if gemma:  # the sandwich: post_attention_layernorm is the attention output's norm, norm2 the MLP input's
            out.update({p + "post_attention_layernorm.weight": norm(layer.post_norm1.weight),
                        p + "pre_feedforward_layernorm.weight": norm(layer.norm2.weight),
                        p + "post_feedforward_layernorm.weight": norm(layer.post_norm2.weight)})
        else:
            out[p + "post_attention_layernorm.weight"] = layer.norm2.weight
        gate, up = layer.mlp.gate_up.weight.chunk(2, dim=0)
        out.update({p + "input_layernorm.weight": norm(layer.norm1.weight),
                    p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.attn.proj.weight,
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": layer.mlp.down.weight})
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}


def hf_config_dict(model, cfg, manifest: dict, num_iterations: int | None = None) -> dict:
    """The fields of LoopedLMConfig for a loaded native model."""
    m = cfg.model
    kind = m.kind
    require(kind_of(cfg), "export_native", "looped_lm export --format looped_lm")
    fields = {"looped_lm_config": cfg.to_dict(), "kind": kind, "vocab_size": manifest["vocab_size"],
              "model_state": manifest.get("model_state") or {}, "tokenizer": manifest["tokenizer"],
              "hidden_size": m.d_model, "num_attention_heads": m.n_heads, "num_hidden_layers": m.n_layers,
              "max_position_embeddings": model.max_positions,
              "tie_word_embeddings": model.lm_head is None}  # untied: transformers must not tie lm_head back
    if kind_of(cfg).offers("iterative"):
        from looped_lm.settings import resolve_settings  # imports torch: seconds at start-up, not at `looped_lm export --help`

        settings = resolve_settings(model.iteration_limits(), num_iterations=num_iterations)
        fields.update(num_iterations=settings.num_iterations, bridge=settings.bridge)
    elif num_iterations is not None:
        raise UserError(f"--num-iterations applies to DiffusionBlocks and looped models, not to model.kind '{kind}'")
    return fields


def token_ids(tok) -> dict:
    """config.json's eos / bos / pad ids: the model's (`Tokenizer.specials`), bos and pad else end-of-text."""
    s = tok.specials
    return {"eos_token_id": tok.eot_id, "bos_token_id": tok.eot_id if s.bos_token_id is None else s.bos_token_id,
            "pad_token_id": tok.eot_id if s.pad_token_id is None else s.pad_token_id}


def save_tokenizer(tok, out: Path, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json: the model's special tokens and its chat template (a
    model without one: the server's plain `Role: content` template, so transformers and vLLM render chat
    as `looped_lm serve` does), in tokenizer_config.json itself; tokenizer_class PreTrainedTokenizerFast,
    which transformers 4 and 5 both load."""
    hf = tok.to_hf(model_max_length=model_max_length, chat_template=tok.specials.chat_template or PLAIN_CHAT_TEMPLATE)
    hf.save_pretrained(out, save_jinja_files=False)  # the template in tokenizer_config.json, not a .jinja file
    path = Path(out) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS  # transformers 5 writes its own class name, TokenizersBackend
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def export(checkpoint: str | Path, out: str | Path, overwrite: bool = False, num_iterations: int | None = None,
           verify: bool = True, format: str = "auto", overrides=()) -> Path:
    import torch  # transformers: seconds at start-up
    from safetensors.torch import save_file, save_model
    from transformers import GenerationConfig

    from looped_lm.models.contract import CachedDecoding

    if format not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)} (got '{format}')")

    out = check_output_path(out, "--out", kind="dir")  # a symlink loop, /proc: before the checkpoint is read
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} is not empty; pass --overwrite to replace it")
    tmp = out.parent / f".tmp-{out.name}"
    try:  # where the temp directory goes, checked before the checkpoint is read
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tmp.rmdir()
    except OSError as e:
        raise UserError(f"--out {out}: cannot write into {out.parent} ({e.strerror})") from None
    model, cfg, manifest = load_checkpoint(checkpoint, verify=verify, overrides=overrides)
    from looped_lm.lora import is_adapted, merge  # imports torch: seconds at start-up

    if is_adapted(model):  # LoRA: the adapters folded into the base, written as plain weights
        model = merge(model)
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lora_rank": 0})})
    if not isinstance(model, CachedDecoding):  # vit / dit / mdm
        raise UserError(f"looped_lm export is for language models; a {cfg.model.kind} checkpoint is used through "
                        "looped_lm eval and looped_lm generate")
    kind = kind_of(cfg)
    if format == "auto":
        format = "llama" if kind.offers("export_llama") else "looped_lm"
    if format == "llama" and not kind.offers("export_llama"):
        raise UserError(f"--format llama: model.kind {kind.name} does not offer export_llama (it is not a stock "
                        f"Llama); use --format looped_lm")
    tok = get_tokenizer(manifest["tokenizer"])
    ids = token_ids(tok)
    stops = list(tok.specials.stop_ids)  # generation stops at eos and the end-of-turn tokens (<|im_end|>)
    gen = {"eos_token_id": stops if len(stops) > 1 else stops[0], "bos_token_id": ids["bos_token_id"],
           "pad_token_id": ids["pad_token_id"]}
    if format == "llama":
        if num_iterations is not None:
            raise UserError(f"--num-iterations applies to DiffusionBlocks and looped models, not to model.kind "
                            f"'{kind.name}'")
        config = llama_config_dict(model, cfg, tok.eot_id, ids["bos_token_id"], ids["pad_token_id"])
        weights = llama_state_dict(model)
    else:
        from looped_lm.hf.configuration import LoopedLMConfig  # transformers: seconds at start-up

        register()
        config = LoopedLMConfig(**hf_config_dict(model, cfg, manifest, num_iterations),
                                architectures=["LoopedLMForCausalLM"], **ids, dtype="float32")
        if kind.offers("iterative"):
            gen.update(num_iterations=config.num_iterations, bridge=config.bridge, seed=0)
        weights = None  # the native weights, tied embedding once, under the wrapper's "model." prefix
    tmp.mkdir(parents=True)
    try:  # a failure mid-write (a full disk) leaves nothing: the temp directory goes, --out is untouched
        if format == "llama":
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        else:
            config.save_pretrained(tmp)
        GenerationConfig(**gen).save_pretrained(tmp)
        if weights is not None:
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            holder = torch.nn.Module()  # the HF wrapper keeps the native model as `.model`: names "model.*"
            holder.model = model
            save_model(holder, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        save_tokenizer(tok, tmp, model.max_positions)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
