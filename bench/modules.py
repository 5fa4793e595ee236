"""DiffusionBlocks vs end-to-end for the supporting modules (vit, dit, mdm) at equal training FLOPs: the
table of bench/results/modules.md, which states the protocol. The study's one driver.

    python bench/modules.py                      # every module, both variants, seeds 0 1 2 (~1 h on 1 core)
    python bench/modules.py --modules vit --seeds 0 --jobs 2
    python bench/modules.py --retable            # reprint the table from bench/results/modules.json
    python bench/modules.py --modules vit --split dev --seeds 0 --lr-mults 0.5 1 2   # LR sweep on the dev split
    python bench/modules.py --modules vit --variants e2e db_w411   # test runs, each at its LR chosen on dev

`--split dev` trains on 80% of the digits' training images and scores on the rest (modules_dev.json); a test
run takes each variant's dev-best LR (a DB option variant without dev runs takes `db`'s), else the module's
base LR. The diagnostics under modules.md's table (`--diagnose-vit`, the vit chain's inference variants, a
final vit run's K = 2B and block-0-alone accuracy) and the figures came from this script at commit 98b2234.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402  (bench/ is not a package)
from looped_lm.config import config_from_dict
from looped_lm.data.images import load_digits
from looped_lm.data.text8 import load_bible
from looped_lm.kinds import get_kind
from looped_lm.models import build_model
from looped_lm.models.dit import frechet_distance
from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups

MODULES = {
    "vit": {"settings": dict(image_size=8, channels=1, num_classes=10, patch=2, n_layers=6, d_model=64,
                             n_heads=4, num_blocks=3),
            "batch": 128, "lr": 2e-3, "e2e_steps": 600, "target": "DB within 1.5 points of end-to-end"},
    "dit": {"settings": dict(image_size=8, channels=1, num_classes=10, patch=2, n_layers=6, d_model=64,
                             n_heads=4, num_blocks=3),
            "batch": 128, "lr": 2e-3, "e2e_steps": 600, "target": "DB <= end-to-end"},
    "mdm": {"settings": dict(seq_len=64, n_layers=6, d_model=96, n_heads=4, num_blocks=3),
            "batch": 32, "lr": 2e-3, "e2e_steps": 600, "target": "DB <= end-to-end"},
}
# variants: the end-to-end baseline and DiffusionBlocks with the module's defaults (vit: the official
# code's recipe, docs/method.md §7)
VARIANTS = {module: {"e2e": {"end_to_end": True}, "db": {}} for module in MODULES}
# DB recipe options (explicit, never the default unless they win on dev): the official DiffusionBlocks code
# learns its label embeddings (normalised); its CE weight w(sigma) is per-sample in the paper's text
OPTION_VARIANTS = {
    "vit": {"db_edm_weight": {"loss_weight": "edm"}, "db_learned_labels": {"label_table": "learned"},
            # block 0 favoured (diffusion.block_sampling fixed + block_weights, block 0 = highest noise first):
            # the K = B chain's prediction is block 0's, and uniform sampling gives it a third of the steps
            "db_w211": {"block_sampling": "fixed", "block_weights": [2, 1, 1]},
            "db_w411": {"block_sampling": "fixed", "block_weights": [4, 1, 1]},
            "db_w811": {"block_sampling": "fixed", "block_weights": [8, 1, 1]}},
}
DEV_FRACTION = 0.2  # of the training images, held out for choosing settings (`--split dev`)
CURVE_POINTS = 4  # evaluations along each run (at equal shares of its FLOPs)
DIT_SAMPLES_PER_CLASS, DIT_STEPS, DIT_CFG = 100, 50, 2.0
MDM_EVAL_WINDOWS, MDM_T_SAMPLES = 128, 8


# what the study ran: the module classes' defaults of that time (docs/method.md §7, the official code's recipe),
# pinned here because the config's defaults differ where a later measurement chose otherwise
RECIPES = {
    "vit": dict(overlap=0.05, block_sampling="uniform", loss_weight="batch_mean", bridge="soft",
                parameterization="edm", last_call="sigma_min", norm_eps=1e-6,
                sample_top_quantile=1.0),  # the chain starts at sigma_max, as the official code (chosen on dev)
    "dit": dict(overlap=0.05, block_sampling="uniform", last_call="sigma_min", norm_eps=1e-6),
    "mdm": dict(overlap=0.05, block_sampling="uniform", norm_eps=1e-6),
}


def build(module: str, variant: str):
    """The module's network: its run config from MODULES' shape, RECIPES and the variant (each field to the
    section of the kind that has it), built as `looped_lm train` builds it."""
    model, diffusion = {"kind": module}, {}
    for key, value in {**MODULES[module]["settings"], **RECIPES[module], **variants_of(module).get(variant, {})}.items():
        (model if key in get_kind(module).section.model_fields else diffusion)[key] = value
    cfg = config_from_dict({"model": model, "diffusion": diffusion,
                            "data": {"source": "bible" if module == "mdm" else "digits"}}, flat_era=False)
    return build_model(cfg, 0)


def variants_of(module: str) -> dict:
    return {**VARIANTS[module], **OPTION_VARIANTS.get(module, {})}


def load_data(module: str, split: str = "test"):
    """`split` test: train on the training images, score on the test images. dev: train on (1 -
    DEV_FRACTION) of the training images and score on the rest (a fixed permutation): the test images
    stay unseen while settings are chosen."""
    if module == "mdm":
        if split != "test":
            raise SystemExit("mdm has no dev split here")
        return load_bible()
    data = load_digits()
    if split == "test":
        return data
    perm = torch.randperm(data.train_x.shape[0], generator=torch.Generator().manual_seed(12345))
    n_dev = round(DEV_FRACTION * len(perm))
    dev, train = perm[:n_dev], perm[n_dev:]
    return dataclasses.replace(data, name=data.name + "_dev", train_x=data.train_x[train], train_y=data.train_y[train],
                               test_x=data.train_x[dev], test_y=data.train_y[dev])


def make_batch(module: str, data, batch: int, g):
    if module == "mdm":
        return data.batch(batch, MODULES["mdm"]["settings"]["seq_len"], g), None
    # digits are not augmented: at 8x8 even 1-pixel crops cost the e2e ViT 36 points of accuracy after
    # 200 steps (0.54 vs 0.90, measured), and flips make other digits
    return data.batch(batch, g, augmented=False)


def flops_and_memory(module: str, variants, data) -> dict:
    """Per-step FLOPs and activation bytes of each variant, on one fixed batch."""
    out = {}
    for variant in variants:
        torch.manual_seed(0)
        model = build(module, variant)
        x, y = make_batch(module, data, MODULES[module]["batch"], torch.Generator().manual_seed(0))
        block_of = [model.choose_block(s, 0) for s in range(64)]
        picks = [block_of.index(b) for b in range(model.num_blocks)]  # a step that trains each block
        flops = [common.step_flops(model, x, y, s) for s in picks]
        acts = [common.saved_bytes(model, x, y, s) for s in picks]
        out[variant] = {"flops_per_step": sum(flops) / len(flops), "flops_by_block": flops,
                        "act_bytes": max(acts), "act_bytes_by_block": acts,
                        "params": sum(p.numel() for p in model.parameters()), "num_blocks": model.num_blocks}
    return out


def feature_net(data, seed: int = 0):
    """A small MLP classifier on the digits (64 -> 128 -> 64 -> 10); its 64-d hidden layer is the
    feature space of the dit Frechet distance. Returns (features_fn, test accuracy)."""
    torch.manual_seed(seed)
    body = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
    net = nn.Sequential(body, nn.Linear(64, 10))
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(1500):
        x, y = data.batch(128, g, augmented=False)
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()
    with torch.no_grad():
        acc = float((net(data.test_x).argmax(-1) == data.test_y).float().mean())
    return (lambda images: body(images).detach()), acc


def evaluate(module: str, model, data, seed: int, final: bool, features=None) -> dict:
    model.eval()
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        if module == "vit":
            out = model.accuracy(data.test_x, data.test_y, generator=g)
        elif module == "dit":
            out = {"val_loss": float(model.validation_loss(data.test_x, data.test_y, seed=seed))}
            if final:
                labels = torch.arange(10).repeat_interleave(DIT_SAMPLES_PER_CLASS)
                t0 = time.process_time()
                images = model.sample(labels, steps=DIT_STEPS, cfg_scale=DIT_CFG, generator=g)
                out["sample_cpu_s"] = time.process_time() - t0
                out["frechet_distance"] = frechet_distance(features(images), features(data.train_x))
        else:
            windows = data.windows(MODULES["mdm"]["settings"]["seq_len"], "val", limit=MDM_EVAL_WINDOWS)
            out = model.elbo_bpc(windows, samples_per_block=MDM_T_SAMPLES, generator=g)
    model.train()
    return out


def run(module: str, variant: str, seed: int, steps: int, lr: float | None = None, split: str = "test") -> dict:
    """Train one variant for `steps` steps at peak learning rate `lr` (default: the module's) on `split`'s
    training images, scored on its held-out images."""
    torch.set_num_threads(1)
    spec = MODULES[module]
    peak = spec["lr"] if lr is None else lr
    data = load_data(module, split)
    features = feature_net(data)[0] if module == "dit" else None
    torch.manual_seed(seed)
    model = build(module, variant)
    model.train()
    opt = BlockwiseAdamW(param_groups(model, 0.05), lr=peak, betas=(0.9, 0.99))
    g = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 20)
    checkpoints = {round(steps * (i + 1) / CURVE_POINTS) - 1 for i in range(CURVE_POINTS)}
    losses, curve, t0, cpu0 = [], [], time.perf_counter(), time.process_time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_with_warmup(step, warmup, steps, peak, peak / 10)
        x, y = make_batch(module, data, spec["batch"], g)
        opt.set_active_units(model.step_units(step, seed))
        loss, _ = model.training_loss(x, y, step, seed)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step in checkpoints:
            curve.append({"step": step + 1, "share_of_flops": (step + 1) / steps,
                          **evaluate(module, model, data, seed, step == steps - 1, features)})
    return {"module": module, "variant": variant, "seed": seed, "steps": steps, "lr": peak, "split": split,
            "overrides": {}, "only_block": None,
            "train_cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - t0,
            "loss_curve": [sum(losses[i:i + 25]) / len(losses[i:i + 25]) for i in range(0, steps, 25)],
            "curve": curve, "final": curve[-1]}


DEV_FILE = RESULTS / "modules_dev.json"


def read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"modules": {}}


def dev_lr(module: str, variant: str, dev: dict) -> tuple[float, str]:
    """The peak LR a test run of `variant` uses, and where it came from: the best mean dev metric over the
    variant's dev runs (ties to the LR nearest the module's base), `db`'s choice for a DB option variant with
    no dev runs of its own, else the module's base LR."""
    base = MODULES[module]["lr"]
    key, _, scale, better = METRIC[module]
    runs = [r for r in dev.get("modules", {}).get(module, {}).get("runs", []) if r["variant"] == variant]
    if not runs:
        if variant.startswith("db_") and dev.get("modules", {}).get(module, {}).get("runs"):
            lr, _ = dev_lr(module, "db", dev)
            return lr, "db's, chosen on dev"
        return base, "the module's base (no dev runs)"
    by_lr: dict[float, list[float]] = {}
    for r in runs:
        by_lr.setdefault(r["lr"], []).append(r["final"][key] * scale)
    sign = 1 if better == "higher" else -1
    best = max(by_lr, key=lambda lr: (round(sign * sum(by_lr[lr]) / len(by_lr[lr]), 9), -abs(math.log(lr / base))))
    return best, f"dev-best of {sorted(by_lr)}"


METRIC = {"vit": ("accuracy", "top-1 accuracy (%)", 100.0, "higher"),
          "dit": ("frechet_distance", "Frechet distance, MLP-classifier features (not FID)", 1.0, "lower"),
          "mdm": ("bpc", "bits per character (NELBO, upper bound)", 1.0, "lower")}


def mean_spread(values):
    return sum(values) / len(values), (max(values) - min(values)) / 2


def cell(values) -> str:
    """mean ± spread (n) of one variant's results."""
    return f"{mean_spread(values)[0]:.2f} ± {mean_spread(values)[1]:.2f} ({len(values)})"


def run_lr(entry: dict, r: dict, module: str) -> float:
    """A run's peak LR (runs written before the LR was recorded ran at the module's base)."""
    return r.get("lr", entry.get("base_lr", entry.get("lr", MODULES[module]["lr"])))


def finals_of(entry: dict, module: str) -> dict[str, list[float]]:
    key, _, scale, _ = METRIC[module]
    finals: dict[str, list[float]] = {}
    for r in entry.get("runs", []):
        finals.setdefault(r["variant"], []).append(r["final"][key] * scale)
    return finals


def summarise(results: dict, dev: dict | None = None) -> str:
    dev = read(DEV_FILE) if dev is None else dev
    lines = ["DiffusionBlocks (DB) vs end-to-end (e2e) at equal training FLOPs (torch.utils.flop_counter: the DB run "
             "gets round(600 x e2e FLOPs/step / DB FLOPs/step) steps), written by `python bench/modules.py`: vit / dit "
             "on scikit-learn's 8x8 digits (6 layers, d 64, B = 3; test = the held-out 20% of the digits), mdm on "
             "the Bible in text8's alphabet (6 layers, d 96, sequence 64, B = 3); spread = half the range over "
             "seeds; activation memory = bytes autograd saves in one training step. Settings are chosen on a dev "
             f"split ({round(100 * DEV_FRACTION)}% of the training images held out; modules_dev.json), never on test.",
             "", "| module | metric | variant | peak LR | result (mean ± spread, n seeds) | DB − e2e | target | met "
             "| training steps | activation memory / e2e (floor 1/B) |", "|---|---|---|---|---:|---:|---|---|---:|---:|"]
    for module, res in results.get("modules", {}).items():
        _, label, _, _ = METRIC[module]
        finals = finals_of(res, module)
        if "e2e" not in finals:
            continue
        e2e_mean, _ = mean_spread(finals["e2e"])
        for variant in [v for v in variants_of(module) if v in finals]:
            mean, _ = mean_spread(finals[variant])
            cost = res["cost"][variant]
            memory = cost["act_bytes"] / res["cost"]["e2e"]["act_bytes"]
            lrs = sorted({run_lr(res, r, module) for r in res["runs"] if r["variant"] == variant})
            source = res.get("lr_source", {}).get(variant, "the module's base (no dev runs)")
            lr_cell = "/".join(f"{lr:g}" for lr in lrs) + (" (dev-chosen)" if source.startswith(("dev", "db's"))
                                                          else " (base, not swept)")
            name = variant if variant in VARIANTS[module] else f"{variant} (option)"
            row = [module, label, name, lr_cell, cell(finals[variant])]
            if variant == "e2e":
                row += ["", "", "", str(res["steps"][variant]), "1.00"]
            else:
                diff = mean - e2e_mean
                met = diff >= -1.5 if module == "vit" else diff <= 0
                row += [f"{diff:+.2f}", MODULES[module]["target"], "yes" if met else "no", str(res["steps"][variant]),
                        f"{memory:.2f} ({1 / cost['num_blocks']:.2f})"]
            lines.append("| " + " | ".join(row) + " |")
    vit = [r for r in results.get("modules", {}).get("vit", {}).get("runs", []) if "accuracy_start_sigma_max" in r["final"]]
    if vit:  # runs made when vit's chain started at sigma_top, which also scored the official start
        by = {v: [100 * r["final"]["accuracy_start_sigma_max"] for r in vit if r["variant"] == v]
              for v in dict.fromkeys(r["variant"] for r in vit)}
        lines += ["", "The vit DB rows above ran when the chain started at sigma_top (the 0.999 quantile of block 0's "
                  "law); the recipe now starts at sigma_max, as the official code (chosen on dev, docs/method.md §7). The "
                  "same trained blocks started at sigma_max score " + ", ".join(f"{v} {cell(a)}" for v, a in by.items())
                  + " on test (`accuracy_start_sigma_max` in modules.json)."]
    dev_lines = summarise_dev(dev)
    if dev_lines:
        lines += ["", "Dev split (seed 0 unless the bracket says more; the LR marked `chosen` is what the test rows "
                  "use):", dev_lines]
    lines += ["", "Diagnostics and the reading of the earlier runs (history): [modules_reading.md](modules_reading.md)."]
    return "\n".join(lines)


def summarise_dev(dev: dict) -> str:
    """The dev split's runs (settings chosen here, never on test): per module, variant and peak LR, the mean ±
    spread over seeds, and the LR each variant's test runs take."""
    lines = []
    for module, res in dev.get("modules", {}).items():
        key, label, scale, _ = METRIC[module]
        cells: dict[tuple[str, float], list[float]] = {}
        for r in res.get("runs", []):
            cells.setdefault((r["variant"], r["lr"]), []).append(r["final"][key] * scale)
        for variant in [v for v in variants_of(module) if any(c[0] == v for c in cells)]:
            chosen, _ = dev_lr(module, variant, dev)
            parts = [f"lr {lr:g}: {cell(vals)}" + (" <- chosen" if lr == chosen else "")
                     for (v, lr), vals in sorted(cells.items()) if v == variant]
            lines.append(f"- {module} {variant}, dev {label}: " + "; ".join(parts))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", nargs="+", default=list(MODULES), choices=list(MODULES))
    ap.add_argument("--variants", nargs="+", default=None,
                    help="default: the module's e2e and db (the DB option variants only when named)")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2], help="none: only re-measure costs and floors")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel, one thread each")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every run's steps (quick checks: 0.1)")
    ap.add_argument("--split", choices=("test", "dev"), default="test",
                    help="dev: train on 80%% of the training images, score on the other 20%% (modules_dev.json)")
    ap.add_argument("--lr-mults", nargs="+", type=float, default=None,
                    help="dev sweep: peak LR = the module's base LR times each (default: the dev-chosen LR)")
    ap.add_argument("--out", type=Path, default=None, help="default: modules.json (test) / modules_dev.json (dev)")
    ap.add_argument("--retable", action="store_true")
    args = ap.parse_args()
    out = args.out or (DEV_FILE if args.split == "dev" else RESULTS / "modules.json")
    if args.lr_mults and args.split != "dev":
        raise SystemExit("--lr-mults is a dev sweep: settings are chosen on dev (--split dev)")
    results = read(out)
    if args.retable:
        print(summarise(results) if args.split == "test" else summarise_dev(results))
        return
    dev = read(DEV_FILE)
    torch.set_num_threads(1)
    jobs = []
    for module in args.modules:
        every = variants_of(module)
        variants = [v for v in every if (v in args.variants if args.variants else v in VARIANTS[module])]
        cost = flops_and_memory(module, every, load_data(module))
        e2e_steps = max(CURVE_POINTS, round(MODULES[module]["e2e_steps"] * args.scale))
        steps = {v: round(e2e_steps * cost["e2e"]["flops_per_step"] / cost[v]["flops_per_step"]) for v in cost}
        entry = results["modules"].setdefault(module, {})
        if args.lr_mults:
            lrs = {v: [MODULES[module]["lr"] * m for m in args.lr_mults] for v in variants}
            entry.setdefault("lr_source", {}).update({v: "sweep" for v in variants})
        else:
            chosen = {v: dev_lr(module, v, dev) for v in variants}
            lrs = {v: [lr] for v, (lr, _) in chosen.items()}
            entry.setdefault("lr_by_variant", {}).update({v: lr for v, (lr, _) in chosen.items()})
            entry.setdefault("lr_source", {}).update({v: src for v, (_, src) in chosen.items()})
        entry.update(cost=cost, steps=steps, settings=MODULES[module]["settings"], variants=every,
                     batch=MODULES[module]["batch"], base_lr=MODULES[module]["lr"], split=args.split)
        entry.pop("lr", None)
        redo = {(s, v, lr) for s in args.seeds for v in variants for lr in lrs[v]}
        keep_lr = args.split == "dev"  # dev: one run per (seed, variant, lr); test: one per (seed, variant)
        entry["runs"] = [r for r in entry.get("runs", []) if r["variant"] in every and
                         not any(r["seed"] == s and r["variant"] == v and (not keep_lr or r.get("lr") == lr)
                                 for s, v, lr in redo)]
        print(f"{module}: flops/step " + ", ".join(f"{v} {c['flops_per_step']:.3g}" for v, c in cost.items())
              + f" -> steps {steps}; activation bytes " + ", ".join(f"{v} {c['act_bytes']}" for v, c in cost.items())
              + f"; lr {lrs}", flush=True)
        if module == "dit" and args.split == "test":  # the distance of real held-out digits: the floor
            data = load_data(module)
            features, accuracy = feature_net(data)
            entry["feature_net_test_accuracy"] = accuracy
            entry["real_test_vs_train_frechet"] = frechet_distance(features(data.test_x), features(data.train_x))
        jobs += [(module, v, s, steps[v], lr, args.split) for s in args.seeds for v in variants for lr in lrs[v]]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for res in pool.map(run, *zip(*jobs)) if jobs else []:  # run(module, variant, seed, steps, lr, split)
            results["modules"][res["module"]]["runs"].append(res)
            key = METRIC[res["module"]][0]
            print(f"{res['module']} {res['variant']} seed {res['seed']} lr {res['lr']:g} ({res['split']}): {key} "
                  f"{res['final'][key]:.4f} ({res['train_cpu_s']:.0f} s CPU)", flush=True)
            common.write_json(out, results)
    common.write_json(out, results)
    if args.split == "dev":
        print(summarise_dev(results))
        return
    print(common.write_lines(out.with_suffix(".md"), [summarise(results)]), end="")


if __name__ == "__main__":
    main()
