"""Quality at EQUAL WALL-CLOCK: looped DiffusionBlocks LM vs the Huginn-style BPTT baseline (method.md §4-6, §8).

    python bench/looped_quality.py                    # 3 models x 4 min of training + ~4 min of scoring, ~16 min
    python bench/looped_quality.py --minutes 0.3 --windows 8      # smoke run, ~2 min
    python bench/looped_quality.py --save /tmp/lq.pt  # keep the trained weights; --load /tmp/lq.pt re-scores them
    python bench/looped_quality.py --minutes 8 --name looped_quality_8min         # a longer run, its own files
    python bench/looped_quality.py --replot           # redraw PNG + table from the JSON

Data: the embedded Bible corpus, byte tokenizer (V = 257), nanoGPT-format split (`ensure_prepared("bible",
"data_cache", "byte", 0.05, 0)`: 3 held-out books, 56 k val tokens). Shape (every model): prelude 1 +
weight-tied core 2 + coda 1, d 128, 4 heads, seq 128, batch 16, fp32.
  huginn        r ~ Poisson-log-normal with mean r-bar = 8 (not the paper's 32: CPU time), backprop through
                the last k = 4 iterations (`model.training_loss`).
  looped_db     `model.training_loss` with the product's defaults: one forward pass of the two-stream core,
                sigma ~ log-normal(-1.2, 1.2) on [0.002, 80] (B = 1, equi_probability), hard bridge.
  looped_db_s8  the measured-curve options of method.md §8 that the prototype used: partition equi_entropy
                (the sigma range [sigma_lo, sigma_hi] re-estimated from held-out CE(sigma) every --curve-every
                steps, as looped_lm/train.py's refresh_curve does; not timed) + noisy_input prev_token.

Training: ONE process, torch.set_num_threads(1), the models' steps INTERLEAVED (h, db, db_s8, h, ...), each
model stops when its own accumulated step wall-time reaches the budget (--minutes each): a job sharing the
machine slows every model alike. Plain torch AdamW (nanoGPT groups: decay on matrices only, wd 0.1, betas
0.9/0.95), grad clip 1.0, lr 3e-3 with 50 warm-up steps then a cosine to 3e-4 over the model's TIME budget
(the step count is not known in advance). The same batch sequence for all (TokenStream.get_batch(16, 0, step)).
A small validation probe every 60 s of training (not counted).

Scoring on --windows disjoint 128-token windows spread evenly over val.bin:
  huginn     exact PPL after K = 1, 2, 4, 8, 16, 32 iterations (one random initial state); top-1 accuracy at K = 8
  looped_db  ppl@0 (one call at sigma_hi) and ppl@k, k = 1, 2, 4, 8, 16, 32 (the K = k sampler, `eval_nll`,
             --draws chains, probabilities averaged over chains: method.md §6); ppl@1/4/16 with the other bridge
             per-step PPL and top-1 accuracy along K = 16 and K = 32 chains (the logits read at step j)
             ENTROPY-GATED read-out (this script, over `model.chain` with a recording `call` wrapped around
             `model.window_call`): each token is scored at the first step whose predictive entropy is below
             tau nats, else at the last step; tau in --entropy-taus, at K = 16 and 32
             adaptive exit at K = 16: ExitRule(kl_threshold=eps), eps in --kl-eps, and ExitRule(argmax_stable=2)
             CE(sigma): one call at sigma with z = y + sigma*eps from the TRUE target (where the token becomes
             readable from z: method.md §8's trivial region)
Writes bench/results/<name>.json and bench/results/<name>.png (name = looped_quality by default).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from looped_lm import diffusion as dm
from looped_lm.config import config_from_dict
from looped_lm.data.bin_dataset import TokenStream
from looped_lm.data.prepare import ensure_prepared
from looped_lm.diffusion.adaptive_exit import ExitRule
from looped_lm.models import build_model
from looped_lm.optim import param_groups

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SEQ, BATCH, V = 128, 16, 257
SHAPE = {"n_prelude": 1, "n_layers": 2, "n_coda": 1, "d_model": 128, "n_heads": 4, "seq_len": SEQ}
MEAN_R, K_BP = 8, 4
K_GRID = [1, 2, 4, 8, 16, 32]
LR, MIN_LR, WARMUP, WD = 3e-3, 3e-4, 50, 0.1


# looped_db variants: the product's defaults, and the measured-curve options of method.md §8
DB_VARIANTS = {
    "looped_db": {},
    "looped_db_s8": {"partition": "equi_entropy", "noisy_input": "prev_token"},
}


def build(name: str):
    raw = {"model": {"kind": "huginn" if name == "huginn" else "looped_db", **SHAPE}}
    if name == "huginn":
        raw["model"].update(mean_recurrence=MEAN_R, backprop_depth=K_BP)
    else:
        raw["diffusion"] = {"num_blocks": 1, **DB_VARIANTS[name]}
    torch.manual_seed(0)
    return build_model(config_from_dict(raw), V)


def lr_at(step: int, progress: float) -> float:
    if step < WARMUP:
        return LR * (step + 1) / (WARMUP + 1)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (LR - MIN_LR)


# ------------------------------------------------------------------------------------------------
# training


def train(models: dict, stream: TokenStream, val_stream: TokenStream, val_probe, budget_s: float, curve_every: int,
          log) -> dict:
    opts = {n: torch.optim.AdamW(param_groups(m, WD), lr=LR, betas=(0.9, 0.95)) for n, m in models.items()}
    state = {n: {"steps": 0, "wall": 0.0, "cpu": 0.0, "next_probe": 0.0, "curve": [], "loss_ema": None}
             for n in models}
    torch.manual_seed(1234)
    while any(s["wall"] < budget_s for s in state.values()):
        for n, m in models.items():  # interleaved: one step of each model per round
            s = state[n]
            if s["wall"] < budget_s and s["wall"] >= s["next_probe"]:
                m.eval()
                s["curve"].append({"train_s": s["wall"], "step": s["steps"], "val_nll": val_probe(n, m)})
                log(f"  {n:<12} {s['wall']:6.0f}s step {s['steps']:5d} train {s['loss_ema'] or float('nan'):.3f} "
                    f"val-probe {s['curve'][-1]['val_nll']:.3f} nats")
                s["next_probe"] += 60.0
            if s["wall"] >= budget_s:
                continue
            if getattr(m, "uses_curve", lambda: False)() and s["steps"] % curve_every == 0:
                # what looped_lm/train.py's refresh_curve does: held-out CE(sigma) -> edges (not timed)
                m.eval()
                xv, yv = val_stream.get_batch(BATCH, 0, -2, 0, 0)
                m.apply_curve(m.measure_curve(xv, yv, seed=s["steps"]))
                s.setdefault("edges", []).append({"step": s["steps"], "edges": list(m.edges)})
            m.train()
            x, y = stream.get_batch(BATCH, 0, s["steps"], 0, 0)
            lr = lr_at(s["steps"], s["wall"] / budget_s)
            for group in opts[n].param_groups:
                group["lr"] = lr
            c0, t0 = time.process_time(), time.perf_counter()
            loss, _ = m.training_loss(x, y, step=s["steps"], seed=0)
            opts[n].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[n].step()
            s["wall"] += time.perf_counter() - t0
            s["cpu"] += time.process_time() - c0
            s["steps"] += 1
            s["loss_ema"] = loss.item() if s["loss_ema"] is None else 0.98 * s["loss_ema"] + 0.02 * loss.item()
    for n, m in models.items():
        m.eval()
        s = state[n]
        s["curve"].append({"train_s": s["wall"], "step": s["steps"], "val_nll": val_probe(n, m)})
        log(f"  {n:<12} done: {s['steps']} steps in {s['wall']:.0f}s wall ({s['cpu']:.0f} CPU-s), "
            f"{s['steps'] / s['wall']:.2f} steps/s, val-probe {s['curve'][-1]['val_nll']:.3f} nats"
            + (f", edges {[round(e, 3) for e in m.edges]}" if hasattr(m, "edges") else ""))
    return state


# ------------------------------------------------------------------------------------------------
# scoring pieces for looped_db (replicating eval_nll's inner call, so every step's logits are visible)


def db_call_factory(model, x):
    """The noisy-stream call of `eval_nll`, clean K/V computed once for the window batch x: the product's
    own `window_call` where it exists, else this replica of eval_nll's inner call."""
    if hasattr(model, "window_call"):
        return model.window_call(x)
    from looped_lm.models.dblm import noisy_mask  # older layouts only

    T = x.shape[1]
    slots = torch.arange(T)
    mask = noisy_mask(slots, T)
    clean = model.clean_inputs(x)
    layers = model.layers_of(0)
    cos, sin = model.rope(slots)
    kv, c = [], clean
    for i, layer in enumerate(layers):
        c, k, v = layer.clean(c, cos, sin, need_output=i + 1 < len(layers))
        kv.append((k, v))
    cos_n, sin_n = model.rope(slots + 1)

    def call(b, z, sigma):
        h, cond, loglik = model.noisy_input(z, sigma)
        for layer, (k, v) in zip(layers, kv):
            h = layer.noisy(h, cond, cos_n, sin_n, k, v, mask)
        return model.denoise_logits(h, z, sigma, loglik)

    return call


@torch.no_grad()
def db_chain_steps(model, x, y, K: int, generator):
    """One K-step chain (the configured bridge, the product's sampler): per step, p(y), the predictive entropy and
    whether the argmax is right, each (K, B, T)."""
    base = db_call_factory(model, x)
    p_y, ent, acc = [], [], []

    def call(b, z, sigma):
        logits = base(b, z, sigma)
        logp = logits.float().log_softmax(-1)
        p_y.append(logp.gather(-1, y[..., None])[..., 0].double().exp())
        ent.append(-(logp.exp() * logp).sum(-1))
        acc.append(logits.argmax(-1) == y)
        return logits

    final = model.chain(call, K, tuple(x.shape), x.device, generator, model.cfg.diffusion.bridge)
    p_final = final.float().log_softmax(-1).gather(-1, y[..., None])[..., 0].double().exp()
    assert torch.allclose(p_final, p_y[-1]), "chain's last logits differ from the recorded last step"
    return torch.stack(p_y), torch.stack(ent), torch.stack(acc)


@torch.no_grad()
def db_ce_vs_sigma(model, x, y, sigmas, generator):
    """CE of one call at sigma from z = y_true + sigma*eps: how much of the token z alone gives away."""
    call = db_call_factory(model, x)
    y_emb = model.targets(y)
    out = {}
    for s in sigmas:
        z = y_emb + s * torch.randn(y_emb.shape, generator=generator)
        logits = call(0, z, torch.full((x.shape[0],), float(s)))
        out[s] = float(F.cross_entropy(logits.float().transpose(1, 2), y))
    return out


def ppl(nll_sum: float, n: int) -> float:
    return math.exp(nll_sum / n)


@torch.no_grad()
def score_huginn(h, windows, n_tok) -> dict:
    g = torch.Generator().manual_seed(7)
    tot = {k: 0.0 for k in K_GRID}
    for x, y in windows:
        out = h.eval_nll(x, y, k_grid=K_GRID, generator=g)
        for k in K_GRID:
            tot[k] += float(out[k].sum())
    g = torch.Generator().manual_seed(7)
    correct = sum(int((h(x, MEAN_R, generator=g).argmax(-1) == y).sum()) for x, y in windows)
    return {"ppl": {k: ppl(tot[k], n_tok) for k in K_GRID}, f"top1_acc@{MEAN_R}": correct / n_tok}


@torch.no_grad()
def score_db(db, windows, n_tok, args, log) -> dict:
    res = {"edges": list(db.edges)}
    # ppl@0 and ppl@k (the product's eval_nll, `draws` chains)
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(7)
    tot = {k: 0.0 for k in [0, *K_GRID]}
    for x, y in windows:
        out = db.eval_nll(x, y, k_grid=K_GRID, draws=args.draws, generator=g)
        for k in tot:
            tot[k] += float(out[k].sum())
    res["ppl"] = {k: ppl(v, n_tok) for k, v in tot.items()}
    log(f"    ppl@k {', '.join(f'k={k}: {v:.3f}' for k, v in res['ppl'].items())} [{time.perf_counter() - t0:.0f}s]")
    # the other bridge (soft = softmax-weighted target table), same protocol, a shorter grid
    t0 = time.perf_counter()
    other = "soft" if db.cfg.diffusion.bridge == "hard" else "hard"
    g = torch.Generator().manual_seed(7)
    tot = {k: 0.0 for k in [1, 4, 16]}
    for x, y in windows:
        out = db.eval_nll(x, y, k_grid=[1, 4, 16], draws=args.draws, generator=g, bridge=other)
        for k in tot:
            tot[k] += float(out[k].sum())
    res["ppl_other_bridge"] = {"bridge": other, **{k: ppl(v, n_tok) for k, v in tot.items()}}
    log(f"    {other} bridge ppl@k {', '.join(f'k={k}: {ppl(v, n_tok):.3f}' for k, v in tot.items())} "
        f"[{time.perf_counter() - t0:.0f}s]")
    # per-step PPL along K = 16 / 32 chains + entropy-gated read-out (same chains)
    t0 = time.perf_counter()
    res["chain_steps"], res["entropy_gated"] = {}, {}
    for K in (16, 32):
        g = torch.Generator().manual_seed(11)
        sigmas = dm.inference_sigmas(K, db.sched, lo=db.edges[0], hi=db.edges[-1])[:-1]
        step_nll = torch.zeros(K, dtype=torch.float64)
        step_ent = torch.zeros(K, dtype=torch.float64)
        step_acc = torch.zeros(K, dtype=torch.float64)
        gated = {tau: {"nll": 0.0, "step_sum": 0.0, "never": 0} for tau in args.entropy_taus}
        for x, y in windows:
            p_sum = torch.zeros(K, *x.shape, dtype=torch.float64)
            gp_sum = {tau: torch.zeros(x.shape, dtype=torch.float64) for tau in args.entropy_taus}
            for _ in range(args.draws):
                p_y, ent, acc = db_chain_steps(db, x, y, K, g)
                p_sum += p_y
                step_ent += ent.double().sum(dim=(1, 2)) / args.draws
                step_acc += acc.double().sum(dim=(1, 2)) / args.draws
                for tau in args.entropy_taus:
                    below = ent < tau  # (K, B, T)
                    never = ~below.any(0)
                    first = torch.where(never, K - 1, below.float().argmax(0))
                    gp_sum[tau] += p_y.gather(0, first[None])[0]
                    gated[tau]["step_sum"] += float(first.double().sum()) / args.draws
                    gated[tau]["never"] += int(never.sum())
            step_nll += -(p_sum / args.draws).clamp_min(1e-300).log().sum(dim=(1, 2))
            for tau in args.entropy_taus:
                gated[tau]["nll"] += float(-(gp_sum[tau] / args.draws).clamp_min(1e-300).log().sum())
        res["chain_steps"][K] = [{"step": j, "sigma": sigmas[j], "ppl": math.exp(float(step_nll[j]) / n_tok),
                                  "mean_entropy": float(step_ent[j]) / n_tok, "top1_acc": float(step_acc[j]) / n_tok}
                                 for j in range(K)]
        res["entropy_gated"][K] = {
            tau: {"ppl": ppl(v["nll"], n_tok), "mean_step": 1 + v["step_sum"] / n_tok,
                  "never_below": v["never"] / (n_tok * args.draws)} for tau, v in gated.items()}
        best = min(res["chain_steps"][K], key=lambda r: r["ppl"])
        log(f"    K={K} chain: best step {best['step']} (sigma {best['sigma']:.3g}) PPL {best['ppl']:.3f}, last step "
            f"PPL {res['chain_steps'][K][-1]['ppl']:.3f}; entropy-gated "
            + ", ".join(f"tau={t}: PPL {v['ppl']:.3f} @ step {v['mean_step']:.1f}"
                        for t, v in res["entropy_gated"][K].items()) + f" [{time.perf_counter() - t0:.0f}s]")
    # adaptive exit at K = 16 (the product's ExitRule inside eval_nll)
    t0 = time.perf_counter()
    res["adaptive_exit"] = {}
    rules = [("kl", eps, ExitRule(kl_threshold=eps)) for eps in args.kl_eps] + [("argmax", 2, ExitRule(argmax_stable=2))]
    for kind, value, rule in rules:
        g = torch.Generator().manual_seed(7)  # the same chains' noise as the plain ppl@16 run
        nll, iters = 0.0, []
        for x, y in windows:
            stats = {}
            out = db.eval_nll(x, y, k_grid=[16], draws=args.draws, generator=g, exit_rule=rule, stats=stats)
            nll += float(out[16].sum())
            iters += stats[16]
        res["adaptive_exit"][f"{kind}:{value}"] = {"ppl": ppl(nll, n_tok), "mean_iterations": sum(iters) / len(iters),
                                                   "ppl_no_exit": res["ppl"][16]}
    log("    adaptive exit K=16: " + ", ".join(f"{k}: PPL {v['ppl']:.3f} ({v['mean_iterations']:.2f} it)"
                                              for k, v in res["adaptive_exit"].items())
        + f" [{time.perf_counter() - t0:.0f}s]")
    # CE(sigma) from the true target
    g = torch.Generator().manual_seed(3)
    ce = {s: 0.0 for s in CE_SIGMAS}
    for x, y in windows:
        for s, v in db_ce_vs_sigma(db, x, y, CE_SIGMAS, g).items():
            ce[s] += v * x.numel() / n_tok
    res["ce_vs_sigma"] = ce
    log("    CE(sigma | true-target z): " + ", ".join(f"{s:g}: {v:.3f}" for s, v in ce.items()))
    return res


CE_SIGMAS = [0.002, 0.01, 0.03, 0.1, 0.17, 0.3, 0.5, 1.0, 2.0, 5.0, 20.0, 80.0]


def score(models, windows, args, log) -> dict:
    n_tok = sum(x.numel() for x, _ in windows)
    res = {"tokens": n_tok, "windows": sum(x.shape[0] for x, _ in windows), "draws": args.draws, "models": {}}
    for name, m in models.items():
        t0 = time.perf_counter()
        log(f"  scoring {name}")
        res["models"][name] = score_huginn(m, windows, n_tok) if name == "huginn" else score_db(m, windows, n_tok, args, log)
        if name == "huginn":
            log(f"    exact PPL {', '.join(f'K={k}: {v:.3f}' for k, v in res['models'][name]['ppl'].items())} "
                f"[{time.perf_counter() - t0:.0f}s]")
    return res


# ------------------------------------------------------------------------------------------------
# report

LABELS = {"huginn": "huginn (BPTT r̄8/k4)", "looped_db": "looped_db (defaults: σ∈[0.002, 80])",
          "looped_db_s8": "looped_db §8 (equi_entropy σ range + prev_token)"}


def plot(res: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 7.5))
    colors = {"huginn": "C0", "looped_db": "C3", "looped_db_s8": "C2"}
    for name, r in res["models"].items():
        c = colors.get(name, "C5")
        if name == "huginn":
            ax.plot(K_GRID, [r["ppl"][k] for k in K_GRID], "o-", color=c, label=f"{LABELS[name]}: exact PPL after K")
            continue
        ax.plot(K_GRID, [r["ppl"][k] for k in K_GRID], "s-", color=c, label=f"{LABELS.get(name, name)}: ppl@K")
        ax.axhline(r["ppl"][0], color=c, ls="--", lw=1, label=f"  ppl@0 (one call at σ_hi = {r['edges'][-1]:.3g}) "
                                                               f"= {r['ppl'][0]:.2f}")
        for K in (16, 32):
            for i, (tau, v) in enumerate(r["entropy_gated"][K].items()):
                ax.plot([K * (1.06 if i else 0.94)], [v["ppl"]], "^v"[i], color=c, ms=8, mfc="white",
                        label=f"  entropy-gated τ={tau}" if K == 16 else None)
        for i, (rule, v) in enumerate(r["adaptive_exit"].items()):
            ax.plot([v["mean_iterations"]], [v["ppl"]], "*Pd"[i % 3], color=c, ms=10, mfc="white",
                    label=f"  adaptive exit {rule} @K=16 (x = mean iterations)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(K_GRID, [str(k) for k in K_GRID])
    ax.set_yscale("log")
    ax.set_xlabel("K (iterations / denoising steps per token)")
    ax.set_ylabel("val perplexity (bytes), log scale")
    ax.set_title(f"Equal wall-clock ({res['train']['budget_s'] / 60:.1f} min each, interleaved), bible bytes, "
                 f"{res['tokens']} val tokens", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2)
    for name, r in res["models"].items():
        c = colors.get(name, "C5")
        if name == "huginn":
            ax2.axhline(r["ppl"][8], color=c, ls=":", lw=1, label="huginn exact PPL at K=8")
            continue
        rows = r["chain_steps"][32]
        ax2.plot([q["sigma"] for q in rows], [q["ppl"] for q in rows], ".-", color=c,
                 label=f"{name}: PPL of the step-j logits, K=32 chain")
        ce = r["ce_vs_sigma"]
        ax2.plot(list(ce), [math.exp(v) for v in ce.values()], "x--", color=c, alpha=0.6, lw=1,
                 label=f"{name}: exp CE(σ), z from the TRUE token")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.invert_xaxis()
    ax2.set_xlabel("σ of the step (a chain runs left → right)")
    ax2.set_ylabel("perplexity, log scale")
    ax2.set_title("looped_db: prediction quality along the chain", fontsize=10)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(res: dict) -> str:
    tr, ms = res["train"], res["models"]
    names = list(ms)
    lines = ["training (equal wall-clock per model, steps interleaved in one process, 1 thread): "
             + "; ".join(f"{n} {tr[n]['steps']} steps ({tr[n]['wall']:.0f}s wall, {tr[n]['cpu']:.0f} CPU-s)" for n in names)
             + f". Scored on {res['windows']} windows x {SEQ} = {res['tokens']} val tokens; looped_db ppl@k with "
             f"{res['draws']} draws.", "",
             "| K | " + " | ".join(f"{n} {'exact PPL' if n == 'huginn' else 'ppl@K'}" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    lines.append("| 0 (one call at σ_hi) | " + " | ".join("–" if n == "huginn" else f"{ms[n]['ppl'][0]:.3f}"
                                                        for n in names) + " |")
    for k in K_GRID:
        lines.append(f"| {k} | " + " | ".join(f"{ms[n]['ppl'][k]:.3f}" for n in names) + " |")
    lines.append("")
    for n in names:
        if n == "huginn":
            continue
        dp = ms[n]["ppl"]
        seq = [dp[k] for k in K_GRID]
        mono = all(b <= a * 1.01 for a, b in zip(seq, seq[1:]))
        lines.append(f"target '{n} PPL does not get worse as K grows 1 → 32' (1% tolerance per step): "
                     f"{'PASS' if mono else 'MISS'} (ppl@1 {dp[1]:.3f} → ppl@32 {dp[32]:.3f}; σ range "
                     f"[{ms[n]['edges'][0]:.3g}, {ms[n]['edges'][-1]:.3g}])")
    for n in names:
        if n != "huginn":
            ob = ms[n].get("ppl_other_bridge")
            if ob:
                lines.append(f"{n} with the {ob['bridge']} bridge: " + ", ".join(
                    f"ppl@{k} {v:.3f}" for k, v in ob.items() if k != "bridge"))
    lines += ["", "| model | read-out | K | PPL | top-1 acc | mean step / iterations used |", "|---|---|---|---|---|---|"]
    if "huginn" in ms and f"top1_acc@{MEAN_R}" in ms["huginn"]:
        lines.append(f"| huginn | exact, after K = {MEAN_R} | {MEAN_R} | {ms['huginn']['ppl'][MEAN_R]:.3f} | "
                     f"{ms['huginn'][f'top1_acc@{MEAN_R}']:.3f} | {MEAN_R} |")
    for n in names:
        if n == "huginn":
            continue
        r = ms[n]
        for K, gated in r["entropy_gated"].items():
            best = min(r["chain_steps"][K], key=lambda q: q["ppl"])
            first, last = r["chain_steps"][K][0], r["chain_steps"][K][-1]
            lines.append(f"| {n} | first step (σ_hi = {first['sigma']:.3g}; = ppl@0) | {K} | {first['ppl']:.3f} | "
                         f"{first.get('top1_acc', float('nan')):.3f} | 1 |")
            lines.append(f"| {n} | last step (= ppl@{K}; this script's chains) | {K} | {last['ppl']:.3f} | "
                         f"{last.get('top1_acc', float('nan')):.3f} | {K} |")
            lines.append(f"| {n} | best single step (oracle: step {best['step'] + 1}, σ {best['sigma']:.3g}) | {K} | "
                         f"{best['ppl']:.3f} | {best.get('top1_acc', float('nan')):.3f} | {best['step'] + 1} |")
            for tau, v in gated.items():
                lines.append(f"| {n} | entropy-gated τ = {tau} nats ({100 * v['never_below']:.0f}% never below → last "
                             f"step) | {K} | {v['ppl']:.3f} | | {v['mean_step']:.2f} |")
        for rule, v in r["adaptive_exit"].items():
            lines.append(f"| {n} | adaptive exit {rule} (no exit: {v['ppl_no_exit']:.3f}) | 16 | {v['ppl']:.3f} | | "
                         f"{v['mean_iterations']:.2f} |")
    lines.append("")
    for n in names:
        if n != "huginn":
            lines.append(f"{n}: CE(σ) of one call with z = y_true + σε (nats): "
                         + ", ".join(f"σ={s:g}: {v:.3f}" for s, v in ms[n]["ce_vs_sigma"].items()))
    return "\n".join(lines)


def _numeric_keys(obj):
    """JSON turned the int K / float tau keys into strings: turn them back."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            try:
                k = int(k) if k.isdigit() else float(k)
            except (ValueError, AttributeError):
                pass
            out[k] = _numeric_keys(v)
        return out
    if isinstance(obj, list):
        return [_numeric_keys(v) for v in obj]
    return obj


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=4.0, help="training wall-clock per model")
    ap.add_argument("--models", default="huginn,looped_db,looped_db_s8",
                    help="comma-separated: huginn, looped_db (defaults), looped_db_s8 (equi_entropy + prev_token)")
    ap.add_argument("--curve-every", type=int, default=50,
                    help="looped_db_s8: re-measure CE(sigma) and move the edges every N steps (trainer default 200)")
    ap.add_argument("--windows", type=int, default=48, help="val windows of 128 tokens (spread over val.bin)")
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--entropy-taus", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--kl-eps", type=float, nargs="+", default=[1e-2, 1e-3])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", help="write the trained state dicts here (e.g. /tmp/looped_quality.pt)")
    ap.add_argument("--load", help="skip training: score the state dicts saved by --save")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG and table from the JSON")
    ap.add_argument("--name", default="looped_quality", help="output stem under bench/results (must start with looped_)")
    args = ap.parse_args()
    if args.replot:
        res = _numeric_keys(json.loads((RESULTS / f"{args.name}.json").read_text()))
        print(table(res))
        plot(res, RESULTS / f"{args.name}.png")
        return
    if not args.name.startswith("looped_"):
        ap.error("--name must start with looped_")
    torch.set_num_threads(args.threads)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:5.0f}s] {msg}", flush=True)

    data = ensure_prepared("bible", str(ROOT / "data_cache"), "byte", 0.05, 0, progress=False)
    stream = TokenStream(os.path.join(data, "train.bin"), SEQ, V)
    val = TokenStream(os.path.join(data, "val.bin"), SEQ, V)
    blocks = list(val.iter_blocks(SEQ))
    pick = [blocks[round(i * (len(blocks) - 1) / max(1, args.windows - 1))] for i in range(min(args.windows, len(blocks)))]
    xs, ys = torch.stack([b[0] for b in pick]), torch.stack([b[1] for b in pick])
    windows = [(xs[i:i + 24], ys[i:i + 24]) for i in range(0, len(pick), 24)]
    probe_x, probe_y = xs[::max(1, len(pick) // 8)][:8], ys[::max(1, len(pick) // 8)][:8]

    @torch.no_grad()
    def val_probe(name, m):
        g = torch.Generator().manual_seed(5)
        if name == "huginn":
            return float(m.eval_nll(probe_x, probe_y, k_grid=[MEAN_R], generator=g)[MEAN_R].mean())
        return float(m.eval_nll(probe_x, probe_y, k_grid=[], draws=1, generator=g)[0].mean())

    models = {n: build(n) for n in args.models.split(",")}
    if args.load:
        saved = torch.load(args.load, weights_only=False)
        for n, m in models.items():
            m.load_state_dict(saved["models"][n])
            if n in saved.get("edges", {}):
                m.set_edges(saved["edges"][n])
        state = saved["train"]
        log(f"loaded {args.load}")
    else:
        log(f"training {', '.join(models)} for {args.minutes} min each of its own step wall-time, interleaved, "
            f"{torch.get_num_threads()} thread(s)")
        state = train(models, stream, val, val_probe, args.minutes * 60, args.curve_every, log)
        if args.save:
            torch.save({"models": {n: m.state_dict() for n, m in models.items()}, "train": state,
                        "edges": {n: m.edges for n, m in models.items() if hasattr(m, "edges")}}, args.save)
    for m in models.values():
        m.eval()
    res = score(models, windows, args, log)
    res["train"] = {**state, "budget_s": args.minutes * 60}
    res["config"] = {"shape": SHAPE, "batch": BATCH, "vocab": V, "huginn_mean_recurrence": MEAN_R,
                     "huginn_backprop_depth": K_BP, "db_variants": {n: DB_VARIANTS[n] for n in models if n in DB_VARIANTS},
                     "curve_every": args.curve_every, "lr": LR, "min_lr": MIN_LR, "warmup": WARMUP,
                     "weight_decay": WD, "threads": args.threads, "k_grid": K_GRID, "draws": args.draws,
                     "entropy_taus": args.entropy_taus, "kl_eps": args.kl_eps, "torch": torch.__version__,
                     "machine": f"{os.cpu_count()}-core CPU, shared with other benchmarks",
                     "load_avg_1m_end": os.getloadavg()[0], "bench_wall_s": time.time() - t_start}
    text = table(res)
    res["table"] = text
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    plot(res, RESULTS / f"{args.name}.png")
    log(f"wrote bench/results/{args.name}.json and {args.name}.png")


if __name__ == "__main__":
    main()
