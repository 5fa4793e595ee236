"""Server throughput (bench/README_serve.md, "Benchmark"): tokens/s vs concurrent streams over HTTP and the same
requests through `Engine.run` alone, for the quickstart GPT and a db_ar (B = 2, K = 2).

    python bench/serve.py                 # untrained quickstart shapes, ~2 min -> bench/results/serve.json
    python bench/serve.py --quick         # fewer rounds (a smoke run)

The server runs in its own process (uvicorn), the load generator (httpx, asyncio) in this one. Every request:
a streamed /v1/completions, 32-token prompt, 64 tokens (ignore_eos), greedy; each of c clients sends its
requests back to back; every point --repeats times, interleaved, the fastest kept. The latency percentiles
and the looped model's tokens/s vs K (serve.json's `latency_16_streams_ms`, `looped_k`) are this script at
commit cafa2ef; `--medium` and `--checkpoint` / `--looped-checkpoint` are this script at commit b3c9eeb.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)
from looped_lm.config import config_from_dict  # noqa: E402
from looped_lm.data.tokenizer import get_tokenizer  # noqa: E402
from looped_lm.engine.engine import Engine, Request  # noqa: E402
from looped_lm.models import build_model  # noqa: E402
from looped_lm.models.contract import Iterative  # noqa: E402
from looped_lm.sampling import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT, MAX_TOKENS = 32, 64
CONCURRENCY = [1, 4, 16, 64]
SHAPES = {  # configs/quickstart.yaml and configs/quickstart_db.yaml
    "gpt": {"kind": "gpt", "n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128},
    "db_ar": {"kind": "db_ar", "n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128},
}


def build_untrained(kind: str):
    raw = {"model": SHAPES[kind], "data": {"tokenizer": "byte"}}
    if kind == "db_ar":  # the project's DB defaults otherwise (sample bridge, K = B)
        raw["diffusion"] = {"num_blocks": 2}
    torch.manual_seed(0)
    model = build_model(config_from_dict(raw), 257).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ada." in name:
                p.normal_(0, 0.02)
    return model, "byte"


def serve_worker(spec: dict) -> None:
    """Run one server until killed: an untrained model of `spec["kind"]`."""
    import uvicorn

    from looped_lm.serve.app import build_app

    torch.set_num_threads(spec["threads"])
    model, tok_name = build_untrained(spec["kind"])
    tok = get_tokenizer(tok_name)
    engine = Engine.from_memory_budget(model, 1.0, max_slots=64, vocab_size=tok.vocab_size,
                                       max_iterations=16 if isinstance(model, Iterative) else None)
    uvicorn.run(build_app(engine, tok, "bench"), host="127.0.0.1", port=spec["port"], log_level="warning")


class ServerProcess:
    def __init__(self, spec: dict):
        spec = {**spec, "port": common.free_port()}
        self.url = f"http://127.0.0.1:{spec['port']}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env)

    def __enter__(self):
        common.wait_for_server(self.url + "/health", self.proc)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)


async def stream_one(client: httpx.AsyncClient, prompt: list[int]) -> int:
    """One streamed request; -> the completion tokens its usage chunk reports."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():  # the client shares the CPUs: parse only what is needed
            if line.startswith("data: ") and line != "data: [DONE]" and '"usage":null' not in line:
                chunk = json.loads(line[6:])  # the usage chunk (or an error)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def load(url: str, clients: int, rounds: int) -> dict:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await stream_one(client, prompt_ids(0))  # warm-up

        async def user(u: int) -> int:
            return sum([await stream_one(client, prompt_ids(u * rounds + i)) for i in range(rounds)])

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(user(u) for u in range(clients))))
        wall = time.perf_counter() - start
    assert tokens == clients * rounds * MAX_TOKENS, "incomplete responses"
    return {"clients": clients, "requests": clients * rounds, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}


def prompt_ids(i: int) -> list[int]:
    return [(7 * i + 13 * j) % 256 for j in range(PROMPT)]


def engine_only(kind: str, clients: int, rounds: int, threads: int) -> float:
    """tokens/s of the same requests through Engine.run (no HTTP), all queued at once."""
    torch.set_num_threads(threads)
    model, _ = build_untrained(kind)
    engine = Engine(model, min(64, clients))
    reqs = [Request(prompt_ids(i), MAX_TOKENS, SamplingParams(0.0)) for i in range(clients * rounds)]
    start = time.perf_counter()
    engine.run(reqs)
    return clients * rounds * MAX_TOKENS / (time.perf_counter() - start)


def concurrency_table(kind: str, threads: int, rounds: dict, repeats: int) -> tuple[list, dict]:
    """Every concurrency `repeats` times, interleaved (a job sharing the machine slows all alike); the
    fastest run of each is kept."""
    runs: dict[int, list] = {c: [] for c in CONCURRENCY}
    with ServerProcess({"kind": kind, "threads": threads}) as server:
        for _ in range(repeats):
            for c in CONCURRENCY:
                runs[c].append(asyncio.run(load(server.url, c, rounds[c])))
                print(f"  {kind} {c:>2} streams: {runs[c][-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    engine = {c: max(engine_only(kind, c, rounds[c], threads) for _ in range(repeats)) for c in CONCURRENCY}
    rows = [max(runs[c], key=lambda r: r["tokens_per_s"]) for c in CONCURRENCY]
    print(f"\n{kind}:\n| streams | requests | tokens/s (HTTP) | vs 1 stream | engine only, tokens/s | vs 1 stream |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c = r["clients"]
        print(f"| {c} | {r['requests']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / rows[0]['tokens_per_s']:.1f}x | "
              f"{engine[c]:.0f} | {engine[c] / engine[1]:.1f}x |")
    return rows, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server process")
    ap.add_argument("--quick", action="store_true", help="one round per client, one repeat (a smoke run)")
    ap.add_argument("--repeats", type=int, default=2, help="measure every point this many times, keep the fastest")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return serve_worker(json.loads(args.worker))
    rounds = {1: 2, 4: 1, 16: 1, 64: 1} if args.quick else {1: 8, 4: 4, 16: 2, 64: 1}
    load_before = os.getloadavg()
    repeats = 1 if args.quick else args.repeats
    rows, engine = concurrency_table("gpt", args.threads, rounds, repeats)
    db_rows, db_engine = concurrency_table("db_ar", args.threads, rounds, repeats)  # DiffusionBlocks requests batch too

    def ratio(rs):
        return next(r for r in rs if r["clients"] == 16)["tokens_per_s"] / rs[0]["tokens_per_s"]

    db = {"concurrency": db_rows, "engine_only_tokens_per_s": db_engine, "http_16_over_1": ratio(db_rows),
          "gpt_http_16_over_1": ratio(rows), "vs_gpt_ratio": ratio(db_rows) / ratio(rows)}
    print(f"\n16 streams / 1 stream over HTTP: db_ar {db['http_16_over_1']:.1f}x, gpt {db['gpt_http_16_over_1']:.1f}x "
          f"(db_ar / gpt = {db['vs_gpt_ratio']:.2f}, target >= 0.8)")
    common.write_json(ROOT / "bench" / "results" / "serve.json", {
        "setup": {"model": SHAPES["gpt"], "prompt_tokens": PROMPT, "max_tokens": MAX_TOKENS,
                  "server_threads": args.threads, "cpus": os.cpu_count(), "rounds": rounds, "repeats": repeats,
                  "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "concurrency": rows, "engine_only_tokens_per_s": engine, "db_ar": db})


if __name__ == "__main__":
    main()
