"""Perplexity of a checkpoint on a nanoGPT-format token file (docs/method.md §6).

Protocol: windows of `block_size` tokens, disjoint by default (the primary number); with `--stride S`
each window after the first scores only its last S targets, so every target is scored once with at
least block_size - S tokens of context (the secondary number). NLL is summed over scored tokens, then
PPL = exp(total NLL / tokens).

Models report per-token scores through the contract's `Scorable.score(x, y, ScoreSettings)`:
  gpt          {"exact": ...}
  huginn       {K: ...} for every K asked            (exact PPL per K)
  db_ar/looped {k: ...} for k in the grid, 0 = one call at sigma_top (ppl@k, docs/method.md §6)
DiffusionBlocks probabilities are estimated (unbiased, `draws` independent estimates per token); the
report gives each ppl@k its standard error from their spread (the delta method over tokens).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from looped_lm.checkpoint import NO_VERIFY_HELP, add_set_argument, load_checkpoint, no_verify_note, resolve_checkpoint
from looped_lm.config import MAX_DRAWS
from looped_lm.data.bin_dataset import TokenStream, token_dtype
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.errors import UserError
from looped_lm.fields import HELD_OUT_SPLITS, TEST, VAL, finite_float, seed, token_file
from looped_lm.kinds import get_kind
from looped_lm.preflight import check_output_path

# torch and the model stack are imported where they are used: `looped_lm eval --help` stays instant


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory (out/step_XXXXXXX), or a run directory (its newest complete checkpoint)")
    p.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    add_set_argument(p)
    p.add_argument("--data", default=None, help="nanoGPT val.bin, or a .txt / .jsonl file (tokenized with the "
                   "checkpoint's tokenizer); default: the run's val.bin (vit / mdm: a data source such as "
                   "cifar100:PATH or text8:PATH; default: the run's)")
    p.add_argument("--block-size", type=int, default=0, help="window length; 0 = the model's seq_len")
    p.add_argument("--stride", type=int, default=0, help="0 = disjoint blocks; S = sliding windows")
    p.add_argument("--max-tokens", type=int, default=0, help="score only the first N tokens (vit: images, mdm: "
                   "characters); 0 = all")
    p.add_argument("--split", choices=HELD_OUT_SPLITS, default=VAL,
                   help="the run's held-out split scored: val (default), or test (language models: the test.bin "
                   "of a run prepared with data.test_fraction > 0; mdm: text8's 5M-character splits); vit scores "
                   "the held-out images")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--num-iterations", default=None,
                   help="comma-separated K grid (huginn: exact PPL per K; DB models: ppl@k); vit: one K >= B")
    p.add_argument("--draws", type=int, default=4,
                   help="DB models: independent estimates averaged per token (their spread gives the standard "
                   f"error); mdm: masking times drawn per block interval; at most {MAX_DRAWS} (each draw is a "
                   "full pass over the data)")
    p.add_argument("--candidates", type=int, default=2,
                   help="DB models: first-step tokens the estimator enumerates (plus the target and one draw)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the DB noise draws (0..2**62 - 1)")
    p.add_argument("--features", default=None, metavar="VIT_CHECKPOINT",
                   help="dit: the classifier in whose features samples are compared with the held-out images "
                   "(a Frechet distance, not FID)")
    p.add_argument("--cfg-scale", type=finite_float, default=None, help="dit: guidance scale of the samples "
                   "(default: the config's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--no-progress", action="store_true")


def parse_k_grid(text: str | None) -> list[int] | None:
    """`--num-iterations 1,4,16` -> [1, 4, 16]; an empty item (`1,,2`) or a non-integer is refused."""
    if text is None:
        return None
    items = [k.strip() for k in text.split(",")]
    if not any(items):
        raise UserError("--num-iterations is empty")
    try:
        ks = [int(k) for k in items]
    except ValueError:
        raise UserError(f"--num-iterations must be comma-separated integers, got '{text}'") from None
    return ks


def check_arguments(args) -> None:
    """What eval can check before the checkpoint is read: one line naming the flag."""
    from looped_lm.devices import check_device  # imports torch: seconds at start-up

    check_device(args.device)

    for flag, value, low in (("--max-tokens", args.max_tokens, 0), ("--block-size", args.block_size, 0),
                             ("--stride", args.stride, 0), ("--batch-size", args.batch_size, 1),
                             ("--draws", args.draws, 1), ("--candidates", args.candidates, 1)):
        if value < low:
            raise UserError(f"{flag} must be >= {low} (got {value})")
    # each draw is a whole pass of the estimator over the data: a bound, like K's, instead of a silent hang
    if args.draws > MAX_DRAWS:
        raise UserError(f"--draws must be in 1..{MAX_DRAWS} (got {args.draws}): each draw is a full pass over the "
                        "data (more tokens, --max-tokens, narrow the standard error too)")
    parse_k_grid(args.num_iterations)
    if args.json is not None:  # before the evaluation, not after it: a loop, /proc, a file in the way
        check_output_path(args.json, "--json", kind="file")
    if args.data is not None and Path(args.data).suffix in (".txt", ".jsonl"):
        path = Path(args.data)
        if not path.is_file():
            raise UserError(f"--data {args.data} does not exist")
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"--data {args.data} is not UTF-8 text (bad byte at offset {e.start})") from None
        except OSError as e:
            raise UserError(f"cannot read --data {args.data}: {e.strerror}") from None


def check_applies(args, model, kind: str) -> None:
    """Flags that would do nothing on this checkpoint's kind are refused, naming the kind, not ignored."""
    from looped_lm.models.contract import ImageGenerator  # imports torch: seconds at start-up

    if not isinstance(model, ImageGenerator):
        given = [flag for flag, value in (("--cfg-scale", args.cfg_scale), ("--features", args.features))
                 if value is not None]
        if given:
            raise UserError(f"{', '.join(given)}: for dit checkpoints (samples scored in a classifier's features); "
                            f"this checkpoint is model.kind {kind}")


def perplexity(model, data_path: str, block_size: int, stride: int = 0, max_tokens: int = 0,
               batch_size: int = 8, settings=None, seed: int = 0, device: str = "cpu", progress: bool = True,
               probs: dict | None = None):
    """Score `data_path`: ({label: summed NLL}, {label: summed NLL variance}, scored tokens).
    Strided windows score their tail only. `probs`, when given, is filled with {label: [summed p, summed
    variance of p or None]}: the held-out tokens' probabilities, for `report`'s mean p."""
    import torch  # torch, tqdm: seconds at start-up
    from tqdm import tqdm

    from looped_lm.models.contract import Iterative
    from looped_lm.settings import resolve_score_settings

    # no settings: the model's default K, as generate and serve use
    settings = settings or resolve_score_settings(model.iteration_limits() if isinstance(model, Iterative) else None)

    if block_size < 1:
        raise UserError(f"--block-size must be >= 1 (got {block_size})")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1 (got {batch_size})")
    if block_size > model.max_positions:
        raise UserError(f"--block-size {block_size} exceeds the model's {model.max_positions} positions")
    if stride < 0 or stride > block_size:
        raise UserError(f"--stride must be in 1..block_size ({block_size}), or 0 for disjoint blocks (got {stride})")
    settings.validate()
    stream = TokenStream(data_path, block_size, vocab_size=model.vocab_size)
    windows = list(stream.iter_blocks(block_size, stride or None, max_tokens or None))
    sums: dict = {}
    variances: dict = {}
    total = 0
    gen = torch.Generator(device=device).manual_seed(seed)
    # progress in draws: an estimated model reports each draw of each k (ppl@0 too); an exact one a batch's
    # worth at once. One bar over every window, so a single slow window still moves it.
    per_batch = len({0, *settings.k_grid}) * settings.draws if settings.k_grid else 1
    bar = tqdm(total=-(-len(windows) // batch_size) * per_batch, desc="eval", disable=not progress,
               unit="draw" if settings.k_grid else "batch")
    settings = replace(settings, progress=bar.update)
    for i in range(0, len(windows), batch_size):
        bar.set_postfix_str(f"windows {i + 1}-{min(i + batch_size, len(windows))} of {len(windows)}", refresh=False)
        chunk = windows[i:i + batch_size]
        x = torch.stack([w[0] for w in chunk]).to(device)
        y = torch.stack([w[1] for w in chunk]).to(device)
        scored = torch.zeros_like(y, dtype=torch.bool)
        for row, (_, _, n) in enumerate(chunk):
            scored[row, y.shape[1] - n:] = True
        with torch.no_grad():
            scores = model.score(x, y, settings, gen)
        bar.update((i // batch_size + 1) * per_batch - bar.n)  # an exact model reported nothing: its batch's worth
        for label, s in scores.items():
            sums[label] = sums.get(label, 0.0) + float(s.nll[scored].double().sum())
            if s.nll_var is not None:
                variances[label] = variances.get(label, 0.0) + float(s.nll_var[scored].double().sum())
            if probs is not None:
                p, p_var = s.probability()
                acc = probs.setdefault(label, [0.0, 0.0 if p_var is not None else None])
                acc[0] += float(p[scored].double().sum())
                if p_var is not None and acc[1] is not None:
                    acc[1] += float(p_var[scored].double().sum())
        total += int(scored.sum())
    bar.close()
    if total == 0:
        raise UserError(f"{data_path} has too few tokens for one window of {block_size}")
    return sums, variances, total


def mean_p(probs: dict, tokens: int) -> tuple[dict, dict]:
    """{label: mean p of the held-out tokens}, {label: its standard error} (estimated labels only)."""
    means = {label: acc[0] / tokens for label, acc in probs.items()}
    ses = {label: math.sqrt(acc[1]) / tokens for label, acc in probs.items() if acc[1] is not None}
    return means, ses


def worse_with_more(means: dict, ses: dict) -> list[dict]:
    """The sampler's K (k >= 1) whose mean p is below a smaller K's by more than 2 standard errors of the
    difference (the same tokens: only the estimates' noise differs): more iterations that did worse."""
    ks = sorted(k for k in means if isinstance(k, int) and k >= 1)
    out = []
    for k in ks:
        for j in ks:
            if j >= k:
                break
            gap = means[j] - means[k]
            if gap > 2 * math.sqrt(ses.get(j, 0.0) ** 2 + ses.get(k, 0.0) ** 2):  # exact scores (huginn): any gap
                out.append({"k": k, "than": j, "mean_p": means[k], "than_mean_p": means[j],
                            "exact": j not in ses and k not in ses})
                break
    return out


def report(sums: dict, variances: dict, tokens: int, block_size: int, stride: int, tokenizer: str, data: str,
           settings, kind: str, probs: dict | None = None) -> dict:
    """PPL per label; for estimated ones, `ppl_se`: the standard error of the ppl from the estimates'
    spread (var(mean NLL) = sum of the per-token jackknife variances / tokens^2). An estimate whose
    standard error is not small against it (se of the mean NLL above UNRESOLVED_MEAN_SE nats, an se
    above the ppl, or none at all: one draw), or whose Jensen bias bound (the mean per-token variance / 2)
    is above UNRESOLVED_MEAN_SE nats, is listed in `unresolved` and its ppl is null, never a number.
    With `probs` (perplexity's), also the mean probability of the held-out token per label (`mean_p`,
    `mean_p_at_k`, `mean_p_se`): a plain mean of unbiased estimates, resolved where ppl@k may not be, and
    `worse_with_more`, the K whose mean p is below a smaller K's."""
    from looped_lm.diffusion.estimator import UNRESOLVED_MEAN_SE  # imports torch: seconds at start-up

    sums = dict(sums)
    out = {"model_kind": kind, "tokens": tokens, "block_size": block_size, "stride": stride or block_size,
           "protocol": "disjoint" if not stride else "strided", "tokenizer": tokenizer, "data": data}
    if "clean" in sums:  # a DiffusionBlocks model's clean stream read as an ordinary LM: exact
        clean = sums.pop("clean") / tokens
        out.update(ppl_clean=math.exp(min(clean, 700.0)), nll_clean=clean)
        if not sums:  # denoising off: the clean readout is the model's only reading
            out.update(ppl=out["ppl_clean"], nll=clean, primary="clean")
            return out
    ppl = {label: math.exp(min(s / tokens, 700.0)) for label, s in sums.items()}
    means, mean_ses = mean_p({k: v for k, v in (probs or {}).items() if k != "clean"}, tokens)
    if "exact" in ppl:
        out.update(ppl=ppl["exact"], nll=sums["exact"] / tokens)
        if "exact" in means:
            out.update(mean_p=means["exact"])
        return out
    se = {label: ppl[label] * math.sqrt(v) / tokens for label, v in variances.items()}
    estimated = get_kind(kind).offers("estimated_ppl")  # huginn's per-K scores are exact: no se, none needed
    # the se covers the estimates' spread, not -log(mean)'s own Jensen bias, about var / 2 per token (left
    # uncorrected on unresolved tokens): the mean of that bound must be small too
    unresolved = sorted(label for label in ppl if estimated and (
        label not in variances or math.sqrt(variances[label]) / tokens > UNRESOLVED_MEAN_SE
        or variances[label] / (2 * tokens) > UNRESOLVED_MEAN_SE or se[label] > ppl[label]))
    shown = {label: None if label in unresolved else v for label, v in ppl.items()}
    primary = 0 if 0 in ppl else min(ppl)
    out.update(ppl=shown[primary], nll=None if primary in unresolved else sums[primary] / tokens, primary=primary,
               ppl_at_k={str(k): v for k, v in sorted(shown.items())},
               ppl_se={str(k): v for k, v in sorted(se.items())},
               unresolved=[str(k) for k in unresolved],
               draws=settings.draws, candidates=settings.candidates)
    if means:
        out.update(mean_p_at_k={str(k): v for k, v in sorted(means.items())},
                   mean_p_se={str(k): v for k, v in sorted(mean_ses.items())},
                   worse_with_more=worse_with_more(means, mean_ses))
    return out


def format_table(rep: dict) -> str:
    head = (f"tokens {rep['tokens']}  block {rep['block_size']}  stride {rep['stride']}  "
            f"tokenizer {rep['tokenizer']}  data {rep['data']}")
    rows = ["| k | ppl | standard error |", "|---|---|---|"]
    notes = []
    if "ppl_at_k" in rep:
        se, mp, mp_se = rep.get("ppl_se", {}), rep.get("mean_p_at_k"), rep.get("mean_p_se", {})
        if mp:
            rows = ["| k | ppl | standard error | mean p of the token (se) |", "|---|---|---|---|"]
        for k, v in rep["ppl_at_k"].items():
            error = f"{se[k]:.3g}" if k in se else "-"
            row = f"| {k} | unresolved (raise --draws) | {error} |" if v is None else f"| {k} | {v:.3f} | {error} |"
            if mp:
                row += f" {mp[k]:.4f} ({mp_se[k]:.4f}) |" if k in mp_se else f" {mp[k]:.4f} |"
            rows.append(row)
        for w in rep.get("worse_with_more", []):
            margin = "exact" if w.get("exact") else "beyond 2 standard errors"
            notes.append(f"K = {w['k']} gives the held-out tokens less probability than K = {w['than']} "
                         f"({w['mean_p']:.4f} vs {w['than_mean_p']:.4f}, {margin}): more iterations are worse "
                         "for this model here")
    elif "ppl_clean" not in rep:
        rows += [f"| exact | {rep['ppl']:.3f} | exact |"]
    if "ppl_clean" in rep:  # the clean stream's readout, an exact ordinary-LM perplexity
        rows += [f"| clean | {rep['ppl_clean']:.3f} | exact |" + (" - |" if rep.get("mean_p_at_k") else "")]
    return head + "\n" + "\n".join(rows + notes)


def data_tokens(data: str, tokenizer_name: str, workdir: str) -> str:
    """The token file to score: a nanoGPT .bin whose meta.json (if any) names the checkpoint's tokenizer,
    or a .txt / .jsonl ("text" per line, one document each) tokenized here with the checkpoint's own
    tokenizer, the end-of-text token after every document."""
    path = Path(data)
    if not path.is_file():
        raise UserError(f"--data {data} does not exist")
    if path.suffix in (".txt", ".jsonl"):
        tok = get_tokenizer(tokenizer_name)
        docs = [path.read_text(encoding="utf-8")] if path.suffix == ".txt" else []  # UTF-8: check_arguments
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    docs.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError):
                    raise UserError(f"{data} line {n}: expected a JSON object with a \"text\" field") from None
        ids = [t for doc in docs for t in [*tok.encode(doc), tok.eot_id]]
        out = Path(workdir) / "tokens.bin"
        dtype = token_dtype(tok.vocab_size)
        np.asarray(ids, dtype=dtype).tofile(out)
        # the dtype beside the file, as prepare writes it: a vocabulary above 65,536 tokens needs uint32
        (out.parent / "meta.json").write_text(json.dumps({"tokenizer": tok.name, "vocab_size": tok.vocab_size,
                                                          "dtype": dtype}))
        return str(out)
    meta_path = path.parent / "meta.json"
    if meta_path.is_file():
        try:
            meta_tok = json.loads(meta_path.read_text()).get("tokenizer")
        except (ValueError, AttributeError):
            raise UserError(f"{meta_path} is not a valid meta.json") from None
        if meta_tok is not None and meta_tok != tokenizer_name:
            raise UserError(f"--data {data} holds {meta_tok} tokens (its meta.json) but the checkpoint's tokenizer "
                            f"is {tokenizer_name}: prepare the data with --tokenizer {tokenizer_name}, or pass a "
                            ".txt / .jsonl file")
    return data


def run(args) -> int:
    # imports torch: seconds at start-up
    from looped_lm.models.contract import Iterative, Scorable
    from looped_lm.settings import resolve_score_settings

    check_arguments(args)
    if args.no_verify:
        print(no_verify_note(), file=sys.stderr)
    model, cfg, manifest = load_checkpoint(resolve_checkpoint(args.checkpoint), args.device,
                                           verify=not args.no_verify, overrides=args.set)
    check_applies(args, model, cfg.model.kind)
    if not isinstance(model, Scorable):  # vit, mdm: accuracy, bits per character (looped_lm.supporting)
        from looped_lm.supporting import ModuleRequest, evaluate  # imports torch: seconds at start-up

        return evaluate(model, cfg, manifest, ModuleRequest.of(args))
    data = args.data
    if data is not None and args.split != VAL:
        raise UserError(f"--split {args.split} chooses one of the run's own token splits; --data names the file to "
                        "score: pass one of them")
    if data is None:
        if "dir" not in manifest.get("data", {}):
            raise UserError(f"{args.checkpoint} does not record its data directory: pass --data VAL.bin")
        data = str(Path(manifest["data"]["dir"]) / token_file(args.split))
        if args.split == TEST and not Path(data).is_file():
            raise UserError(f"{args.checkpoint}'s data has no test split: prepare it with data.test_fraction > 0 "
                            "(or pass --data FILE)")
    block = args.block_size or cfg.eval.block_size or cfg.model.seq_len
    # the K grid by the rule every K follows (1..model.max_iterations, DB models also 0), resolved once
    settings = resolve_score_settings(model.iteration_limits() if isinstance(model, Iterative) else None,
                                      parse_k_grid(args.num_iterations), kind=cfg.model.kind, draws=args.draws,
                                      candidates=args.candidates)
    with tempfile.TemporaryDirectory() as work:
        tokens_file = data_tokens(data, manifest["tokenizer"], work)
        probs: dict = {}
        sums, variances, tokens = perplexity(model, tokens_file, block, args.stride, args.max_tokens,
                                             args.batch_size, settings, args.seed, args.device,
                                             progress=not args.no_progress, probs=probs)
    rep = report(sums, variances, tokens, block, args.stride, manifest["tokenizer"], data, settings, cfg.model.kind,
                 probs)
    if args.set:  # what the checkpoint was run with besides its own config
        rep["set"] = list(args.set)
    print(format_table(rep))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return 0
