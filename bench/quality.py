"""The quality study (docs/results.md; its one driver): DiffusionBlocks LMs against end-to-end and looped
baselines at equal training FLOPs, three seeds, scored with the unbiased ppl@k estimator.

    python bench/quality.py run powered                 # the main rows, 3 seeds, 2 lanes (~3 h on 2 cores)
    python bench/quality.py run ablations --seeds 0,1   # one change each against db_ar_b2, some seeds
    python bench/quality.py run powered --only gpt,huginn
    python bench/quality.py run scorer                  # the paper's protocol: a larger, longer-trained gpt,
    python bench/quality.py generate --seeds 0,1,2      # then generated text scored by it, and MAUVE
                                                        # (pip install -e ".[bench]" for mauve-text)
    python bench/quality.py temperatures --seeds 0      # the same, plain sampling at T = 0.7, 0.85, 1
    python bench/quality.py rebuild powered --only gpt  # re-train a checkpoint this machine lost (JSON kept apart)
    python bench/quality.py decode powered              # re-score finished checkpoints with other
                                                        # last_call / bridge settings (no training)
    python bench/quality.py parity                      # FLOPs to parity: quality/parity.json
    python bench/quality.py table [powered ...]         # the headline tables, from the JSON already written
    python bench/quality.py run powered --smoke         # a few steps of everything: checks the script

Protocol (every run): the King James Bible embedded in the package, byte tokenizer (V = 257), split by
document (3 held-out books); 4 layers of d 128 (4 heads), seq 128, batch 16, fp32; `BlockwiseAdamW`, lr 3e-3
with a linear warm-up over 2.5% of the run's steps and a cosine to 3e-4, wd 0.1, clip 1.0; the batches of
`TokenStream.get_batch(16, seed, step)`; one step is `looped_lm.training.train_step` with a `TorchRunner`.
Seeds set the init, the data order, the blocks and the noise. One torch thread per process.

Equal training FLOPs: a run takes as many steps as fit the budget (BUDGET_GPT_STEPS steps of the 4-layer
gpt), each step charged its model kind's cost-model FLOPs (`Kind.step_flops`: matmul FLOPs, attention over
the pairs a causal mask lets through; the first shapes also counted by FlopCounterMode on the real step and
recorded); CE(sigma) curve refreshes count their forward FLOPs. Training CPU seconds are a secondary axis.

Metric: held-out next-token NLL on fixed windows of the validation books: gpt exact; huginn exact after K
iterations; DiffusionBlocks ppl@0 (one call at sigma_top) and ppl@k (looped_lm/diffusion/estimator.py) with a
standard error. Probes every tenth of a run; final scoring on more windows and draws. Outputs:
bench/results/quality/<study>/<run>__s<seed>.json (with the run's full config); checkpoints in
bench/work/quality/ (not committed). Each study's report.md and plots were written from that JSON by
bench/quality_report.py (commit 34386d9); FLOPs to parity by bench/parity.py (commit e2ca177), now `parity`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from looped_lm.config import config_from_dict
from looped_lm.data.bin_dataset import TokenStream
from looped_lm.data.prepare import ensure_prepared
from looped_lm.engine.generate import generate
from looped_lm.kinds import get_kind
from looped_lm.models import build_model
from looped_lm.models.contract import Iterative
from looped_lm.models.huginn import sample_recurrence
from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups
from looped_lm.sampling import GREEDY, PLAIN, SamplingParams
from looped_lm.settings import ExitRule, ScoreSettings, resolve_settings
from looped_lm.training import TorchRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package: the benches' one equal-FLOPs loop)

ROOT = common.ROOT
RESULTS = ROOT / "bench" / "results" / "quality"
WORK = ROOT / "bench" / "work" / "quality"
BATCH, SEQ, VOCAB = 16, 128, 257
LR, MIN_LR, WARMUP_SHARE, WD = 3e-3, 3e-4, 0.025, 0.1
BUDGET_GPT_STEPS = 2000
N_PROBES = 10
PROBE_WINDOWS, FINAL_WINDOWS = 16, 32
# The estimator's cost grows with K x draws: a run's final scoring is held to ~2 CPU-minutes by scoring
# the expensive settings on fewer windows. val_windows(val, n) for n dividing 32 is a subset of the
# 32 final windows (every 32/n-th), and every score keeps its per-window nll, so shared windows compare.
DB_WINDOWS = {2: 32, 4: 16}  # db_ar: K in {0, 1, B, 2B} at 16 draws, by B
K4B_WINDOWS = 2  # db_ar: K in {0, B, 2B} at 16 draws and K = 4B at 64 on these
LOOPED_WINDOWS, LOOPED_KS = 2, (1, 2, 4, 8, 16, 32)  # the looped models' K grid: huginn and looped_db alike
LOOPED_DB_WINDOWS = 16  # looped_db's final K in {0, 1, 2, 4}
CURVE_SIGMAS = 24
UNRESOLVED = 0.25  # nats: an estimate whose standard error is this large ranks nothing

SHAPE = {"d_model": 128, "n_heads": 4, "seq_len": SEQ}
LOOPED_SHAPE = {"n_prelude": 1, "n_layers": 2, "n_coda": 1}  # 4 layers, like the others
# The project's DiffusionBlocks layout, spelled out so a later change of the config defaults does not
# change what a run measures (the JSON keeps the whole config).
PROJECT = {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False, "bridge": "sample",
           "block_sampling": "loss_share", "last_call": "edge"}


@dataclass(frozen=True)
class Run:
    model: dict
    diffusion: dict = field(default_factory=dict)
    budget: float = 1.0  # share of the study's FLOP budget
    steps: int | str | None = None  # a fixed step count, or "updates:<run>:<block>" of a powered run's seed
    seeds: tuple = (0, 1, 2)
    what: str = ""
    score: str = "full"  # "short": no K = 4B (the 64-draw estimate is the expensive part)


def db_ar(B: int, what: str = "", seeds=(0, 1, 2), budget: float = 1.0, score: str = "full", **diffusion) -> Run:
    return Run({"kind": "db_ar", "n_layers": 4}, {"num_blocks": B, **PROJECT, **diffusion}, budget, None, seeds, what,
               score)


def tax(what: str, **diffusion) -> Run:
    """A B = 2 ablation of the denoising tax: two seeds, no K = 4B."""
    return db_ar(2, what, seeds=(0, 1), score="short", **diffusion)


def chains(what: str, **diffusion) -> Run:
    """A B = 2 ablation of the chains: two seeds, the whole K grid."""
    return db_ar(2, what, seeds=(0, 1), **diffusion)


def looped_db(what: str = "", seeds=(0, 1, 2), budget: float = 1.0, **diffusion) -> Run:
    return Run({"kind": "looped_db", **LOOPED_SHAPE}, {"num_blocks": 1, **PROJECT, **diffusion}, budget, None,
               seeds, what)


HUGINN = {"kind": "huginn", **LOOPED_SHAPE, "mean_recurrence": 8, "backprop_depth": 4}

STUDIES: dict[str, dict[str, Run]] = {
    # section 1: the main rows
    "powered": {
        "gpt": Run({"kind": "gpt", "n_layers": 4}, what="end-to-end, 4 layers"),
        "gpt_depth2": Run({"kind": "gpt", "n_layers": 2}, what="end-to-end, 2 layers (one B = 2 block's depth)"),
        "db_ar_b2": db_ar(2, "4 layers in B = 2 blocks, the project's layout"),
        "db_ar_b4": db_ar(4, "4 layers in B = 4 blocks, the project's layout"),
        "huginn": Run(HUGINN, what="prelude 1 + core 2 (r ~ mean 8, backprop through 4) + coda 1"),
        "looped_db": looped_db("prelude 1 + one weight-tied two-stream core 2 + coda 1"),
        # the depth-matched gpt trained for exactly as many steps as db_ar_b2's block 0 got updates (same seed)
        "gpt_depth2_updates": Run({"kind": "gpt", "n_layers": 2}, steps="updates:db_ar_b2:0",
                                  what="end-to-end, 2 layers, as many steps as db_ar_b2's block 0 had updates"),
        "looped_db_quarter": replace(looped_db("looped_db at 1/4 of the budget", budget=0.25), score="short"),
        # the copying regime's fix for looped_db (depth_synthetic plan item 15): its one block's sigma law moved up
        # (p_mean 1.0: 97 % of the draws above sigma 0.3, where the context decides the token), nothing else changed
        "looped_db_sigma_up": looped_db("looped_db with its sigma law moved up (p_mean 1.0)", p_mean=1.0),
    },
    # section 5: the scorer of generated text, larger and longer-trained than every studied model
    "scorer": {
        "gpt_big": Run({"kind": "gpt", "n_layers": 6, "d_model": 192, "n_heads": 6}, steps=3000, seeds=(0,),
                       what="end-to-end, 6 layers of d 192, 3000 steps (about 5x the study's budget in FLOPs)"),
    },
    # sections 2 and 3: one change each against db_ar_b2 of "powered" (same seeds)
    "ablations": {
        "target_fraction_0.25": tax("a quarter of the slots trained per sequence (cheaper steps: more of them)",
                                    target_fraction=0.25),
        # the one change that met section 2's targets on seeds 0 and 1: a third seed
        "clean_lm_0.5": db_ar(2, "+ the clean stream's own next-token CE, weight 0.5", seeds=(0, 1, 2), score="short",
                              clean_lm_weight=0.5),
        "b4_clean_lm_0.5": db_ar(4, "B = 4 + the clean stream's own next-token CE, weight 0.5", seeds=(0, 1),
                                 score="short", clean_lm_weight=0.5),
        "cosine_head": tax("cosine head, the likelihood folded into its product", head="cosine"),
        "posterior_detached": tax("the noisy input's posterior embedding without gradient", posterior_input="detached"),
        "noise_input": tax("noisy input: z's posterior embedding alone (no previous-token embedding)",
                           noisy_input="noise"),
        "sigma_high": tax("sigma law concentrated high in each block: partition uniform (edge 0.41), p_mean 1.0",
                          partition="uniform", p_mean=1.0),
        "clean_lm_sigma_high": tax("clean_lm_0.5 and sigma_high together", clean_lm_weight=0.5, partition="uniform",
                                   p_mean=1.0),
        "loss_edm": chains("loss weight edm (more weight at low sigma)", loss_weight="edm"),
        "uniform_blocks": chains("block_sampling uniform (block 1 gets half the updates)", block_sampling="uniform"),
        "split_3_1": chains("layers_per_block [3, 1]: the high-noise block 3 layers deep, the low-noise one 1",
                            layers_per_block=[3, 1]),
        "overlap_0.3": chains("each block trains on its interval widened by 0.3 of its ln-width (was 0.1)",
                              overlap=0.3),
    },
}


def run_config(spec: Run, seed: int):
    raw = {"model": {**SHAPE, **spec.model}, "data": {"tokenizer": "byte"}, "train": {"seed": seed}}
    if spec.diffusion:
        raw["diffusion"] = spec.diffusion
    return config_from_dict(raw)


def data_streams():
    path = ensure_prepared("bible", str(ROOT / "data_cache"), "byte", 0.05, 0, progress=False)
    return TokenStream(f"{path}/train.bin", SEQ), TokenStream(f"{path}/val.bin", SEQ)


def val_windows(val: TokenStream, n: int, offset: float = 0.0, seq: int = SEQ):
    """n disjoint windows spread evenly over val.bin (shifted by `offset` of a spacing): x, y (n, seq)."""
    tokens = torch.from_numpy(val.tokens[:].astype("int64"))
    span = (len(tokens) - seq - 2) / n
    rows = torch.stack([tokens[int(span * (i + offset)):int(span * (i + offset)) + seq + 1] for i in range(n)])
    return rows[:, :-1], rows[:, 1:]


# ------------------------------------------------------------------------------------------------
# FLOPs per step: the cost model (Kind.step_flops), beside FlopCounterMode on the real step


def step_key(model, cfg, step: int, seed: int):
    """What decides a step's cost: the DB block trained, huginn's recurrence r, or nothing (gpt)."""
    if cfg.model.kind == "huginn":
        return sample_recurrence(cfg.model.mean_recurrence, torch.Generator().manual_seed(seed * 1_000_003 + step))
    if cfg.model.kind in ("db_ar", "looped_db"):
        return model.choose_block(step, seed)
    return 0


class FlopBook:
    """FLOPs per step shape (the DB block / huginn's r), from the cost model; the first four shapes are also
    counted by FlopCounterMode on the real step (math attention: every pair) and recorded beside it
    (tests/test_cost_model.py checks the model against the counter)."""

    def __init__(self, model, cfg, x, y):
        self.model, self.cfg, self.x, self.y = model, cfg, x, y
        self.cache: dict = {}
        self.checks: dict = {}

    def __call__(self, key) -> float:
        if key not in self.cache:
            self.cache[key] = get_kind(self.cfg.model.kind).step_flops(self.cfg, VOCAB, BATCH, key)
            if len(self.checks) < 4:
                step = next(s for s in range(10_000) if step_key(self.model, self.cfg, s, self.cfg.train.seed) == key)
                rng = torch.get_rng_state()  # the check must not move the training's random stream

                def fwd_bwd():
                    self.model.training_loss(self.x, self.y, step, self.cfg.train.seed)[0].backward()

                measured = common.counted(fwd_bwd)
                self.model.zero_grad(set_to_none=True)
                torch.set_rng_state(rng)
                self.checks[str(key)] = {"counter_dense": measured, "cost_model_visible": self.cache[key]}
        return self.cache[key]


def budget_flops() -> float:
    return get_kind("gpt").step_flops(run_config(STUDIES["powered"]["gpt"], 0), VOCAB, BATCH) * BUDGET_GPT_STEPS


def plan_steps(model, cfg, spec: Run, book: FlopBook, budget: float, curve_cost: float) -> int:
    """Steps that fit the budget (each step's own FLOPs, plus the CE(sigma) curves every curve_every steps),
    a fixed count, or "updates:<run>:<block>": that powered run's updates of the block at the same seed."""
    if isinstance(spec.steps, str):
        _, run, block = spec.steps.split(":")
        return json.loads(run_path("powered", run, cfg.train.seed, False).read_text())["block_updates"][block]
    if spec.steps is not None:
        return spec.steps
    return common.plan_steps(lambda step: book(step_key(model, cfg, step, cfg.train.seed)), budget * spec.budget,
                             getattr(cfg.diffusion, "curve_every", 0), curve_cost)


# ------------------------------------------------------------------------------------------------
# scoring


def kind_of(model) -> str:
    return model.cfg.model.kind if hasattr(model, "cfg") and hasattr(model.cfg, "model") else "gpt"


def k_plan(model, final: bool) -> dict[int, int]:
    """{K: draws} scored besides ppl@0. The estimator converges within its standard error by 16 draws
    for K <= 2B; at K = 4B it still drifts with the draw count, so 64 there (final_scores)."""
    kind = kind_of(model)
    if kind == "db_ar":
        B = len(model.blocks)
        return {1: 16, B: 16, 2 * B: 16} if final else {B: 4}
    if kind == "looped_db":  # K >= 8 on the LOOPED_WINDOWS only: the estimator's cost grows with K
        return {1: 16, 2: 16, 4: 16} if final else {4: 4}
    if kind == "huginn":
        return {k: 1 for k in LOOPED_KS} if final else {model.mean_recurrence: 1}
    return {}


def summarise(scores, n: int) -> dict:
    """nll, its estimator standard error (draws; 0 where p is exact), and the windows' own spread:
    per_window (mean nll of each window, so runs can be compared on shared windows) and window_se."""
    nll = float(scores.nll.double().mean())
    se = float(scores.nll_var.sum().sqrt()) / n if scores.nll_var is not None else 0.0
    rows = scores.nll.double().mean(1)
    window_se = float(rows.std() / math.sqrt(len(rows))) if len(rows) > 1 else 0.0
    return {"nll": nll, "se": se, "ppl": math.exp(nll), "window_se": window_se, "per_window": rows.tolist()}


@torch.no_grad()
def score_model(model, x, y, plan: dict[int, int], seed: int, settings: dict | None = None) -> dict:
    """{label: {nll, se, ppl, draws}}: "exact" (gpt), K (huginn), "0" and K (DiffusionBlocks)."""
    model.eval()
    n, kind, out = y.numel(), kind_of(model), {}
    if kind == "gpt":
        out["exact"] = summarise(model.score(x, y, ScoreSettings())["exact"], n)
    elif kind == "huginn":
        scores = model.score(x, y, ScoreSettings(k_grid=tuple(plan)), torch.Generator().manual_seed(seed))
        out = {str(k): summarise(v, n) for k, v in scores.items()}
    else:
        by_draws: dict[int, list[int]] = {}
        for k, d in plan.items():
            by_draws.setdefault(d, []).append(k)
        by_draws.setdefault(16, [])  # ppl@0 with 16 draws at least
        for d, ks in sorted(by_draws.items()):
            s = ScoreSettings(k_grid=tuple(ks), draws=d, **(settings or {}))
            for k, v in model.score(x, y, s, torch.Generator().manual_seed(seed + d)).items():
                if not (k == 0 and "0" in out and out["0"]["draws"] >= d):
                    out[str(k)] = {**summarise(v, n), "draws": d}
    model.train()
    return out


def probe_nll(model, x, y, seed: int) -> dict:
    plan = k_plan(model, final=False)
    if kind_of(model) not in ("db_ar", "looped_db"):
        return {k: v["nll"] for k, v in score_model(model, x, y, plan, seed).items()}
    model.eval()
    with torch.no_grad():
        scores = model.score(x, y, ScoreSettings(k_grid=tuple(plan), draws=4), torch.Generator().manual_seed(seed))
    model.train()
    return {str(k): float(v.nll.mean()) for k, v in scores.items()}


@torch.no_grad()
def ce_curves(model, x, y) -> dict:
    """CE(sigma) with the real context and with another window's (how much each sigma uses context)."""
    model.eval()
    obj = model.objective
    out = {"real": obj.measure_curve(x, y, seed=3, n_sigma=CURVE_SIGMAS),
           "shuffled": obj.measure_curve(x.roll(1, dims=0), y, seed=3, n_sigma=CURVE_SIGMAS)}
    model.train()
    return out


@torch.no_grad()
def kv_bytes(model, ks=(1, 2, 4, 8, 16, 32)) -> dict:
    """Decode-cache bytes per token of history, at each K (huginn keeps a cache per iteration)."""
    out = {}
    for K in ks:
        cache = model.new_cache(1, 8)
        model.reserve(cache, K)
        out[str(K)] = model.kv_bytes_per_token(cache)
    return out


# ------------------------------------------------------------------------------------------------
# one run


def run_path(study: str, name: str, seed: int, smoke: bool, rebuilt: bool = False) -> Path:
    """A run's JSON; `rebuilt`: the JSON of a re-training that only restores a checkpoint this machine lost
    (results/<study>_rebuilt/), kept apart so the study's own JSON is never overwritten."""
    return RESULTS / (study + ("_rebuilt" if rebuilt else "") + ("_smoke" if smoke else "")) / f"{name}__s{seed}.json"


def decode_path(study: str, name: str, seed: int, smoke: bool) -> Path:
    path = run_path(study, name, seed, smoke)
    return path.with_name(path.name.replace(".json", ".decode.json"))


def work_dir(study: str, smoke: bool) -> Path:
    path = WORK / (study + ("_smoke" if smoke else ""))
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(spec: Run, seed: int):
    cfg = run_config(spec, seed)
    torch.manual_seed(seed)
    return build_model(cfg, VOCAB), cfg


def load_trained(study: str, name: str, seed: int, smoke: bool = False, **diffusion_changes):
    """A finished run's model (eval mode), optionally with decode-time settings changed (last_call...)."""
    spec = STUDIES[study][name]
    if diffusion_changes:
        spec = replace(spec, diffusion={**spec.diffusion, **diffusion_changes})
    model, cfg = build(spec, seed)
    saved = torch.load(work_dir(study, smoke) / f"{name}__s{seed}.pt", weights_only=False)
    model.load_state_dict(saved["model"])
    if saved.get("curve") is not None:
        model.apply_curve(saved["curve"])
    return model.eval(), saved


def train_run(study: str, name: str, seed: int, smoke: bool, log) -> dict:
    spec = STUDIES[study][name]
    torch.set_num_threads(1)
    train, val = data_streams()
    model, cfg = build(spec, seed)
    n_params = sum(p.numel() for p in model.parameters())
    x0, y0 = train.get_batch(BATCH, seed, 0, 0, 0)
    book = FlopBook(model, cfg, x0, y0)
    budget = budget_flops() * (0.01 if smoke else 1.0)
    uses_curve = model.uses_curve() if hasattr(model, "uses_curve") else False
    curve_cost = 0.0
    if uses_curve:  # one measurement's forward FLOPs (its own generator: the random stream is untouched)
        model.eval()
        curve_cost = common.counted(lambda: model.measure_curve(x0, y0, seed=0))
        model.train()
    steps = plan_steps(model, cfg, spec, book, budget, curve_cost) if not (smoke and spec.steps) else 20
    warmup = max(1, round(WARMUP_SHARE * steps))
    probe_at = sorted({max(1, round(steps * (i + 1) / N_PROBES)) for i in range(N_PROBES)})
    xp, yp = val_windows(val, 4 if smoke else PROBE_WINDOWS, offset=0.5)
    opt = BlockwiseAdamW(param_groups(model, WD), lr=LR, betas=(0.9, 0.95))
    runner = TorchRunner(model, opt, grad_clip=1.0, seed=seed)
    ckpt = work_dir(study, smoke) / f"{name}__s{seed}.pt"
    state = {**common.fresh_state(), "probes": []}
    torch.manual_seed(seed + 7919)  # the training's own stream (noise, slots, sigma)
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        if saved.get("curve") is not None:
            model.apply_curve(saved["curve"])
        torch.set_rng_state(saved["rng"])
        log(f"{name} s{seed}: resumed at step {state['step']}")

    def checkpoint():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state, "rng": torch.get_rng_state(),
                    "curve": getattr(getattr(model, "objective", None), "curve", None)}, tmp)
        os.replace(tmp, ckpt)

    def probe(state, result):
        if state["step"] in probe_at:
            nll = probe_nll(model, xp, yp, seed)
            state["probes"].append({"step": state["step"], "flops": state["flops"], "cpu_s": state["cpu_s"],
                                    "wall_s": state["wall_s"], "tokens": state["step"] * BATCH * SEQ,
                                    "block_updates": dict(state["block_updates"]), "train_loss": float(result.loss),
                                    "val": nll})
            checkpoint()
            log(f"{name} s{seed}: step {state['step']}/{steps} val {nll} ({state['cpu_s']:.0f} cpu-s)")

    common.train(model, opt, runner, steps, seed, batch_at=lambda step: train.get_batch(BATCH, seed, step, 0, 0),
                 cost_at=lambda step: book(step_key(model, cfg, step, seed)),
                 lr_at=lambda step: cosine_with_warmup(step, warmup, steps, LR, MIN_LR),
                 curve_every=cfg.diffusion.curve_every if uses_curve else 0,
                 curve_batch_at=lambda step: train.get_batch(BATCH, seed + 1_000, step, 0, 0),
                 state=state, after_step=probe, name=name)
    checkpoint()
    out = {"run": name, "study": study, "seed": seed, "what": spec.what, "config": cfg.to_dict(),
           "spec": asdict(spec), "commit": common.git_commit(), "params": n_params, "steps": steps, "warmup": warmup,
           "flops_budget": budget * spec.budget, "flop_checks": book.checks,
           "flops_per_step": {str(k): v for k, v in book.cache.items()}, **state}
    log(f"{name} s{seed}: final scoring")
    t0 = time.process_time()
    out.update(final_scores(model, val, seed, smoke, spec.score))
    out["score_cpu_s"] = time.process_time() - t0
    return out


def final_scores(model, val, seed: int, smoke: bool, score: str = "full") -> dict:
    kind = kind_of(model)
    windows = {"db_ar": DB_WINDOWS.get(len(getattr(model, "blocks", [])), 16), "looped_db": LOOPED_DB_WINDOWS}
    x, y = val_windows(val, 4 if smoke else windows.get(kind, FINAL_WINDOWS))
    plan = {k: (min(d, 2) if smoke else d) for k, d in k_plan(model, final=True).items()}
    out = {"final": score_model(model, x, y, plan, seed=100 + seed), "final_tokens": y.numel(),
           "final_windows": y.shape[0]}
    if kind == "db_ar" and score == "full":  # the chain's trend K = B .. 4B on the same (fewer) windows
        B = len(model.blocks)
        xk, yk = val_windows(val, 2 if smoke else K4B_WINDOWS)
        plan4 = {k: (2 if smoke else d) for k, d in {B: 16, 2 * B: 16, 4 * B: 64}.items()}
        out["k4b"] = score_model(model, xk, yk, plan4, seed=400 + seed)
        out["k4b_windows"] = yk.shape[0]
    if kind in ("db_ar", "looped_db"):
        out["ce_curve"] = ce_curves(model, x, y)
        out["edges"] = list(model.edges)
    if kind in ("huginn", "looped_db"):
        out["kv_bytes_per_token"] = kv_bytes(model)
        # PPL vs K on fewer windows (the same for both kinds): 16 draws per K up to K = 32
        xl, yl = val_windows(val, 2 if smoke else LOOPED_WINDOWS)
        ks = LOOPED_KS if score == "full" else (1, 2, 4, 8)
        plan = {k: (2 if smoke else 16) for k in ks} if kind == "looped_db" else {k: 1 for k in ks}
        out["looped"] = score_model(model, xl, yl, plan, seed=300 + seed)
        out["looped_tokens"] = yl.numel()
    if kind == "looped_db" and score == "full":  # adaptive exit: mean iterations and ppl under a KL rule, K up to 32
        out["adaptive_exit"] = {}
        for eps in (1e-2, 1e-3):
            s = ScoreSettings(k_grid=(32,), draws=2 if smoke else 4, exit_rule=ExitRule(kl_threshold=eps))
            scores = model.score(xl, yl, s, torch.Generator().manual_seed(200 + seed))
            out["adaptive_exit"][str(eps)] = {**summarise(scores[32], yl.numel()), "mean_iterations": s.stats[32]}
    return out


# ------------------------------------------------------------------------------------------------
# decode-time variants of finished runs: no training


DECODE_VARIANTS = {  # name -> (diffusion changes of the loaded model, ScoreSettings changes, {K/B: draws})
    "sigma_min": ({"last_call": "sigma_min"}, {}, {1: 16, 2: 16}),  # K = 1 does not depend on it
    "hard": ({}, {"bridge": "hard"}, {1: 16}),
    "soft": ({}, {"bridge": "soft"}, {1: 16}),
    # section 3: the soft bridge's K = B chain was nominally below 0.95x ppl@0 at B = 4 within an se of
    # 0.04 nats at 16 draws; 64 draws settle it, with and without the read-back last call
    "soft_64": ({}, {"bridge": "soft"}, {1: 64, 2: 64}),
    "soft_sigma_min_64": ({"last_call": "sigma_min"}, {"bridge": "soft"}, {1: 64, 2: 64}),
}
DECODE_WINDOWS = 16  # every other final window: ~1 CPU-minute a checkpoint


def decode_run(study: str, name: str, seed: int, smoke: bool, log) -> dict:
    torch.set_num_threads(1)
    x, y = val_windows(data_streams()[1], 4 if smoke else DECODE_WINDOWS)
    path = decode_path(study, name, seed, smoke)
    out = json.loads(path.read_text()) if path.exists() else {"run": name, "study": study, "seed": seed, "variants": {}}
    out["commit"] = common.git_commit()
    for variant, (changes, settings, per_b) in DECODE_VARIANTS.items():
        if variant in out["variants"]:  # a variant added later runs alone; the others are kept
            continue
        model, _ = load_trained(study, name, seed, smoke, **changes)
        if kind_of(model) != "db_ar":
            return out
        plan = {m * len(model.blocks): (min(d, 2) if smoke else d) for m, d in per_b.items()}
        out["variants"][variant] = {"changes": {**changes, **settings}, "commit": out["commit"],
                                    "final": score_model(model, x, y, plan, 100 + seed, settings)}
        log(f"{name} s{seed} {variant}: {out['variants'][variant]['final']}")
    return out


# ------------------------------------------------------------------------------------------------
# the paper's protocol: generated text scored by a larger gpt (generative PPL, distinct-n, MAUVE)

GEN_PROMPT, GEN_NEW, GEN_SAMPLES = 32, 96, 400
TEMPERATURES = (0.7, 0.85, 1.0)
SWEPT = ("gpt", "db_ar_b2", "db_ar_b4", "looped_db_sigma_up")  # the runs whose seed-0 checkpoints this machine has


def decodings(model) -> list[tuple[str, dict]]:
    """(label, resolve_settings arguments) of every decoding compared: the paper's (AR top-p 0.95, DB
    greedy with 4 steps) and the models' own distributions (temperature 1, K = B and 2B)."""
    kind = kind_of(model)
    top_p = SamplingParams(1.0, top_p=0.95)
    if kind in ("gpt", "huginn"):
        return [("greedy", {"sampling": GREEDY}), ("top-p 0.95", {"sampling": top_p}), ("sampled", {"sampling": PLAIN})]
    B = len(model.blocks) if kind == "db_ar" else 4  # looped_db: K = 4 and 8
    out = [("greedy, K = 4", {"sampling": GREEDY, "num_iterations": 4})]
    out += [(f"sampled, K = {K}", {"sampling": PLAIN, "num_iterations": K}) for K in sorted({B, 2 * B})]
    return out + [(f"top-p 0.95, K = {B}", {"sampling": top_p, "num_iterations": B})]


def temperature_decodings(model) -> list[tuple[str, dict]]:
    """Plain sampling at each of TEMPERATURES; db_ar at K = B, looped_db at K = 4 (as in `decodings`)."""
    kind = kind_of(model)
    K = len(model.blocks) if kind == "db_ar" else 4 if kind == "looped_db" else None
    return [(f"T = {t:g}" + (f", K = {K}" if K else ""),
             {"sampling": SamplingParams(t), **({"num_iterations": K} if K else {})}) for t in TEMPERATURES]


def distinct(texts: list[list]) -> float:
    """Distinct n-grams / n-grams over all samples together (n given by the tuples' length)."""
    grams = [g for t in texts for g in t]
    return len(set(grams)) / max(1, len(grams))


def text_stats(rows: list[list[int]]) -> dict:
    words = [bytes(b for b in r if b < 256).decode("utf-8", "replace").split() for r in rows]
    out = {f"word_distinct_{n}": distinct([[tuple(w[i:i + n]) for i in range(len(w) - n + 1)] for w in words])
           for n in (1, 2, 3)}
    out["byte_distinct_4"] = distinct([[tuple(r[i:i + 4]) for i in range(len(r) - 3)] for r in rows])
    # repetition within a sample: share of its 4-byte grams seen earlier in the same sample
    reps = [1 - len({tuple(r[i:i + 4]) for i in range(len(r) - 3)}) / max(1, len(r) - 3) for r in rows]
    out["self_repetition_4"] = statistics.fmean(reps)
    return out


@torch.no_grad()
def scorer_view(scorer, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row NLL (mean over the continuation) and the feature MAUVE compares: the scorer's last hidden
    state averaged over the continuation."""
    h = scorer.hidden(tokens[:, :-1])
    logits = scorer.logits(h)
    nll = F.cross_entropy(logits[:, start - 1:].flatten(0, 1).float(), tokens[:, start:].flatten(), reduction="none")
    return nll.view(tokens.shape[0], -1).mean(1), scorer.norm(h[:, start - 1:]).mean(1)


def generation_run(seed: int, smoke: bool, log, runs=("gpt", "huginn", "db_ar_b2", "db_ar_b4", "looped_db"),
                   decodings_of=decodings) -> dict:
    """The paper's protocol: `runs` of the powered study generate from held-out prompts with each of
    `decodings_of(model)`, scored by the larger gpt (generative PPL, MAUVE)."""
    try:
        import mauve
    except ImportError:
        raise SystemExit("error: generate needs mauve-text: pip install -e \".[bench]\"") from None

    torch.set_num_threads(1)
    _, val = data_streams()
    n = 8 if smoke else GEN_SAMPLES
    x, _ = val_windows(val, n, seq=GEN_PROMPT + GEN_NEW)
    human = torch.cat([x, val_windows(val, n, seq=GEN_PROMPT + GEN_NEW)[1][:, -1:]], dim=1)  # prompt + truth
    prompts = human[:, :GEN_PROMPT]
    scorer, _ = load_trained("scorer", "gpt_big", 0, smoke)
    out = {"seed": seed, "commit": common.git_commit(), "prompt_tokens": GEN_PROMPT, "new_tokens": GEN_NEW,
           "samples": n, "scorer": {"run": "scorer/gpt_big", "seed": 0}, "rows": {}}
    nll, p_feats = scorer_view(scorer, human, GEN_PROMPT)
    out["human"] = {"gen_ppl": math.exp(float(nll.mean())), **text_stats(human[:, GEN_PROMPT:].tolist())}
    for name in runs:
        model, _ = load_trained("powered", name, seed, smoke)
        limits = model.iteration_limits() if isinstance(model, Iterative) else None
        for label, kw in decodings_of(model):
            t0 = time.process_time()
            tokens = generate(model, prompts, GEN_NEW, resolve_settings(limits, **kw), seed=1000 + seed)
            seconds = time.process_time() - t0
            nll, q_feats = scorer_view(scorer, tokens, GEN_PROMPT)
            m = mauve.compute_mauve(p_features=p_feats.numpy(), q_features=q_feats.numpy(), device_id=-1,
                                    verbose=False, seed=25, num_buckets=max(2, n // 10))
            key = f"{name} | {label}"
            out["rows"][key] = {"run": name, "decoding": label, "gen_ppl": math.exp(float(nll.mean())),
                                "mauve": float(m.mauve), **text_stats(tokens[:, GEN_PROMPT:].tolist()),
                                "cpu_s": seconds, "examples": [bytes(b for b in r if b < 256).decode("utf-8", "replace")
                                                               for r in tokens[:3].tolist()]}
            log(f"{key}: gen ppl {out['rows'][key]['gen_ppl']:.2f} mauve {m.mauve:.3f}")
    return out


# ------------------------------------------------------------------------------------------------
# FLOPs to parity (docs/results.md, first table): how much of the budget gpt needs to reach each DiffusionBlocks
# run's final probe NLL, read off gpt's probe curve of the same seed (probes sit mid-schedule, so the share is
# an upper bound, its inverse a lower bound on the compute DB needs); linear in log FLOPs between probes.

PARITY_RUNS = {"db_ar_b2": "0", "db_ar_b4": "0", "huginn": "8", "looped_db": "0"}


def flops_to_reach(points: list[tuple[float, float]], target: float) -> float | None:
    for (f0, v0), (f1, v1) in zip(points, points[1:]):
        if v0 >= target >= v1:
            w = (v0 - target) / (v0 - v1) if v0 != v1 else 0.0
            return math.exp(math.log(f0) + w * (math.log(f1) - math.log(f0)))
    return None  # gpt never reaches it (beyond the budget), or already at its first probe (below)


def parity() -> dict:
    out = {}
    for name, key in PARITY_RUNS.items():
        rows = []
        for seed in (0, 1, 2):
            db = json.loads((RESULTS / "powered" / f"{name}__s{seed}.json").read_text())
            gpt = json.loads((RESULTS / "powered" / f"gpt__s{seed}.json").read_text())
            target = db["probes"][-1]["val"][key]
            points = [(p["flops"], p["val"]["exact"]) for p in gpt["probes"] if "exact" in p["val"]]
            f = flops_to_reach(points, target)
            first = target >= points[0][1]  # gpt's first probe (a tenth of the budget) is already better
            rows.append({"seed": seed, "db_probe_nll": target, "gpt_flops_to_reach": f, "budget": db["flops"],
                         "fraction": points[0][0] / db["flops"] if first else (None if f is None else f / db["flops"]),
                         "bound": "at most (gpt's first probe already better)" if first else "interpolated"})
        fr = [r["fraction"] for r in rows if r["fraction"] is not None]
        out[name] = {"per_seed": rows, "fraction_mean": statistics.fmean(fr) if fr else None,
                     "compute_for_parity_at_least": 1 / max(fr) if fr else None}
        print(name, [None if r["fraction"] is None else round(r["fraction"], 3) for r in rows])
    (RESULTS / "parity.json").write_text(json.dumps(out, indent=1))
    return out


# ------------------------------------------------------------------------------------------------
# driver: lanes of subprocesses


def jobs_of(study: str, seeds: list[int] | None, only: list[str] | None, smoke: bool, mode: str) -> list:
    jobs = []
    for seed in sorted({s for r in STUDIES[study].values() for s in r.seeds} | set(seeds or [])):
        for name, spec in STUDIES[study].items():
            # --seeds replaces each run's own seeds (a study extended to more seeds); without it, the run's own
            if (only and name not in only) or seed not in (seeds or spec.seeds):
                continue
            if mode == "decode":
                path = decode_path(study, name, seed, smoke)
                done = json.loads(path.read_text())["variants"] if path.exists() else {}
                if spec.model["kind"] == "db_ar" and not set(DECODE_VARIANTS) <= set(done):
                    jobs.append((name, seed, path))
            elif mode == "rebuild":  # the study's JSON exists, its checkpoint does not
                path = run_path(study, name, seed, smoke, rebuilt=True)
                if not (work_dir(study, smoke) / f"{name}__s{seed}.pt").exists() or not path.exists():
                    jobs.append((name, seed, path))
            elif not run_path(study, name, seed, smoke).exists():
                jobs.append((name, seed, run_path(study, name, seed, smoke)))
    return jobs


def run_jobs(study: str, mode: str, seeds, only, lanes: int, smoke: bool) -> None:
    todo = jobs_of(study, seeds, only, smoke, mode)
    if not todo:
        print(f"{study}: nothing to {mode} (every requested run has its JSON)", flush=True)
    for _, _, path in todo:
        path.parent.mkdir(parents=True, exist_ok=True)
    failed = common.run_lanes([([__file__, "_one", mode, study, name, str(seed)] + (["--smoke"] if smoke else []),
                                path.with_suffix(".log")) for name, seed, path in todo], lanes)
    if failed:
        raise SystemExit(f"error: runs failed: {', '.join(failed)} (see their .log files)")


def one(mode: str, study: str, name: str, seed: int, smoke: bool) -> None:
    log = lambda s: print(s, flush=True)  # noqa: E731
    path = run_path(study, name, seed, smoke)
    if mode == "decode":
        common.write_json(decode_run(study, name, seed, smoke, log), decode_path(study, name, seed, smoke))
    elif mode == "rebuild":  # same seed, same code path: the study's final scores say whether it is the same model
        out = train_run(study, name, seed, smoke, log)
        if path.exists():
            out["study_final"] = json.loads(path.read_text()).get("final")
        common.write_json(out, run_path(study, name, seed, smoke, rebuilt=True))
    else:
        common.write_json(train_run(study, name, seed, smoke, log), path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["run", "rebuild", "decode", "generate", "temperatures", "parity", "table",
                                       "_one"])
    p.add_argument("rest", nargs="*")
    p.add_argument("--seeds", help="comma-separated seeds (default: each run's own)")
    p.add_argument("--only", help="comma-separated run names")
    p.add_argument("--lanes", type=int, default=2, help="runs at a time, one thread each")
    p.add_argument("--smoke", action="store_true", help="1%% of the budget, few windows and draws")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    only = args.only.split(",") if args.only else None
    log = lambda s: print(s, flush=True)  # noqa: E731
    gen_dir = RESULTS / ("generation" + ("_smoke" if args.smoke else ""))
    if args.command == "_one":
        mode, study, name, seed = args.rest
        one(mode, study, name, int(seed), args.smoke)
    elif args.command == "temperatures":  # the same protocol, plain sampling at each of TEMPERATURES
        for seed in seeds or [0]:
            path = gen_dir / (f"temperatures{'_' + '_'.join(only) if only else ''}__s{seed}.json")  # --only: a part
            if not path.exists():
                out = generation_run(seed, args.smoke, log, only or SWEPT, temperature_decodings)
                common.write_json({**out, "temperatures": list(TEMPERATURES)}, path)
    elif args.command == "generate":  # one process: the paper's protocol on the powered runs of each seed
        for seed in seeds or [0]:
            if not (gen_dir / f"generation__s{seed}.json").exists():
                common.write_json(generation_run(seed, args.smoke, log), gen_dir / f"generation__s{seed}.json")
    elif args.command == "parity":
        parity()
    elif args.command == "table":
        tables(args.rest)
    elif not args.rest or args.rest[0] not in STUDIES:
        p.error(f"name a study: {', '.join(STUDIES)}")
    else:
        run_jobs(args.rest[0], args.command if args.command in ("decode", "rebuild") else "train", seeds, only,
                 args.lanes, args.smoke)


# ------------------------------------------------------------------------------------------------
# table: the headline tables from the JSON (each study's full report.md and plots were written by
# bench/quality_report.py at commit 34386d9; they stay beside the JSON). PPL = exp(mean held-out NLL): a mean
# over a run's seeds ± their sd, and the estimator's standard error; ratios per seed on shared windows.


def load(study_dir: Path) -> dict[str, dict[int, dict]]:
    """{run: {seed: result}} of a study's training runs."""
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(study_dir.glob("*__s*.json")):
        if not path.name.endswith(".decode.json"):
            r = json.loads(path.read_text())
            runs.setdefault(r["run"], {})[r["seed"]] = r
    return runs


def primary_label(r: dict) -> str:
    """The label of a run's headline number: gpt exact, huginn at its mean recurrence, DB ppl@0."""
    m = r["config"]["model"]
    return {"gpt": "exact", "huginn": str(m.get("mean_recurrence"))}.get(m["kind"], "0")


def nll(r: dict, label: str | None = None, n_windows: int | None = None) -> float | None:
    """A run's final mean NLL at `label`; with n_windows, on that many of its windows (val_windows(val, n) is
    every (N/n)-th window of val_windows(val, N), and each score keeps its per-window NLL)."""
    e = r["final"].get(label or primary_label(r))
    if e is None or n_windows is None:
        return None if e is None else e["nll"]
    w = e.get("per_window", [])
    return statistics.fmean(w[::len(w) // n_windows]) if w and not len(w) % n_windows else None


def fmt_ppl(values: list, ses: list | None = None, digits: int = 2) -> str:
    """PPL of the mean NLL over seeds ± the sd over seeds of the PPL, and the mean se in PPL."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    m = math.exp(statistics.fmean(values))
    text = f"{m:.{digits}f}" + (f" ± {statistics.stdev([math.exp(v) for v in values]):.{digits}f}"
                                if len(values) > 1 else "")
    return text + (f" (se {m * statistics.fmean(ses):.{digits}f})" if ses and any(ses) else "")


def fmt_mean(values: list, digits: int = 3) -> str:
    if not values:
        return "-"
    return f"{statistics.fmean(values):.{digits}f}" + (f" ± {statistics.stdev(values):.{digits}f}"
                                                        if len(values) > 1 else "")


def ratio_per_seed(runs: dict, a: str, b: str) -> list[float]:
    """PPL(a) / PPL(b) for every seed both have, on the smaller of their window sets."""
    out = []
    for seed, ra in runs.get(a, {}).items():
        rb = runs.get(b, {}).get(seed)
        if rb is not None:
            n = min(ra.get("final_windows", 32), rb.get("final_windows", 32))
            na, nb = nll(ra, None, n), nll(rb, None, n)
            if na is not None and nb is not None:
                out.append(math.exp(na - nb))
    return out


def main_table(runs: dict, ref_runs: dict) -> list[str]:
    """Every run at equal training FLOPs, and its PPL over gpt's per seed (the study's own gpt, else ref_runs')."""
    lines = ["| run | what | seeds | params | steps | TFLOPs | train CPU-s | PPL at equal FLOPs | × gpt |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, by_seed in runs.items():
        rs = list(by_seed.values())
        label = primary_label(rs[0])
        metric = {"exact": "", "0": " (ppl@0)"}.get(label, f" (K = {label})")
        ses = [r["final"][label].get("se", 0.0) for r in rs]
        lines.append(f"| `{name}` | {rs[0]['what']}{metric} | {','.join(map(str, sorted(by_seed)))} | "
                     f"{rs[0]['params'] / 1e6:.2f} M | {statistics.fmean(r['steps'] for r in rs):.0f} | "
                     f"{statistics.fmean(r['flops'] for r in rs) / 1e12:.1f} | "
                     f"{statistics.fmean(r['cpu_s'] for r in rs):.0f} | {fmt_ppl([nll(r) for r in rs], ses)} | "
                     f"{fmt_mean(ratio_per_seed({**ref_runs, **runs}, name, 'gpt')) if name != 'gpt' else '1'} |")
    return lines


def generation_table(study_dir: Path) -> list[str]:
    """The paper's protocol (`generate`): generative PPL under the scorer gpt, MAUVE, word distinct-1 and the
    4-byte self-repetition per decoding, mean ± sd over the seeds of the generating models."""
    by_seed = {r["seed"]: r for r in (json.loads(p.read_text()) for p in sorted(study_dir.glob("generation__s*.json")))}
    if not by_seed:
        return []
    cols = ("gen_ppl", "mauve", "word_distinct_1", "self_repetition_4")
    lines = ["| model | decoding | seeds | gen PPL | MAUVE | distinct-1 | self-rep-4 |", "|---|---|---|---:|---:|---:|---:|",
             "| held-out text | - | | " + " | ".join(fmt_mean([r["human"][c] for r in by_seed.values()])
                                                     if c != "mauve" else "1" for c in cols) + " |"]
    for key in by_seed[min(by_seed)]["rows"]:
        rows = [r["rows"][key] for r in by_seed.values() if key in r["rows"]]
        lines.append(f"| `{rows[0]['run']}` | {rows[0]['decoding']} | {len(rows)} | "
                     + " | ".join(fmt_mean([row[c] for row in rows]) for c in cols) + " |")
    return lines


def tables(names: list[str] | None = None) -> None:
    dirs = [RESULTS / n for n in names] if names else [d for d in sorted(RESULTS.iterdir())
                                                       if d.is_dir() and not d.name.endswith("_rebuilt")]
    for d in dirs:
        runs = {} if d.name.startswith("generation") else load(d)
        lines = generation_table(d) if d.name.startswith("generation") else \
            main_table(runs, load(RESULTS / "powered")) if runs else []
        if lines:
            print(f"\n## {d.name} (full report: {d.relative_to(ROOT)}/report.md)\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
