"""`looped_lm generate`: continue a prompt from a language-model checkpoint, or (dit / mdm) draw samples from
noise through looped_lm.supporting. Its flags, their checks and what it prints; the decoding itself is
looped_lm.engine.generate's.
"""

from __future__ import annotations

import sys

from looped_lm.checkpoint import add_set_argument, add_verify_argument, load_checkpoint, no_verify_note, resolve_checkpoint
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.errors import UserError
from looped_lm.fields import BRIDGES, finite_float, seed
from looped_lm.preflight import check_output_path


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory, or a run directory (its newest complete checkpoint)")
    add_verify_argument(p)
    add_set_argument(p)
    p.add_argument("--prompt", default=None, help="text to continue (language models)")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temperature", type=finite_float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=seed, default=0, help="0..2**62 - 1")
    p.add_argument("--num-iterations", type=int, default=None,
                   help="DiffusionBlocks / looped models: K denoising steps per token (default: the config's); "
                   "dit / mdm: sampler steps, split across the blocks (at least one per block)")
    p.add_argument("--bridge", choices=BRIDGES, default=None,
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


def run(args) -> int:
    import torch  # torch: seconds at start-up

    # imports torch: seconds at start-up
    from looped_lm.devices import check_device
    from looped_lm.engine.generate import generate
    from looped_lm.models.contract import CachedDecoding, Iterative
    from looped_lm.sampling import SamplingParams
    from looped_lm.settings import ExitRule, resolve_settings, iterations_note

    check_device(args.device)
    if args.num_samples is not None and args.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1 (got {args.num_samples})")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    if args.out is not None:  # before the checkpoint is read: a loop, /proc, a directory in the way
        check_output_path(args.out, "--out", kind="file")
    if args.no_verify:
        print(no_verify_note(), file=sys.stderr)
    model, cfg, manifest = load_checkpoint(resolve_checkpoint(args.checkpoint), args.device,
                                           verify=not args.no_verify, overrides=args.set)
    if not isinstance(model, CachedDecoding):  # dit, mdm: samples from noise (looped_lm.supporting)
        from looped_lm.supporting import ModuleRequest  # imports torch: seconds at start-up
        from looped_lm.supporting import generate as generate_module

        given = [f"--{name.replace('_', '-')}" for name in LM_FLAGS if getattr(args, name) is not None]
        if given:  # flags that would do nothing here are refused, not ignored
            raise UserError(f"{', '.join(given)}: for language models (a prompt's tokens); a {cfg.model.kind} "
                            "checkpoint samples from noise")

        return generate_module(model, cfg, manifest, ModuleRequest.of(args))
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
    note = iterations_note(limits, settings)
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
