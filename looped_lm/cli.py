"""`looped_lm {prepare,train,eval,generate,export,merge,verify,serve}`: one verb per job; each verb only routes.

Bad input (a UserError anywhere below) prints one line, `error: ...`, and exits with code 2. A verb's
module is imported only when that verb runs (or shows its --help): `looped_lm --help` and a mistyped
flag answer at once, without importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from looped_lm import __version__
from looped_lm.errors import UserError


# --- train: the same trainer as `deepspeed looped_lm/train.py`, through the launcher -----------


def add_train_arguments(p) -> None:
    from looped_lm import train as trainer

    trainer.add_arguments(p)
    p.add_argument("--nproc", type=int, default=0,
                   help="processes on this node (GPUs; on CPU, gloo ranks); 0 = all GPUs, or 1 on CPU; with "
                        "--hostfile, processes per node (0 = each node's slots)")
    p.add_argument("--hostfile", default=None, metavar="FILE",
                   help="DeepSpeed hostfile (`host slots=N` per line): run on every node it lists, over ssh "
                        "(README: multi-node)")
    p.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a free one; 29500 "
                   "with --hostfile)")


def run_train(args) -> int:
    from looped_lm import checkpoint as ckpt_io
    from looped_lm import launch, preflight
    from looped_lm import train as trainer
    from looped_lm.config import describe_fields

    if args.help_config:
        print(describe_fields())
        return 0
    cfg = trainer.config_from_args(args)
    if args.nproc < 0:
        raise UserError(f"--nproc must be >= 0 (got {args.nproc})")
    if not 0 <= args.master_port <= 65535:
        raise UserError(f"--master-port must be in 1..65535, or 0 for a free one (got {args.master_port})")
    if args.no_verify:
        print(ckpt_io.no_verify_note(), file=sys.stderr)
    import torch

    if args.hostfile:  # every node's slots, capped by --nproc
        nproc, world = args.nproc, launch.hostfile_slots(args.hostfile, args.nproc)
    else:
        nproc = world = args.nproc or (torch.cuda.device_count() or 1)
    # config, world size, data, out_dir and the checkpoint to resume: checked here, before the launcher starts
    plan = preflight.preflight(cfg, verify=not args.no_verify, world_size=world)
    for note in plan.notes:
        print(f"note: {note}", flush=True)
    if preflight.nothing_to_train(plan, cfg):
        print(preflight.nothing_to_train(plan, cfg))
        return 0
    port = args.master_port or (29500 if args.hostfile else trainer._free_port())
    cmd = launch.command(nproc, port, trainer.forward_args(args), args.verbose, args.hostfile)
    env = {**os.environ, trainer.PREFLIGHT_DONE: "1", "PYTHONUNBUFFERED": "1"}
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    if args.hostfile:
        return killed_rank(launch.run(cmd, env, verbose=args.verbose))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="looped_lm-rendezvous-") as rendezvous:  # one node: loopback only
        env[trainer.RENDEZVOUS_FILE] = os.path.join(rendezvous, "store")
        return killed_rank(launch.run(cmd, env, verbose=args.verbose))


def killed_rank(code: int) -> int:
    """The launcher's exit code; a rank killed by a signal (DeepSpeed then stops the others before they can
    say anything) becomes one line and exit code 1."""
    import signal

    if code < 0 or code > 128:
        number = -code if code < 0 else 256 - code
        try:
            name = signal.Signals(number).name
        except ValueError:
            return code
        why = " (out of memory, or killed by hand)" if name == "SIGKILL" else ""
        print(f"error: a training rank was killed by {name}{why}; the launcher stopped the others: the same command "
              "resumes from the newest checkpoint", file=sys.stderr)
        return 1
    return code


# --- generate ----------------------------------------------------------------------------------


def add_generate_arguments(p) -> None:
    from looped_lm.checkpoint import add_verify_argument
    from looped_lm.fields import finite_float, seed

    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory, or a run directory (its newest complete checkpoint)")
    add_verify_argument(p)
    p.add_argument("--prompt", default=None, help="text to continue (language models)")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temperature", type=finite_float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=seed, default=0, help="0..2**62 - 1")
    p.add_argument("--num-iterations", type=int, default=None,
                   help="DiffusionBlocks / looped models: K denoising steps per token (default: the config's); "
                   "dit / mdm: sampler steps, split across the blocks (at least one per block)")
    p.add_argument("--bridge", choices=("soft", "hard", "sample"), default=None,
                   help="DB models: logits -> embedding between steps (expectation, argmax, or a sampled token)")
    p.add_argument("--exit-threshold", type=finite_float, default=None,
                   help="DB models (db_ar, looped_db): stop a token's iterations once KL(p_k || p_k-1) < this")
    p.add_argument("--exit-criterion", default=None, help="DB models (db_ar, looped_db): kl:<eps> or "
                   "argmax-stable:<m>")
    p.add_argument("--device", default="cpu")
    m = p.add_argument_group("dit / mdm checkpoints (samples from noise; no prompt)")
    m.add_argument("--out", default=None, help="dit: the PNG grid of samples to write")
    m.add_argument("--labels", default=None, help="dit: comma-separated class ids, one sample each "
                   "(default: --num-samples cycling through the classes)")
    m.add_argument("--cfg-scale", type=finite_float, default=None,
                   help="dit: classifier-free guidance scale (1 = none; default: the config's)")
    m.add_argument("--num-samples", type=int, default=None, help="samples to draw (dit: 4 per class, mdm: 4)")
    m.add_argument("--length", type=int, default=None, help="mdm: characters per sample (default: model.seq_len)")
    m.add_argument("--vae", default=None, help="dit on latents: the local AutoencoderKL directory that decodes them")


MODULE_FLAGS = ("out", "labels", "cfg_scale", "num_samples", "length", "vae")  # dit / mdm only
LM_FLAGS = ("bridge", "exit_threshold", "exit_criterion")  # language models only (dit / mdm ignore them)


def run_generate(args) -> int:
    import torch

    from looped_lm.checkpoint import check_device, load_checkpoint, no_verify_note, resolve_checkpoint
    from looped_lm.data.tokenizer import get_tokenizer
    from looped_lm.engine.generate import generate
    from looped_lm.models.contract import CachedDecoding, Iterative
    from looped_lm.sampling import SamplingParams
    from looped_lm.settings import ExitRule, resolve_settings, skipped_blocks_note

    check_device(args.device)
    if args.num_samples is not None and args.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1 (got {args.num_samples})")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    if args.out is not None:  # before the checkpoint is read: a loop, /proc, a directory in the way
        from looped_lm.preflight import check_output_path

        check_output_path(args.out, "--out", kind="file")
    if args.no_verify:
        print(no_verify_note(), file=sys.stderr)
    model, cfg, manifest = load_checkpoint(resolve_checkpoint(args.checkpoint), args.device,
                                           verify=not args.no_verify)
    if not isinstance(model, CachedDecoding):  # dit, mdm: samples from noise (looped_lm.supporting)
        from looped_lm.supporting import generate as generate_module

        given = [f"--{name.replace('_', '-')}" for name in LM_FLAGS if getattr(args, name) is not None]
        if given:  # flags that would do nothing here are refused, not ignored
            raise UserError(f"{', '.join(given)}: for language models (a prompt's tokens); a {cfg.model.kind} "
                            "checkpoint samples from noise")

        return generate_module(model, cfg, manifest, args)
    given = [f"--{name.replace('_', '-')}" for name in MODULE_FLAGS if getattr(args, name) is not None]
    if given:
        raise UserError(f"{', '.join(given)}: for dit / mdm checkpoints (samples from noise); a {cfg.model.kind} "
                        "checkpoint continues --prompt")
    if args.prompt is None:
        raise UserError("give --prompt TEXT: the text to continue")
    tok = get_tokenizer(manifest["tokenizer"])
    ids = tok.encode(args.prompt) or [tok.eot_id]
    if len(ids) >= model.max_positions:
        raise UserError(f"--prompt is {len(ids)} tokens, but the model's context holds {model.max_positions} "
                        "(the prompt and at least one new token): shorten the prompt")
    limits = model.iteration_limits() if isinstance(model, Iterative) else None
    settings = resolve_settings(limits, num_iterations=args.num_iterations, bridge=args.bridge,
                                exit_rule=ExitRule.parse(args.exit_threshold, args.exit_criterion),
                                sampling=SamplingParams(args.temperature, args.top_k, args.top_p))
    refuse_idle_exit_rule(args, settings, cfg.model.kind)
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


def refuse_idle_exit_rule(args, settings, kind: str) -> None:
    """An exit rule compares a token's step with the one before: the first exit it can take is after step 2,
    so at K <= 2 (a db_ar model's default K is its block count) it would do nothing; refused, not ignored."""
    K = settings.num_iterations
    if settings.exit_rule is not None and K is not None and K <= 2:
        flags = " / ".join(f for f, v in (("--exit-threshold", args.exit_threshold),
                                          ("--exit-criterion", args.exit_criterion)) if v is not None)
        raise UserError(f"{flags}: does nothing at K = {K} on this {kind} checkpoint (a token can exit only after "
                        "its second step); pass --num-iterations above 2, or drop the flag")


# --- verify ------------------------------------------------------------------------------------


def add_verify_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="checkpoint directory, or a run directory (its newest complete checkpoint)")


def run_verify(args) -> int:
    """Every file, hash and manifest field a resume checks (checkpoint.verify_report); exit 0 or 2."""
    from looped_lm.checkpoint import verify_report

    for line in verify_report(args.checkpoint):
        print(line)
    return 0


# --- entry point -------------------------------------------------------------------------------

# verb: (help, module, its argument adder, its runner); serve/ imports fastapi only when it starts
VERBS = {
    "prepare": ("tokenize a corpus into nanoGPT train.bin / val.bin", "looped_lm.data.prepare", "add_arguments", "run"),
    "train": ("train under DeepSpeed (wraps `deepspeed --module looped_lm.train`)", "looped_lm.cli",
              "add_train_arguments", "run_train"),
    "eval": ("perplexity of a checkpoint (exact, per K, or ppl@k)", "looped_lm.eval", "add_arguments", "run"),
    "generate": ("continue a prompt from a checkpoint", "looped_lm.cli", "add_generate_arguments", "run_generate"),
    "export": ("write a Hugging Face directory (transformers / vLLM) from a checkpoint", "looped_lm.export",
               "add_arguments", "run"),
    "merge": ("join independently trained DiffusionBlocks block jobs into one checkpoint", "looped_lm.merge",
              "add_arguments", "run"),
    "verify": ("check a checkpoint as a resume would (files, hashes, manifest against weights)", "looped_lm.cli",
               "add_verify_arguments", "run_verify"),
    "serve": ("OpenAI-compatible HTTP server (completions, chat, streaming, K per request)", "looped_lm.serve.cli",
              "add_arguments", "run"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line and a pointer to --help, not the whole usage text (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser(argv=()) -> argparse.ArgumentParser:
    """The parser, with the arguments of the verb named in argv only (the others list their help line)."""
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = OneLineParser(prog="looped_lm", description="DiffusionBlocks language models: "
                                     "prepare data, train, evaluate, generate, export, merge block jobs, serve.")
    parser.add_argument("--version", action="version", version=f"looped_lm {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="{" + ",".join(VERBS) + "}")
    for name, (helptext, module, add, run) in VERBS.items():
        p = verbs.add_parser(name, help=helptext, description=helptext)
        if name == verb:
            mod = importlib.import_module(module)
            getattr(mod, add)(p)
            p.set_defaults(run=getattr(mod, run))
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    from looped_lm.console import plain_warnings

    verbose = getattr(args, "verbose", False)
    plain_warnings(verbose)
    try:
        return args.run(args)
    except UserError as e:
        if verbose:
            import traceback

            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a failure mid-run (a full disk, a read-only file system): one line, exit 1
        if verbose:
            import traceback

            traceback.print_exc()
        where = f" on {e.filename}" if e.filename else ""
        print(f"error: I/O failure{where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
