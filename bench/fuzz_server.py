"""Fuzz the server with schemathesis, from its own OpenAPI document: every route, schema-valid and
schema-invalid bodies, plain and streamed, against a tiny gpt and a tiny db_ar server (untrained, byte
vocabulary; what is fuzzed is the HTTP layer, not the text).

    pip install schemathesis
    python bench/fuzz_server.py                 # ~5 min: 300 cases per operation per model
    python bench/fuzz_server.py --examples 50   # a quick look

Writes bench/results/fuzz_server.json: per model, the cases schemathesis ran, its failures by check
(not_a_server_error: any 5xx), and the 5xx answers the server itself counted (/metrics). The target is
zero 5xx. Other checks report where the document and the server disagree; the ones left are listed in
bench/README_serve.md with the reason.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODELS = {  # tests/tiny_models.py's shapes, over the byte vocabulary
    "gpt": {"model": {"kind": "gpt", "n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 64}},
    "db_ar": {"model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 64, "n_prelude": 1,
                        "max_iterations": 4}, "diffusion": {"num_blocks": 2}},
}


def build_server(kind: str):
    import torch

    from looped_lm.config import config_from_dict
    from looped_lm.data.tokenizer import get_tokenizer
    from looped_lm.engine.engine import Engine
    from looped_lm.models import build_model
    from looped_lm.serve.app import BackgroundServer, build_app

    torch.manual_seed(0)
    tok = get_tokenizer("byte")
    model = build_model(config_from_dict({**MODELS[kind], "data": {"tokenizer": "byte"}}), tok.vocab_size).eval()
    engine = Engine.from_memory_budget(model, 0.05, max_slots=16, vocab_size=tok.vocab_size,
                                       max_len=MODELS[kind]["model"]["seq_len"])
    return BackgroundServer(build_app(engine, tok, f"tiny-{kind}"))


def server_errors(metrics: str) -> dict[str, int]:
    """5xx answers by route, from the server's own HTTP counter."""
    out = {}
    for m in re.finditer(r'looped_lm_http_requests_total\{method="(\w+)",path="([^"]+)",status="(5\d\d)"\} (\S+)',
                         metrics):
        out[f"{m[1]} {m[2]} {m[3]}"] = int(float(m[4]))
    return out


def fuzz(kind: str, examples: int, seed: int, st: str) -> dict:
    import httpx

    with build_server(kind) as server, tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [st, "run", f"{server.url}/openapi.json", "--checks", "all", "--max-examples", str(examples),
               "--seed", str(seed), "--workers", "1", "--continue-on-failure", "--no-color",
               "--report", "json", "--report-json-path", str(report)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)  # its example cache stays out of the repo
        seconds = time.perf_counter() - start
        metrics = httpx.get(f"{server.url}/metrics").text
        summary = json.loads(report.read_text()) if report.is_file() else None
    out = proc.stdout
    failures = {code: int(n) for code, n in re.findall(r"❌ (ST\d+) [^:\n]*: (\d+)", out)}
    names = dict(re.findall(r"❌ (ST\d+) ([^:\n]*):", out))
    cases = re.search(r"(\d+) generated", out)
    found = out[out.find("FAILURES"):out.find("SUMMARY")] if "FAILURES" in out else ""
    return {"model": kind, "seconds": round(seconds, 1), "cases": int(cases[1]) if cases else None,
            "failures": {f"{code} {names[code]}": n for code, n in failures.items()},
            "server_5xx": server_errors(metrics), "schemathesis_exit": proc.returncode,
            "report": summary, "failure_details": found[:30000]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=300, help="cases per API operation per model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if st is None:
        print("error: schemathesis is not installed (pip install schemathesis)", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    version = subprocess.run([st, "--version"], capture_output=True, text=True).stdout.strip()
    runs = [fuzz(kind, args.examples, args.seed, st) for kind in MODELS]
    result = {"schemathesis": version, "examples_per_operation": args.examples, "seed": args.seed, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fuzz_server.json").write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        print(f"{r['model']}: {r['cases']} cases in {r['seconds']} s, server 5xx: {sum(r['server_5xx'].values())}, "
              f"schemathesis failures: {r['failures'] or 'none'}")
    return 1 if any(r["server_5xx"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
