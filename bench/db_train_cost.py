"""Training cost of one DiffusionBlocks-AR step vs one end-to-end GPT step (method.md §3, §4).

    python bench/db_train_cost.py            # all configurations, ~5-8 min on a 2-core CPU
    python bench/db_train_cost.py --quick    # seq 256 only

Every configuration runs in a FRESH subprocess (so memory peaks never mix), fp32, batch 4,
8 layers, d 256, 4 heads; DB-AR with B = 4 blocks (2 layers each), round-robin block sampling so
that the B timed steps visit every block once. Per configuration:

  time        forward + backward of `model.training_loss(x, y, step, seed=0)`, after `--warmup`
              untimed steps; DB: mean over B steps (one per block), GPT: mean over B steps too.
  act_bytes   activation memory, exactly: the bytes of every tensor autograd saves for backward
              (torch.autograd.graph.saved_tensors_hooks), deduplicated by storage data_ptr, counted
              at storage size, parameters excluded. Split into `head` (everything saved inside the
              tied head + cross-entropy: final norm, logits, log-softmax) and `body` (the layers).
  rss_peak    peak RSS delta of one step: /proc/self/status VmHWM after the step minus VmRSS before
              it (VmHWM reset through /proc/self/clear_refs), glibc's mmap threshold pinned to 64 KiB
              so freed tensors go back to the OS between steps. It includes the gradients (set to
              None before the step) and the transient buffers of the kernels.

Two vocabularies: V = 50257 (GPT-2, what the project trains with) and V = 512, where the
embedding/head/loss are negligible, so the ratio reads the layers alone (the paper's accounting).
Time statistic: the MIN CPU time over the timed steps (every DB block does the same work, so all
timed steps of a configuration are repeats; the min is the one least disturbed by other jobs on a
shared box); the mean is in the JSON. A config whose wall time exceeds its CPU time by >30% ran
under contention and is flagged with '~'.

Writes bench/results/db_train_cost.json and prints a markdown table with the targets of the issue.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

LAYERS, D_MODEL, HEADS, BATCH, NUM_BLOCKS = 8, 256, 4, 4, 4
# targets of the issue (ratios DB / gpt; lower is better)
ACT_TARGET = {1.0: 0.55, 0.25: 0.35}  # activation memory of one block's step, at seq 1024
ACT_FLOOR = {1.0: 2 / NUM_BLOCKS, 0.25: 1.25 / NUM_BLOCKS}
TIME_TARGET = {1.0: 2.2, 0.25: 1.4}  # B DB steps / one gpt step
TIME_FLOOR = {1.0: 2.0, 0.25: 1.25}


# ------------------------------------------------------------------------------------------------
# worker: one configuration, one process


def _status_kb(key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def worker(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from looped_lm.config import config_from_dict
    from looped_lm.models import build_model

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    kind, T, V, f = spec["kind"], spec["seq"], spec["vocab"], spec.get("target_fraction", 1.0)
    raw = {"model": {"kind": kind, "n_layers": LAYERS, "d_model": D_MODEL, "n_heads": HEADS, "seq_len": T,
                     **spec.get("model_extra", {})},
           "diffusion": {"num_blocks": NUM_BLOCKS, "block_sampling": "round_robin", "target_fraction": f,
                         **spec.get("diffusion_extra", {})}}
    model = build_model(config_from_dict(raw), V)
    model.train()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (BATCH, T), generator=g)
    y = torch.randint(0, V, (BATCH, T), generator=g)

    # --- head/loss attribution: anything saved while inside the head or the CE is "head" ------
    region = {"head": False}

    def tagged(fn):
        def wrapped(*a, **k):
            prev, region["head"] = region["head"], True
            try:
                return fn(*a, **k)
            finally:
                region["head"] = prev
        return wrapped

    if kind == "gpt":
        model.logits = tagged(model.logits)
    else:
        model.denoise_logits = tagged(model.denoise_logits)
    orig_ce = F.cross_entropy
    F.cross_entropy = tagged(orig_ce)  # the models call F.cross_entropy through torch.nn.functional

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen[ptr] = (s.nbytes(), region["head"])
        return t

    step = 0
    for _ in range(spec["warmup"]):
        model.zero_grad(set_to_none=True)
        loss, _ = model.training_loss(x, y, step=step, seed=0)
        loss.backward()
        step += 1
    # timed steps; each also measures its saved tensors (the hook only records sizes: negligible cost)
    # and its peak RSS delta (VmHWM reset before the step)
    times, cpu, blocks, acts, rss = [], [], [], [], []
    for _ in range(spec["steps"]):
        model.zero_grad(set_to_none=True)
        seen.clear()
        gc.collect()
        rss_before = _status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, metrics = model.training_loss(x, y, step=step, seed=0)
            loss.backward()
        cpu.append(time.process_time() - c0)
        times.append(time.perf_counter() - t0)
        rss.append((_status_kb("VmHWM") - rss_before) * 1024)
        head = sum(n for n, h in seen.values() if h)
        acts.append((sum(n for n, _ in seen.values()), head, len(seen)))
        blocks.append(metrics.get("block"))
        step += 1
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    act_total, act_head, n_saved = max(acts)
    F.cross_entropy = orig_ce
    return {**spec, "wall_s": times, "cpu_s": cpu, "blocks_timed": blocks,
            "step_s_mean": sum(cpu) / len(cpu), "wall_s_mean": sum(times) / len(times),
            "step_s_min": min(cpu), "wall_s_min": min(times),
            "act_bytes": act_total, "act_head_bytes": act_head, "act_body_bytes": act_total - act_head,
            "act_per_step": acts, "saved_tensors": n_saved, "rss_per_step": rss,
            "rss_peak_delta_bytes": max(rss), "grad_bytes": grad_bytes,
            "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------------------
# driver


def run_fresh(spec: dict) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"worker {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n):
    return n / 2**20


def verdict(value, target):
    return "PASS" if value <= target else "MISS"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--retable", action="store_true", help="rebuild the table from bench/results/db_train_cost.json")
    ap.add_argument("--quick", action="store_true", help="seq 256 only, no V=512 rows")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    ap.add_argument("--gpt-steps", type=int, default=2, help="timed gpt steps (all identical)")
    ap.add_argument("--chunked", action="store_true",
                    help="T=1024, V=50257 with model.loss_chunk 128 in BOTH models (+ the DB defaults of "
                         "docs/results.md); writes db_train_cost_chunked.json")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per worker (1: stable CPU-time ratios on a shared 2-core box)")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    if args.retable:
        saved = json.loads((RESULTS / "db_train_cost.json").read_text())
        table, rows = make_table(saved["raw"], argparse.Namespace(**saved["args"]), saved["seqs"],
                                 saved.get("bench_wall_s", 0))
        print(table)
        return
    seqs = [256] if args.quick else [256, 1024]
    specs = []
    if args.chunked:
        seqs = [1024]
        chunk = {"loss_chunk": 128}
        new = {"parameterization": "likelihood", "noisy_input": "prev_token", "noisy_self": False}
        specs = [{"name": "gpt", "seq": 1024, "vocab": 50257, "kind": "gpt", "model_extra": chunk},
                 {"name": "db", "seq": 1024, "vocab": 50257, "kind": "db_ar", "model_extra": chunk,
                  "diffusion_extra": new},
                 {"name": "db f=0.25", "seq": 1024, "vocab": 50257, "kind": "db_ar", "target_fraction": 0.25,
                  "model_extra": chunk, "diffusion_extra": new}]
    for T in ([] if args.chunked else seqs):  # the product as it is, GPT-2 vocabulary
        specs += [{"name": "gpt", "seq": T, "vocab": 50257, "kind": "gpt"},
                  {"name": "db", "seq": T, "vocab": 50257, "kind": "db_ar"},
                  {"name": "db f=0.25", "seq": T, "vocab": 50257, "kind": "db_ar", "target_fraction": 0.25}]
    if not args.quick and not args.chunked:
        specs += [{"name": "gpt", "seq": 1024, "vocab": 512, "kind": "gpt"},  # layers only
                  {"name": "db", "seq": 1024, "vocab": 512, "kind": "db_ar"},
                  {"name": "db f=0.25", "seq": 1024, "vocab": 512, "kind": "db_ar", "target_fraction": 0.25}]
    results = []
    t_start = time.time()
    for spec in specs:
        spec = {**spec, "warmup": args.warmup, "threads": args.threads,
                "steps": args.gpt_steps if spec["kind"] == "gpt" else NUM_BLOCKS}
        t0 = time.time()
        r = run_fresh(spec)
        r["load_avg_1m"] = os.getloadavg()[0]
        results.append(r)
        print(f"  {spec['name']:<10} V={spec['vocab']:<6} T={spec['seq']:<5} step cpu {r['step_s_mean']:.2f}s "
              f"wall {r['wall_s_mean']:.2f}s act {mib(r['act_bytes']):.0f} MiB (head {mib(r['act_head_bytes']):.0f}) "
              f"rss+ {mib(r['rss_peak_delta_bytes']):.0f} MiB blocks {r['blocks_timed']} "
              f"[{time.time() - t0:.0f}s, load {r['load_avg_1m']:.1f}]", flush=True)

    wall = time.time() - t_start
    table, rows = make_table(results, args, seqs, wall)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "db_train_cost_chunked.json" if args.chunked else "db_train_cost.json"
    (RESULTS / name).write_text(json.dumps({"rows": rows, "raw": results, "table": table,
                                                            "args": vars(args), "seqs": seqs, "bench_wall_s": wall},
                                                           indent=1))


def make_table(results, args, seqs, wall):
    def find(name, T, V):
        return next((r for r in results if r["name"] == name and r["seq"] == T and r["vocab"] == V), None)

    rows = []
    for V in (50257, 512):
        for T in seqs:
            g = find("gpt", T, V)
            if g is None:
                continue
            for name in ("db", "db f=0.25"):
                d = find(name, T, V)
                if d is None:
                    continue
                f = d.get("target_fraction", 1.0)
                act = d["act_bytes"] / g["act_bytes"]
                act_body = d["act_body_bytes"] / g["act_body_bytes"]
                tim = d["step_s_min"] * NUM_BLOCKS / g["step_s_min"]
                rows.append({
                    "vocab": V, "seq": T, "variant": name, "target_fraction": f,
                    "gpt_step_cpu_s": g["step_s_min"], "db_step_cpu_s": d["step_s_min"],
                    "contended": any(r["wall_s_mean"] > 1.3 * r["step_s_mean"] for r in (g, d)),
                    "gpt_step_wall_s": g["wall_s_mean"], "db_step_wall_s": d["wall_s_mean"],
                    "time_ratio_B_steps": tim, "time_ratio_B_steps_wall": d["wall_s_min"] * NUM_BLOCKS / g["wall_s_min"],
                    "time_target": TIME_TARGET[f], "time_floor": TIME_FLOOR[f],
                    "gpt_act_MiB": mib(g["act_bytes"]), "db_act_MiB": mib(d["act_bytes"]),
                    "gpt_act_body_MiB": mib(g["act_body_bytes"]), "db_act_body_MiB": mib(d["act_body_bytes"]),
                    "act_ratio": act, "act_ratio_excl_head": act_body,
                    "act_target": ACT_TARGET[f], "act_floor": ACT_FLOOR[f],
                    "gpt_rss_MiB": mib(g["rss_peak_delta_bytes"]), "db_rss_MiB": mib(d["rss_peak_delta_bytes"]),
                    "rss_peak_ratio": d["rss_peak_delta_bytes"] / g["rss_peak_delta_bytes"],
                    "act_verdict": verdict(act, ACT_TARGET[f]) if T == 1024 else "(T=1024 target)",
                    "act_excl_head_verdict": verdict(act_body, ACT_TARGET[f]) if T == 1024 else "",
                    "time_verdict": verdict(tim, TIME_TARGET[f])})

    import torch

    lines = [f"machine: {os.cpu_count()}-core CPU (shared with other jobs), torch {torch.__version__}, "
             f"{args.threads} thread(s) per worker, fp32, batch {BATCH}, {LAYERS} layers d {D_MODEL} {HEADS} heads, "
             f"DB-AR B={NUM_BLOCKS} (2 layers/block); warm-up {args.warmup} steps; timed: gpt {args.gpt_steps} "
             f"steps, DB {NUM_BLOCKS} (one per block); bench wall {wall:.0f}s",
             "",
             "| V | T | DB variant | step CPU-s gpt / DB | B·DB/gpt time (target) | (wall-clock) | "
             "act MiB gpt / DB | act ratio (target) | act ratio excl. head+CE | head+CE act MiB gpt / DB "
             "| peak-RSS Δ MiB gpt / DB (ratio) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['seq']} | {r['variant']} | {r['gpt_step_cpu_s']:.2f} / {r['db_step_cpu_s']:.2f} | "
            f"**{r['time_ratio_B_steps']:.2f}** (≤{r['time_target']}, floor {r['time_floor']}) {r['time_verdict']} | "
            f"{r['time_ratio_B_steps_wall']:.2f}{' ~' if r['contended'] else ''} | {r['gpt_act_MiB']:.0f} / {r['db_act_MiB']:.0f} | "
            f"**{r['act_ratio']:.2f}** (≤{r['act_target']}, floor {r['act_floor']:.2f}) {r['act_verdict']} | "
            f"{r['act_ratio_excl_head']:.2f} {r['act_excl_head_verdict']} | "
            f"{r['gpt_act_MiB'] - r['gpt_act_body_MiB']:.0f} / {r['db_act_MiB'] - r['db_act_body_MiB']:.0f} | "
            f"{r['gpt_rss_MiB']:.0f} / {r['db_rss_MiB']:.0f} ({r['rss_peak_ratio']:.2f}) |")
    lines += ["",
              "time = CPU seconds of forward+backward of one training step (process_time, 1 thread, min over the "
              "timed steps: robust to the other jobs on this box; wall-clock ratio alongside, '~' = that config ran "
              "contended, wall > 1.3 x CPU); 'B·DB/gpt' = DB step x B / gpt step. "
              "act = bytes of tensors autograd saves for backward (saved_tensors_hooks, dedup by storage, "
              "params excluded; one block's step for DB); 'excl. head+CE' drops what the final norm, tied head "
              "and cross-entropy save (the (B,T,V) log-softmax). peak-RSS delta = VmHWM - VmRSS over one step "
              "(includes gradients and kernel scratch). Memory targets are stated at T=1024. "
              "V=512 rows: same models with a 512-token vocabulary, where head+CE are negligible (layers only)."]
    return "\n".join(lines), rows


if __name__ == "__main__":
    main()
