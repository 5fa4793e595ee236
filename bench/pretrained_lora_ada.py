"""train.lora_ada: a LoRA job's adaLN `ada` (d -> 6d per two-stream layer) trained fully (full) or by a
rank-r adapter on its frozen zero weight (lora): quality, checkpoint bytes and trainable elements
(docs/pretrained.md, "A LoRA job's adaLN").

    python bench/pretrained_lora_ada.py               # every arm, seeds 0,1,2 (~20 CPU-min, one thread)
    python bench/pretrained_lora_ada.py --summary     # only rebuild summary.json from the runs
    python bench/pretrained_lora_ada.py --smoke       # a few steps of everything: checks the script
    python bench/pretrained_lora_ada.py --only r8_full_open,r8_lora_open --seeds 3,4,5   # some arms, more seeds

The setting of bench/pretrained.py (its functions and constants, imported): the tiny source (the project's
gpt, 4 layers of d 64, 800 steps on the byte-level Bible, seed 0, exported as a stock Llama; trained here
again in this study's own work folder), converted to db2 (db_ar, B = 2 blocks of 2 layers, context
stacked), noisy gates open, clean anchor 0.3, LoRA on qkv/proj/gate_up/down, lr 3e-3 -> 1e-4, alpha =
2 x rank, batch 8 x 64, the same steps for both arms; seeds 0-2 (data.split_seed 0: the source's
held-out books for every seed). Arms: rank 8 at 200 steps (the decision, plan.json), rank 8 at 1000,
and rank 1 at 200 (r / d = 1/64, about SmolLM2-135M's 8 / 576).

Per run: `looped_lm eval` ppl@0 and ppl@2 (8,192 held-out tokens, 4 draws) with their eval standard
errors, the checkpoint's model.safetensors and optimizer/ bytes, trainable and saved elements. Plus
SmolLM2-135M's db_ar (30 layers of d 576) at rank 8, counted on the meta device (nothing allocated).

Output: bench/results/pretrained/lora_ada/ (plan.json, written before the first run; runs/<arm>_s<seed>.json;
summary.json). Work files in bench/work/pretrained_lora_ada/ (not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrained as P  # noqa: E402  (bench/ is not a package)

RESULTS = P.ROOT / "bench" / "results" / "pretrained" / "lora_ada"
P.WORK = P.ROOT / "bench" / "work" / "pretrained_lora_ada"  # its own source and checkpoints
PLAN = {
    "question": "train.lora_ada: does training a LoRA job's adaLN `ada` (d -> 6d per two-stream layer) through a "
                "rank-r adapter on its frozen zero weight (lora) lose quality against training it fully (full)?",
    "fixed": "db2 (db_ar, B = 2 blocks of 2 layers, context stacked), noisy gates open, clean_lm_weight 0.3, LoRA on "
             "qkv/proj/gate_up/down, lr 3e-3 -> 1e-4 (warm-up 20), alpha = 2 x rank, batch 8 x 64, the same steps "
             "for both arms; seeds 0, 1, 2 (the fine-tuning's: init of new parts and adapters, data order, noise); "
             "held-out books of the source's split (data.split_seed 0)",
    "metric": "looped_lm eval on 8,192 held-out tokens, 4 draws: ppl@0 (decides) and ppl@2 (reported), each with its "
              "eval standard error",
    "statistic": "per seed s, d_s = ppl@0(lora, s) / ppl@0(full, s) - 1 (paired: same seed); mean and standard "
                 "error of the mean over the 3 seeds, for rank 8 at 200 steps",
    "decision": "lora becomes the default if mean(d) + 2 se(d) <= 0.02 (a loss above 2 % excluded); if mean(d) - "
                "2 se(d) > 0.02 lora loses and full stays the default; otherwise inconclusive: full stays the "
                "default. The rank-1 (r / d of SmolLM2-135M at rank 8) and 1000-step arms are reported, not "
                "decisive.",
    "also": "checkpoint bytes (model.safetensors, optimizer/), trainable and saved elements per arm; SmolLM2-135M's "
            "(30 layers, d 576) db_ar B = 2 at rank 8, counted on the meta device",
}


def arms(ft_steps: int) -> dict:
    """name -> (lora rank, train.lora_ada, steps); the names carry _open (P.train opens the noisy gates)."""
    return {f"r{rank}_{ada}_open{suffix}": (rank, ada, steps)
            for rank, suffix, steps in ((8, "", ft_steps), (1, "", ft_steps), (8, "_x5", 5 * ft_steps))
            for ada in ("full", "lora")}


def config(name: str, seed: int, rank: int, ada: str, steps: int) -> dict:
    model, diffusion = P.kinds()["db2"]
    raw = P.run_config(f"ada_{name}", seed, {**model, "init_from": str(P.hf_dir())}, {**diffusion, **P.ANCHOR},
                       {**P.LORA, "lora_rank": rank, "lora_alpha": 2.0 * rank, "lora_ada": ada}, steps)
    raw["data"]["split_seed"] = 0
    return raw


def make_source() -> None:
    """The source as bench/pretrained.py trains it (gpt, SOURCE_STEPS steps, seed 0), exported to P.hf_dir()."""
    from looped_lm.export import export

    raw = P.run_config("source", 0, {"kind": "gpt"}, {}, {"lr": 3e-3, "min_lr": 3e-4}, P.SOURCE_STEPS)
    ckpt, secs = P.train(raw, "source")
    export(ckpt, P.hf_dir(), overwrite=True, format="llama")
    rep = P.evaluate("source", ckpt, "gpt", 0)
    (RESULTS / "runs" / "source_s0.json").write_text(json.dumps(
        {"name": "source", "seed": 0, "config": raw, "steps": P.SOURCE_STEPS, "train_cpu_seconds": round(secs, 1),
         "eval": rep}, indent=2) + "\n")


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def counts(model) -> dict:
    from looped_lm.lora import adapter_names

    params = dict(model.named_parameters())
    saved = adapter_names(model)
    return {"trainable_elements": sum(p.numel() for p in params.values() if p.requires_grad),
            "saved_elements": sum(params[n].numel() for n in saved),
            "ada_trainable_elements": sum(p.numel() for n, p in params.items() if ".ada." in n and p.requires_grad),
            "ada_saved_elements": sum(params[n].numel() for n in saved if ".ada." in n)}


def smollm2_counts() -> dict:
    """SmolLM2-135M converted to db_ar (30 layers of d 576, 9 heads, FFN 1536, V 49152; B = 2: the adaLN
    count does not depend on B), rank-8 LoRA: built on the meta device, exact counts, fp32 bytes."""
    import torch

    from looped_lm.config import config_from_dict
    from looped_lm.models import build_model

    out = {}
    for ada in ("full", "lora"):
        cfg = config_from_dict({"model": {"kind": "db_ar", "n_layers": 30, "d_model": 576, "n_heads": 9,
                                          "ffn_hidden": 1536, "vocab_size": 49152, "seq_len": 2048,
                                          "init_from": "SmolLM2-135M"},
                                "diffusion": {"num_blocks": 2}, "train": {"lora_rank": 8, "lora_ada": ada}})
        with torch.device("meta"):
            model = build_model(cfg, 49152)
        c = counts(model)
        out[ada] = {**c, "weights_bytes": 4 * c["saved_elements"], "adamw_state_bytes": 8 * c["trainable_elements"],
                    "model_elements": sum(p.numel() for p in model.parameters())}
    return out


def run_all(seeds, only=()) -> None:
    """Every arm (or those in `only`) at every seed, seed by seed (a budget cut short still covers every
    arm); a run whose JSON exists is kept."""
    plan = RESULTS / "plan.json"
    if not plan.is_file():  # written before the first run
        plan.write_text(json.dumps({**PLAN, "arms": {k: list(v) for k, v in arms(P.FT_STEPS).items()},
                                    "seeds": list(seeds)}, indent=2) + "\n")
    for seed in seeds:
        for name, (rank, ada, steps) in arms(P.FT_STEPS).items():
            out = RESULTS / "runs" / f"{name}_s{seed}.json"
            if out.is_file() or (only and name not in only):
                continue
            raw = config(name, seed, rank, ada, steps)
            ckpt, secs = P.train(raw, f"ada_{name}_s{seed}")
            rep = P.evaluate(f"ada_{name}_s{seed}", ckpt, "db_ar", seed)
            model, _ = P.build(raw, init=True)
            out.write_text(json.dumps({
                "name": name, "seed": seed, "lora_rank": rank, "lora_ada": ada, "steps": steps, "config": raw,
                "train_cpu_seconds": round(secs, 1), "eval": rep,
                "checkpoint": {"weights_bytes": _bytes(ckpt / "model.safetensors"),
                               "optimizer_bytes": _bytes(ckpt / "optimizer")},
                **counts(model)}, indent=2) + "\n")
            print(f"{name} seed {seed}: ppl@0 {rep['ppl_at_k']['0']:.3f} ({secs:.0f} CPU-s)", flush=True)


def summarize() -> dict:
    recs: dict[str, list] = {}
    for path in sorted((RESULTS / "runs").glob("r*.json")):
        r = json.loads(path.read_text())
        recs.setdefault(r["name"], []).append(r)
    rows = {}
    for name, rs in recs.items():
        rs.sort(key=lambda r: r["seed"])
        row = {"lora_rank": rs[0]["lora_rank"], "lora_ada": rs[0]["lora_ada"], "steps": rs[0]["steps"],
               "seeds": [r["seed"] for r in rs]}
        for k in ("0", "2"):
            vals = [r["eval"]["ppl_at_k"][k] for r in rs]
            m, se = P._mean_se(vals)
            row[f"ppl@{k}"] = {"mean": m, "se_seeds": se, "per_seed": vals,
                               "eval_se_per_seed": [(r["eval"].get("ppl_se") or {}).get(k) for r in rs]}
        for key in ("trainable_elements", "saved_elements", "ada_trainable_elements", "ada_saved_elements",
                    "checkpoint"):
            row[key] = rs[0][key]
        row["train_cpu_seconds"] = [r["train_cpu_seconds"] for r in rs]
        rows[name] = row
    paired = {}
    for name, row in rows.items():
        full = rows.get(name.replace("_lora_", "_full_"))
        if row["lora_ada"] != "lora" or full is None:
            continue
        seeds = [s for s in row["seeds"] if s in full["seeds"]]
        entry: dict = {"seeds": seeds}
        for k in ("0", "2"):
            mine = dict(zip(row["seeds"], row[f"ppl@{k}"]["per_seed"]))
            theirs = dict(zip(full["seeds"], full[f"ppl@{k}"]["per_seed"]))
            d = [mine[s] / theirs[s] - 1 for s in seeds]
            m, se = P._mean_se(d)
            entry[f"ppl@{k}"] = {"relative_difference_per_seed": d, "mean": m, "se": se}
        for what in ("weights_bytes", "optimizer_bytes"):
            entry[f"{what}_full_over_lora"] = full["checkpoint"][what] / row["checkpoint"][what]
        paired[name.replace("_lora", "")] = entry
    planned = json.loads((RESULTS / "plan.json").read_text())["seeds"] if (RESULTS / "plan.json").is_file() else []

    def decide(seeds: list) -> dict | None:
        d = paired.get("r8_open", {}).get("ppl@0", {}).get("relative_difference_per_seed")
        d = [v for s, v in zip(paired.get("r8_open", {}).get("seeds", []), d or []) if s in seeds]
        if len(d) < 2:
            return None
        m, se = P._mean_se(d)
        outcome = ("lora becomes the default" if m + 2 * se <= 0.02 else
                   "lora loses: full stays the default" if m - 2 * se > 0.02 else "inconclusive: full stays the default")
        return {"arm": "r8_open", "seeds": [s for s in paired["r8_open"]["seeds"] if s in seeds], "mean": m, "se": se,
                "mean_plus_2se": m + 2 * se, "mean_minus_2se": m - 2 * se, "outcome": outcome}

    decision = decide(planned)  # the plan's seeds
    seeds_run = paired.get("r8_open", {}).get("seeds", [])
    extended = decide(seeds_run) if set(seeds_run) - set(planned) else None  # seeds added after the plan's
    source = RESULTS / "runs" / "source_s0.json"
    return {"plan": PLAN, "source_ppl": json.loads(source.read_text())["eval"]["ppl"] if source.is_file() else None,
            "arms": rows, "paired_lora_vs_full": paired, "decision": decision,
            "decision_with_added_seeds": extended,
            "added_seeds_note": None if extended is None else (
                "seeds beyond the plan's were run after the plan's seeds gave an inconclusive reading (200-step arms "
                "only); `decision` is the plan's reading, `decision_with_added_seeds` the same rule on every seed run"),
            "smollm2_135m_db_ar_rank8": smollm2_counts()}


def main() -> int:
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", default="", help="comma-separated arms (default: all)")
    p.add_argument("--summary", action="store_true", help="only rebuild summary.json from the runs")
    p.add_argument("--smoke", action="store_true", help="a few steps of everything, in the work folder")
    args = p.parse_args()
    if args.smoke:  # its own folders: a smoke run must never replace the real ones
        P.SOURCE_STEPS, P.FT_STEPS, P.EVAL_TOKENS, P.WORK = 4, 2, 512, P.WORK / "smoke"
        RESULTS = P.WORK / "results"
    (RESULTS / "runs").mkdir(parents=True, exist_ok=True)
    P.WORK.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    if not args.summary:
        if not (P.hf_dir() / "config.json").is_file():
            make_source()
        only = [a for a in args.only.split(",") if a]
        unknown = sorted(set(only) - set(arms(P.FT_STEPS)))
        if unknown:
            sys.exit(f"--only: unknown arm {unknown[0]} (have: {', '.join(arms(P.FT_STEPS))})")
        run_all([int(s) for s in args.seeds.split(",")], only)
    summary = summarize()
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"decision": summary["decision"], "decision_with_added_seeds": summary["decision_with_added_seeds"],
                      "paired": summary["paired_lora_vs_full"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
