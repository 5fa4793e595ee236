"""Training cost of the looped DiffusionBlocks LM vs the Huginn-style BPTT baseline (method.md §4, §8).

    python bench/looped_cost.py                 # V = 257 (timed + memory) and V = 50257 (memory + 2 rounds), ~6 min
    python bench/looped_cost.py --vocabs 257    # byte-level only, ~3 min
    python bench/looped_cost.py --device cuda --batch 8 --seq 1024 --dtype bf16   # on a GPU

Shape: the paper's looped setting, prelude 2 + weight-tied core 4 + coda 2, d 512, 8 heads (SwiGLU
hidden 1408), fp32 on CPU, batch 2 x seq 256 by default (CPU time). Three training steps are compared:

  huginn       r = 32 core iterations (r-bar = 32, fixed at its mean for timing), backprop through the
               last k = 8: `model(x, 32, no_grad_iterations=24)` + cross-entropy, i.e. exactly what
               `training_loss` does when it draws r = 32.
  looped_db    `model.training_loss(x, y, step, seed=0)`: ONE forward pass of both streams, sigma over
               the whole range, no BPTT.
  looped_db f=0.25   the same with `diffusion.target_fraction: 0.25` (a quarter of the noisy slots).

Measured:
  time         forward + backward of one step. ONE process holds the three models and runs their steps
               interleaved (round i: h, db, db25 in a rotating order), torch.set_num_threads(1), so a job
               sharing the machine slows all three alike. CPU seconds (process_time) are the primary number,
               wall-clock is reported too. Warm-up rounds are not timed.
  act bytes    bytes of the tensors autograd saves for backward (torch.autograd.graph.saved_tensors_hooks),
               deduplicated by storage, parameters and buffers excluded, attributed to the region that saved
               them (prelude / core / adapter / coda / noisy core / noisy coda / head+CE).
  peak RSS     peak RSS delta of one step in a FRESH subprocess per configuration (VmHWM reset through
               /proc/self/clear_refs before the step, glibc mmap threshold 64 KiB so freed tensors go back to
               the OS); gradients were allocated in the warm-up step (zeroed, not freed), so the delta is
               activations + kernel scratch.
  (cuda)       time with torch.cuda.synchronize, memory = max_memory_allocated - memory_allocated before.

The ANALYTIC model (layer-pass units: one layer forward over the T tokens = 1, backward = 2, adapter and the
last clean layer counted by their share of a layer's matmul parameters) is printed beside the measurement,
together with the issue's simpler count; see bench/README_looped.md for the derivation.
Writes bench/results/looped_cost.json (or looped_cost_<device>.json) and prints a markdown table.
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

SHAPE = {"n_prelude": 2, "n_layers": 4, "n_coda": 2, "d_model": 512, "n_heads": 8}
R, K_BP = 32, 8  # huginn: iterations run, iterations backpropagated
TIME_TARGET, MEM_TARGET = 5.0, 2.8  # huginn / looped_db, higher is better
CONFIGS = {
    "huginn": {"model": {"kind": "huginn", "mean_recurrence": R, "backprop_depth": K_BP}},
    "looped_db": {"model": {"kind": "looped_db"}, "diffusion": {"num_blocks": 1}},
    "looped_db f=0.25": {"model": {"kind": "looped_db"}, "diffusion": {"num_blocks": 1, "target_fraction": 0.25}},
}
TIMED_ONLY: dict[str, str] = {}  # timing-only variants -> the configuration whose memory they share (none now)


# ------------------------------------------------------------------------------------------------
# analytic model


LAYER_SAVED_D = 24  # d-vectors per token one pre-norm SwiGLU layer saves for backward, counted (see README)


def analytic(f: float = 1.0, vocab: int = 257) -> dict:
    """Layer-pass counts (forward units; backward = 2 units) for both models at the bench's shape.

    Time: one unit = one layer's matmuls over T tokens (attention scores, ~4% at T = 256, ignored).
    Memory: one unit = what one layer saves for backward over T tokens (~LAYER_SAVED_D d-vectors/token).
    The tied head + CE: d*V matmul parameters per token (time) and V floats per token (memory);
    looped_db runs it on the f*T noisy slots only.
    """
    d = SHAPE["d_model"]
    hidden = 64 * -(-8 * d // (3 * 64))  # ffn_width's rule: 1408 at d 512
    layer = 4 * d * d + 3 * d * hidden  # matmul parameters of one layer (attention 4d^2 + SwiGLU 3dh)
    a = 2 * d * d / layer  # the adapter Linear(2d, d), as a share of one layer
    qkv = 3 * d * d / layer  # the last clean layer computes only its K/V (need_output=False)
    head_t = d * vocab / layer  # tied head matmul, as a share of one layer
    head_m = vocab / (LAYER_SAVED_D * d)  # saved log-softmax (V floats/token), in layers
    P, C, Cd = SHAPE["n_prelude"], SHAPE["n_layers"], SHAPE["n_coda"]
    # huginn: r iterations forward (no-grad ones cost the same), backward through prelude + last k + coda
    h_fwd = P + R * (C + a) + Cd + head_t
    h_bwd = 2 * (P + K_BP * (C + a) + Cd + head_t)
    h_mem = P + K_BP * C + Cd + head_m  # layers whose activations are saved (+ the adapter inputs, ~0)
    # looped_db: clean stream prelude + core + coda (last layer: K/V only); noisy stream core + coda on f*T
    clean = P + C + (Cd - 1) + qkv
    noisy = f * (C + Cd + head_t)
    db_fwd = clean + noisy
    db_time = 3 * db_fwd
    db_mem = clean + f * (C + Cd + head_m)
    # the issue's count: 2 streams x (core + coda), prelude, K/V-only layer and head ignored
    issue_h_time = P + R * C + Cd + 2 * (P + K_BP * C + Cd)
    issue_db_time = 3 * (C + Cd) * (1 + f)
    issue_h_mem, issue_db_mem = P + K_BP * C + Cd, (C + Cd) * (1 + f)
    return {"vocab": vocab, "layer_params": layer, "adapter_share": a, "kv_only_share": qkv,
            "head_time_units": head_t, "head_mem_units": head_m,
            "huginn_time_units": h_fwd + h_bwd, "db_time_units": db_time,
            "fwd_ratio": h_fwd / db_fwd, "bwd_ratio": h_bwd / (2 * db_fwd),
            "huginn_mem_units": h_mem, "db_mem_units": db_mem,
            "time_ratio": (h_fwd + h_bwd) / db_time, "mem_ratio": h_mem / db_mem,
            "issue_time_ratio": issue_h_time / issue_db_time, "issue_mem_ratio": issue_h_mem / issue_db_mem,
            # with the prelude recomputed in backward (activation checkpointing of the clean prelude)
            "mem_ratio_prelude_recomputed": h_mem / (db_mem - P),
            "time_ratio_prelude_recomputed": (h_fwd + h_bwd) / (db_time + P)}


# ------------------------------------------------------------------------------------------------
# workers


def _status_kb(key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def build(name: str, vocab: int, seq: int, device: str, dtype):
    import torch

    from looped_lm.config import config_from_dict
    from looped_lm.models import build_model

    raw = {k: dict(v) for k, v in CONFIGS[TIMED_ONLY.get(name, name)].items()}
    raw["model"].update(SHAPE, seq_len=seq)
    torch.manual_seed(0)
    model = build_model(config_from_dict(raw), vocab).to(device=device, dtype=dtype)
    model.train()
    return model


def step_fn(name, model, x, y):
    """One training step's loss (forward), the same computation as training_loss at r = 32 for huginn."""
    import torch.nn.functional as F

    if name == "huginn":
        logits = model(x, R, no_grad_iterations=R - K_BP)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    return model.training_loss(x, y, step=0, seed=0)[0]


class Regions:
    """Saved-for-backward bytes, deduplicated by storage, attributed to the region that saved them."""

    def __init__(self, model, name):
        import torch.nn.functional as F

        self.current, self.seen = "other", {}
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.undo = []

        def tag(obj, attr, region):
            fn = getattr(obj, attr)

            def wrapped(*a, **k):
                prev, self.current = self.current, region
                try:
                    return fn(*a, **k)
                finally:
                    self.current = prev

            setattr(obj, attr, wrapped)
            self.undo.append((obj, attr, fn))

        for layer in model.prelude:
            tag(layer, "forward", "prelude")
        if name == "huginn":
            for layer in model.core:
                tag(layer, "forward", "core")
            for layer in model.coda:
                tag(layer, "forward", "coda")
            tag(model.adapter, "forward", "adapter")
            tag(model.norm, "forward", "head+CE")
        else:
            for part, layers in (("core", model.blocks[0]), ("coda", model.coda)):
                for layer in layers:
                    tag(layer, "clean", part)
                    tag(layer, "noisy", "noisy " + part)
            tag(model, "denoise_logits", "head+CE")
        tag(F, "cross_entropy", "head+CE")
        linear = F.linear

        def head_linear(*a, **k):  # huginn's tied head is a bare F.linear after the coda
            if self.current != "other":
                return linear(*a, **k)
            self.current = "head+CE"
            try:
                return linear(*a, **k)
            finally:
                self.current = "other"

        if name == "huginn":
            F.linear = head_linear

    def pack(self, t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            self.seen[ptr] = (s.nbytes(), self.current)
        return t

    def by_region(self) -> dict:
        out = {}
        for n, region in self.seen.values():
            out[region] = out.get(region, 0) + n
        return out


def worker_memory(spec: dict) -> dict:
    """Fresh process, one configuration: saved-tensor bytes by region and peak RSS / CUDA delta of a step."""
    import torch

    torch.set_num_threads(spec["threads"])
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    model = build(spec["name"], spec["vocab"], spec["seq"], device, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)
    y = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)
    step_fn(spec["name"], model, x, y).backward()  # warm-up; allocates the gradients once
    regions = Regions(model, spec["name"])
    model.zero_grad(set_to_none=False)
    gc.collect()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    with torch.autograd.graph.saved_tensors_hooks(regions.pack, lambda t: t):
        loss = step_fn(spec["name"], model, x, y)
        loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = (_status_kb("VmHWM") - before) * 1024
    by_region = regions.by_region()
    return {**spec, "act_bytes": sum(by_region.values()), "act_by_region": by_region,
            "saved_tensors": len(regions.seen), "peak_delta_bytes": peak, "loss": float(loss),
            "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__}


def worker_time(spec: dict) -> dict:
    """One process, all configurations, steps interleaved round by round (rotating order)."""
    import torch

    torch.set_num_threads(spec["threads"])
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    names = list(CONFIGS) + list(TIMED_ONLY)
    models = {n: build(n, spec["vocab"], spec["seq"], device, dtype) for n in names}
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)
    y = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cpu = {n: [] for n in names}
    wall = {n: [] for n in names}
    fwd = {n: [] for n in names}  # CPU seconds of the forward part (loss computed)
    order_log = []
    for rnd in range(spec["warmup"] + spec["rounds"]):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        order_log.append(order)
        for n in order:
            m = models[n]
            m.zero_grad(set_to_none=False)
            sync()
            c0, t0 = time.process_time(), time.perf_counter()
            loss = step_fn(n, m, x, y)
            sync()
            cm = time.process_time()
            loss.backward()
            sync()
            c1, t1 = time.process_time(), time.perf_counter()
            if rnd >= spec["warmup"]:
                cpu[n].append(c1 - c0)
                wall[n].append(t1 - t0)
                fwd[n].append(cm - c0)
            print(f"    round {rnd} {n:<17} cpu {c1 - c0:6.2f}s wall {t1 - t0:6.2f}s"
                  f"{' (warm-up)' if rnd < spec['warmup'] else ''}", file=sys.stderr, flush=True)
    return {**spec, "cpu_s": cpu, "wall_s": wall, "fwd_cpu_s": fwd, "threads_used": torch.get_num_threads(),
            "torch": torch.__version__}


# ------------------------------------------------------------------------------------------------
# driver


def run_fresh(mode: str, spec: dict) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, __file__, "--worker", mode, json.dumps(spec)], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=None if mode == "time" else subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"worker {mode} {spec} failed:\n{(out.stderr or '')[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def mib(n):
    return n / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "SPEC"))
    ap.add_argument("--vocabs", default="257,50257", help="comma-separated vocabulary sizes")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5, help="timed interleaved rounds (first vocabulary)")
    ap.add_argument("--rounds-other", type=int, default=2, help="timed rounds for the other vocabularies")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (1: stable on a shared box)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    args = ap.parse_args()
    if args.worker:
        mode, spec = args.worker
        print(json.dumps((worker_memory if mode == "memory" else worker_time)(json.loads(spec))))
        return

    import torch

    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(args.dtype, args.dtype)
    vocabs = [int(v) for v in args.vocabs.split(",")]
    t_start = time.time()
    base = {"batch": args.batch, "seq": args.seq, "threads": args.threads, "device": args.device, "dtype": dtype}
    results = []
    for i, V in enumerate(vocabs):
        mem = {}
        for name in CONFIGS:
            t0 = time.time()
            mem[name] = run_fresh("memory", {**base, "name": name, "vocab": V})
            print(f"  V={V} {name:<17} act {mib(mem[name]['act_bytes']):7.1f} MiB  peak delta "
                  f"{mib(mem[name]['peak_delta_bytes']):7.1f} MiB  [{time.time() - t0:.0f}s]", flush=True)
        rounds = args.rounds if i == 0 else args.rounds_other
        print(f"  V={V}: timing {rounds} interleaved rounds (+{args.warmup} warm-up), {args.threads} thread(s)",
              flush=True)
        t0 = time.time()
        tim = run_fresh("time", {**base, "vocab": V, "rounds": rounds, "warmup": args.warmup})
        load = os.getloadavg()[0]
        print(f"  [{time.time() - t0:.0f}s, load {load:.1f}]", flush=True)
        h_cpu, h_wall = median(tim["cpu_s"]["huginn"]), median(tim["wall_s"]["huginn"])
        h_mem, h_peak = mem["huginn"]["act_bytes"], mem["huginn"]["peak_delta_bytes"]
        first = len(results)
        for name in ("looped_db", "looped_db f=0.25", *TIMED_ONLY):
            f = 0.25 if "0.25" in name else 1.0
            an = analytic(f, V)
            d_cpu, d_wall = median(tim["cpu_s"][name]), median(tim["wall_s"][name])
            h_f, d_f = median(tim["fwd_cpu_s"]["huginn"]), median(tim["fwd_cpu_s"][name])
            t_ratio = (h_cpu if args.device == "cpu" else h_wall) / (d_cpu if args.device == "cpu" else d_wall)
            memory = mem[TIMED_ONLY.get(name, name)]  # the flat-CE variant saves what looped_db saves
            m_ratio = h_mem / memory["act_bytes"]
            results.append({
                "vocab": V, "variant": name, "target_fraction": f,
                "huginn_step_cpu_s": h_cpu, "db_step_cpu_s": d_cpu, "huginn_step_wall_s": h_wall,
                "db_step_wall_s": d_wall, "time_ratio": t_ratio, "time_ratio_wall": h_wall / d_wall,
                "huginn_fwd_cpu_s": h_f, "db_fwd_cpu_s": d_f, "fwd_ratio": h_f / d_f,
                "bwd_ratio": (h_cpu - h_f) / (d_cpu - d_f), "db_bwd_over_fwd": (d_cpu - d_f) / d_f,
                "huginn_act_MiB": mib(h_mem), "db_act_MiB": mib(memory["act_bytes"]), "mem_ratio": m_ratio,
                "huginn_peak_MiB": mib(h_peak), "db_peak_MiB": mib(memory["peak_delta_bytes"]),
                "peak_ratio": h_peak / max(1, memory["peak_delta_bytes"]),
                "huginn_act_by_region_MiB": {k: mib(v) for k, v in mem["huginn"]["act_by_region"].items()},
                "db_act_by_region_MiB": {k: mib(v) for k, v in memory["act_by_region"].items()},
                "analytic": an,
                "time_verdict": "PASS" if t_ratio >= TIME_TARGET else "MISS",
                "mem_verdict": "PASS" if m_ratio >= MEM_TARGET else "MISS"})
        results[first]["raw_time"] = tim
        results[first]["raw_memory"] = mem

    unit = "CPU-s" if args.device == "cpu" else "s (wall)"
    lines = [
        f"machine: {os.cpu_count()}-core CPU ({'shared with another benchmark' if args.device == 'cpu' else ''}) "
        f"device {args.device}, torch {torch.__version__}, {args.threads} thread(s) per worker "
        f"(torch.set_num_threads), {dtype}; shape prelude 2 + core 4 + coda 2, d 512, 8 heads, batch {args.batch} x "
        f"seq {args.seq}; huginn r = {R} (r-bar {R}, fixed), backprop k = {K_BP}; steps interleaved "
        f"(huginn / db / db f=0.25, rotating order) in one process, median of the timed rounds; memory in a "
        f"fresh subprocess per configuration. Bench wall {time.time() - t_start:.0f}s.",
        "",
        f"| V | looped_db variant | step {unit} huginn / db | time ratio (analytic; issue) | target ≥{TIME_TARGET}× | "
        "saved act MiB huginn / db | memory ratio (analytic; issue) | target ≥2.8× | peak Δ MiB huginn / db (ratio) |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        an = r["analytic"]
        h_s = r["huginn_step_cpu_s"] if args.device == "cpu" else r["huginn_step_wall_s"]
        d_s = r["db_step_cpu_s"] if args.device == "cpu" else r["db_step_wall_s"]
        lines.append(
            f"| {r['vocab']} | {r['variant']} | {h_s:.3f} / {d_s:.3f} | **{r['time_ratio']:.2f}×** "
            f"({an['time_ratio']:.2f}; {an['issue_time_ratio']:.2f}) | {r['time_verdict']} | "
            f"{r['huginn_act_MiB']:.0f} / {r['db_act_MiB']:.0f} | **{r['mem_ratio']:.2f}×** "
            f"({an['mem_ratio']:.2f}; {an['issue_mem_ratio']:.2f}) | {r['mem_verdict']} | "
            f"{r['huginn_peak_MiB']:.0f} / {r['db_peak_MiB']:.0f} ({r['peak_ratio']:.2f}×) |")
    lines += ["", "saved activations by region (MiB):", ""]
    regions = ["other", "prelude", "adapter", "core", "coda", "noisy core", "noisy coda", "head+CE"]
    lines += ["| V | model | " + " | ".join(regions) + " | total |", "|---|---|" + "---|" * (len(regions) + 1)]
    for V in vocabs:
        rows = [r for r in results if r["vocab"] == V]
        entries = [("huginn", rows[0]["huginn_act_by_region_MiB"], rows[0]["huginn_act_MiB"])]
        entries += [(r["variant"], r["db_act_by_region_MiB"], r["db_act_MiB"]) for r in rows
                    if r["variant"] not in TIMED_ONLY]
        for name, reg, tot in entries:
            lines.append(f"| {V} | {name} | " + " | ".join(f"{reg.get(k, 0):.1f}" for k in regions) + f" | {tot:.1f} |")
    lines += ["", "where the time goes (CPU-s, median): forward (loss computed) / backward, and the ratios vs the "
              "analytic layer-pass counts:", "",
              "| V | variant | huginn fwd / bwd | db fwd / bwd | db bwd÷fwd (analytic 2) | fwd ratio (analytic) "
              "| bwd ratio (analytic) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        an = r["analytic"]
        lines.append(f"| {r['vocab']} | {r['variant']} | {r['huginn_fwd_cpu_s']:.2f} / "
                     f"{r['huginn_step_cpu_s'] - r['huginn_fwd_cpu_s']:.2f} | {r['db_fwd_cpu_s']:.3f} / "
                     f"{r['db_step_cpu_s'] - r['db_fwd_cpu_s']:.3f} | {r['db_bwd_over_fwd']:.2f} | "
                     f"{r['fwd_ratio']:.2f} ({an['fwd_ratio']:.2f}) | {r['bwd_ratio']:.2f} ({an['bwd_ratio']:.2f}) |")
    an_all = {f"V={V} f={f}": analytic(f, V) for V in vocabs for f in (1.0, 0.25)}
    lines += ["", "analytic model (layer-pass units: one layer's forward matmuls over T tokens = 1, its backward = 2; "
              "memory unit = what one layer saves for backward over T tokens):", "",
              "| V | f | adapter / K/V-only layer / head (time units) | huginn time | db time | time ratio | "
              "huginn mem | db mem | mem ratio | issue's count time / mem | prelude recomputed: time / mem ratio |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, an in an_all.items():
        V, f = key.split(" ")
        lines.append(f"| {V[2:]} | {f[2:]} | {an['adapter_share']:.3f} / {an['kv_only_share']:.3f} / "
                     f"{an['head_time_units']:.3f} | {an['huginn_time_units']:.1f} | {an['db_time_units']:.1f} | "
                     f"{an['time_ratio']:.2f} | {an['huginn_mem_units']:.2f} | {an['db_mem_units']:.2f} | "
                     f"{an['mem_ratio']:.2f} | {an['issue_time_ratio']:.2f} / {an['issue_mem_ratio']:.2f} | "
                     f"{an['time_ratio_prelude_recomputed']:.2f} / {an['mem_ratio_prelude_recomputed']:.2f} |")
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.device == "cpu" else "_" + args.device.split(":")[0]
    (RESULTS / f"looped_cost{suffix}.json").write_text(json.dumps(
        {"rows": results, "analytic": an_all, "table": table,
         "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
