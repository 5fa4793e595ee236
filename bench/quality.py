"""The quality study (docs/results.md): what DiffusionBlocks costs in quality, and which choices fix it.

    python bench/quality.py main            # gpt, db_ar B=2 / B=4, huginn, looped_db on GPT-2 BPE, equal FLOPs
    python bench/quality.py ablate          # db_ar switches of method.md §8 + the paper's knobs, byte level
    python bench/quality.py main --lanes 2  # two runs at a time, one thread each (the default)
    python bench/quality.py report          # tables + plots from the JSON already written
    python bench/quality.py main --smoke    # a few steps of everything: checks the script, not the models
    python bench/quality.py rescore ablate paper    # recompute a finished run's final scores

Protocol (every run, seeded): the embedded King James Bible, split by document (3 held-out books),
`TokenStream` batches (the same sequence of batches for every model), plain `BlockwiseAdamW` (idle DB blocks
untouched), lr 3e-3 (50 warm-up steps, cosine to 3e-4), wd 0.1, clip 1.0, fp32, ONE thread per run.

Equal training FLOPs: every run trains until its counted FLOPs reach the study's budget (the reference
gpt's FLOPs over its steps). FLOPs are COUNTED, not estimated: `torch.utils.flop_counter` over one real
forward + backward for each distinct step shape (a DB block, a Huginn recurrence r), cached by shape.
Equal wall-clock: read from the probe curves (val metric vs training seconds, probes not timed) at the
shortest run's time. Runs in parallel lanes share the machine alike.

Val metric: exact next-token NLL (gpt; huginn at K = its mean recurrence) or ppl@0's NLL (DB: one call at
sigma_hi, method.md §6), on fixed held-out windows. Final scoring adds ppl@k (K grid, 2 draws), both bridges,
CE(sigma) with real and shuffled context, and (main) generated text scored by the study's gpt.

Resumable: each run checkpoints (model, optimiser, log, step) to --work at every probe, atomically; a run
whose JSON exists is skipped. Writes bench/results/quality/<study>/<run>.json and the report's PNGs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from looped_lm.config import config_from_dict
from looped_lm.data.bin_dataset import TokenStream
from looped_lm.data.prepare import ensure_prepared
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.generate import generate
from looped_lm.sampling import SamplingParams
from looped_lm.models import build_model
from looped_lm.models.huginn import sample_recurrence
from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_report  # noqa: E402  (bench/ is not a package)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "quality"
SEED, BATCH, SEQ = 0, 16, 128
LR, MIN_LR, WARMUP, WD = 3e-3, 3e-4, 50, 0.1
N_PROBES = 16

# ------------------------------------------------------------------------------------------------
# the studies: run name -> (model section, diffusion section)

MAIN_SHAPE = {"d_model": 128, "n_heads": 4, "seq_len": SEQ}
LOOPED = {"n_prelude": 1, "n_layers": 2, "n_coda": 1}  # 4 layers, like the others
LIK = {"parameterization": "likelihood", "noisy_input": "prev_token", "bridge": "sample", "noisy_self": True,
       "block_sampling": "uniform",
       "last_call": "edge"}  # the layout when the main study ran (docs/results.md)
MAIN = {
    "tokenizer": "gpt2", "ref": "gpt", "ref_steps": 120,  # the 50257-way head: a gpt step ~2-3 s on one core, DB ~2x
    "runs": {
        "gpt": ({"kind": "gpt", "n_layers": 4}, {}),
        "db_ar_b2": ({"kind": "db_ar", "n_layers": 4}, {"num_blocks": 2, **LIK}),
        "db_ar_b4": ({"kind": "db_ar", "n_layers": 4}, {"num_blocks": 4, **LIK}),
        "huginn": ({"kind": "huginn", **LOOPED, "mean_recurrence": 8, "backprop_depth": 4}, {}),
        "looped_db": ({"kind": "looped_db", **LOOPED}, {"num_blocks": 1, **LIK}),
    },
}

AB = {"kind": "db_ar", "n_layers": 4}  # the quickstart's shape: 4 layers d 128 byte level, B = 2
# Every DB run states its whole layout: the paper's (method.md §4-5) or the project's defaults (OURS),
# plus one switch, so a change of the config defaults never changes what a run measures.
PAPER = {"num_blocks": 2, "parameterization": "edm", "noisy_input": "noise", "noisy_self": True,
         "bridge": "hard", "last_call": "edge"}
OURS = {"num_blocks": 2, "parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False,
        "bridge": "sample", "last_call": "edge"}
ABLATE = {
    "tokenizer": "byte", "ref": "gpt", "ref_steps": 300,
    "runs": {
        "gpt": ({"kind": "gpt", "n_layers": 4}, {}),
        "gpt_depth2": ({"kind": "gpt", "n_layers": 2}, {}),  # depth-matched: L/B layers
        "paper": (AB, PAPER),
        # method.md §8's switches and the paper's knobs, each on the paper's layout
        "prev_token": (AB, {**PAPER, "noisy_input": "prev_token"}),
        "equi_entropy": (AB, {**PAPER, "partition": "equi_entropy", "curve_every": 100}),
        "adaptive": (AB, {**PAPER, "noise": "adaptive", "curve_every": 100}),
        "stacked": (AB, {**PAPER, "context": "stacked"}),
        "loss_share": (AB, {**PAPER, "block_sampling": "loss_share", "curve_every": 100}),
        "clean_lm": (AB, {**PAPER, "clean_lm_weight": 0.5}),
        "p_mean_0": (AB, {**PAPER, "p_mean": 0.0}),
        "target_sigma_data": (AB, {**PAPER, "target_scale": "sigma_data"}),
        "loss_edm": (AB, {**PAPER, "loss_weight": "edm"}),
        "overlap_0": (AB, {**PAPER, "overlap": 0.0}),
        "overlap_0.05": (AB, {**PAPER, "overlap": 0.05}),
        # the likelihood parameterization (docs/notes.md), built up to the project's defaults
        "likelihood": (AB, {**PAPER, "parameterization": "likelihood"}),
        "likelihood_prev": (AB, {**PAPER, "parameterization": "likelihood", "noisy_input": "prev_token"}),
        "likelihood_prev_noself": (AB, OURS),
        "ours_loss_share": (AB, {**OURS, "block_sampling": "loss_share", "curve_every": 100}),
        "ours_stacked": (AB, {**OURS, "context": "stacked"}),
    },
}
STUDIES = {"main": MAIN, "ablate": ABLATE}


def run_config(study: dict, name: str):
    model, diffusion = study["runs"][name]
    raw = {"model": {**MAIN_SHAPE, **model}, "data": {"tokenizer": study["tokenizer"]}}
    if diffusion:
        raw["diffusion"] = diffusion
    return config_from_dict(raw)


def build(cfg, vocab: int):
    torch.manual_seed(SEED)
    model = build_model(cfg, vocab)
    model._study_kind = cfg.model.kind  # gpt / huginn keep no config
    return model


def load_run(study: dict, name: str, work: Path, vocab: int):
    """A finished (or interrupted) run's model from its checkpoint in `work`, in eval mode."""
    model = build(run_config(study, name), vocab)
    saved = torch.load(work / f"{name}.pt", weights_only=False)
    model.load_state_dict(saved["model"])
    if saved.get("curve") is not None:
        model.apply_curve(saved["curve"])
    return model.eval()


def vocab_of(study: dict, train: TokenStream) -> int:
    return 50257 if study["tokenizer"] == "gpt2" else int(train.tokens.max()) + 1


def data_streams(tokenizer: str):
    path = ensure_prepared("bible", str(ROOT / "data_cache"), tokenizer, 0.05, 0, progress=False)
    return TokenStream(f"{path}/train.bin", SEQ), TokenStream(f"{path}/val.bin", SEQ)


def val_windows(val: TokenStream, n: int, seq: int = SEQ):
    """n disjoint windows spread evenly over val.bin: (x, y) int64 (n, seq)."""
    tokens = torch.from_numpy(val.tokens[:].astype("int64"))
    starts = torch.linspace(0, len(tokens) - seq - 2, n).long()
    rows = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


# ------------------------------------------------------------------------------------------------
# FLOPs per step, counted


def step_key(model, step: int):
    """What decides a step's shape: the DB block trained, Huginn's recurrence r, or nothing."""
    if hasattr(model, "choose_block"):
        return model.choose_block(step, SEED)
    if hasattr(model, "mean_recurrence"):
        return sample_recurrence(model.mean_recurrence, torch.Generator().manual_seed(SEED * 1_000_003 + step))
    return 0


def counted_flops(model, step: int, x, y) -> int:
    """FLOPs of one forward + backward of `step`'s shape (gradients discarded)."""
    counter = FlopCounterMode(display=False)
    with counter:
        loss, _ = model.training_loss(x, y, step, SEED)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def mean_flops_per_step(model, train: TokenStream, cache: dict, n: int = 64) -> float:
    """The mean counted FLOPs over the first n steps' shapes (DB blocks, Huginn's r draws)."""
    x, y = train.get_batch(BATCH, SEED, 0, 0, 0)
    total = 0
    for step in range(n):
        key = step_key(model, step)
        if key not in cache:
            cache[key] = counted_flops(model, step, x, y)
        total += cache[key]
    return total / n


# ------------------------------------------------------------------------------------------------
# training one run


@torch.no_grad()
def val_nll(model, x, y, k_grid=None, draws: int = 1) -> dict:
    """{k: mean NLL}: exact for gpt / huginn (k = iterations), ppl@k's NLL for DB models (k = 0: ppl@0)."""
    model.eval()
    g = torch.Generator().manual_seed(1)
    kind = model._study_kind
    if kind == "gpt":
        out = {0: float(model(x, y)[1])}
    elif kind == "huginn":  # k = 0: at the mean recurrence (the probes' number)
        ks = k_grid or []
        nll = model.eval_nll(x, y, sorted({*ks, model.mean_recurrence}), generator=g)
        out = {0: float(nll[model.mean_recurrence].mean()), **{k: float(nll[k].mean()) for k in ks}}
    else:
        out = {k: float(v.mean()) for k, v in model.eval_nll(x, y, k_grid=k_grid or [], draws=draws,
                                                               generator=g).items()}
    model.train()
    return out


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_run(study_name: str, name: str, work: Path, smoke: bool, log) -> dict:
    study = STUDIES[study_name]
    torch.set_num_threads(1)
    cfg = run_config(study, name)
    train, val = data_streams(study["tokenizer"])
    model = build(cfg, vocab_of(study, train))
    n_params = sum(p.numel() for p in model.parameters())
    flops_cache: dict = {}
    budget = budget_flops(study_name, train, work, smoke)
    per_step = mean_flops_per_step(model, train, flops_cache)
    steps = max(2, round(budget / per_step))
    probe_every = max(1, steps // N_PROBES)
    xv, yv = val_windows(val, 8 if smoke else 32)
    opt = BlockwiseAdamW(param_groups(model, WD), lr=LR, betas=(0.9, 0.95))
    ckpt = work / f"{name}.pt"
    state = {"step": 0, "flops": 0, "train_s": 0.0, "probes": [], "edges": []}
    if ckpt.exists():  # resume
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        if saved.get("curve") is not None:
            model.apply_curve(saved["curve"])
        log(f"{name}: resumed at step {state['step']}")
    uses_curve = getattr(model, "uses_curve", lambda: False)()
    curve_every = cfg.diffusion.curve_every
    model.train()
    while state["step"] < steps:
        step = state["step"]
        if step % probe_every == 0:
            state["probes"].append({"step": step, "flops": state["flops"], "train_s": state["train_s"],
                                    "tokens": step * BATCH * SEQ, "val_nll": val_nll(model, xv, yv)[0]})
            save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                         "curve": getattr(model, "curve", None)}, ckpt)
            log(f"{name}: step {step}/{steps} val {state['probes'][-1]['val_nll']:.3f} ({state['train_s']:.0f}s)")
        if uses_curve and step % curve_every == 0:  # as train.py's refresh_curve (not timed)
            model.eval()
            xc, yc = val.get_batch(BATCH, SEED, -2, 0, 0)
            model.apply_curve(model.measure_curve(xc, yc, seed=step))
            state["edges"].append({"step": step, "edges": list(model.edges)})
            model.train()
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = cosine_with_warmup(step, WARMUP, steps, LR, MIN_LR)
        if hasattr(model, "step_units"):
            opt.set_active_units(model.step_units(step, SEED))
        x, y = train.get_batch(BATCH, SEED, step, 0, 0)
        loss, _ = model.training_loss(x, y, step, SEED)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["train_s"] += time.perf_counter() - t0
        key = step_key(model, step)
        if key not in flops_cache:
            flops_cache[key] = counted_flops(model, step, x, y)
        state["flops"] += flops_cache[key]
        state["step"] += 1
    state["probes"].append({"step": state["step"], "flops": state["flops"], "train_s": state["train_s"],
                            "tokens": state["step"] * BATCH * SEQ, "val_nll": val_nll(model, xv, yv)[0]})
    save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                 "curve": getattr(model, "curve", None)}, ckpt)
    result = {"run": name, "study": study_name, "config": cfg_summary(cfg), "params": n_params,
              "steps": steps, "flops_budget": budget, "flops_per_step": per_step, **state}
    result.update(final_scores(model, val, smoke))
    return result


def cfg_summary(cfg) -> dict:
    from dataclasses import asdict
    out = {"model": asdict(cfg.model)}
    if cfg.model.kind in ("db_ar", "looped_db"):
        out["diffusion"] = asdict(cfg.diffusion)
    return out


def budget_flops(study_name: str, train: TokenStream, work: Path, smoke: bool) -> float:
    """The study's FLOP budget: the reference gpt's counted FLOPs per step x its steps (cached)."""
    path = work / "budget.json"
    if path.exists():
        return json.loads(path.read_text())["flops"]
    study = STUDIES[study_name]
    cfg = run_config(study, study["ref"])
    ref = build(cfg, vocab_of(study, train))
    steps = 4 if smoke else study["ref_steps"]
    flops = mean_flops_per_step(ref, train, {}, n=1) * steps
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"flops": flops, "ref": study["ref"], "ref_steps": steps}))
    os.replace(tmp, path)
    return flops


# ------------------------------------------------------------------------------------------------
# final scoring


def k_grid_of(model) -> list[int]:
    kind = model._study_kind
    if kind == "db_ar":
        B = len(model.blocks)
        return [1, B, 2 * B]
    if kind == "looped_db":
        return [1, 2, 4, 8]
    if kind == "huginn":
        return [1, 2, 4, 8, 16]
    return []


@torch.no_grad()
def final_scores(model, val: TokenStream, smoke: bool) -> dict:
    # 48 windows at byte level; 4 with the 50257-way head (each chain call scores V logits per slot, and
    # the Rao-Blackwellised sample bridge makes ~9 calls per step: ~10 s each on one shared core)
    big_vocab = model.tok_emb.weight.shape[0] >= 1000
    x, y = val_windows(val, 8 if smoke else (4 if big_vocab else 48))
    kind = model._study_kind
    out = {"final": {str(k): v for k, v in val_nll(model, x, y, k_grid_of(model), draws=2).items()}}
    if kind in ("db_ar", "looped_db"):
        B = len(model.blocks)
        K = max(B, 2)
        model.eval()
        g = torch.Generator().manual_seed(2)
        out["bridges"] = {b: float(model.eval_nll(x, y, k_grid=[K], draws=2, generator=g, bridge=b)[K].mean())
                          for b in ("soft", "hard", "sample")}
        out["bridges_k"] = K
        # where does each block use the context? CE(sigma) with the real context vs another row's
        shuffled = x.roll(1, dims=0)
        n_sigma = 12 if big_vocab else 24
        out["ce_curve"] = {"real": model.measure_curve(x, y, seed=3, n_sigma=n_sigma),
                           "shuffled": model.measure_curve(shuffled, y, seed=3, n_sigma=n_sigma)}
        out["edges_final"] = list(model.edges)
        model.train()
    return out


# ------------------------------------------------------------------------------------------------
# generated text, scored by the study's gpt


@torch.no_grad()
def generation_scores(study_name: str, work: Path, names: list[str], smoke: bool, log) -> dict:
    study = STUDIES[study_name]
    torch.set_num_threads(1)
    train, val = data_streams(study["tokenizer"])
    tok = get_tokenizer(study["tokenizer"])

    def load(name):
        return load_run(study, name, work, vocab_of(study, train))

    n_samples, prompt_len, new = (8, 8, 8) if smoke else (100, 16, 48)
    x, _ = val_windows(val, n_samples, prompt_len + new)
    prompts = x[:, :prompt_len]
    ref = load(study["ref"])
    out = {}
    for name in names:
        model = load(name)
        kind = model._study_kind
        if kind == "gpt":
            Ks = [None]
        elif kind == "huginn":
            Ks = [model.mean_recurrence]
        else:
            Ks = [len(model.blocks), 2 * len(model.blocks)] if kind == "db_ar" else [4, 8]
        for K in Ks:
            for mode, temp in (("greedy", 0.0), ("sampled", 1.0)):
                kw = {} if K is None else {"num_iterations": K}
                if kind in ("db_ar", "looped_db"):
                    kw["bridge"] = model.cfg.diffusion.bridge
                t0 = time.perf_counter()
                tokens = generate(model, prompts, new, SamplingParams(temp), seed=5, **kw)
                gen_s = time.perf_counter() - t0
                cont = tokens[:, prompt_len:]
                logits = ref(tokens[:, :-1])[0]
                nll = torch.nn.functional.cross_entropy(logits[:, prompt_len - 1:].flatten(0, 1), cont.flatten())
                key = f"{name}|K={K}|{mode}"
                out[key] = {"gen_ppl": math.exp(float(nll)), "distinct": distinct_n(cont), "seconds": gen_s,
                            "samples": [tok.decode(tokens[i].tolist()) for i in range(3)]}
                log(f"{key}: gen ppl {out[key]['gen_ppl']:.1f} distinct-2 {out[key]['distinct']['2']:.2f}")
    return out


def distinct_n(tokens: torch.Tensor) -> dict:
    """Mean over samples of (distinct n-grams / n-grams), n = 1, 2, 3."""
    out = {}
    for n in (1, 2, 3):
        ratios = []
        for row in tokens.tolist():
            grams = [tuple(row[i:i + n]) for i in range(len(row) - n + 1)]
            ratios.append(len(set(grams)) / max(1, len(grams)))
        out[str(n)] = sum(ratios) / len(ratios)
    return out


# ------------------------------------------------------------------------------------------------
# driver: lanes of subprocesses, then the report


def run_one(study: str, name: str, smoke: bool) -> None:
    out_dir = RESULTS / (study + ("_smoke" if smoke else ""))
    work = work_dir(study, smoke)
    result = train_run(study, name, work, smoke, log=lambda s: print(s, flush=True))
    tmp = out_dir / f"{name}.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out_dir / f"{name}.json")


def rescore(study_name: str, names: list[str]) -> None:
    """Recompute the final scores of finished runs from their checkpoints (after a scoring change)."""
    study = STUDIES[study_name]
    torch.set_num_threads(1)
    train, val = data_streams(study["tokenizer"])
    for name in names:
        path = RESULTS / study_name / f"{name}.json"
        result = json.loads(path.read_text())
        model = load_run(study, name, work_dir(study_name, False), vocab_of(study, train))
        result.update(final_scores(model, val, smoke=False))
        path.write_text(json.dumps(result, indent=1))
        print(f"rescored {study_name}/{name}")


def work_dir(study: str, smoke: bool) -> Path:
    path = ROOT / "bench" / "work" / (study + ("_smoke" if smoke else ""))
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_study(study: str, lanes: int, smoke: bool, only: list[str] | None) -> None:
    out_dir = RESULTS / (study + ("_smoke" if smoke else ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [n for n in STUDIES[study]["runs"] if not only or n in only]
    todo = [n for n in names if not (out_dir / f"{n}.json").exists()]
    budget_flops(study, data_streams(STUDIES[study]["tokenizer"])[0], work_dir(study, smoke), smoke)
    running: list[tuple[str, subprocess.Popen]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    while todo or running:
        while todo and len(running) < lanes:
            name = todo.pop(0)
            cmd = [sys.executable, __file__, "_one", study, name] + (["--smoke"] if smoke else [])
            log_file = open(out_dir / f"{name}.log", "w")
            running.append((name, subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)))
            print(f"started {name}", flush=True)
        time.sleep(2)
        for name, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, proc))
                print(f"finished {name}: exit {proc.returncode}", flush=True)
    if study == "main":
        gen_path = out_dir / "generation.json"
        if not gen_path.exists():
            scores = generation_scores(study, work_dir(study, smoke), names, smoke, log=print)
            gen_path.write_text(json.dumps(scores, indent=1))
    quality_report.report(out_dir, study)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", choices=["main", "ablate", "report", "rescore", "_one"])
    p.add_argument("rest", nargs="*")
    p.add_argument("--lanes", type=int, default=2, help="runs at a time (one thread each)")
    p.add_argument("--smoke", action="store_true", help="a few steps of everything")
    p.add_argument("--only", nargs="*", help="only these runs")
    args = p.parse_args()
    if args.study == "_one":
        run_one(args.rest[0], args.rest[1], args.smoke)
    elif args.study == "rescore":  # rescore STUDY RUN...
        rescore(args.rest[0], args.rest[1:])
    elif args.study == "report":
        for study in STUDIES:
            out_dir = RESULTS / study
            if out_dir.exists():
                quality_report.report(out_dir, study)
    else:
        run_study(args.study, args.lanes, args.smoke, args.only)


if __name__ == "__main__":
    main()
