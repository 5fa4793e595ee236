"""Autoregressive generation of a batch of prompts against KV caches, for every model kind (the
`CachedDecoding` contract). One loop: DiffusionBlocks models run their K-step chain inside
`forward_cached`; the settings (K, bridge, sampler, exit rule) come resolved from `resolve_settings`.
"""

from __future__ import annotations

import torch

from looped_lm.errors import UserError
from looped_lm.sampling import GREEDY, GREEDY_SEED, SharedGenerator, sample
from looped_lm.settings import InferenceSettings, RowBatch


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, settings: InferenceSettings = InferenceSettings(GREEDY),
             seed: int = 0,
             eot_id: int | None = None, return_logits: bool = False, iteration_log: list | None = None,
             noise: list | None = None):
    """prompt (B, T0) int64 -> (B, T0 + n) tokens; with return_logits also (B, n, V) step logits.

    Stops early when every row has produced `eot_id`. Same seed, same output: every draw (starting
    noise, bridge tokens, sampled tokens) comes from one generator seeded with `seed` (greedy: with
    GREEDY_SEED, so the output does not depend on `seed`). `iteration_log`
    receives the iterations each row used per token (DiffusionBlocks models). `noise[i]` (B, 1, d)
    replaces token i's starting noise (tests).
    """
    settings.sampling.validate()
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise UserError("the prompt must hold at least one token", "prompt")
    if max_new_tokens < 1:
        raise UserError(f"max_tokens must be >= 1 (got {max_new_tokens})", "max_tokens")
    total = prompt.shape[1] + max_new_tokens
    if total > model.max_positions:
        raise UserError(f"prompt ({prompt.shape[1]}) + max_tokens ({max_new_tokens}) exceeds the model's "
                        f"{model.max_positions} positions", "max_tokens")
    B = prompt.shape[0]
    seed = GREEDY_SEED if settings.sampling.greedy else seed  # greedy: the same text whatever the seed
    random = SharedGenerator(torch.Generator(device=prompt.device).manual_seed(seed))
    cache = model.new_cache(B, total)

    def step(tokens, i):
        batch = RowBatch.uniform(settings, B, random, None if noise is None else noise[i])
        logits = model.forward_cached(tokens, cache, None, batch)
        if iteration_log is not None and batch.iterations is not None:
            iteration_log.append(batch.iterations)
        return logits

    logits = step(prompt, 0)
    out, step_logits = [prompt], []
    done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    for i in range(max_new_tokens):
        step_logits.append(logits)
        token = sample(logits, [settings.sampling] * B, random)
        out.append(token[:, None])
        if eot_id is not None:
            done |= token == eot_id
            if bool(done.all()):
                break
        if i + 1 < max_new_tokens:
            logits = step(token[:, None], i + 1)
    tokens = torch.cat(out, dim=1)
    return (tokens, torch.stack(step_logits, dim=1)) if return_logits else tokens
