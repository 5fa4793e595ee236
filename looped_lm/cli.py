"""`looped_lm {prepare,train,eval,generate,export,merge,verify,serve}`: one verb per job; each verb only routes,
to the module that implements it (VERBS).

Bad input (a UserError anywhere below) prints one line, `error: ...`, and exits with code 2. A verb's
module is imported only when that verb runs (or shows its --help): `looped_lm --help` and a mistyped
flag answer at once, without importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from looped_lm import __version__
from looped_lm.console import plain_warnings
from looped_lm.errors import UserError


# verb: (help, the module that implements it: its add_arguments(p) and run(args) -> exit code); serve/ imports
# fastapi only when it starts
VERBS = {
    "prepare": ("tokenize a corpus into nanoGPT train.bin / val.bin", "looped_lm.data.prepare"),
    "train": ("train under DeepSpeed (wraps `deepspeed --module looped_lm.train`)", "looped_lm.launch"),
    "eval": ("perplexity of a checkpoint (exact, per K, or ppl@k)", "looped_lm.eval"),
    "generate": ("continue a prompt from a checkpoint", "looped_lm.generate"),
    "export": ("write a Hugging Face directory (transformers / vLLM) from a checkpoint", "looped_lm.export"),
    "merge": ("join independently trained DiffusionBlocks block jobs into one checkpoint", "looped_lm.merge"),
    "verify": ("check a checkpoint as a resume would (files, hashes, manifest against weights)", "looped_lm.verify"),
    "serve": ("OpenAI-compatible HTTP server (completions, chat, streaming, K per request)", "looped_lm.serve.cli"),
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
    for name, (helptext, module) in VERBS.items():
        p = verbs.add_parser(name, help=helptext, description=helptext)
        if name == verb:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)

    verbose = getattr(args, "verbose", False)
    plain_warnings(verbose)
    try:
        return args.run(args)
    except UserError as e:
        if verbose:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a failure mid-run (a full disk, a read-only file system): one line, exit 1
        if verbose:
            traceback.print_exc()
        where = f" on {e.filename}" if e.filename else ""
        print(f"error: I/O failure{where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
