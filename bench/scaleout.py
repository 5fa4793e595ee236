"""Scale-out (bench/README.md "scaleout.py"): memory, step time and traffic per rank of data parallel (ZeRO 0,
1), block parallel and independent block jobs on 2 gloo ranks, beside `analytic`'s model.

    python bench/scaleout.py memory [SETUP ...]  # the real trainer under the DeepSpeed launcher, each rank instrumented
    python bench/scaleout.py table     # the markdown table, from bench/results/scaleout.json

The ppl@0 of layers_per_block [3, 1] vs [2, 2] at equal counted FLOPs (scaleout.json's `split`) came from
`split` at commit 96d80fb (its own equal-FLOPs loop); the mode, later on bench/common.py's shared loop (a
rerun differed slightly), is this script at commit daf8543, and the `table` that printed those runs at
commit cafa2ef.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "scaleout.json"
MEMORY_MODEL = {"kind": "db_ar", "n_layers": 12, "d_model": 768, "n_heads": 12, "seq_len": 256}
MEMORY_STEPS, MEMORY_WARMUP, MEMORY_BATCH = 5, 2, 2
SETUPS = {
    "dp_zero0": {"train": {"mode": "data_parallel"}, "deepspeed": {"zero_stage": 0}},
    "dp_zero1": {"train": {"mode": "data_parallel"}, "deepspeed": {"zero_stage": 1}},
    "bp": {"train": {"mode": "block_parallel"}, "deepspeed": {"zero_stage": 0}},
    "independent": {"train": {"mode": "data_parallel"}, "deepspeed": {"zero_stage": 0}},
}


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmHWM: peak resident set; VmRSS: current)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# the collectives counted: name -> (the position and keywords of the tensor (or list of tensors) whose bytes it sends)
COLLECTIVES = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
               "all_reduce_coalesced": (0, "tensors"), "reduce_scatter_tensor": (1, "input", "input_tensor"),
               "_reduce_scatter_base": (1, "input", "input_tensor"), "reduce_scatter": (1, "input_list"),
               "all_gather_into_tensor": (0, "output_tensor"), "_all_gather_base": (0, "output_tensor"),
               "all_gather": (0, "tensor_list")}


def _payload(name: str, args, kwargs) -> int:
    at, *keys = COLLECTIVES[name]
    t = args[at] if len(args) > at else next((kwargs[k] for k in keys if k in kwargs), None)
    return sum(x.numel() * x.element_size() for x in (t if isinstance(t, (list, tuple)) else [t]))


def worker(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--out")
    p.add_argument("--local_rank", type=int, default=0)
    args, rest = p.parse_known_args(argv)
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    import deepspeed  # noqa: F401  (its import-time RSS belongs to the baseline)

    from looped_lm import optim, training
    from looped_lm import trainer

    baseline = _status("VmRSS")
    sent = {"bytes": 0}
    for name in COLLECTIVES:
        if hasattr(tdist, name):
            def counting(*a, _fn=getattr(tdist, name), _name=name, **k):
                if tdist.get_world_size(k.get("group")) > 1:  # a group of one sends nothing
                    sent["bytes"] += _payload(_name, a, k)
                return _fn(*a, **k)
            setattr(tdist, name, counting)
    steps, seen = [], {}
    step_fn = training.train_step

    def timed_step(model, optimizer, *a, **k):
        seen["model"], seen["optimizer"], seen["grad_bytes"] = model, optimizer, 0
        b0, t0, c0 = sent["bytes"], time.perf_counter(), time.process_time()
        result = step_fn(model, optimizer, *a, **k)
        steps.append({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                      "comm_bytes": sent["bytes"] - b0, "hwm": _status("VmHWM"), "loss": result.loss})
        return result

    training.train_step = timed_step
    adam_step = optim.BlockwiseAdamW.step

    def counted_step(self, closure=None):  # the gradients the optimiser is handed (before idle units drop theirs);
        # ZeRO 1/2 call it once per parameter group, with that group's flat gradient partition
        seen["grad_bytes"] += sum(q.grad.numel() * q.grad.element_size() for g in self.param_groups
                                  for q in g["params"] if q.grad is not None)
        return adam_step(self, closure)

    optim.BlockwiseAdamW.step = counted_step
    code = trainer.main(["--config", args.config, *rest])
    model, optimizer = seen["model"], seen["optimizer"]
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    rank = int(os.environ.get("RANK", 0))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({
        "code": code, "rank": rank, "baseline_rss": baseline, "steps": steps,
        "optimizer_state_bytes": state, "grad_bytes": seen.get("grad_bytes", 0),
        "weight_bytes": sum(q.numel() * q.element_size() for q in model.parameters())}))
    return code


def _memory_config(path: Path, out_dir: Path, cache: str, setup: str, blocks=()) -> Path:
    import yaml

    raw = {"model": dict(MEMORY_MODEL),
           "diffusion": {"num_blocks": 2, "block_sampling": "round_robin", "blocks_to_train": list(blocks)},
           "data": {"source": "bible", "tokenizer": "gpt2", "cache_dir": cache},
           "train": {"max_steps": MEMORY_STEPS, "batch_size": MEMORY_BATCH, "warmup_steps": 1, "save_every": 0,
                     "eval_every": 0, "log_every": 1, "progress": False, "out_dir": str(out_dir), "resume": "never",
                     **SETUPS[setup]["train"]},
           "deepspeed": SETUPS[setup]["deepspeed"]}
    path.write_text(yaml.safe_dump(raw))
    return path


def _counts(cfg) -> dict:
    """Parameter counts (P, S, per block) and activation bytes per layer / rest, from the model itself."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from looped_lm.models import build_model
    from looped_lm.models.two_stream import TwoStreamLayer

    torch.manual_seed(0)
    model = build_model(cfg, 50257)
    units: dict[str, int] = {}
    for n, p in model.named_parameters():
        units[model.param_unit(n)] = units.get(model.param_unit(n), 0) + p.numel()
    where, saved = ["rest"], {}

    def inside_layer(fn):
        def run(*a, **k):
            where.append("layer")
            try:
                return fn(*a, **k)
            finally:
                where.pop()
        return run

    for m in model.modules():
        if isinstance(m, TwoStreamLayer):  # the objective calls its streams, not forward
            m.clean, m.noisy = inside_layer(m.clean), inside_layer(m.noisy)

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            key = t.untyped_storage().data_ptr()
            saved.setdefault(where[-1], {})[key] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, 50257, (MEMORY_BATCH, cfg.model.seq_len))
    out = {}
    for b in range(cfg.diffusion.num_blocks):
        saved.clear()
        with saved_tensors_hooks(pack, lambda t: t):
            loss, metrics = model.training_loss(x, x.roll(-1, 1), b, 0)  # round robin: step b trains block b
        assert metrics["block"] == b
        layers = len(model.blocks[b])
        out[b] = {"layer": sum(saved.get("layer", {}).values()) / layers, "rest": sum(saved.get("rest", {}).values())}
        del loss
    return {"P": sum(units.values()), "S": units["shared"], "blocks": [units[f"block{b}"] for b in range(len(out))],
            "layers": [len(b) for b in model.blocks], "act_layer": out[0]["layer"], "act_rest": out[0]["rest"],
            "tokens": MEMORY_BATCH * cfg.model.seq_len}


def analytic(setup: str, c: dict, world: int = 2) -> dict:
    """Bytes per rank (rank 0: block 0; P all parameters, S the shared ones, Pb one block's): weights 4P;
    gradients 4P (ZeRO 0 data parallel zero-fills the idle block's) or 4(S + Pb); Adam 8 x what the rank
    steps (ZeRO 1: / W); activations as counted; exchange buffers 4P (ZeRO 0's bucket), 4P / W (ZeRO 1's
    partition), 4S (block parallel); payload per step 4P, 4(S + Pb) + 4P, 4S, 0."""
    P, S, Pb = c["P"], c["S"], c["blocks"][0]
    trained = P if setup.startswith("dp") else S + Pb
    act = c["layers"][0] * c["act_layer"] + c["act_rest"]
    zero1 = setup == "dp_zero1"
    # in param.grad after backward: DeepSpeed's ZeRO 0 all-reduce zero-fills the idle block's, ZeRO 1 does not
    grads = 4 * (S + Pb if zero1 else trained)
    adam = 8 * trained / (world if zero1 else 1)
    # what the exchange copies: DeepSpeed's flat all-reduce bucket (ZeRO 0) or fp32 partition (ZeRO 1), ours
    buffers = {"dp_zero0": 4 * P, "dp_zero1": 4 * P / world, "bp": 4 * S, "independent": 0}[setup]
    comm = {"dp_zero0": 4 * P, "dp_zero1": 4 * (S + Pb) + 4 * P, "bp": 4 * S, "independent": 0}[setup]
    return {"weights": 4 * P, "grads": grads, "optimizer_grads": 4 * trained / (world if zero1 else 1), "adam": adam,
            "buffers": buffers, "activations": act, "comm_payload": comm,
            "total": 4 * P + grads + adam + buffers + act}


def run_memory(only=()) -> dict:
    from looped_lm.config import load_config

    work = Path(tempfile.mkdtemp(prefix="scaleout-"))
    cache = str(ROOT / "data_cache")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launcher = str(Path(sys.executable).parent / "deepspeed")
    results = {}
    for setup in [s for s in SETUPS if not only or s in only]:
        out = work / setup
        print(f"memory: {setup} ...", flush=True)
        t0 = time.time()
        if setup == "independent":  # two 1-rank jobs at once, one per block
            procs = []
            for b in (0, 1):
                cfg = _memory_config(work / f"{setup}{b}.yaml", work / f"run_{setup}{b}", cache, setup, [b])
                procs.append(subprocess.Popen([sys.executable, __file__, "worker", "--config", str(cfg), "--out",
                                               str(out / f"job{b}")], env=env, cwd=work))
            codes = [p.wait() for p in procs]
            ranks = [json.loads((out / f"job{b}" / "rank0.json").read_text()) for b in (0, 1)]
        else:
            cfg = _memory_config(work / f"{setup}.yaml", work / f"run_{setup}", cache, setup)
            codes = [subprocess.run([launcher, "--num_gpus", "2", "--master_port", str(29500 + len(results)),
                                     __file__, "worker", "--config", str(cfg), "--out", str(out)],
                                    env=env, cwd=work).returncode]
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        if any(codes):
            raise SystemExit(f"{setup} failed: {codes}")
        results[setup] = {"ranks": ranks, "seconds": time.time() - t0}
    cfg = load_config(str(next(work.glob("*.yaml"))))
    counts = _counts(cfg)
    shutil.rmtree(work, ignore_errors=True)
    return {"model": MEMORY_MODEL, "blocks": 2, "batch_per_rank": MEMORY_BATCH, "steps": MEMORY_STEPS,
            "timed_from_step": MEMORY_WARMUP + 1, "threads_per_rank": 1, "counts": counts,
            "setups": {s: {**r, "analytic": analytic(s, counts)} for s, r in results.items()}}


def memory_table(mem: dict) -> str:
    GiB, MiB = 2 ** 30, 2 ** 20
    c = mem["counts"]
    lines = [f"P = {c['P'] / 1e6:.1f}M parameters: shared S = {c['S'] / 1e6:.1f}M ({c['S'] / c['P']:.0%}), blocks "
             f"{' + '.join(f'{b / 1e6:.1f}M' for b in c['blocks'])}; activations {c['act_layer'] / MiB:.0f} MiB per "
             f"layer + {c['act_rest'] / MiB:.0f} MiB rest per micro-batch of {c['tokens']} tokens (counted).", "",
             "| set-up (2 processes) | peak RSS growth / rank, GiB (model) | Adam state / rank, MiB (model) | "
             "gradients the optimiser steps with / rank, MiB (model) | payload sent / step / rank, MiB (model) | step s wall (CPU) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in mem["setups"].items():
        a, ranks = s["analytic"], s["ranks"]
        timed = [st for r in ranks for st in r["steps"][mem["timed_from_step"] - 1:]]
        growth = max(max(st["hwm"] for st in r["steps"]) - r["baseline_rss"] for r in ranks)
        state = max(r["optimizer_state_bytes"] for r in ranks)
        grads = max(r["grad_bytes"] for r in ranks)
        comm = statistics.median([st["comm_bytes"] for st in timed])
        lines.append(f"| {name} | {growth / GiB:.2f} ({a['total'] / GiB:.2f}) | {state / MiB:.0f} ({a['adam'] / MiB:.0f}) | "
                     f"{grads / MiB:.0f} ({a['optimizer_grads'] / MiB:.0f}) | {comm / MiB:.0f} ({a['comm_payload'] / MiB:.0f}) | "
                     f"{statistics.median([st['wall_s'] for st in timed]):.1f} ({statistics.median([st['cpu_s'] for st in timed]):.1f}) |")
    dp, bp = mem["setups"]["dp_zero0"], mem["setups"]["bp"]
    ratio = max(r["optimizer_state_bytes"] for r in bp["ranks"]) / max(r["optimizer_state_bytes"] for r in dp["ranks"])
    bound = 1 / mem["blocks"] + c["S"] / c["P"]
    sent = int(statistics.median([st["comm_bytes"] for r in bp["ranks"] for st in r["steps"][mem["timed_from_step"] - 1:]]))
    lines += ["", f"- block-parallel Adam state per rank / data parallel's: {ratio:.3f} (target <= 1/B + S/P = "
                  f"{bound:.3f}: {'met' if ratio <= bound else 'MISSED'})",
              f"- block-parallel payload per step and rank: {sent:,} bytes; the shared parameters' fp32 gradients: "
              f"{4 * c['S']:,} bytes ({'met' if sent <= 4 * c['S'] else 'MISSED'})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "worker" in argv[:2]:  # the DeepSpeed launcher puts --local_rank=N first
        return worker([a for a in argv if a != "worker"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("memory", "table"))
    p.add_argument("setups", nargs="*", help="memory: rerun only these set-ups (the others stay as measured)")
    args = p.parse_args(argv)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}  # its `split` runs stay
    if args.what == "memory":
        fresh = run_memory(args.setups)
        if args.setups and "memory" in data:  # keep the other set-ups, re-model every one
            old = data["memory"]["setups"]
            fresh["setups"] = {s: {**old.get(s, {}), **fresh["setups"].get(s, {})} for s in SETUPS}
            fresh["setups"] = {s: {**v, "analytic": analytic(s, fresh["counts"])} for s, v in fresh["setups"].items()}
        data["memory"] = fresh
        common.write_json(RESULTS, data)
    print(memory_table(data["memory"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
