"""`looped_lm export`: a checkpoint -> a Hugging Face directory that transformers (and the vLLM plugin) load.

    HF_DIR/config.json              LoopedLMConfig (model_type "looped_lm"): the run config, vocab size,
                                    model state (block edges), kind, default K and bridge
    HF_DIR/model.safetensors        the native weights under "model.", the tied embedding stored once
    HF_DIR/generation_config.json   eos/bos/pad = end-of-text; DB models: num_iterations (K), bridge, seed
    HF_DIR/tokenizer.json ...       `Tokenizer.to_hf().save_pretrained`

Load it with `import looped_lm` then `transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from looped_lm.checkpoint import NO_VERIFY_HELP
from looped_lm.errors import UserError

DB_KINDS = ("db_ar", "looped_db")


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory, or a run directory (its newest complete checkpoint)")
    p.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    p.add_argument("--num-iterations", type=int, default=None,
                   help="DB models: default K written to the configs (default: the run config's)")


def run(args) -> int:
    import sys

    from looped_lm.checkpoint import no_verify_note, resolve_checkpoint

    if args.no_verify:
        print(no_verify_note(), file=sys.stderr)
    checkpoint = resolve_checkpoint(args.checkpoint)
    out = export(checkpoint, args.out, overwrite=args.overwrite, num_iterations=args.num_iterations,
                 verify=not args.no_verify)
    print(f"exported {checkpoint} -> {out}")
    return 0


def hf_config_dict(model, cfg, manifest: dict, num_iterations: int | None = None) -> dict:
    """The fields of LoopedLMConfig for a loaded native model."""
    m = cfg.model
    kind = m.kind
    if kind not in ("gpt", *DB_KINDS):
        raise UserError(f"export supports model.kind gpt, db_ar and looped_db (not '{kind}')")
    fields = {"looped_lm_config": cfg.to_dict(), "kind": kind, "vocab_size": manifest["vocab_size"],
              "model_state": manifest.get("model_state") or {}, "tokenizer": manifest["tokenizer"],
              "hidden_size": m.d_model, "num_attention_heads": m.n_heads, "num_hidden_layers": m.n_layers,
              "max_position_embeddings": model.max_positions}
    if kind in DB_KINDS:
        from looped_lm.settings import resolve_settings  # imports torch: not at `looped_lm export --help`

        settings = resolve_settings(model.iteration_limits(), num_iterations=num_iterations)
        fields.update(num_iterations=settings.num_iterations, bridge=settings.bridge)
    elif num_iterations is not None:
        raise UserError(f"--num-iterations applies to DiffusionBlocks and looped models, not to model.kind '{kind}'")
    return fields


def export(checkpoint: str | Path, out: str | Path, overwrite: bool = False, num_iterations: int | None = None,
           verify: bool = True) -> Path:
    import torch
    from safetensors.torch import save_model
    from transformers import GenerationConfig

    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.data.tokenizer import get_tokenizer
    from looped_lm.hf import register
    from looped_lm.hf.configuration import LoopedLMConfig

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} is not empty; pass --overwrite to replace it")
    model, cfg, manifest = load_checkpoint(checkpoint, verify=verify)
    register()
    tok = get_tokenizer(manifest["tokenizer"])
    config = LoopedLMConfig(**hf_config_dict(model, cfg, manifest, num_iterations),
                            architectures=["LoopedLMForCausalLM"], eos_token_id=tok.eot_id,
                            bos_token_id=tok.eot_id, pad_token_id=tok.eot_id, dtype="float32")
    gen = {"eos_token_id": tok.eot_id, "bos_token_id": tok.eot_id, "pad_token_id": tok.eot_id}
    if config.kind in DB_KINDS:
        gen.update(num_iterations=config.num_iterations, bridge=config.bridge, seed=0)
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    GenerationConfig(**gen).save_pretrained(tmp)
    holder = torch.nn.Module()  # the HF wrapper keeps the native model as `.model`: names "model.*"
    holder.model = model
    save_model(holder, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.to_hf(model_max_length=model.max_positions).save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
