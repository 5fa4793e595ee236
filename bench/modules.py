"""DiffusionBlocks vs end-to-end for the supporting modules (vit, dit, mdm) on CPU-sized settings.

    python bench/modules.py                      # every module, both variants, seeds 0 1 2 (~1 h on 1 core)
    python bench/modules.py --modules vit --seeds 0 --jobs 2
    python bench/modules.py --retable            # reprint the table from bench/results/modules.json
    python bench/modules.py --modules vit --split dev --seeds 0 --lr-mults 0.5 1 2   # LR sweep on the dev split
    python bench/modules.py --modules vit --seeds 0 1 2   # test runs, each variant at its LR chosen on dev

Settings are chosen on a DEV split and reported on the test split: `--split dev` trains on 80% of the
digits' training images and scores on the other 20% (DEV_FRACTION, a fixed permutation; the test images
are never seen), writing bench/results/modules_dev.json. A test run takes each variant's learning rate
from that file (the dev-best mean over seeds, ties to the module's base LR; a DB option variant without
dev runs of its own takes `db`'s), or the module's base LR where it has no dev runs.

Per module, the same network trained end-to-end (`end_to_end: true`) and as B DiffusionBlocks, at
EQUAL TRAINING FLOPs: the FLOPs of one training step (forward + backward) are counted with
torch.utils.flop_counter for each variant (DB: the mean over its B blocks), the end-to-end run gets
`e2e_steps` steps and the DB run round(e2e_steps * flops_e2e / flops_db) steps. Same optimiser
(the trainer's BlockwiseAdamW: only the step's block and the shared parts move), same batch size,
warm-up + cosine schedule over each run's own steps, grad-norm clip 1. One torch thread.

Metrics (mean +- spread over seeds; spread = half the max - min range):
  vit  top-1 accuracy on the held-out 20% of scikit-learn's digits, K = B (one step per block)
  dit  Frechet distance between 1,000 samples (100 per class, 50 Euler steps, CFG 2.0) and the digits
       training images, in the 64-d feature space of a small MLP classifier trained on the same data
       (NOT FID: no Inception network); the held-out real images' distance is the floor
  mdm  bits per character (the NELBO, an upper bound) on the Bible's validation split in text8's
       alphabet, with the share of each t-interval
Activation memory: the bytes autograd saves for backward in one training step (saved_tensors_hooks,
deduplicated by storage, parameters excluded): one DB block's step vs the end-to-end network's, beside
the layer-count floor 1/B.

Writes bench/results/modules.json (every run: curves, metrics, FLOPs, memory) and modules.md (the table).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

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
VARIANTS = {
    "vit": {"e2e": {"end_to_end": True}, "db": {}},
    "dit": {"e2e": {"end_to_end": True}, "db": {}},
    "mdm": {"e2e": {"end_to_end": True}, "db": {}},
}
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


# ------------------------------------------------------------------------------------------------
# building blocks


def build(module: str, variant: str, overrides: dict | None = None):
    from looped_lm.models.dit import DiffusionDiT, DiTSettings
    from looped_lm.models.mdm import MaskedDiffusionLM, MDMSettings
    from looped_lm.models.vit import DiffusionViT, ViTSettings

    cls, settings = {"vit": (DiffusionViT, ViTSettings), "dit": (DiffusionDiT, DiTSettings),
                     "mdm": (MaskedDiffusionLM, MDMSettings)}[module]
    kw = {**MODULES[module]["settings"], **variants_of(module).get(variant, {}), **(overrides or {})}
    weights = kw.pop("block_weights", None)  # a model attribute (set by adaln.finish_build from the config)
    model = cls(settings(**kw))
    if weights is not None:
        model.block_weights = [float(w) for w in weights]
    return model


def variants_of(module: str) -> dict:
    return {**VARIANTS[module], **OPTION_VARIANTS.get(module, {})}


def load_data(module: str, split: str = "test"):
    """`split` test: train on the training images, score on the test images. dev: train on (1 -
    DEV_FRACTION) of the training images and score on the rest (a fixed permutation): the test images
    stay unseen while settings are chosen."""
    if module == "mdm":
        from looped_lm.data.text8 import load_bible

        if split != "test":
            raise SystemExit("mdm has no dev split here")
        return load_bible()
    import dataclasses

    import torch

    from looped_lm.data.images import load_digits

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


def step_flops(model, x, y, step: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss, _ = model.training_loss(x, y, step, seed=0)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def activation_bytes(model, x, y, step: int) -> int:
    """Bytes autograd saves for backward in one training step (parameters and buffers excluded)."""
    import torch

    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = model.training_loss(x, y, step, seed=0)
    del loss
    return sum(seen.values())


def flops_and_memory(module: str, variants, data) -> dict:
    """Per-step FLOPs and activation bytes of each variant, on one fixed batch."""
    import torch

    out = {}
    for variant in variants:
        torch.manual_seed(0)
        model = build(module, variant)
        x, y = make_batch(module, data, MODULES[module]["batch"], torch.Generator().manual_seed(0))
        block_of = [model.choose_block(s, 0) for s in range(64)]
        picks = [block_of.index(b) for b in range(model.num_blocks)]  # a step that trains each block
        flops = [step_flops(model, x, y, s) for s in picks]
        acts = [activation_bytes(model, x, y, s) for s in picks]
        out[variant] = {"flops_per_step": sum(flops) / len(flops), "flops_by_block": flops,
                        "act_bytes": max(acts), "act_bytes_by_block": acts,
                        "params": sum(p.numel() for p in model.parameters()), "num_blocks": model.num_blocks}
    return out


# ------------------------------------------------------------------------------------------------
# evaluation


def feature_net(data, seed: int = 0):
    """A small MLP classifier on the digits (64 -> 128 -> 64 -> 10); its 64-d hidden layer is the
    feature space of the dit Frechet distance. Returns (features_fn, test accuracy)."""
    import torch
    import torch.nn as nn

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


def grid_to_hex(images) -> dict:
    """Images in [-1, 1] -> {"shape", "uint8_hex"}: 8-bit pixels, compact in the JSON."""
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(dtype=__import__("torch").uint8)
    return {"shape": list(images.shape), "uint8_hex": pixels.numpy().tobytes().hex()}


def grid_from_hex(grid: dict):
    import numpy as np
    import torch

    pixels = np.frombuffer(bytes.fromhex(grid["uint8_hex"]), dtype=np.uint8).reshape(grid["shape"])
    return torch.from_numpy(pixels.astype(np.float32) / 127.5 - 1.0)


def evaluate(module: str, model, data, seed: int, final: bool, features=None) -> dict:
    import torch

    model.eval()
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        if module == "vit":
            out = model.accuracy(data.test_x, data.test_y, generator=g)
            if final and not model.end_to_end:  # where the chain gains or loses: block 0 alone, and K = 2B
                twice = model.accuracy(data.test_x, data.test_y, 2 * model.num_blocks, generator=g)
                out["accuracy_2B"] = twice["accuracy"]
                patches, n = model.embed_patches(data.test_x), data.test_x.shape[0]
                top = model.grid.sigma_top  # where the chain's first call runs
                z = top * torch.randn(n, model.settings.d_model, generator=g)
                logits = model.block_logits(0, patches, z, torch.full((n,), top))
                out["block0_accuracy"] = float((logits.argmax(-1) == data.test_y).float().mean())
                out.update(chain_variants(model, data, g))
        elif module == "dit":
            out = {"val_loss": float(model.validation_loss(data.test_x, data.test_y, seed=seed))}
            if final:
                from looped_lm.models.dit import frechet_distance

                labels = torch.arange(10).repeat_interleave(DIT_SAMPLES_PER_CLASS)
                t0 = time.process_time()
                images = model.sample(labels, steps=DIT_STEPS, cfg_scale=DIT_CFG, generator=g)
                out["sample_cpu_s"] = time.process_time() - t0
                out["frechet_distance"] = frechet_distance(features(images), features(data.train_x))
                grid = images.view(10, DIT_SAMPLES_PER_CLASS, *images.shape[1:])[:, :10]  # 10 per class
                out["grid"] = grid_to_hex(grid.transpose(0, 1).reshape(100, *images.shape[1:]))
        else:
            windows = data.windows(MODULES["mdm"]["settings"]["seq_len"], "val", limit=MDM_EVAL_WINDOWS)
            out = model.elbo_bpc(windows, samples_per_block=MDM_T_SAMPLES, generator=g)
            if final:
                from looped_lm.data.text8 import decode

                ids = model.sample(4, MODULES["mdm"]["settings"]["seq_len"], steps=model.settings.seq_len, generator=g)
                out["samples"] = [decode(row) for row in ids]
    model.train()
    return out


def chain_variants(model, data, g) -> dict:
    """The trained vit's K = B accuracy under other inference choices (the training is the same): where the
    chain, not the blocks, gains or loses. The official code's start (sigma_max), the `edge` grid, the hard
    and sampled bridges."""
    import dataclasses

    from looped_lm.diffusion.blocks import chain_grid

    grid, settings, out = model.grid, model.settings, {}
    cases = {"accuracy_start_sigma_max": (dict(), dict(top=1.0)),
             "accuracy_edge_grid": (dict(), dict(last_call="edge")),
             "accuracy_hard_bridge": (dict(bridge="hard"), dict()),
             "accuracy_sample_bridge": (dict(bridge="sample"), dict())}
    for name, (change, grid_change) in cases.items():
        model.settings = dataclasses.replace(settings, **change)
        model.grid = chain_grid(model.edges, model.train_ranges, model.sched, grid_change.get("top", settings.sample_top_quantile),
                                grid_change.get("last_call", settings.last_call))
        out[name] = model.accuracy(data.test_x, data.test_y, generator=g)["accuracy"]
    model.grid, model.settings = grid, settings
    return out


# ------------------------------------------------------------------------------------------------
# one run


def run(module: str, variant: str, seed: int, steps: int, overrides: dict | None = None,
        only_block: int | None = None, lr: float | None = None, split: str = "test") -> dict:
    """Train one variant for `steps` steps at peak learning rate `lr` (default: the module's) on `split`'s
    training images, scored on its held-out images; `overrides` change its settings, `only_block` trains
    that block alone (a diagnosis: how well one block learns from all of the updates)."""
    import torch

    from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups

    torch.set_num_threads(1)
    spec = MODULES[module]
    peak = spec["lr"] if lr is None else lr
    data = load_data(module, split)
    features = feature_net(data)[0] if module == "dit" else None
    torch.manual_seed(seed)
    model = build(module, variant, overrides)
    if only_block is not None:
        model.choose_block = lambda step, seed: only_block
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
            final = step == steps - 1
            point = {"step": step + 1, "share_of_flops": (step + 1) / steps,
                     **evaluate(module, model, data, seed, final, features)}
            curve.append(point)
    return {"module": module, "variant": variant, "seed": seed, "steps": steps, "lr": peak, "split": split,
            "overrides": overrides or {}, "only_block": only_block,
            "train_cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - t0,
            "loss_curve": [sum(losses[i:i + 25]) / len(losses[i:i + 25]) for i in range(0, steps, 25)],
            "curve": curve, "final": curve[-1]}


def run_job(args):
    module, variant, seed, steps, lr, split = args
    return run(module, variant, seed, steps, lr=lr, split=split)


DEV_FILE = RESULTS / "modules_dev.json"


def dev_lr(module: str, variant: str, dev: dict) -> tuple[float, str]:
    """The peak LR a test run of `variant` uses, and where it came from: the best mean dev metric over the
    variant's dev runs (ties to the LR nearest the module's base), `db`'s choice for a DB option variant with
    no dev runs of its own, else the module's base LR."""
    import math

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


DIAGNOSES = ("e2e_2_layers", "block0_only")


def diagnose_vit(out: Path, seeds=(0, 1, 2), kinds=("e2e_2_layers",)) -> None:
    """Where the DB ViT's remaining gap comes from (test split; the LRs chosen on dev). Its K = B chain scores
    about what block 0 alone scores from pure noise (the chain's later calls read the label block 0 chose back
    from z), and block 0 is L/B = 2 layers deep with ~1/B of the updates. Two references, each appended to
    `out` by (kind, seed):
      e2e_2_layers  a 2-layer end-to-end classifier (block 0's depth) with the e2e run's 600 updates, at
                    e2e's LR: what block 0's depth and update count allow with plain CE
      block0_only   the DB network with every one of the DB run's equal-FLOPs updates given to block 0, at
                    db's LR, scored as block 0 alone from pure noise at sigma_top: what block 0's
                    noisy-label objective reaches with 3x its updates"""
    dev = json.loads(DEV_FILE.read_text()) if DEV_FILE.exists() else {"modules": {}}
    results = json.loads(out.read_text()) if out.exists() else {}
    main_file = RESULTS / "modules.json"
    db_steps = json.loads(main_file.read_text())["modules"]["vit"]["steps"]["db"] if main_file.exists() else None
    for kind in kinds:
        for seed in seeds:
            if kind == "e2e_2_layers":
                lr, steps = dev_lr("vit", "e2e", dev)[0], MODULES["vit"]["e2e_steps"]
                r = run("vit", "e2e", seed, steps, {"n_layers": 2, "num_blocks": 1}, lr=lr)
                acc = r["final"]["accuracy"]
            else:
                if db_steps is None:
                    raise SystemExit("block0_only needs modules.json's equal-FLOPs db steps: run the vit first")
                lr, steps = dev_lr("vit", "db", dev)[0], db_steps
                r = run("vit", "db", seed, steps, only_block=0, lr=lr)
                acc = r["final"]["block0_accuracy"]
            results[f"{kind}_seed{seed}"] = {"kind": kind, "steps": steps, "seed": seed, "lr": lr, "accuracy": acc,
                                             "train_cpu_s": r["train_cpu_s"], "split": "test"}
            print(results[f"{kind}_seed{seed}"], flush=True)
            out.write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------------------------
# report


METRIC = {"vit": ("accuracy", "top-1 accuracy (%)", 100.0, "higher"),
          "dit": ("frechet_distance", "Frechet distance, MLP-classifier features (not FID)", 1.0, "lower"),
          "mdm": ("bpc", "bits per character (NELBO, upper bound)", 1.0, "lower")}


def mean_spread(values):
    return sum(values) / len(values), (max(values) - min(values)) / 2


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
    if dev is None:
        dev = json.loads(DEV_FILE.read_text()) if DEV_FILE.exists() else {"modules": {}}
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
            mean, spread = mean_spread(finals[variant])
            cost = res["cost"][variant]
            memory = cost["act_bytes"] / res["cost"]["e2e"]["act_bytes"]
            lrs = sorted({run_lr(res, r, module) for r in res["runs"] if r["variant"] == variant})
            source = res.get("lr_source", {}).get(variant, "the module's base (no dev runs)")
            lr_cell = "/".join(f"{lr:g}" for lr in lrs) + (" (dev-chosen)" if source.startswith(("dev", "db's"))
                                                          else " (base, not swept)")
            name = variant if variant in VARIANTS[module] else f"{variant} (option)"
            row = [module, label, name, lr_cell, f"{mean:.2f} ± {spread:.2f} ({len(finals[variant])})"]
            if variant == "e2e":
                row += ["", "", "", str(res["steps"][variant]), "1.00"]
            else:
                diff = mean - e2e_mean
                met = diff >= -1.5 if module == "vit" else diff <= 0
                row += [f"{diff:+.2f}", MODULES[module]["target"], "yes" if met else "no", str(res["steps"][variant]),
                        f"{memory:.2f} ({1 / cost['num_blocks']:.2f})"]
            lines.append("| " + " | ".join(row) + " |")
    dev_lines = summarise_dev(dev)
    if dev_lines:
        lines += ["", "Dev split (seed 0 unless the bracket says more; the LR marked `chosen` is what the test rows "
                  "use):", dev_lines]
    return "\n".join(lines + diagnostics(results) + reading(results))


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
            parts = [f"lr {lr:g}: {mean_spread(vals)[0]:.2f} ± {mean_spread(vals)[1]:.2f} ({len(vals)})"
                     + (" <- chosen" if lr == chosen else "")
                     for (v, lr), vals in sorted(cells.items()) if v == variant]
            lines.append(f"- {module} {variant}, dev {label}: " + "; ".join(parts))
    return "\n".join(lines)


def vit_diagnosis() -> dict[str, list[dict]]:
    """modules_vit_diagnosis.json by kind (entries written before kinds were recorded are e2e_2_layers)."""
    path = RESULTS / "modules_vit_diagnosis.json"
    out: dict[str, list[dict]] = {}
    if path.exists():
        for r in json.loads(path.read_text()).values():
            out.setdefault(r.get("kind", "e2e_2_layers"), []).append(r)
    return out


def diagnostics(results: dict) -> list[str]:
    """Where the DiffusionBlocks numbers come from: vit's chain vs its first block, mdm's per-interval BPC,
    dit's real-data floor."""
    out, mods = [""], results.get("modules", {})
    for db_variant in [v for v in variants_of("vit") if v != "e2e"]:
        runs = [r for r in mods.get("vit", {}).get("runs", []) if r["variant"] == db_variant and "block0_accuracy" in r["final"]]
        if not runs:
            continue
        keys = [("accuracy", "K = B"), ("accuracy_2B", "K = 2B"), ("block0_accuracy", "block 0 alone from pure noise at "
                "sigma_top"), ("accuracy_start_sigma_max", "K = B started at sigma_max (the official code)"),
                ("accuracy_edge_grid", "K = B on the `edge` grid"), ("accuracy_hard_bridge", "hard bridge"),
                ("accuracy_sample_bridge", "sampled bridge")]
        parts = [f"{label} {mean_spread([100 * r['final'][k] for r in runs])[0]:.2f}" for k, label in keys
                 if all(k in r["final"] for r in runs)]
        out.append(f"- vit {db_variant}, the same trained blocks under other inference choices (test, mean of {len(runs)} "
                   "seeds): " + "; ".join(parts))
    for variant in ("e2e", "db"):
        runs = [r for r in mods.get("mdm", {}).get("runs", []) if r["variant"] == variant]
        if runs:
            shares = [mean_spread([r["final"]["per_block"][i] for r in runs])[0]
                      for i in range(len(runs[0]["final"]["per_block"]))]
            out.append(f"- mdm {variant}: BPC by t-interval (high t first) " + " + ".join(f"{v:.3f}" for v in shares))
    if "real_test_vs_train_frechet" in mods.get("dit", {}):
        d = mods["dit"]
        out.append(f"- dit: held-out real digits vs the training digits: Frechet distance "
                   f"{d['real_test_vs_train_frechet']:.2f} (the floor; the feature classifier's test accuracy "
                   f"{100 * d['feature_net_test_accuracy']:.1f}%)")
    what = {"e2e_2_layers": "a 2-layer end-to-end classifier (block 0's depth) with {steps} updates",
            "block0_only": "block 0 alone (from pure noise) after ALL {steps} of the DB run's equal-FLOPs updates"}
    for kind, entries in vit_diagnosis().items():
        acc = mean_spread([100 * r["accuracy"] for r in entries])
        lrs = "/".join(f"{lr:g}" for lr in sorted({r.get("lr", MODULES["vit"]["lr"]) for r in entries}))
        out.append(f"- vit diagnosis (modules_vit_diagnosis.json, test, lr {lrs}, seeds "
                   f"{sorted(r['seed'] for r in entries)}): {what[kind].format(steps=entries[0]['steps'])}: "
                   f"{acc[0]:.2f} ± {acc[1]:.2f}")
    return out if len(out) > 1 else []


def reading(results: dict) -> list[str]:
    """What the numbers say, computed from them (no number is written here by hand)."""
    mods, out = results.get("modules", {}), ["", "Reading (vit and dit: the recipe of docs/method.md §7, the official "
                                             "DiffusionBlocks code's grid, last call at sigma_min, network term, "
                                             "batch-mean weight and smooth noise embedding; mdm's rows come from the "
                                             "earlier run at the base LR, its code unchanged since):"]
    vit = mods.get("vit", {})
    finals = finals_of(vit, "vit")
    if "e2e" in finals and "db" in finals:
        e2e, db = mean_spread(finals["e2e"])[0], mean_spread(finals["db"])[0]
        runs = [r for r in vit["runs"] if r["variant"] == "db" and "block0_accuracy" in r["final"]]
        chain = mean_spread([100 * (r["final"]["accuracy"] - r["final"]["block0_accuracy"]) for r in runs])[0]
        line = (f"- vit: DB − e2e = {db - e2e:+.2f} points on test ({'met' if db - e2e >= -1.5 else 'missed'}: the "
                f"target is −1.5). The K = B chain adds {chain:+.2f} points to block 0 alone from pure noise, so the "
                "prediction is block 0's")
        diag = vit_diagnosis()
        if "block0_only" in diag:
            b0 = mean_spread([100 * r["accuracy"] for r in diag["block0_only"]])[0]
            own = mean_spread([100 * r["final"]["block0_accuracy"] for r in runs])[0]
            line += (f"; block 0 with all the DB run's updates (3x its share) scores {b0:.2f} vs {own:.2f} at its "
                     f"share and {e2e:.2f} for e2e: ")
            line += ("the update share explains most of the gap" if b0 - own > (e2e - own) / 2 else
                     "more updates do not close it: block 0's noisy-label objective at its depth is the limit")
        if "e2e_2_layers" in diag:
            two = mean_spread([100 * r["accuracy"] for r in diag["e2e_2_layers"]])[0]
            line += f"; a 2-layer e2e classifier with 600 updates scores {two:.2f}"
        out.append(line + ".")
        dev = json.loads(DEV_FILE.read_text()) if DEV_FILE.exists() else {"modules": {}}
        for variant in ("e2e", "db"):
            cells: dict[float, list[float]] = {}
            examples = 0
            for r in dev.get("modules", {}).get("vit", {}).get("runs", []):
                if r["variant"] == variant:
                    cells.setdefault(r["lr"], []).append(100 * r["final"]["accuracy"])
                    examples = r["final"]["examples"]
            if len(cells) < 2:
                continue
            means = sorted(((sum(v) / len(v), lr) for lr, v in cells.items()), reverse=True)
            n_seeds = min(len(v) for v in cells.values())
            out.append(f"- vit {variant}: LR {means[0][1]:g} chosen on dev by {means[0][0] - means[1][0]:.2f} points over "
                       f"the next LR ({means[1][1]:g}), {n_seeds} seed(s) of {examples} dev images; "
                       f"its test spread over seeds is ± {mean_spread(finals[variant])[1]:.2f}"
                       + (" (the dev margin is inside the test seed-to-seed range: one dev seed does not resolve the choice)"
                          if means[0][0] - means[1][0] < 2 * mean_spread(finals[variant])[1] else "") + ".")
        dev_runs = dev.get("modules", {}).get("vit", {}).get("runs", [])
        for option, change in OPTION_VARIANTS.get("vit", {}).items():  # explicit recipe options, judged on dev
            mine = [r for r in dev_runs if r["variant"] == option]
            if not mine or option in finals:
                continue
            for lr in sorted({m["lr"] for m in mine}):
                at = {m["seed"]: 100 * m["final"]["accuracy"] for m in mine if m["lr"] == lr}
                base = {r["seed"]: 100 * r["final"]["accuracy"] for r in dev_runs
                        if r["variant"] == "db" and r["lr"] == lr and r["seed"] in at}
                if not base:
                    continue
                paired = sorted(base)  # the seeds both have: a paired comparison
                acc, ref = (sum(d[s] for s in paired) / len(paired) for d in (at, base))
                out.append(f"- vit option {option} ({change}): dev {acc:.2f} vs db {ref:.2f} at lr {lr:g}, seeds "
                           f"{paired}" + (f" (the option also ran seeds {sorted(set(at) - set(base))}: mean over all "
                                          f"{sum(at.values()) / len(at):.2f})" if set(at) - set(base) else "") + ": "
                           + ("won on dev" if acc > ref else "lost on dev") + "; not run on test; the default stays")
        weighted = {o: c for o, c in OPTION_VARIANTS.get("vit", {}).items() if "block_weights" in c}
        cells: dict[tuple[str, float], list[float]] = {}
        for r in dev_runs:
            if r["variant"] in weighted or (r["variant"] == "db" and r["lr"] in {m["lr"] for m in dev_runs
                                                                                  if m["variant"] in weighted}):
                cells.setdefault((r["variant"], r["lr"]), []).append(100 * r["final"]["accuracy"])
        best = max(((v, lr) for v, lr in cells if v in weighted), key=lambda c: sum(cells[c]) / len(cells[c]),
                   default=None)
        if best:
            out.append("- vit block weights on dev (block 0 = highest noise first; mean over dev seeds, n in brackets): "
                       + "; ".join(f"{v}{' ' + str(weighted[v]['block_weights']) if v in weighted else ' (uniform)'} "
                                   f"lr {lr:g}: {sum(x) / len(x):.2f} ({len(x)})" for (v, lr), x in sorted(cells.items()))
                       + f"; dev-best weights: {best[0]} at lr {best[1]:g}.")
        for option in [o for o in weighted if o in finals]:
            runs = [r for r in vit["runs"] if r["variant"] == option]
            mean, spread = mean_spread(finals[option])
            lrs = sorted({run_lr(vit, r, "vit") for r in runs})
            model = build("vit", option)
            steps = vit["steps"][option]
            share = [sum(model.choose_block(t, r["seed"]) == 0 for t in range(steps)) for r in runs]
            with_b0 = [r for r in runs if "block0_accuracy" in r["final"]]
            chain = mean_spread([100 * (r["final"]["accuracy"] - r["final"]["block0_accuracy"]) for r in with_b0])[0]
            b0 = mean_spread([100 * r["final"]["block0_accuracy"] for r in with_b0])[0]
            diff = mean - mean_spread(finals["e2e"])[0]
            at = {m["seed"]: 100 * m["final"]["accuracy"] for m in dev_runs if m["variant"] == option and m["lr"] in lrs}
            base = {r["seed"]: 100 * r["final"]["accuracy"] for r in dev_runs
                    if r["variant"] == "db" and r["lr"] in lrs and r["seed"] in at}
            if base:
                acc, ref = (sum(d[s] for s in base) / len(base) for d in (at, base))
                out.append(f"- vit option {option} vs uniform db on dev (same lr, paired seeds {sorted(base)}): {acc:.2f} vs "
                           f"{ref:.2f}: " + ("won" if acc > ref else "lost: the weights did not beat uniform sampling "
                                             "on dev") + "; run on test as the dev-best of the block weights.")
            db_lr = dev_lr("vit", "db", dev)[0]
            own = {m["seed"]: 100 * m["final"]["accuracy"] for m in dev_runs if m["variant"] == "db" and m["lr"] == db_lr}
            paired = sorted(set(own) & set(at))
            if paired and db_lr not in lrs:
                acc, ref = (sum(d[s] for s in paired) / len(paired) for d in (at, own))
                out.append(f"  At each side's dev-chosen LR ({option} {'/'.join(f'{x:g}' for x in lrs)}, db {db_lr:g}), "
                           f"paired dev seeds {paired}: {acc:.2f} vs {ref:.2f} ("
                           + ("the option ahead" if acc > ref else "uniform db ahead: dev, one paired seed of 288 images, "
                              "did not show the option's test gain") + ").")
            out.append(f"- vit option {option} (diffusion.block_sampling fixed, block_weights "
                       f"{weighted[option]['block_weights']}; recipe option, the default stays uniform): test "
                       f"{mean:.2f} ± {spread:.2f} over seeds {sorted(r['seed'] for r in runs)} at lr "
                       f"{'/'.join(f'{lr:g}' for lr in lrs)} ({'the dev-best weights and LR' if best and best[0] == option and best[1] in lrs else 'NOT the dev-best choice'}), "
                       f"{steps} equal-FLOPs steps of which block 0 got {min(share)}-{max(share)}; DB − e2e = {diff:+.2f} "
                       f"({'met' if diff >= -1.5 else 'missed'}: the target is −1.5; uniform db {db - e2e:+.2f}). The K = B "
                       f"chain adds {chain:+.2f} points to block 0 alone ({b0:.2f})"
                       + (", so the prediction is still block 0's" if abs(chain) < 1 else ", so the later blocks move the "
                          "prediction") + ".")
            on_dev = [100 * (m["final"]["accuracy"] - m["final"]["block0_accuracy"]) for m in dev_runs
                      if m["variant"] == option and m["lr"] in lrs and "block0_accuracy" in m["final"]]
            if on_dev and chain < 0:
                out.append(f"  Cause of the miss: the later blocks (each ~{(1 - sum(share) / len(share) / steps) / 2:.0%} of "
                           f"the steps) cost the chain {-chain:.2f} points on test and {-sum(on_dev) / len(on_dev):.2f} on "
                           f"dev (seeds {len(on_dev)}, same runs' block 0 alone); block 0 alone would give DB − e2e = "
                           f"{b0 - mean_spread(finals['e2e'])[0]:+.2f} on test, but that inference choice was not made on "
                           "dev before this test run, so it is a lead for a dev-chosen follow-up, not a verdict.")
            diag = vit_diagnosis()
            uniform = [r for r in vit["runs"] if r["variant"] == "db" and "block0_accuracy" in r["final"]]
            if "block0_only" in diag and uniform:
                every = mean_spread([100 * r["accuracy"] for r in diag["block0_only"]])[0]
                third = mean_spread([100 * r["final"]["block0_accuracy"] for r in uniform])[0]
                out.append(f"  Block 0 alone on test: {third:.2f} with uniform's third of the steps, {b0:.2f} with "
                           f"{option}'s {sum(share) / len(share) / steps:.0%}, {every:.2f} with all of them "
                           f"(modules_vit_diagnosis.json, lr {'/'.join(f'{x:g}' for x in sorted({r.get('lr', 0) for r in diag['block0_only']}))})" +
                           (f": block 0 falls {every - b0:.2f} points short of the all-steps diagnosis, below the "
                            "midpoint between a third and all of the steps, so its share of the steps does not explain "
                            "the gap on its own at this LR" if b0 < (third + every) / 2 else
                            ": block 0's accuracy rises with its share of the steps") + ".")
    for module in ("dit", "mdm"):
        n = {v: len(x) for v, x in finals_of(mods.get(module, {}), module).items()}
        if n:
            out.append(f"- {module}: seeds per variant {n}.")
    return out


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
    ap.add_argument("--fresh", action="store_true", help="drop the modules' earlier runs (after their code changed)")
    ap.add_argument("--diagnose-vit", nargs="*", choices=DIAGNOSES, default=None,
                    help="append these diagnoses (default e2e_2_layers) to modules_vit_diagnosis.json and stop")
    args = ap.parse_args()
    out = args.out or (DEV_FILE if args.split == "dev" else RESULTS / "modules.json")
    if args.lr_mults and args.split != "dev":
        raise SystemExit("--lr-mults is a dev sweep: settings are chosen on dev (--split dev)")
    if args.diagnose_vit is not None:
        import torch

        torch.set_num_threads(1)
        diagnose_vit(RESULTS / "modules_vit_diagnosis.json", args.seeds, args.diagnose_vit or ("e2e_2_layers",))
        return
    results = json.loads(out.read_text()) if out.exists() else {"modules": {}}
    if args.retable:
        print(summarise(results) if args.split == "test" else summarise_dev(results))
        return
    dev = json.loads(DEV_FILE.read_text()) if DEV_FILE.exists() else {"modules": {}}
    import torch

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
        entry["runs"] = [r for r in entry.get("runs", []) if r["variant"] in every and not args.fresh and
                         not any(r["seed"] == s and r["variant"] == v and (not keep_lr or r.get("lr") == lr)
                                 for s, v, lr in redo)]
        print(f"{module}: flops/step " + ", ".join(f"{v} {c['flops_per_step']:.3g}" for v, c in cost.items())
              + f" -> steps {steps}; activation bytes " + ", ".join(f"{v} {c['act_bytes']}" for v, c in cost.items())
              + f"; lr {lrs}", flush=True)
        if module == "dit" and args.split == "test":  # the distance of real held-out digits: the floor
            from looped_lm.models.dit import frechet_distance

            data = load_data(module)
            features, accuracy = feature_net(data)
            entry["feature_net_test_accuracy"] = accuracy
            entry["real_test_vs_train_frechet"] = frechet_distance(features(data.test_x), features(data.train_x))
        jobs += [(module, v, s, steps[v], lr, args.split) for s in args.seeds for v in variants for lr in lrs[v]]
    out.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for res in pool.map(run_job, jobs):
            results["modules"][res["module"]]["runs"].append(res)
            key = METRIC[res["module"]][0]
            print(f"{res['module']} {res['variant']} seed {res['seed']} lr {res['lr']:g} ({res['split']}): {key} "
                  f"{res['final'][key]:.4f} ({res['train_cpu_s']:.0f} s CPU)", flush=True)
            out.write_text(json.dumps(results, indent=1))
    out.write_text(json.dumps(results, indent=1))
    if args.split == "dev":
        print(summarise_dev(results))
        return
    table = summarise(results)
    out.with_suffix(".md").write_text(table + "\n")
    write_figures(results, out.parent / out.stem)
    print(table)


def write_figures(results: dict, stem: Path) -> None:
    """{stem}_curves.png: each run's metric against its share of the training FLOPs; {stem}_dit_VARIANT.png:
    10 samples per class (one column each) from the seed-0 run of each dit variant."""
    from looped_lm.data.images import write_png_grid

    for r in results["modules"].get("dit", {}).get("runs", []):
        if r["seed"] == 0 and "grid" in r["final"]:
            write_png_grid(grid_from_hex(r["final"]["grid"]), f"{stem}_dit_{r['variant']}.png", nrow=10, scale=4)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    modules = list(results["modules"])
    fig, axes = plt.subplots(1, len(modules), figsize=(5 * len(modules), 3.6), squeeze=False)
    for ax, module in zip(axes[0], modules):
        key, label, scale, _ = METRIC[module]
        key = "val_loss" if module == "dit" else key  # dit's curve: the EDM loss; its FD is measured at the end
        for r in results["modules"][module]["runs"]:
            colour = {"e2e": "tab:blue", "db": "tab:orange"}.get(r["variant"], "tab:green")
            ax.plot([p["share_of_flops"] for p in r["curve"]], [p[key] * (scale if key != "val_loss" else 1)
                                                                for p in r["curve"]],
                    marker="o", color=colour, alpha=0.7, label=r["variant"] if r["seed"] == 0 else None)
        ax.set_title(module)
        ax.set_xlabel("share of the training FLOPs")
        ax.set_ylabel("validation EDM loss" if module == "dit" else label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(f"{stem}_curves.png", dpi=110)


if __name__ == "__main__":
    main()
