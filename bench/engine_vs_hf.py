"""Our engine vs transformers' `generate` on the same exported GPT, batch 1 and 16 (greedy tokens/s).

    python bench/engine_vs_hf.py            # ~2 min on a 2-core CPU
    python bench/engine_vs_hf.py --quick    # one repeat

Both sides run the same weights, fp32, one thread, in this process: `looped_lm export` of an untrained
GPT (speed does not depend on the weights), loaded with `AutoModelForCausalLM.from_pretrained` for
transformers (greedy, `min_new_tokens` = `max_new_tokens`, so every row makes exactly N tokens) and with
`load_checkpoint` for `Engine.run` (B requests queued at once, greedy). Each row: 32-token prompts, 64
new tokens; every point measured --repeats times, interleaved, the fastest kept. The greedy tokens of
both sides are compared (a mismatch fails the bench). Shapes: the quickstart GPT (4 x 128, byte vocab)
and a GPT-2-vocabulary one (6 x 256, V 50257).
Writes bench/results/engine_vs_hf.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROMPT, NEW = 32, 64
SHAPES = {
    "gpt 4x128 byte": ({"kind": "gpt", "n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128}, "byte"),
    "gpt 6x256 gpt2": ({"kind": "gpt", "n_layers": 6, "d_model": 256, "n_heads": 4, "seq_len": 128}, "gpt2"),
}


def write_checkpoint(root: Path, model_cfg: dict, tokenizer: str) -> Path:
    from looped_lm.checkpoint import finalize, tmp_dir_for, write_rank_files
    from looped_lm.config import config_from_dict
    from looped_lm.data.tokenizer import get_tokenizer
    from looped_lm.models import build_model

    torch.manual_seed(0)
    cfg = config_from_dict({"model": model_cfg, "data": {"tokenizer": tokenizer}})
    vocab = get_tokenizer(tokenizer).vocab_size
    model = build_model(cfg, vocab)
    write_rank_files(tmp_dir_for(root, 1), 0)
    manifest = {"config": cfg.to_dict(), "vocab_size": vocab, "tokenizer": tokenizer, "model_state": {}}
    return finalize(root, 1, model, manifest, keep_last=1)


def prompts(batch: int, vocab: int) -> torch.Tensor:
    return torch.tensor([[(7 * i + 13 * j + 1) % vocab for j in range(PROMPT)] for i in range(batch)])


def engine_run(model, ids: torch.Tensor) -> tuple[float, list]:
    from looped_lm.engine.engine import Engine, Request
    from looped_lm.engine.sampling import SamplingParams

    engine = Engine(model, ids.shape[0], max_len=PROMPT + NEW)
    reqs = [Request(row.tolist(), NEW, SamplingParams(0.0)) for row in ids]
    start = time.perf_counter()
    outs = engine.run(reqs)
    elapsed = time.perf_counter() - start
    return ids.shape[0] * NEW / elapsed, [o.token_ids for o in outs]


def hf_run(model, ids: torch.Tensor) -> tuple[float, list]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             attention_mask=torch.ones_like(ids))
    elapsed = time.perf_counter() - start
    return ids.shape[0] * NEW / elapsed, out[:, PROMPT:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import looped_lm  # noqa: F401  registers the model with transformers
    from transformers import AutoModelForCausalLM

    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.export import export

    rows = []
    for name, (shape, tokenizer) in SHAPES.items():
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = write_checkpoint(Path(tmp) / "run", shape, tokenizer)
            hf_dir = export(ckpt, Path(tmp) / "hf")
            native, _, _ = load_checkpoint(ckpt)
            native.eval()
            hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
            vocab = native.tok_emb.weight.shape[0]
            for batch in (1, 16):
                ids = prompts(batch, vocab)
                best = {"engine": 0.0, "transformers": 0.0}
                for _ in range(1 if args.quick else args.repeats):
                    e_tps, e_tokens = engine_run(native, ids)
                    h_tps, h_tokens = hf_run(hf, ids)
                    if e_tokens != h_tokens:
                        raise SystemExit(f"{name} batch {batch}: the engine's greedy tokens differ from transformers'")
                    best["engine"] = max(best["engine"], e_tps)
                    best["transformers"] = max(best["transformers"], h_tps)
                row = {"model": name, "batch": batch, "engine_tok_s": best["engine"],
                       "transformers_tok_s": best["transformers"], "ratio": best["engine"] / best["transformers"]}
                rows.append(row)
                print(f"{name} batch {batch}: engine {row['engine_tok_s']:.0f} tok/s, transformers "
                      f"{row['transformers_tok_s']:.0f} tok/s, {row['ratio']:.2f}x", flush=True)
    lines = ["| model | batch | engine tok/s | transformers generate tok/s | engine / transformers | target |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        verdict = "PASS" if r["ratio"] >= 1.5 else "MISS"
        lines.append(f"| {r['model']} | {r['batch']} | {r['engine_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | "
                     f"{r['ratio']:.2f}x | >= 1.5x {verdict} |")
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine_vs_hf.json").write_text(json.dumps({"rows": rows, "table": table, "prompt": PROMPT,
                                                           "new_tokens": NEW, "threads": 1,
                                                           "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
