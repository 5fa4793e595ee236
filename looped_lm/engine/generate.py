"""Autoregressive generation against KV caches, for every model kind that offers
`new_cache(batch, max_len)` and `forward_cached(idx, caches, **kw) -> logits (B, n, V)`.

DiffusionBlocks models accept `num_iterations` (K) in `forward_cached`; the loop here is the same.
"""

from __future__ import annotations

import torch

from looped_lm.engine.sampling import SamplingParams, sample
from looped_lm.errors import UserError


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams = SamplingParams(0.0),
             seed: int | None = None, eot_id: int | None = None, return_logits: bool = False,
             iteration_log: list | None = None, **model_kw):
    """prompt (B, T0) int64 -> (B, T0 + n) tokens; with return_logits also (B, n, V) step logits.

    Stops early when every row has produced `eot_id`. Same seed, same output. With adaptive exit
    (`exit_rule=` for looped models), `iteration_log` receives the iterations each row used per token.
    """
    params.validate()
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise UserError("the prompt must hold at least one token")
    if max_new_tokens < 1:
        raise UserError(f"max_tokens must be >= 1 (got {max_new_tokens})")
    total = prompt.shape[1] + max_new_tokens
    if total > model.max_positions:
        raise UserError(f"prompt ({prompt.shape[1]}) + max_tokens ({max_new_tokens}) exceeds the model's "
                        f"{model.max_positions} positions")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=prompt.device).manual_seed(seed)
        model_kw.setdefault("generator", generator) if _takes_generator(model) else None
    if model_kw.get("bridge") == "sample":
        model_kw.setdefault("sampling", params)  # the sample bridge draws the token with the request's sampler
    caches = model.new_cache(prompt.shape[0], total)

    def step(tokens):
        if iteration_log is None or "exit_rule" not in model_kw:
            return model.forward_cached(tokens, caches, **model_kw)[:, -1]
        stats = {}
        logits = model.forward_cached(tokens, caches, stats=stats, **model_kw)[:, -1]
        iteration_log.append(stats["iterations"][:, -1])  # (B,): the next token's slot
        return logits

    logits = step(prompt)
    out, step_logits = [prompt], []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for i in range(max_new_tokens):
        step_logits.append(logits)
        token = sample(logits, params, generator)
        out.append(token[:, None])
        if eot_id is not None:
            done |= token == eot_id
            if bool(done.all()):
                break
        if i + 1 < max_new_tokens:
            logits = step(token[:, None])
    tokens = torch.cat(out, dim=1)
    return (tokens, torch.stack(step_logits, dim=1)) if return_logits else tokens


def _takes_generator(model) -> bool:
    return getattr(model, "uses_noise", False)
