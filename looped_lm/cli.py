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
from looped_lm.checkpoint import add_verify_argument
from looped_lm.errors import UserError


# --- train: the same trainer as `deepspeed looped_lm/train.py`, through the launcher -----------


def add_train_arguments(p) -> None:
    from looped_lm import train as trainer

    trainer.add_arguments(p)
    p.add_argument("--nproc", type=int, default=0,
                   help="processes on this node (GPUs; on CPU, gloo ranks); 0 = all GPUs, or 1 on CPU")


def run_train(args) -> int:
    from looped_lm import checkpoint as ckpt_io
    from looped_lm import train as trainer
    from looped_lm.config import describe_fields

    if args.help_config:
        print(describe_fields())
        return 0
    cfg = trainer.config_from_args(args)
    if args.nproc < 0:
        raise UserError(f"--nproc must be >= 0 (got {args.nproc})")
    if args.no_verify:
        print(ckpt_io.no_verify_note(), file=sys.stderr)
    # config, data, out_dir and the checkpoint to resume: checked here, before the launcher starts
    plan = trainer.preflight(cfg, verify=not args.no_verify)
    import torch

    nproc = args.nproc or (torch.cuda.device_count() or 1)
    if plan.manifest is not None:
        plan.notes += trainer.check_resume(plan.manifest, cfg, plan.vocab_size, nproc, Path(plan.resume))
    for note in plan.notes:
        print(f"note: {note}", flush=True)
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
    if args.no_verify:
        cmd += ["--no-verify"]
    env = dict(os.environ)
    env[trainer.PREFLIGHT_DONE] = "1"
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    proc = subprocess.run(cmd, env=env)
    return proc.returncode


# --- generate ----------------------------------------------------------------------------------


def add_generate_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory, or a run directory (its newest complete checkpoint)")
    add_verify_argument(p)
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

    from looped_lm.checkpoint import load_checkpoint, no_verify_note, resolve_checkpoint
    from looped_lm.data.tokenizer import get_tokenizer
    from looped_lm.engine.generate import generate
    from looped_lm.engine.sampling import SamplingParams

    if args.no_verify:
        print(no_verify_note(), file=sys.stderr)
    model, cfg, manifest = load_checkpoint(resolve_checkpoint(args.checkpoint), args.device,
                                           verify=not args.no_verify)
    tok = get_tokenizer(manifest["tokenizer"])
    ids = tok.encode(args.prompt) or [tok.eot_id]
    from looped_lm.diffusion.adaptive_exit import ExitRule

    exit_rule = ExitRule.from_options(args.exit_threshold, args.exit_criterion)
    if hasattr(model, "inference_kwargs"):
        kw = model.inference_kwargs(args.num_iterations, args.bridge, exit_rule)
    elif args.num_iterations is not None or args.bridge is not None or exit_rule is not None:
        raise UserError(f"--num-iterations / --bridge / --exit-* apply to DiffusionBlocks and looped models, "
                        f"not to model.kind '{cfg.model.kind}'")
    else:
        kw = {}
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    prompt = torch.tensor([ids], dtype=torch.long, device=args.device)
    iterations: list = []
    out = generate(model, prompt, args.max_tokens, params, seed=args.seed, eot_id=tok.eot_id,
                   iteration_log=iterations, **kw)
    new = out[0, len(ids):].tolist()
    if tok.eot_id in new:
        new = new[:new.index(tok.eot_id)]
    print(args.prompt + tok.decode(new))
    if iterations:
        per_token = [int(it[0]) for it in iterations]
        print(f"iterations per token: {per_token} (total {sum(per_token)}, mean "
              f"{sum(per_token) / len(per_token):.2f} of K={kw['num_iterations']})", file=sys.stderr)
    return 0


# --- serve: the OpenAI-compatible server (serve/, imported only for this verb) -------------------


def add_serve_arguments(p) -> None:
    from serve.cli import add_arguments  # argparse only: fastapi is imported when the server starts

    add_arguments(p)


def run_serve(args) -> int:
    from serve.cli import run

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
