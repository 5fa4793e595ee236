"""Served log-probs of DiffusionBlocks models against plain Monte-Carlo of the chain `generate` runs (`mc`),
and lm-evaluation-harness through `looped_lm serve` against `looped_lm eval` on the same windows (`lm-eval`,
needs `pip install "lm-eval[api]"`); bench/README_serve.md, "DiffusionBlocks log-probs", has the protocol.

    python bench/logprob_check.py mc --checkpoint out/quickstart_db/step_0001000 --ks 4,8,16,32
    python bench/logprob_check.py lm-eval --checkpoint out/quickstart_db/step_0001000 --ks 1,2,4,8,16,32
    python bench/logprob_check.py report      # markdown tables of the committed JSONs

Writes bench/results/logprob_check/<mode>_<run>.json. One thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)
from estimator_check import plain_chains  # noqa: E402
from looped_lm.checkpoint import load_checkpoint  # noqa: E402
from looped_lm.data.tokenizer import get_tokenizer  # noqa: E402
from looped_lm.engine.engine import Engine  # noqa: E402
from looped_lm.eval import data_tokens, perplexity  # noqa: E402
from looped_lm.settings import ScoreSettings  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "logprob_check"
CONTEXT = 128  # the quickstart's seq_len: the server's context, lm-eval's max_length
# lm-eval's API models keep one token for generation (echo requests send max_tokens 1) and one of context per
# rolling window, so each window predicts CONTEXT - 2 tokens from a prompt of CONTEXT - 1
BLOCK = CONTEXT - 2


def held_out(manifest: dict, n: int, start: int = 0) -> list[int]:
    """n tokens of the run's val.bin with no end-of-text token among them."""
    ids = np.fromfile(Path(manifest["data"]["dir"]) / "val.bin", dtype=np.uint16).astype(np.int64)
    eot = manifest["vocab_size"] - 1 if manifest["tokenizer"] == "byte" else 50256
    while np.any(ids[start:start + n + 1] == eot):
        start += n
    return ids[start:start + n + 1].tolist()


def run_mc(args) -> dict:
    model, cfg, manifest = load_checkpoint(args.checkpoint, "cpu", verify=False)
    served = Engine(model, 1).score_settings  # what `looped_lm serve` uses by default
    variants = [served] + [replace(served, resolve_se=float(se), max_draws=int(cap))  # what less bias costs
                           for se, cap in (v.split(":") for v in args.variants.split(",") if v)]
    ids = held_out(manifest, args.tokens, args.start)
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    rows = []
    for K in args.ks:
        t0 = time.time()  # the chains in one batch (one random stream)
        p_mc, p_var, _ = plain_chains(model, x, y, K, args.chains, args.mc_seed + K, group=args.chains)
        p_mc, p_se = p_mc[0], p_var[0].sqrt()
        mc_time = time.time() - t0
        for settings in variants:
            rows.append({"K": K, "resolve_se": settings.resolve_se, "max_draws": settings.max_draws,
                         "seconds_mc": round(mc_time, 1),
                         **served_vs_mc(model, x, y, K, settings, args.repeats, p_mc, p_se)})
            print(json.dumps(rows[-1]), flush=True)
    return {"checkpoint": str(args.checkpoint), "kind": cfg.model.kind, "chains": args.chains, "mc_seed": args.mc_seed,
            "repeats": args.repeats, "served_defaults": {"draws": served.draws, "max_draws": served.max_draws,
                                                         "resolve_se": served.resolve_se},
            "rows": rows}


def served_vs_mc(model, x, y, K: int, settings, repeats: int, p_mc, p_se) -> dict:
    """`repeats` served estimates of every token (scoring seeds 0..repeats-1) against MC's p (and se)."""
    t0 = time.time()
    values, ses = [], []
    for r in range(repeats):
        with torch.no_grad():
            est = model.token_logprobs(x, y, settings, K, torch.Generator().manual_seed(r))
        values.append(est.logp.gather(-1, y[..., None])[0, :, 0].double())
        ses.append(est.se[0])
    values, ses = torch.stack(values), torch.stack(ses)  # (repeats, T)
    ok = p_mc > 0  # tokens MC saw at least once: log p_mc is defined
    log_mc = p_mc[ok].log()
    diff = values[:, ok].mean(0) - log_mc  # per token: served (mean over repeats) - MC
    # se of the mean bias: the served values' spread over repeats and MC's own se (delta method)
    var_tok = values[:, ok].var(0) / repeats + (p_se[ok] / p_mc[ok]) ** 2
    return {"tokens": int(ok.sum()), "tokens_mc_never_drew": int((~ok).sum()),
            "bias_per_token": float(diff.mean()), "bias_se": float(var_tok.sum().sqrt() / ok.sum()),
            "spread_per_token_sd": float(values[:, ok].std(0).mean()),
            "mc_log_se_mean": float((p_se[ok] / p_mc[ok]).mean()),
            "unresolved_after_cap": float((ses > 1).double().mean()),
            "mean_nll_served": float(-values[:, ok].mean()), "mean_nll_mc": float(-log_mc.mean()),
            "seconds_per_served_estimate": round((time.time() - t0) / repeats, 2)}


def run_lm_eval(args) -> dict:
    model, cfg, manifest = load_checkpoint(args.checkpoint, "cpu", verify=False)
    tok = get_tokenizer(manifest["tokenizer"])
    text = tok.decode(held_out(manifest, BLOCK * args.windows, args.start)[:BLOCK * args.windows])
    assert len(tok.encode(text)) == BLOCK * args.windows
    work = Path(tempfile.mkdtemp(prefix="logprob_check_"))
    (work / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    # eval on [EOT] + doc + [EOT]: windows of BLOCK that are exactly lm-eval's rolling windows of the doc
    (work / "eval.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": text}) + "\n")
    tokens_file = data_tokens(str(work / "eval.jsonl"), manifest["tokenizer"], str(work))
    (work / "task.yaml").write_text(
        "task: looped_lm_heldout\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {work / 'doc.jsonl'}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: bits_per_byte\n")
    port, name, env = common.free_port(), "m", {**os.environ, "OMP_NUM_THREADS": "1"}
    meta = {"checkpoint": str(args.checkpoint), "kind": cfg.model.kind, "windows": args.windows, "block": BLOCK,
            "eval_draws": args.eval_draws}
    server = subprocess.Popen([sys.executable, "-m", "looped_lm", "serve", "--checkpoint", str(args.checkpoint),
                               "--port", str(port), "--served-model-name", name, "--threads", "1", "--no-verify"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows = []
    try:
        common.wait_for_server(f"http://127.0.0.1:{port}/health", server)
        for K in args.ks:
            t0 = time.time()
            out = work / f"lm_eval_{K}"
            cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--tasks", "looped_lm_heldout",
                   "--include_path", str(work), "--output_path", str(out),
                   "--model_args", f"model={name}@{K},base_url=http://127.0.0.1:{port}/v1/completions,"
                                   f"tokenized_requests=True,tokenizer_backend=remote,max_length={CONTEXT}"]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                rows.append({"K": K, "lm_eval_exit": done.returncode, "lm_eval_error": done.stderr[-2000:]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            result = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["looped_lm_heldout"]
            nll_lm_eval = result["bits_per_byte,none"] * math.log(2)  # byte tokens: bytes = tokens
            t1 = time.time()
            # looped_lm eval's estimate, in process (its report prints "unresolved" where the se is large;
            # the comparison needs the number and its se either way)
            sums, variances, tokens = perplexity(model, tokens_file, BLOCK, settings=ScoreSettings(
                k_grid=(K,), draws=args.eval_draws), progress=False)
            label = K if K in sums else "exact"
            nll_eval, se = sums[label] / tokens, math.sqrt(variances[label] or 0.0) / tokens
            rows.append({"K": K, "tokens": BLOCK * args.windows, "nll_lm_eval": nll_lm_eval, "nll_eval": nll_eval,
                         "eval_se": se, "z": None if not se else (nll_lm_eval - nll_eval) / se,
                         "within": bool(se) and abs(nll_lm_eval - nll_eval) <= 2 * math.sqrt(2) * se,
                         "lm_eval_seconds": round(t1 - t0, 1), "eval_seconds": round(time.time() - t1, 1)})
            print(json.dumps(rows[-1]), flush=True)
            common.write_json(out_path(args), {**meta, "rows": rows})  # each K as it lands
    finally:
        server.terminate()
        server.wait(30)
    return {**meta, "rows": rows}


def out_path(args) -> Path:
    return args.out or RESULTS / f"{args.mode.replace('-', '_')}_{args.checkpoint.resolve().parent.name}.json"


def report() -> str:
    """Markdown tables of every committed JSON: bias against Monte-Carlo by K and setting, lm-eval against eval."""
    lines = ["| file | model | K | resolve se / most draws | bias per token (served - MC), nats | sd of one served value | "
             "s per estimate (64 tokens) |", "|---|---|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("mc_*.json")):
        d, seen = json.loads(path.read_text()), set()
        for r in d["rows"]:
            if (r["K"], r["resolve_se"], r["max_draws"]) in seen:  # the default listed again as a variant
                continue
            seen.add((r["K"], r["resolve_se"], r["max_draws"]))
            lines.append(f"| {path.stem} | {d['kind']} | {r['K']} | {r['resolve_se']:g} / {r['max_draws']} | "
                         f"{r['bias_per_token']:+.3f} ± {r['bias_se']:.3f} | {r['spread_per_token_sd']:.2f} | "
                         f"{r['seconds_per_served_estimate']:g} |")
    lines += ["", "| model | K | lm-eval NLL / token | eval NLL / token (32 draws) | eval se | z | within 2√2 se |",
              "|---|---|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("lm_eval_*.json")):
        d = json.loads(path.read_text())
        for r in d["rows"]:
            lines.append(f"| {d['kind']} | {r['K']} | {r['nll_lm_eval']:.4f} | {r['nll_eval']:.4f} | {r['eval_se']:.2g} | "
                         f"{r['z']:+.1f} | {'yes' if r['within'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["report"] or argv == ["report"]:
        print(report())
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("mc", "lm-eval", "report"))
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--ks", default="4,8,16,32")
    p.add_argument("--tokens", type=int, default=64, help="mc: held-out tokens scored")
    p.add_argument("--chains", type=int, default=2000, help="mc: plain Monte-Carlo chains per token")
    p.add_argument("--mc-seed", type=int, default=10_000, help="mc: the Monte-Carlo chains' seed (+ K)")
    p.add_argument("--repeats", type=int, default=8, help="mc: independent served estimates per token")
    p.add_argument("--windows", type=int, default=8, help="lm-eval: windows of 126 tokens in the document")
    p.add_argument("--start", type=int, default=0, help="offset into val.bin")
    p.add_argument("--eval-draws", type=int, default=32,
                   help="lm-eval: `looped_lm eval --draws` (its Jensen bias shrinks with draws; 4 leave K >= 8 biased)")
    p.add_argument("--variants", default="", help="mc: also score with these resolve_se:max_draws pairs, e.g. 0.5:64,0.25:256")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",")]
    torch.set_num_threads(1)
    common.write_json(out_path(args), run_mc(args) if args.mode == "mc" else run_lm_eval(args))
    print(f"wrote {out_path(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
