"""`looped_lm {prepare,train,eval,generate}`: one verb per job; each verb only routes.

Bad input (a UserError anywhere below) prints one line, `error: ...`, and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from looped_lm import __version__
from looped_lm.errors import UserError


# --- train: the same trainer as `deepspeed looped_lm/train.py`, through the launcher -----------


def add_train_arguments(p) -> None:
    p.add_argument("--config", help="YAML run config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    p.add_argument("--nproc", type=int, default=0,
                   help="processes on this node (GPUs; on CPU, gloo ranks); 0 = all GPUs, or 1 on CPU")
    p.add_argument("--stop-after", type=int, default=0, help="save and exit after N steps of this launch")
    p.add_argument("--help-config", action="store_true", help="list every config field and exit")


def run_train(args) -> int:
    import torch

    from looped_lm import train as trainer
    from looped_lm.config import describe_fields, load_config

    if args.help_config:
        print(describe_fields())
        return 0
    if args.config is None and not args.set:
        raise UserError("give --config FILE (and/or --set section.key=value overrides)")
    load_config(args.config, args.set)  # fail here, before the launcher starts any process
    nproc = args.nproc or (torch.cuda.device_count() or 1)
    launcher = shutil.which("deepspeed")
    if launcher is None:
        raise UserError("the `deepspeed` launcher is not on PATH; pip install deepspeed")
    cmd = [launcher, "--num_gpus", str(nproc), "--master_port", str(trainer._free_port()),
           str(Path(trainer.__file__).resolve())]
    if args.config:
        cmd += ["--config", args.config]
    for item in args.set:
        cmd += ["--set", item]
    if args.stop_after:
        cmd += ["--stop-after", str(args.stop_after)]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    proc = subprocess.run(cmd, env=env)
    return 2 if proc.returncode == 2 else proc.returncode


# --- generate ----------------------------------------------------------------------------------


def add_generate_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-iterations", type=int, default=None,
                   help="DiffusionBlocks / looped models: K denoising steps per token (default: the config's)")
    p.add_argument("--bridge", choices=("soft", "hard", "sample"), default=None,
                   help="DB models: logits -> embedding between steps (expectation, argmax, or a sampled token)")
    p.add_argument("--exit-threshold", type=float, default=None,
                   help="looped_db: stop a token's iterations once KL(p_k || p_k-1) < this")
    p.add_argument("--exit-criterion", default=None, help="looped_db: kl:<eps> or argmax-stable:<m>")
    p.add_argument("--device", default="cpu")


def run_generate(args) -> int:
    import torch

    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.data.tokenizer import get_tokenizer
    from looped_lm.engine.generate import generate
    from looped_lm.models.contract import Iterative
    from looped_lm.sampling import SamplingParams
    from looped_lm.settings import ExitRule, resolve_settings, skipped_blocks_note

    model, cfg, manifest = load_checkpoint(args.checkpoint, args.device)
    tok = get_tokenizer(manifest["tokenizer"])
    ids = tok.encode(args.prompt) or [tok.eot_id]
    limits = model.iteration_limits() if isinstance(model, Iterative) else None
    settings = resolve_settings(limits, num_iterations=args.num_iterations, bridge=args.bridge,
                                exit_rule=ExitRule.parse(args.exit_threshold, args.exit_criterion),
                                sampling=SamplingParams(args.temperature, args.top_k, args.top_p))
    note = skipped_blocks_note(limits, settings)
    if note:
        print(note, file=sys.stderr)
    prompt = torch.tensor([ids], dtype=torch.long, device=args.device)
    iterations: list = []
    out = generate(model, prompt, args.max_tokens, settings, seed=args.seed, eot_id=tok.eot_id,
                   iteration_log=iterations if settings.exit_rule is not None else None)
    new = out[0, len(ids):].tolist()
    if tok.eot_id in new:
        new = new[:new.index(tok.eot_id)]
    print(args.prompt + tok.decode(new))
    if iterations:
        per_token = [int(it[0]) for it in iterations]
        print(f"iterations per token: {per_token} (total {sum(per_token)}, mean "
              f"{sum(per_token) / len(per_token):.2f} of K={settings.num_iterations})", file=sys.stderr)
    return 0


# --- serve: the OpenAI-compatible server (serve/, imported only for this verb) -------------------


def add_serve_arguments(p) -> None:
    from looped_lm.serve.cli import add_arguments  # argparse only: fastapi is imported when the server starts

    add_arguments(p)


def run_serve(args) -> int:
    from looped_lm.serve.cli import run

    return run(args)


# --- entry point -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from looped_lm import eval as evaluate
    from looped_lm import export
    from looped_lm.data import prepare

    parser = argparse.ArgumentParser(prog="looped_lm", description="DiffusionBlocks language models: "
                                     "prepare data, train, evaluate, generate.")
    parser.add_argument("--version", action="version", version=f"looped_lm {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="{prepare,train,eval,generate,export,serve}")
    for name, helptext, add, run in (
        ("prepare", "tokenize a corpus into nanoGPT train.bin / val.bin", prepare.add_arguments, prepare.run),
        ("train", "train under DeepSpeed (wraps `deepspeed looped_lm/train.py`)", add_train_arguments, run_train),
        ("eval", "perplexity of a checkpoint (exact, per K, or ppl@k)", evaluate.add_arguments, evaluate.run),
        ("generate", "continue a prompt from a checkpoint", add_generate_arguments, run_generate),
        ("export", "write a Hugging Face directory (transformers / vLLM) from a checkpoint", export.add_arguments,
         export.run),
        ("serve", "OpenAI-compatible HTTP server (completions, chat, streaming, K per request)",
         add_serve_arguments, run_serve),
    ):
        p = verbs.add_parser(name, help=helptext, description=helptext)
        add(p)
        p.set_defaults(run=run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
