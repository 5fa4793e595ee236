"""What a DiffusionBlocks step saves on a real model: SmolLM2-135M's shape (30 x 576, 9 heads, V 49152, the
chunked loss), one training step of each layout, LoRA rank 8 and full (docs/pretrained.md's memory table).

    python bench/smollm2_memory.py [--json bench/results/smollm2/memory.json] [--speed-repeats 2]

Rows: the end-to-end fine-tune (gpt), the same with activation checkpointing, db2 (the recipe: B = 2, context
stacked, stack_order low_noise_first, noisy_input clean_state) and db4 (B = 4 in blocks of 8 / 8 / 7 / 7 layers,
the same layout). A DB step trains one block; its cost depends on which (with the stack, the block the clean
stream reaches last runs every earlier block forward without gradient), so each DB row reports every block and
its maximum. Per shape:
- `kept_mib`: the bytes autograd keeps for backward (each storage once, parameters excluded): exact, counted
  by saved-tensor hooks over one forward, at T 1024 and 2048, batch 1; batch 8 is 8x the per-sequence bytes
  (`derived`: a sequence's activations do not depend on the others; `linearity_checked`: batch 2 over batch 1
  at T 256), since batch 8 of the end-to-end rows would not fit in this machine's memory beside other work;
- at T 256, batch 1, `peak_mib`: the step's peak of bytes allocated during forward + backward (the profiler's
  memory timeline; weights and optimizer state excluded): how far the peak sits above what is kept (the
  profiler is too slow on this machine for the long shapes);
- `state_mib`: weights + gradients + AdamW moments in fp32 (4 + 4 + 8 bytes per trainable parameter, 4 per
  frozen one), exact from the parameter counts;
- at T 512 (`--speed-seq`), batch 1: training tokens per second of one step (forward + backward, one thread, the best of
  `--speed-repeats`, rows interleaved so a busy machine slows all alike), beside the step's matmul FLOPs
  (looped_lm.cost).
Random weights at the source's shape: bytes and FLOPs do not depend on the values (the GGUF is named, for
LoRA's check, but not read).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)
from smollm2_convert import SMOLLM2, V  # noqa: E402  (the source's shape)
from train_memory import step_peak_bytes  # noqa: E402  (the same peak measure as the GPT-2 table)

from looped_lm.config import config_from_dict  # noqa: E402
from looped_lm.kinds import get_kind  # noqa: E402
from looped_lm.models import build_model  # noqa: E402
from looped_lm.pretrained import smollm2_gguf  # noqa: E402

OUT = common.ROOT / "bench" / "results" / "smollm2" / "memory.json"
LAYOUT = {"context": "stacked", "stack_order": "low_noise_first", "noisy_input": "clean_state",
          "block_sampling": "round_robin"}
ROWS = {
    "gpt": ("gpt", {}, None),
    "gpt+ckpt": ("gpt", {"activation_checkpointing": True}, None),
    "db2": ("db_ar", {}, {**LAYOUT, "num_blocks": 2}),
    "db4": ("db_ar", {}, {**LAYOUT, "layers_per_block": [8, 8, 7, 7]}),
}
SHAPES = [(1024, 1), (256, 1), (256, 2), (2048, 1)]
PEAK_SHAPES = [(256, 1)]


def config(row: str, seq: int, lora: bool):
    kind, extra, diffusion = ROWS[row]
    model = {"kind": kind, **SMOLLM2, "seq_len": seq, "loss_chunk": 128, **extra,
             "init_from": str(smollm2_gguf())}  # named for LoRA's check; its weights are not read here
    raw = {"model": model, "train": {"lora_rank": 8 if lora else 0, **({"lora_ada": "lora"} if lora and diffusion else {})}}
    if diffusion:
        raw["diffusion"] = diffusion
    return config_from_dict(raw)


def keys(cfg) -> list:
    """The step kinds of a row: one per block for DB models (the step trains block b), one for gpt."""
    return list(range(get_kind("db_ar").num_blocks(cfg))) if cfg.model.kind == "db_ar" else [None]


def loss_of(model, x, y, key):
    return model.objective.block_loss(x, y, key)[0] if key is not None else model.training_loss(x, y, 0, 0)[0]


def kept_bytes(model, x, y, key) -> int:
    """common.saved_bytes for one block's step (or gpt's)."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, x, y, key)
    del loss
    return sum(seen.values())


class _Step:
    """model.training_loss as step_peak_bytes calls it, for one block."""

    def __init__(self, model, key):
        self.model, self.key = model, key

    def training_loss(self, x, y, step, seed):
        return loss_of(self.model, x, y, self.key), {}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def step_seconds(model, x, y, key) -> float:
    t0 = time.perf_counter()
    loss_of(model, x, y, key).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def build(row: str, seq: int, lora: bool):
    cfg = config(row, seq, lora)
    torch.manual_seed(0)
    model = build_model(cfg, V).train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return cfg, model, trainable, frozen


def table(path: Path) -> str:
    """docs/pretrained.md's memory table from the JSON: MiB kept for backward per step (max over blocks), the
    step's resident peak (rss_all), the state, and tokens/s."""
    d = json.loads(Path(path).read_text())
    shapes = sorted({(r["seq"], r["batch"]) for r in d["rows"] if r["seq"] >= 1024})
    peak_seqs = sorted({r["seq"] for r in d.get("rss_peaks", []) if r["seq"] >= 1024})
    lines = ["| row | " + " | ".join(f"kept, T {t} x {b}" for t, b in shapes)
             + "".join(f" | peak, T {t} x 1" for t in peak_seqs)
             + " | weights + grads + AdamW | tokens/s (T " + str(d.get("speed", {}).get("seq", "-")) + ") |",
             "|---|" + "---|" * (len(shapes) + len(peak_seqs) + 2)]
    for lora in (True, False):
        for row in ROWS:
            cells = []
            for t, b in shapes:
                r = next((r for r in d["rows"] if (r["row"], r["lora"], r["seq"], r["batch"]) == (row, lora, t, b)), None)
                cells.append("-" if r is None else f"{r['kept_mib']:,.0f} MiB" + (" *" if r.get("derived") else ""))
            for t in peak_seqs:
                r = next((r for r in d["rss_peaks"] if (r["row"], r["lora"], r["seq"]) == (row, lora, t)), None)
                cells.append("-" if r is None else f"{r['rss_peak_mib']:,.0f} MiB" + (" (bound)" if r["bounded"] else ""))
            state = next((r["state_mib"] for r in d["rows"] if (r["row"], r["lora"]) == (row, lora)), None)
            if state is None:  # a row this JSON does not have
                continue
            sp = d.get("speed", {}).get("rows", {}).get(f"{row} {'lora' if lora else 'full'}")
            speed = f"{sp['tokens_per_s']:.0f}" if sp else "-"
            lines.append(f"| {row}, {'LoRA 8' if lora else 'full'} | " + " | ".join(cells)
                         + f" | {state:,.0f} MiB | {speed} |")
    return "\n".join(lines)


def rss_one(row: str, lora: bool, seq: int, key) -> dict:
    """In a fresh process: the resident bytes one step (forward + backward) adds at its peak over what the
    process holds before it (the model built, one batch-1 window): ru_maxrss after the step minus VmRSS before.
    `bounded` if the step did not raise the process's high-water mark (the build's was higher): then the
    number is only an upper bound."""
    import resource

    def vm_rss() -> int:
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    _, model, _, _ = build(row, seq, lora)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (1, seq), generator=g)
    y = torch.randint(0, V, (1, seq), generator=g)
    before, high_before = vm_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loss_of(model, x, y, key).backward()
    high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"row": row, "lora": lora, "seq": seq, "batch": 1, "block": key, "rss_peak_mib": (high - before) / 2 ** 20,
            "bounded": high <= high_before}


def rss_all(path: Path, seqs: list[int]) -> None:
    """rss_one for every row, LoRA and full, at each T, each in its own process; a DB row at the block that
    keeps the most bytes there (the hooks' count); written into the JSON's `rss_peaks`."""
    import subprocess

    d = json.loads(path.read_text())
    peaks = d.get("rss_peaks", [])
    done = {(r["row"], r["lora"], r["seq"]) for r in peaks}
    for lora in (True, False):
        for seq in seqs:
            for row in ROWS:
                if (row, lora, seq) in done:
                    continue
                measured = next((r for r in d["rows"] if (r["row"], r["lora"], r["seq"], r["batch"]) == (row, lora, seq, 1)), None)
                key = max(measured["per_block"], key=lambda b: b["kept_mib"])["block"] if measured else keys(config(row, seq, lora))[0]
                out = subprocess.run([sys.executable, __file__, "--rss-one", f"{row},{int(lora)},{seq},{key}"],
                                     capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                r = json.loads(out.stdout.strip().splitlines()[-1])
                peaks.append(r)
                print(f"rss {row:9s} lora={lora!s:5s} T={seq}: peak {r['rss_peak_mib']:,.0f} MiB"
                      + (" (bounded)" if r["bounded"] else ""), flush=True)
                d["rss_peaks"] = peaks
                common.write_json(path, d)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=str(OUT))
    p.add_argument("--table", action="store_true", help="print docs/pretrained.md's table from --json and stop")
    p.add_argument("--lora", choices=["both", "on", "off"], default="both",
                   help="which fine-tune's rows: LoRA rank 8, full, or both (two processes can share the work)")
    p.add_argument("--speed-repeats", type=int, default=2)
    p.add_argument("--shapes", default=",".join(f"{t}x{b}" for t, b in SHAPES), help="TxB,... measured")
    p.add_argument("--peak-shapes", default=",".join(f"{t}x{b}" for t, b in PEAK_SHAPES), help="TxB,... with the peak")
    p.add_argument("--speed-seq", type=int, default=512)
    p.add_argument("--rows", default=",".join(ROWS), help="which rows (a process per row keeps its memory apart)")
    p.add_argument("--resume", action="store_true", help="keep the rows --json already holds; measure the rest")
    p.add_argument("--rss", default=None, help="T,...: the step's resident peak per row in fresh processes (rss_all)")
    p.add_argument("--rss-one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_one:
        row, lora, seq, key = args.rss_one.split(",")
        torch.set_num_threads(1)
        print(json.dumps(rss_one(row, lora == "1", int(seq), None if key == "None" else int(key))))
        return 0
    if args.rss:
        rss_all(Path(args.json), [int(t) for t in args.rss.split(",")])
        return 0
    if args.table:
        print(table(Path(args.json)))
        return 0
    torch.set_num_threads(1)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]  # "": speed only
    peak_shapes = [tuple(int(v) for v in s.split("x")) for s in args.peak_shapes.split(",")]
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.lora]
    rows, speed = [], {}
    if args.resume and Path(args.json).exists():  # a run cut short: its measured rows stand
        rows = [r for r in json.loads(Path(args.json).read_text())["rows"] if "derived" not in r]
    done = {(r["row"], r["lora"], r["seq"], r["batch"]) for r in rows}
    result = {"shape": {**SMOLLM2, "loss_chunk": 128, "dtype": "float32"}, "rows": rows, "threads": 1,
              "commit": common.git_commit()}
    for lora in modes:
        for seq, batch in shapes:
            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, V, (batch, seq), generator=g)
            y = torch.randint(0, V, (batch, seq), generator=g)
            for row in ROWS:
                if (row, lora, seq, batch) in done or row not in args.rows.split(","):
                    continue
                cfg, model, trainable, frozen = build(row, seq, lora)
                per_key = []
                for key in keys(cfg):
                    r = {"block": key, "kept_mib": kept_bytes(model, x, y, key) / 2 ** 20}
                    if (seq, batch) in peak_shapes:
                        r["peak_mib"] = step_peak_bytes(_Step(model, key), x, y) / 2 ** 20
                    flops = get_kind(cfg.model.kind).step_flops(cfg, V, batch, key=key)
                    r["step_gflops"] = flops / 1e9 if flops else None
                    per_key.append(r)
                out = {"row": row, "lora": lora, "seq": seq, "batch": batch, "trainable_m": trainable / 1e6,
                       "state_mib": (16 * trainable + 4 * frozen) / 2 ** 20, "per_block": per_key,
                       "kept_mib": max(r["kept_mib"] for r in per_key)}
                if (seq, batch) in peak_shapes:
                    out["peak_mib"] = max(r["peak_mib"] for r in per_key)
                rows.append(out)
                print(f"{row:9s} lora={lora!s:5s} T={seq} B={batch}: kept {out['kept_mib']:,.0f} MiB"
                      + (f", peak {out['peak_mib']:,.0f} MiB" if "peak_mib" in out else "")
                      + f", state {out['state_mib']:,.0f} MiB, trainable {trainable / 1e6:.2f} M", flush=True)
                del model
                common.write_json(Path(args.json), {**result, "complete": False})  # each row kept as it comes
    linear = {}  # (row, lora) -> kept(batch 2) / kept(batch 1) at a T measured both ways
    for r in rows:
        one = [q for q in rows if (q["row"], q["lora"], q["seq"], q["batch"]) == (r["row"], r["lora"], r["seq"], 1)]
        if r["batch"] == 2 and one:
            linear[(r["row"], r["lora"])] = {"seq": r["seq"], "ratio": r["kept_mib"] / one[0]["kept_mib"]}
    for r in [r for r in rows if r["batch"] == 1 and r["seq"] >= 1024]:  # batch 8 from the per-sequence bytes
        rows.append({**{k: r[k] for k in ("row", "lora", "seq", "trainable_m", "state_mib")}, "batch": 8,
                     "kept_mib": 8 * r["kept_mib"], "derived": "8 x batch 1",
                     "linearity_checked": linear.get((r["row"], r["lora"]))})
    common.write_json(Path(args.json), {**result, "complete": True, "finished_utc": common.utc_now()})
    # speed: T speed_seq, batch 1, every row and block interleaved, best of the repeats
    T = args.speed_seq
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (1, T), generator=g)
    y = torch.randint(0, V, (1, T), generator=g)
    for lora in modes if args.speed_repeats else ():
        models = {row: build(row, T, lora) for row in ROWS}
        best: dict = {}
        for _ in range(args.speed_repeats):
            for row, (cfg, model, _, _) in models.items():
                for key in keys(cfg):
                    s = step_seconds(model, x, y, key)
                    best[(row, key)] = min(best.get((row, key), s), s)
        for row, (cfg, _, _, _) in models.items():
            ks = keys(cfg)
            mean_s = sum(best[(row, k)] for k in ks) / len(ks)  # round_robin: each block equally often
            flops = [get_kind(cfg.model.kind).step_flops(cfg, V, 1, key=k) for k in ks]
            speed[f"{row} {'lora' if lora else 'full'}"] = {
                "seconds_per_step": mean_s, "tokens_per_s": T / mean_s, "per_block_s": [best[(row, k)] for k in ks],
                "step_gflops": sum(flops) / len(flops) / 1e9, "gflop_per_s": sum(flops) / len(flops) / mean_s / 1e9}
            print(f"speed {row} lora={lora}: {T / mean_s:,.0f} tokens/s", flush=True)
        del models
    common.write_json(Path(args.json), {
        **result, "complete": True, "speed": {"seq": T, "batch": 1, "repeats": args.speed_repeats, "rows": speed},
        "load_average_at_end": list(os.getloadavg()), "finished_utc": common.utc_now()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
