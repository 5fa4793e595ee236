"""The copying study (docs/results.md "The depth regime"; its one driver): in-context copying (induction), a
regime where depth matters by construction (one attention layer cannot copy, two can).

    DEPTH_SYNTHETIC_DIR=round3 python bench/depth_synthetic.py jobs db_L4_B2_gain:0.01:5 huginn_wu20:0.003:1
                                                       # given row:lr:seed runs, in a round's folder
    DEPTH_SYNTHETIC_DIR=round3 python bench/depth_synthetic.py table   # the headline tables of a round
    python bench/depth_synthetic.py one gpt_L2 0.001 0 --smoke         # a few steps: checks the script

Data: each sequence of T = 64 tokens repeats one segment of 8..24 distinct symbols (out of 64; length and
symbols random per sequence). The first period is unpredictable (ln 64 = 4.16 nats); every later token follows
from its previous occurrence. Metric: NLL on the later periods' tokens ("copy NLL") of 512 fresh test sequences
(512 dev sequences pick every setting). Rows: gpt with 1, 2, 4 layers; db_ar (likelihood layout, the
product's defaults, `block_sampling: uniform` unless the row says network_gain) with 2 or 4 layers in B = 2
blocks, independent or `context: stacked`; huginn and looped_db (prelude 1 + core 2 + coda 1). db_ar is scored
by ppl@0 and by the K = B chain (the unbiased estimator, 4 draws); the looped kinds at the K their dev copy NLL
picks. Equal FLOPs by FlopCounterMode per block step (huginn: per drawn recurrence). Every run's JSON:
results/depth_synthetic/<round>/<row>__lr<lr>__s<seed>.json; its weights in bench/work/ (not committed).

Each round's report.md (and round 2's `confidence`, `chain-check` and `rescore` side studies, the sequential-
schedule rows and the `--commit` option) was written by this script at commit 85636b7; `table` prints the
headline tables from the JSON. Round 1's `run` mode (plan.md's SWEEP x LRS at seed 0, then SEEDS at each row's
dev-chosen lr, in that order; every run it made is a `jobs` row:lr:seed) is this script at commit daf8543.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from looped_lm.config import config_from_dict
from looped_lm.models import build_model
from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups
from looped_lm.settings import ScoreSettings
from looped_lm.training import TorchRunner, train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "depth_synthetic"
V, T, BATCH, D, HEADS = 64, 64, 32, 64, 4
SEG = (8, 25)  # segment lengths, [low, high)
BUDGET = float(os.environ.get("DEPTH_SYNTHETIC_BUDGET", 6e12))
DEV_SEED, TEST_SEED = 1, 2  # the held-out data: 512 dev sequences pick each row's learning rate, 512 test ones report
COPIES = 1.0  # a run "learns to copy" when its test copy NLL is below this (stated before the 5-seed runs)
DB = {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False, "bridge": "sample",
      "block_sampling": "uniform", "last_call": "sigma_min"}


def db(layers: int, **diffusion) -> tuple[dict, dict]:
    """A db_ar row: `layers` layers in B = 2 blocks, DB's settings otherwise."""
    return {"kind": "db_ar", "n_layers": layers}, {"num_blocks": 2, **diffusion}


LOW_FIRST = {"context": "stacked", "stack_order": "low_noise_first"}
RUNS = {
    "gpt_L1": ({"kind": "gpt", "n_layers": 1}, {}),
    "gpt_L2": ({"kind": "gpt", "n_layers": 2}, {}),
    "gpt_L4": ({"kind": "gpt", "n_layers": 4}, {}),
    "db_L2_B2_independent": db(2),
    "db_L2_B2_stacked": db(2, context="stacked"),
    "db_L2_B2_stacked_low_first": db(2, **LOW_FIRST),
    "db_L2_B2_stacked_low_first_clean_lm": db(2, **LOW_FIRST, clean_lm_weight=0.5),
    "db_L4_B2_independent": db(4),
    "db_L4_B2_stacked_low_first": db(4, **LOW_FIRST),
    # block 0 (whose call ppl@0 scores) gets the steps in proportion to what the network adds there
    "db_L4_B2_gain": db(4, block_sampling="network_gain"),
    # Does block 0 lose by spreading its capacity over noise levels where z already tells the token? Move the
    # sigma law up (ln-sigma mean +2 instead of -1.2, so the B = 2 edge sits at e^2 = 7.4 instead of 0.30):
    # block 0 then trains only where z says almost nothing, i.e. on the context prior that ppl@0 scores.
    "db_L4_B2_prior_block0": db(4, p_mean=2.0),
}
# Looped models (round 3, plan.md item 8): prelude 1 + weight-tied core 2 + coda 1, the text study's shape.
# huginn: recurrence r ~ Huginn's law with mean 8, backprop through the last 4 iterations (truncated BPTT);
# looped_db: one DiffusionBlocks block (the core), ONE forward pass per step. Each is scored at every K of
# LOOPED_KS and reported at the K its dev copy NLL picks.
LOOPED = {"n_prelude": 1, "n_layers": 2, "n_coda": 1}
RUNS["huginn"] = ({"kind": "huginn", **LOOPED, "mean_recurrence": 8, "backprop_depth": 4}, {})
RUNS["looped_db"] = ({"kind": "looped_db", **LOOPED}, {"num_blocks": 1})
LOOPED_KS = {"huginn": (1, 2, 4, 8, 16), "looped_db": (0, 1, 2, 4, 8)}  # 0: ppl@0
# plan.md item 11: looped_db's one block trains at every sigma, and the EDM law (ln sigma ~ N(-1.2, 1.2)) puts
# half its draws below 0.3, where z alone gives the token away (the network adds nothing there); moving the
# law up (p_mean 1.0: 97 % of the draws above 0.3) spends the steps where the context decides
RUNS["looped_db_sigma_up"] = ({"kind": "looped_db", **LOOPED}, {"num_blocks": 1, "p_mean": 1.0})
# the warm-up sweep (a share of the steps; every other row warms up over 5 %)
WARMUP = {"huginn_wu1": 0.01, "huginn_wu20": 0.20, "looped_db_wu1": 0.01, "looped_db_wu20": 0.20,
          "gpt_L2_wu1": 0.01, "gpt_L2_wu20": 0.20, "db_L4_B2_gain_wu1": 0.01, "db_L4_B2_gain_wu20": 0.20,  # circuit/plan.md
          "looped_db_sigma_up_wu1": 0.01, "looped_db_sigma_up_wu20": 0.20}  # plan.md item 17
for _name in WARMUP:
    RUNS[_name] = RUNS[_name.rsplit("_wu", 1)[0]]
CURVE_EVERY = 200  # network_gain / loss_share: re-measure CE(sigma) on a fixed training batch this often (the product's default)


def segments(n: int, seed: int):
    """Each sequence's segment: its length L (8..24) and its L distinct symbols, as the generator draws them."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        L = int(torch.randint(*SEG, (1,), generator=g))
        yield L, torch.randperm(V, generator=g)[:L]


def sequences(n: int, seed: int) -> torch.Tensor:
    """(n, T + 1) tokens: one random segment of 8..24 distinct symbols, repeated."""
    return torch.stack([seg.repeat(T // L + 2)[:T + 1] for L, seg in segments(n, seed)])


def lengths(n: int, seed: int) -> torch.Tensor:
    return torch.tensor([L for L, _ in segments(n, seed)])


def copy_mask(n: int, seed: int) -> torch.Tensor:
    """(n, T): target t (= token t + 1) lies in a later period."""
    L = lengths(n, seed)
    return torch.arange(1, T + 1)[None] >= L[:, None]


def config(name: str):
    model, diffusion = RUNS[name]
    return config_from_dict({"model": {"d_model": D, "n_heads": HEADS, "seq_len": T, "init_std": 0.02, **model},
                             "diffusion": {**DB, **diffusion} if model["kind"] in ("db_ar", "looped_db") else {}})


def huginn_costs(model, x, y, seed: int):
    """huginn's step cost depends on its recurrence r (drawn per step from seed and step, as training_loss
    draws it): the counted FLOPs of one real step per distinct r, -> (cost_at(step), {r: FLOPs})."""
    from looped_lm.models.huginn import sample_recurrence

    by_r: dict = {}

    def cost_at(step: int) -> float:
        r = sample_recurrence(model.mean_recurrence, torch.Generator().manual_seed(seed * 1_000_003 + step))
        if r not in by_r:
            by_r[r] = float(common.step_flops(model, x, y, step, seed))
        return by_r[r]

    return cost_at, by_r


def step_flops(model, x, y) -> tuple[float, list]:
    """Mean FlopCounterMode FLOPs of one training step over the blocks a step may train, and each block's."""
    units = len(model.blocks) if hasattr(model, "objective") else 1
    costs = [common.step_flops(model, x, y, next(s for s in range(1000) if units == 1 or model.choose_block(s, 0) == b))
             for b in range(units)]
    return sum(costs) / len(costs), costs


def refresh_curve(model, batch, seed: int) -> None:
    """What the product's trainer does every `curve_every` steps (looped_lm/train.py refresh_curve)."""
    model.eval()
    model.apply_curve(model.measure_curve(batch[:, :-1], batch[:, 1:], seed=seed))
    model.train()


def curve_cost(model, batch) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model.measure_curve(batch[:, :-1], batch[:, 1:], seed=0)
    model.objective.curve = None
    return float(counter.get_total_flops())


def first_repeat(n: int, seed: int) -> torch.Tensor:
    """(n, T): target t is the first token of the second period (token L), the one a copy cannot be sure of:
    after L distinct symbols the segment may end (then token L repeats token 0) or go on with a new symbol."""
    L = lengths(n, seed)
    return torch.arange(1, T + 1)[None] == L[:, None]


def oracle_copy_nll(n: int, seed: int) -> float:
    """The Bayes-optimal copy NLL on a split: 0 on every copy token but the first repeat, where the segment
    ends after L distinct symbols with probability 1 / (SEG[1] - L) (L uniform on SEG, given it is >= L),
    so the repeat costs ln(SEG[1] - L) nats."""
    L = lengths(n, seed).double()
    return float(torch.log(SEG[1] - L).sum() / copy_mask(n, seed).sum())


def copy_scores(nll: torch.Tensor, n: int, seed: int) -> dict:
    """A split's copy NLL, first-period NLL and the copy NLL's parts, from its per-token NLL (n, T)."""
    mask = copy_mask(n, seed)
    return {"copy_nll": float(nll[mask].mean()), "first_period_nll": float(nll[~mask].mean()), **copy_parts(nll, n, seed)}


def copy_parts(nll: torch.Tensor, n: int, seed: int) -> dict:
    """Copy NLL split into the first repeat token (hazard: ambiguous even to the Bayes predictor) and the later
    copy tokens (determined: induction), each as its share of the copy NLL's numerator, so they add up."""
    mask, first = copy_mask(n, seed), first_repeat(n, seed)
    later = mask & ~first
    total = mask.sum()
    return {"copy_nll_first_repeat_part": float(nll[first].sum() / total),
            "copy_nll_later_part": float(nll[later].sum() / total),
            "first_repeat_nll": float(nll[first].mean()), "later_copy_nll": float(nll[later].mean()),
            "oracle_copy_nll": oracle_copy_nll(n, seed)}


@torch.no_grad()
def score_looped(model, ks: tuple, split_seed: int, smoke: bool) -> dict:
    """Every K of the grid (huginn: exact after K iterations from its random initial state; looped_db: K = 0
    is ppl@0, K >= 1 the K-step chain by the estimator at its default settings): {K: per-token NLL (n, T)}."""
    n = 64 if smoke else 512
    seq = sequences(n, split_seed)
    x, y = seq[:, :-1], seq[:, 1:]
    g = torch.Generator().manual_seed(7)
    grid = tuple(k for k in ks if k) if hasattr(model, "objective") else ks
    parts = [model.score(x[i:i + 64], y[i:i + 64], ScoreSettings(k_grid=grid, draws=2 if smoke else 4), g)
             for i in range(0, n, 64)]
    return {k: torch.cat([p[k].nll for p in parts]) for k in ks}


def looped_scores(model, name: str, smoke: bool) -> dict:
    """dev and test at every K, and the headline: test at the K with the lowest dev copy NLL."""
    ks = LOOPED_KS[RUNS[name][0]["kind"]]
    n = 64 if smoke else 512
    out = {}
    for split, split_seed in (("dev", DEV_SEED), ("test", TEST_SEED)):
        nll, mask = score_looped(model, ks, split_seed, smoke), copy_mask(n, split_seed)
        out[split] = {f"copy_nll_at_K{k}": float(v[mask].mean()) for k, v in nll.items()}
        out[split] |= {f"first_period_nll_at_K{k}": float(v[~mask].mean()) for k, v in nll.items()}
        out[split]["nll"] = nll
    k = min(ks, key=lambda k: out["dev"][f"copy_nll_at_K{k}"])
    for split, split_seed in (("dev", DEV_SEED), ("test", TEST_SEED)):
        out[split] |= {"K": k, **copy_scores(out[split].pop("nll")[k], n, split_seed)}
    return out


@torch.no_grad()
def score(model, split_seed: int, smoke: bool) -> dict:
    """gpt: exact; db_ar: ppl@0 (the headline copy NLL) and the K = B chain with the estimator's standard error."""
    n = 64 if smoke else 512
    seq, mask = sequences(n, split_seed), copy_mask(n, split_seed)
    x, y = seq[:, :-1], seq[:, 1:]
    if not hasattr(model, "objective"):
        nll = [model.score(x[i:i + 64], y[i:i + 64], ScoreSettings())["exact"].nll for i in range(0, n, 64)]
        return copy_scores(torch.cat(nll), n, split_seed)
    B, g = len(model.blocks), torch.Generator().manual_seed(7)
    parts = [model.score(x[i:i + 64], y[i:i + 64], ScoreSettings(k_grid=(B,), draws=2 if smoke else 4), g)
             for i in range(0, n, 64)]
    chain, var = torch.cat([s[B].nll for s in parts]), torch.cat([s[B].nll_var for s in parts])
    return {**copy_scores(torch.cat([s[0].nll for s in parts]), n, split_seed),
            f"copy_nll_K{B}": float(chain[mask].mean()), f"copy_nll_K{B}_est_se": float(var[mask].sum().sqrt() / mask.sum())}


# A later round writes to its own folder (DEPTH_SYNTHETIC_DIR, under RESULTS), so a change of scoring never
# mixes with the JSON an earlier round scored (round3/: every run after the ppl@0 estimator fix)
OUT = RESULTS / os.environ.get("DEPTH_SYNTHETIC_DIR", "")
MODELS = ROOT / "work" / "depth_synthetic_models"  # each run's trained weights (not committed), for re-scoring


def results_dir(budget: float = BUDGET) -> Path:
    """The 6e12 study at the top of OUT; every other budget (its own full schedule) in budget_<flops>/."""
    return OUT if budget == 6e12 else OUT / f"budget_{budget:g}"


def weights_of(path: Path) -> Path:
    """Where a run's kept weights lie (outside git): MODELS mirrors the folder of its JSON."""
    return MODELS / path.parent.resolve().relative_to(ROOT) / path.with_suffix(".pt").name


def path_of(name: str, lr: float, seed: int, smoke: bool) -> Path:
    return (ROOT / "work" / "depth_synthetic_smoke" if smoke else results_dir()) / f"{name}__lr{lr:g}__s{seed}.json"


def run_one(name: str, lr: float, seed: int, smoke: bool, keep: dict | None = None) -> dict:
    torch.set_num_threads(1)
    cfg = config(name)
    torch.manual_seed(seed)
    model = build_model(cfg, V)
    seq0 = sequences(BATCH, 10_000)
    if cfg.model.kind == "huginn":  # a step costs what its recurrence r costs: count the budget step by step
        cost_at, by_r = huginn_costs(model, seq0[:, :-1], seq0[:, 1:], seed)
        steps, spent = 0, 0.0
        while spent < BUDGET and not (smoke and steps == 5):
            spent, steps = spent + cost_at(steps), steps + 1
        per_step, per_block = spent / steps, [by_r[r] for r in sorted(by_r)]
    else:
        per_step, per_block = step_flops(model, seq0[:, :-1], seq0[:, 1:])
        steps = 5 if smoke else int(BUDGET // per_step)
    share = WARMUP.get(name, 0.05)
    curve_batch = sequences(BATCH, 10_000)  # a training-distribution batch no split draws (never dev or test)
    uses_curve = hasattr(model, "objective") and model.objective.uses_curve()
    curve_flops = curve_cost(model, curve_batch) if uses_curve else 0.0
    opt = BlockwiseAdamW(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95))
    runner = TorchRunner(model, opt, grad_clip=1.0, seed=seed)
    model.train()
    t0, curve = time.process_time(), []
    counts = [0] * len(model.blocks) if hasattr(model, "objective") and len(model.blocks) > 1 else None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_with_warmup(step, max(1, round(share * steps)), steps, lr, lr / 10)
        if uses_curve and step and step % CURVE_EVERY == 0:  # as the trainer: after each CURVE_EVERY steps done;
            refresh_curve(model, curve_batch, seed + step)     # before the first curve, blocks are drawn uniformly
        if counts is not None:
            counts[model.choose_block(step, seed)] += 1  # the block this step trains (the same call train_step makes)
        seq = sequences(BATCH, 1_000_000 * (seed + 1) + step)
        result = train_step(model, opt, runner, [(seq[:, :-1], seq[:, 1:])], step, seed)
        if step % max(1, steps // 20) == 0:
            curve.append((step, round(float(result.loss), 4)))
    cpu = time.process_time() - t0
    model.eval()
    if keep is not None:
        keep["model"] = model
    if cfg.model.kind in LOOPED_KS:
        scores = looped_scores(model, name, smoke)
    else:
        scores = {"dev": score(model, DEV_SEED, smoke), "test": score(model, TEST_SEED, smoke)}
    return {"run": name, "lr": lr, "seed": seed, "budget": BUDGET, "git": common.git_commit(), "steps": steps, "flops_per_step": per_step,
            # per DB block; for huginn per distinct recurrence r (ascending r)
            "flops_per_block_step": per_block, "train_flops": per_step * steps, "train_cpu_s": round(cpu, 1),
            "warmup_share": share,
            "train_curve": curve, "config": cfg.model_dump(),
            # the curve refreshes are forward-only and not in train_flops; their total is stated beside it
            "curve_flops": curve_flops * len(range(CURVE_EVERY, steps, CURVE_EVERY)) if uses_curve else 0.0,
            "block_steps": counts, **scores}


def one(name: str, lr: float, seed: int, smoke: bool) -> None:
    keep: dict = {}
    out = run_one(name, lr, seed, smoke, keep)
    path = path_of(name, lr, seed, smoke)
    weights_of(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(keep["model"].state_dict(), weights_of(path))
    common.write_json(path, out)
    print(f"{path.name}: test copy NLL {out['test']['copy_nll']:.4f} ({out['steps']} steps, {out['train_cpu_s']} CPU-s)",
          flush=True)


def run_jobs(todo: list, lanes: int) -> None:
    """Run (row, lr, seed) jobs whose JSON is missing, `lanes` processes at a time, one thread each."""
    todo = [job for job in todo if not path_of(*job, False).is_file()]
    print(f"jobs: {len(todo)} runs to do: {todo}", flush=True)
    common.run_lanes([([__file__, "one", name, str(lr), str(seed)], None) for name, lr, seed in todo], lanes)


# --- table --------------------------------------------------------------------------------------------


def share_ci(k: int, n: int) -> tuple[float, float]:
    """Exact (Clopper-Pearson) 95 % interval of a share k / n."""
    from scipy.stats import beta

    return (0.0 if k == 0 else float(beta.ppf(0.025, k, n - k + 1)),
            1.0 if k == n else float(beta.ppf(0.975, k + 1, n - k)))


def all_token_nll(split: dict, split_seed: int = TEST_SEED) -> float:
    """NLL over every predicted token: the copy and first-period means weighted by their token counts."""
    mask = copy_mask(512, split_seed)
    n_copy, n_first = int(mask.sum()), int((~mask).sum())
    return (split["copy_nll"] * n_copy + split["first_period_nll"] * n_first) / (n_copy + n_first)


def paired_ratio(a: dict, b: dict, metric) -> tuple[int, float, float, float]:
    """(pairs, geometric mean, 95 % low, 95 % high) of metric(a[s]) / metric(b[s]) over shared seeds."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return 0, float("nan"), float("nan"), float("nan")
    return (len(seeds), *common.ratio_ci([metric(a[s]) / metric(b[s]) for s in seeds]))


def median_ratio(a: dict, b: dict, metric) -> tuple[int, float, float, float, float]:
    """(pairs, median, low, high, coverage) of metric(a[s]) / metric(b[s]) over shared seeds: the interval is
    the sign test's, [k-th smallest, k-th largest] with the largest k whose coverage is still >= 95 %, so one
    wild seed moves it by one order statistic only (plan.md item 13). nan bounds when no k reaches 95 %."""
    from scipy.stats import binom

    ratios = sorted(metric(a[s]) / metric(b[s]) for s in sorted(set(a) & set(b)))
    n = len(ratios)
    if not n:
        return 0, float("nan"), float("nan"), float("nan"), float("nan")
    k = 0  # P(fewer than k of n fall below the median) = binom.cdf(k - 1, n, 1/2) on each side
    while k + 1 <= n // 2 and 1 - 2 * binom.cdf(k, n, 0.5) >= 0.95:
        k += 1
    if k == 0:
        return n, statistics.median(ratios), float("nan"), float("nan"), float("nan")
    return n, statistics.median(ratios), ratios[k - 1], ratios[n - k], 1 - 2 * float(binom.cdf(k - 1, n, 0.5))


def verdict(lo: float, hi: float, target: float = 1.10) -> str:
    """met: the 95 % upper bound is within the target; missed: the whole interval is above it."""
    if math.isnan(hi):
        return "not judged (no interval)"
    return "met" if hi <= target else "missed" if lo > target else "not met (the interval spans the target)"


def load(directory: Path) -> dict:
    """{row: {lr: {seed: run}}} of a round's folder."""
    by: dict = {}
    for path in sorted(directory.glob("*.json")):
        r = json.loads(path.read_text())
        by.setdefault(r["run"], {}).setdefault(r["lr"], {})[r["seed"]] = r
    return by


def chosen(by: dict) -> dict:
    """Each row's learning rate: the lowest dev copy NLL at seed 0 among the rates that ran."""
    return {name: min((lr for lr in lrs if 0 in lrs[lr]), key=lambda lr: lrs[lr][0]["dev"]["copy_nll"])
            for name, lrs in by.items() if any(0 in s for s in lrs.values())}


def best_recipe(by: dict, best: dict, rows: list) -> str:
    """plan.md item 3: the row whose chosen lr has the lowest dev copy NLL at seed 0. Not a mean over seeds: that
    would compare rows with different seed counts, and a row with more seeds has more chances of a bad one."""
    return min(rows, key=lambda n: by[n][best[n]][0]["dev"]["copy_nll"])


def recipe(by: dict, rows) -> tuple[str, float] | None:
    """The (row, lr) among `rows`' runs at seed 0 with the lowest dev copy NLL (its lr and warm-up rows)."""
    runs = [(n, lr) for n in rows if n in by for lr, s in by[n].items() if 0 in s]
    return min(runs, key=lambda job: by[job[0]][job[1]][0]["dev"]["copy_nll"]) if runs else None


def table() -> None:
    """A round's headline (OUT): the lr sweep, test at each row's chosen lr, the best DB-AR recipe against gpt_L2
    (paired, and by the median with its sign-test interval), looped_db against huginn, the budget trend."""
    by = load(OUT)
    best = chosen(by)
    copy = lambda r: r["test"]["copy_nll"]  # noqa: E731
    lrs = sorted({lr for name in best for lr in by[name]})
    lines = [f"# {OUT.relative_to(ROOT.parent)}: test copy NLL (full report: report.md there)", "",
             "| row | " + " | ".join(f"dev, lr {lr:g}" for lr in lrs) + " | chosen | seeds | copies (< 1) | "
             "median [min, max] | mean (95 % CI) |", "|---|" + "---|" * (len(lrs) + 5)]
    for name in [n for n in RUNS if n in best]:
        seeds = by[name][best[name]]
        v = [copy(seeds[s]) for s in sorted(seeds)]
        k, (lo, hi), (m, h) = sum(x < COPIES for x in v), share_ci(sum(x < COPIES for x in v), len(v)), common.ci(v)
        lines.append(f"| {name} | " + " | ".join(f"{by[name][lr][0]['dev']['copy_nll']:.3f}" if 0 in by[name].get(lr, {})
                                                 else "" for lr in lrs)
                     + f" | {best[name]:g} | {len(v)} | {k}/{len(v)} [{lo:.2f}, {hi:.2f}] | {statistics.median(v):.3f} "
                     f"[{min(v):.3f}, {max(v):.3f}] | {m:.3f}" + ("" if math.isnan(h) else f" ± {h:.3f}") + " |")
    dbs = [n for n in RUNS if n.startswith("db_") and n not in WARMUP and n in best]  # gpt_L2 is at warm-up 5 % too
    if "gpt_L2" in best and dbs:
        top, g = best_recipe(by, best, dbs), by["gpt_L2"][best["gpt_L2"]]
        d = by[top][best[top]]
        n, gm, lo, hi = paired_ratio(d, g, copy)
        _, gm2, lo2, hi2 = paired_ratio(d, g, lambda r: all_token_nll(r["test"]))
        mn, med, mlo, mhi, cover = median_ratio(d, g, copy)
        lines += ["", f"Best DB-AR recipe (dev): {top} at lr {best[top]:g}. Against gpt_L2, paired over {n} seeds: copy "
                  f"NLL {gm:.2f} [{lo:.2f}, {hi:.2f}] (target <= 1.10: {verdict(lo, hi)}), all-token NLL {gm2:.2f} "
                  f"[{lo2:.2f}, {hi2:.2f}] ({verdict(lo2, hi2)}); median copy NLL ratio {med:.2f} [{mlo:.2f}, {mhi:.2f}] "
                  f"(sign test, coverage {cover:.1%}: {verdict(mlo, mhi)})."]
    picked = {kind: recipe(by, [n for n in RUNS if RUNS[n][0]["kind"] == kind]) for kind in ("huginn", "looped_db")}
    if all(picked.values()):
        (hr, hlr), (dr, dlr) = picked["huginn"], picked["looped_db"]
        n, gm, lo, hi = paired_ratio(by[dr][dlr], by[hr][hlr], copy)
        lines += ["", f"looped_db ({dr}, lr {dlr:g}) / huginn ({hr}, lr {hlr:g}), copy NLL paired over {n} seeds: "
                  f"{gm:.2f} [{lo:.2f}, {hi:.2f}] (target <= 1: {verdict(lo, hi, 1.0)})."]
    for directory in sorted(OUT.glob("budget_*")):
        lines += ["", f"Budget {directory.name}:"] + [
            f"- {name} lr {lr:g}: " + ", ".join(f"s{s} {copy(r):.3f}" for s, r in sorted(seeds.items()))
            for name, lrs in load(directory).items() for lr, seeds in sorted(lrs.items())]
    print("\n".join(lines))


CIRCUIT_BUDGETS = (3e12, 4e12, 5e12, 6e12)


def circuit() -> str:
    """circuit/plan.md's report: each recipe (its lr and warm-up chosen on dev at 6e12, seed 0), the seeds that copy
    at each budget, the verdict (the smallest budget where >= 4 of 5 seeds copy), and the later-part copy NLL."""
    pick = {base: recipe(load(OUT), (base, base + "_wu1", base + "_wu20")) for base in ("gpt_L2", "db_L4_B2_gain")}
    lines = ["# Compute to circuit: results", "", "Written by `DEPTH_SYNTHETIC_DIR=circuit python bench/depth_synthetic.py "
             "circuit` from the JSON here; plan, statistics and rules: plan.md (written before the runs).", ""]
    for base, (name, lr) in pick.items():
        lines.append(f"- {base}: chosen on dev at 6e12 (seed 0): {name} (warm-up share {WARMUP.get(name, 0.05):g}), "
                     f"lr {lr:g}")
    lines += ["", "| budget | " + " | ".join(f"{b}: seeds copying (95 % CI) | copy NLL by seed" for b in pick)
              + " | later-part copy NLL, DB / gpt (pairs) |", "|---|" + "---|---|" * len(pick) + "---|"]
    first = {}
    for budget in CIRCUIT_BUDGETS:
        runs = {b: load(results_dir(budget)).get(n, {}).get(lr, {}) for b, (n, lr) in pick.items()}
        runs = {b: {s: r for s, r in seeds.items() if s < 5} for b, seeds in runs.items()}
        cells = []
        for b, seeds in runs.items():
            k = sum(r["test"]["copy_nll"] < COPIES for r in seeds.values())
            lo, hi = share_ci(k, len(seeds)) if seeds else (float("nan"), float("nan"))
            if len(seeds) == 5 and k >= 4:
                first.setdefault(b, budget)
            cells.append(f"{k}/{len(seeds)} [{lo:.2f}, {hi:.2f}] | "
                         + ", ".join(f"s{s} {r['test']['copy_nll']:.3f}" for s, r in sorted(seeds.items())))
        g, d = runs["gpt_L2"], runs["db_L4_B2_gain"]
        both = [s for s in sorted(set(g) & set(d)) if max(g[s]["test"]["copy_nll"], d[s]["test"]["copy_nll"]) < COPIES
                and "copy_nll_later_part" in g[s]["test"] and "copy_nll_later_part" in d[s]["test"]]
        ratios = [d[s]["test"]["copy_nll_later_part"] / g[s]["test"]["copy_nll_later_part"] for s in both]
        geo, lo, hi = common.ratio_ci(ratios) if ratios else (0, 0, 0)
        later = "no pair" if not ratios else f"{geo:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if len(ratios) >= 3 else " (no interval)")
        lines.append(f"| {budget:g} | " + " | ".join(cells) + f" | {later} ({len(ratios)}) |")
    at = {b: first.get(b) for b in pick}
    text = {b: f"{v:g}" if v else "> 6e12" for b, v in at.items()}
    if at["db_L4_B2_gain"] and (not at["gpt_L2"] or at["db_L4_B2_gain"] <= at["gpt_L2"]):
        call = "DB no later than gpt"
    elif at["gpt_L2"] or at["db_L4_B2_gain"]:
        call = "gpt earlier"
    else:
        call = "neither copies on 4 of 5 seeds by 6e12"
    lines += ["", f"**Verdict (the plan's statistic): compute to circuit gpt_L2 {text['gpt_L2']}, db_L4_B2_gain "
              f"{text['db_L4_B2_gain']} FLOPs: {call}** (resolution: the 1e12 budget grid; a budget counts once all 5 "
              "seeds ran)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("jobs", help="run the listed row:lr:seed jobs whose JSON is missing (DEPTH_SYNTHETIC_DIR "
                       "picks the round's folder)")
    j.add_argument("job", nargs="+")
    j.add_argument("--lanes", type=int, default=1)
    o = sub.add_parser("one")
    o.add_argument("name", choices=RUNS)
    o.add_argument("lr", type=float)
    o.add_argument("seed", type=int)
    o.add_argument("--smoke", action="store_true")
    sub.add_parser("table", help="the headline tables of a round (DEPTH_SYNTHETIC_DIR), from its JSON")
    sub.add_parser("circuit", help="circuit/plan.md's report (DEPTH_SYNTHETIC_DIR=circuit): written to report.md there")
    a = p.parse_args()
    if a.cmd == "jobs":
        todo = [(name, float(lr), int(seed)) for name, lr, seed in (job.split(":") for job in a.job)]
        unknown = sorted({name for name, _, _ in todo} - set(RUNS))
        if unknown:
            p.error(f"unknown rows {unknown} (have: {', '.join(RUNS)})")
        run_jobs(todo, a.lanes)
    elif a.cmd == "one":
        one(a.name, a.lr, a.seed, a.smoke)
    elif a.cmd == "circuit":
        report = circuit()
        (OUT / "report.md").write_text(report)
        print(report)
    else:
        table()


if __name__ == "__main__":
    main()
