"""`looped_lm serve --checkpoint DIR`: flags, then load, size the KV pool, and run uvicorn.

Imports nothing heavy at module level: `looped_lm --help` lists this verb without fastapi installed.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from pathlib import Path

from looped_lm.checkpoint import NO_VERIFY_HELP, add_set_argument, load_checkpoint, no_verify_note, resolve_checkpoint
from looped_lm import fields
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.errors import UserError
from looped_lm.serve.text import load_chat_template


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory, or a run directory (its newest complete checkpoint)")
    p.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    add_set_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("LOOPED_LM_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $LOOPED_LM_API_KEY; unset = no key)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the run directory, e.g. quickstart_db)")
    p.add_argument("--default-iterations", type=int, default=None,
                   help="K when a request names none (default: the kind's, as generate and eval use: "
                        "diffusion.num_iterations or B; huginn: model.num_iterations or its mean recurrence)")
    p.add_argument("--max-iterations", type=int, default=None,
                   help="largest K a request may ask for (default: model.max_iterations)")
    p.add_argument("--kv-memory-gb", type=float, default=None,
                   help="KV cache budget in GiB: sets the slot count (default: KV_MEMORY_FRACTION, a quarter, of "
                        "the memory free on --device once the model is loaded, as vLLM sizes its cache from the "
                        "memory it has; a context that one slot of it cannot hold is lowered to what fits, with a "
                        "note, unless --max-model-len asks for it)")
    p.add_argument("--max-slots", type=int, default=64, help="at most this many concurrent sequences")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per sequence, prompt + completion (default: the trained context, model.seq_len; "
                        "longer, up to the model's positions, with a warning)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill forward")
    p.add_argument("--logprob-draws", type=int, default=4,
                   help="DiffusionBlocks models: independent estimates averaged for each log-prob (the sampler's "
                        "marginal, as `looped_lm eval --draws`; more draws, less noise, more compute)")
    p.add_argument("--logprob-max-draws", type=int, default=64,
                   help="DiffusionBlocks models: where a token's standard error is still above 0.5 nats after "
                        "--logprob-draws, draw again for those tokens, doubling, up to this many "
                        "in all (default 64): every log-prob is a number, its standard error in `token_logprob_se`")
    p.add_argument("--max-request-work", type=int, default=2 ** 20,
                   help="denoising calls one request may cost at most (tokens x K x choices, and prompt "
                        "scoring's draws): more is refused with 400 before it runs; a chat request without "
                        "max_tokens gets as many tokens as fit (default 2**20)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                   help="the Jinja chat template for /v1/chat/completions, a file or the template itself (as "
                        "vLLM's flag); default: the model's (tokenizer_config.json's chat_template, a "
                        "chat_template.jinja beside it, or the GGUF's), else a plain `Role: content` one")
    p.add_argument("--compile-decode", type=fields.switch, default="auto",
                   help="torch.compile the one-token decode step, rows padded to power-of-two buckets (CUDA graphs "
                        "on a GPU): gpt's whole step, db_ar's and looped_db's block calls (huginn decodes eagerly): "
                        "auto = on CUDA")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


KV_MEMORY_FRACTION = 0.25  # of the memory free once the model is loaded: the default KV budget


def default_name(checkpoint: Path) -> str:
    """out/quickstart_db/step_0001000 -> quickstart_db; any other directory -> its own name."""
    checkpoint = checkpoint.resolve()
    return checkpoint.parent.name if checkpoint.name.startswith("step_") else checkpoint.name


def served_context(trained: int, positions: int, max_model_len: int | None) -> int:
    """Tokens per sequence: the trained context (model.seq_len, or a pretrained source's positions,
    model.max_positions) unless --max-model-len says otherwise (at most the model's `positions`). Positions
    past the trained context were never trained on: serving them takes the flag, and prints a warning line."""
    if max_model_len is None:
        return min(trained, positions)
    if not 1 <= max_model_len <= positions:
        raise UserError(f"--max-model-len must be in 1..{positions} (the model's positions; trained on "
                        f"{trained}); got {max_model_len}")
    if max_model_len > trained:
        print(f"warning: --max-model-len {max_model_len} exceeds the trained context of {trained} tokens "
              "(model.seq_len / model.max_positions); text past it may be poor", file=sys.stderr)
    return max_model_len


def check_address(host: str, port: int) -> None:
    """The address uvicorn will bind: it resolves, it is this machine's, and the port is free."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host {host} does not resolve ({getattr(e, 'strerror', None) or e})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"--port {port}: {host}:{port} is already in use (another server?); choose another "
                                "--port") from None
            raise UserError(f"--host {host} --port {port}: cannot bind ({e.strerror})") from None


def run(args) -> int:
    try:
        import uvicorn  # optional: the serve extra

        from looped_lm.serve.app import build_app  # optional: the serve extra
    except ModuleNotFoundError as e:
        raise UserError(f"`looped_lm serve` needs the serve extra ({e.name} is missing): "
                        "pip install -e '.[serve]'") from None
    # torch and the engine: seconds at start-up, so only when the verb runs
    import torch

    from looped_lm import devices
    from looped_lm.engine.compiled import compile_setting
    from looped_lm.engine.engine import Engine
    from looped_lm.models.contract import CachedDecoding

    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1 (got {args.threads})")
        torch.set_num_threads(args.threads)
    if args.port < 0 or args.port > 65535:
        raise UserError(f"--port must be in 0..65535 (got {args.port})")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key (or $LOOPED_LM_API_KEY) is empty: give a key, or leave both unset to serve "
                        "without authentication")
    from looped_lm.settings import MAX_DRAWS  # imports torch: seconds at start-up

    if not 1 <= args.logprob_draws <= args.logprob_max_draws <= MAX_DRAWS:
        raise UserError(f"--logprob-draws and --logprob-max-draws must satisfy 1 <= draws <= max draws <= "
                        f"{MAX_DRAWS} (got {args.logprob_draws} and {args.logprob_max_draws})")
    if args.max_request_work < 1:
        raise UserError(f"--max-request-work must be >= 1 (got {args.max_request_work})")
    if args.max_slots < 1 or args.prefill_chunk < 1 or (args.kv_memory_gb is not None and not args.kv_memory_gb > 0):
        raise UserError("--max-slots and --prefill-chunk must be >= 1 and --kv-memory-gb > 0")
    for flag, value in (("--default-iterations", args.default_iterations), ("--max-iterations", args.max_iterations)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1 (got {value}): K, as a request's num_iterations")
    from looped_lm.devices import check_device  # imports torch: seconds at start-up

    check_device(args.device)
    template = None
    if args.chat_template is not None:
        template = load_chat_template(args.chat_template)
    check_address(args.host, args.port)  # before the model loads: a taken port fails in a second
    if args.no_verify:
        print(no_verify_note(), file=sys.stderr)
    checkpoint = resolve_checkpoint(args.checkpoint)
    model, cfg, manifest = load_checkpoint(checkpoint, args.device, verify=not args.no_verify,
                                           overrides=args.set)
    if not isinstance(model, CachedDecoding):  # vit / dit / mdm
        raise UserError(f"looped_lm serve is for language models; a {cfg.model.kind} checkpoint is used through "
                        "looped_lm eval and looped_lm generate")
    tok = get_tokenizer(manifest["tokenizer"])
    name = args.served_model_name or default_name(checkpoint)
    if "@" in name:
        raise UserError(f"--served-model-name must not contain '@' (it marks K aliases): {name!r}")
    from looped_lm.settings import LOGPROB_RESOLVE_SE, InferenceSettings, ScoreSettings, iterations_note  # imports torch: seconds at start-up

    max_len = served_context(cfg.model.positions(), model.max_positions, args.max_model_len)
    budget = args.kv_memory_gb
    if budget is None:
        budget = KV_MEMORY_FRACTION * devices.available_memory(torch.device(args.device)) / 2 ** 30
    fits = Engine.context_that_fits(model, budget, max_len, args.max_iterations)
    if fits < max_len and args.max_model_len is None and fits >= 1:  # asked for explicitly: refused below instead
        print(f"note: a KV budget of {budget:.2f} GiB holds one sequence of {fits} tokens, not the model's "
              f"{max_len}: serving {fits} tokens per sequence (--kv-memory-gb or --max-model-len to choose)",
              file=sys.stderr)
        max_len = fits
    engine = Engine.from_memory_budget(model, budget, max_slots=args.max_slots, max_len=max_len,
                                       max_iterations=args.max_iterations, default_iterations=args.default_iterations,
                                       prefill_chunk=args.prefill_chunk, vocab_size=tok.vocab_size,
                                       score_settings=ScoreSettings(draws=args.logprob_draws,
                                                                    max_draws=args.logprob_max_draws,
                                                                    resolve_se=LOGPROB_RESOLVE_SE),
                                       compile_decode=compile_setting(args.compile_decode, torch.device(args.device)))
    app = build_app(engine, tok, name, api_key=args.api_key, max_request_work=args.max_request_work,
                    chat_template=template)
    k = f", K default {engine.default_iterations} (max {engine.max_iterations})" if engine.max_iterations else ""
    print(f"serving {name} ({cfg.model.kind}{k}) at http://{args.host}:{args.port}/v1 with "
          f"{engine.stats.num_slots} slots of {engine.max_len} tokens", file=sys.stderr)
    # the cap itself through the same rule a request meets: a note here means some allowed K gets a `warning`
    if engine.limits and iterations_note(engine.limits, InferenceSettings(num_iterations=engine.max_iterations)):
        print(f"note: a request may ask for K up to {engine.max_iterations}; one above K = "
              f"{max(engine.limits.num_blocks, engine.limits.default_iterations)} (B = {engine.limits.num_blocks}) "
              f"gets a `warning` in its response: more denoising calls may be worse", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
