"""Starting from a pretrained model (docs/pretrained.md): a converted db_ar (B = 2) fine-tuned for a fixed
budget, against db_ar from scratch and against its source.

    python bench/pretrained.py --ft-steps 200    # ~10 min on one core (most of it scoring)
    python bench/pretrained.py --ft-steps 200 --only converted_blocks11_coda2_anchor   # some runs; the
                                                 # source is reused when its checkpoint is there
    python bench/pretrained.py --smoke           # a few steps of everything: checks the script

Protocol (one seed, tiny; a first reading, not a study): the Bible, byte tokenizer (V = 257), 4 layers
of d 64 (4 heads), seq 64, batch 8, fp32, one torch thread.

    source        the project's gpt trained SOURCE_STEPS steps, exported with `looped_lm export` as a
                  stock LlamaForCausalLM: the pretrained directory every converted run starts from
    converted     db_ar, 2 blocks of 2 layers, model.init_from the export, fine-tuned FT_STEPS steps:
                  context stacked (the clean stream is the source's forward pass) or independent (the
                  paper's), full fine-tuning or LoRA (rank 8, every Linear), with and without the clean
                  next-token anchor (diffusion.clean_lm_weight 0.3); and two other splits of the same 4
                  layers (stacked, anchor): prelude 2 + blocks [1, 1], and blocks [1, 1] + a shared coda
                  of 2 (block 0's denoiser then has 3 of the source's layers instead of 2)
    scratch       db_ar from random init: FT_STEPS steps (equal fine-tuning FLOPs: the same network,
                  batch and steps as the full fine-tuning) and SOURCE_STEPS + FT_STEPS steps (equal to
                  the source's pretraining plus the fine-tuning)

Metric: `looped_lm eval` on the run's held-out books, EVAL_TOKENS tokens, disjoint windows of 64: the
gpt exact PPL; db_ar ppl@0 (one call at sigma_top) and ppl@2 (the K = 2 sampler) with standard errors
from 4 draws. Optimizer state: 8 bytes (two fp32 AdamW moments) per trainable element, counted on the
built models, full vs LoRA, and a one-block job (diffusion.blocks_to_train [0], context independent).

Output: bench/results/pretrained/ft<FT_STEPS>/<run>.json (one per run: its config, steps, CPU seconds
of training, eval report) and summary.json. Work files (checkpoints, the export) in bench/work/pretrained/ (not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "pretrained"
WORK = ROOT / "bench" / "work" / "pretrained"
SEED = 0
SOURCE_STEPS, FT_STEPS, EVAL_TOKENS = 800, 200, 16384

MODEL = {"n_layers": 4, "d_model": 64, "n_heads": 4, "seq_len": 64}
TRAIN = {"batch_size": 8, "warmup_steps": 20, "save_every": 0, "eval_every": 0, "log_every": 50,
         "progress": False, "seed": SEED, "resume": "never"}


def run_config(name: str, model: dict, diffusion: dict | None = None, train: dict | None = None) -> dict:
    return {"model": {**MODEL, **model}, "diffusion": diffusion or {},
            "data": {"source": "bible", "tokenizer": "byte", "cache_dir": str(WORK / "data_cache")},
            "train": {**TRAIN, "out_dir": str(WORK / name), **(train or {})}}


def train(name: str, raw: dict) -> tuple[Path, float]:
    import yaml

    from looped_lm import train as trainer

    path = WORK / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    start = time.process_time()
    if trainer.main(["--config", str(path)]) != 0:
        sys.exit(f"training {name} failed")
    ckpt = WORK / name / f"step_{raw['train']['max_steps']:07d}"
    return ckpt, time.process_time() - start


def evaluate(name: str, ckpt: Path, kind: str) -> dict:
    from looped_lm import cli

    out = WORK / f"{name}.eval.json"
    argv = ["eval", "--checkpoint", str(ckpt), "--max-tokens", str(EVAL_TOKENS), "--json", str(out), "--no-progress",
            "--seed", str(SEED)]
    if kind == "db_ar":
        argv += ["--num-iterations", "2", "--draws", "4"]
    if cli.main(argv) != 0:
        sys.exit(f"eval of {name} failed")
    return json.loads(out.read_text())


def optimizer_bytes(raw: dict, vocab: int = 257) -> int:
    """8 bytes per trainable element (AdamW's two fp32 moments), on the model `raw` builds."""
    import torch

    from looped_lm.config import config_from_dict
    from looped_lm.models import build_model
    from looped_lm.optim import param_groups

    cfg = config_from_dict({k: v for k, v in raw.items() if k in ("model", "diffusion", "train")})
    with torch.device("meta"):
        model = build_model(cfg, vocab)
    return sum(8 * p.numel() for g in param_groups(model, 0.1) for p in g["params"])


def main() -> int:
    global SOURCE_STEPS, FT_STEPS, EVAL_TOKENS, WORK
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--ft-steps", type=int, default=FT_STEPS, help="fine-tuning budget in steps")
    p.add_argument("--only", default="", help="comma-separated runs (default: all); summary.json covers every "
                   "<run>.json in the results folder")
    args = p.parse_args()
    FT_STEPS = args.ft_steps
    if args.smoke:  # its own work folder: a smoke source must never replace the real one
        SOURCE_STEPS, FT_STEPS, EVAL_TOKENS, WORK = 4, 2, 512, WORK / "smoke"
    results = RESULTS / f"ft{FT_STEPS}" if not args.smoke else WORK / "results"
    results.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)

    # the source: the project's gpt, pretrained here and exported as a stock Llama
    src_raw = run_config("source", {"kind": "gpt"}, train={"max_steps": SOURCE_STEPS, "lr": 3e-3, "min_lr": 3e-4})
    hf_dir, rows = WORK / "source_hf", {}
    if not (args.only and (hf_dir / "config.json").is_file() and (results / "source.json").is_file()):
        src_ckpt, src_s = train("source", src_raw)
        from looped_lm.export import export

        export(src_ckpt, hf_dir, overwrite=True, format="llama")
        rows["source"] = (src_raw, SOURCE_STEPS, src_s, evaluate("source", src_ckpt, "gpt"))

    db = {"kind": "db_ar", "init_from": str(hf_dir)}
    ft = {"max_steps": FT_STEPS, "lr": 1e-3, "min_lr": 1e-4}
    lora = {**ft, "lr": 3e-3, "lora_rank": 8, "lora_alpha": 16.0}
    stacked, independent = {"num_blocks": 2, "context": "stacked"}, {"num_blocks": 2}
    anchor = {"clean_lm_weight": 0.3}
    runs = {
        "converted_stacked_full": (db, stacked, ft),
        "converted_stacked_full_anchor": (db, {**stacked, **anchor}, ft),
        "converted_stacked_lora": (db, stacked, lora),
        "converted_stacked_lora_anchor": (db, {**stacked, **anchor}, lora),
        "converted_independent_full": (db, independent, ft),
        "converted_prelude2_blocks11_anchor": ({**db, "n_prelude": 2, "n_layers": 2},
                                               {**stacked, **anchor, "layers_per_block": [1, 1]}, ft),
        "converted_blocks11_coda2_anchor": ({**db, "n_coda": 2, "n_layers": 2},
                                            {**stacked, **anchor, "layers_per_block": [1, 1]}, ft),
        "scratch_equal_ft": ({"kind": "db_ar"}, stacked, {**ft, "lr": 3e-3, "min_lr": 3e-4}),
        "scratch_equal_total": ({"kind": "db_ar"}, stacked,
                                {**ft, "max_steps": SOURCE_STEPS + FT_STEPS, "lr": 3e-3, "min_lr": 3e-4}),
    }
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - set(runs))
    if unknown:
        sys.exit(f"--only: unknown run {unknown[0]} (have: {', '.join(runs)})")
    for name, (model, diffusion, tr) in runs.items():
        if only and name not in only:
            continue
        raw = run_config(name, model, diffusion, tr)
        ckpt, seconds = train(name, raw)
        rows[name] = (raw, tr["max_steps"], seconds, evaluate(name, ckpt, "db_ar"))

    summary = {"seed": SEED, "source_steps": SOURCE_STEPS, "ft_steps": FT_STEPS, "eval_tokens": EVAL_TOKENS,
               "runs": {}, "optimizer_state_bytes": {}}
    for name, (raw, steps, seconds, rep) in rows.items():
        record = {"name": name, "config": raw, "steps": steps, "train_cpu_seconds": round(seconds, 1),
                  "optimizer_state_bytes": optimizer_bytes(raw) if name != "source" else None, "eval": rep}
        (results / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    for path in sorted(results.glob("*.json")):
        if path.name == "summary.json":
            continue
        record = json.loads(path.read_text())
        name, steps, rep = record["name"], record["steps"], record["eval"]
        summary["runs"][name] = {"steps": steps, "ppl": rep.get("ppl"), "ppl_at_k": rep.get("ppl_at_k"),
                                 "ppl_se": rep.get("ppl_se"), "unresolved": rep.get("unresolved"),
                                 "optimizer_state_bytes": record["optimizer_state_bytes"]}
    one_block = {"num_blocks": 2, "blocks_to_train": [0]}
    for name, (diffusion, tr) in {"full_all_blocks": (stacked, ft), "lora_all_blocks": (stacked, lora),
                                  "full_block0_job": (one_block, ft), "lora_block0_job": (one_block, lora)}.items():
        summary["optimizer_state_bytes"][name] = optimizer_bytes(run_config(name, db, diffusion, tr))
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
