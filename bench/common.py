"""What the bench scripts share (bench/ is not a package: a script puts bench/ on sys.path and imports this):
counted FLOPs and saved-for-backward bytes of one training step, the git commit, `python -m` runs, a server
process's port and start, JSON and markdown files, subprocess lanes, a process pool that runs a study's stages,
95 % intervals and paired ratios.

The equal-FLOPs training loop that was here (`plan_steps`, `train`, `train_bible_db`; bench/scaleout.py's
`split` and the retired quality study's, bench/quality.py at commit a2d4a89) is this file at commit daf8543.
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def step_flops(model, x, y, step: int, seed: int = 0) -> int:
    """FlopCounterMode's FLOPs of one training step (forward + backward) of `model` at `step`."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model.training_loss(x, y, step, seed)[0].backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def saved_bytes(model, x, y, step: int) -> int:
    """Bytes autograd saves for backward in one training step (each storage once; parameters and buffers
    excluded)."""
    import torch

    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = model.training_loss(x, y, step, seed=0)
    del loss
    return sum(seen.values())


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def python(*args, threads: int | None = 1) -> str:
    """Run `python ARGS` (e.g. "-m", "looped_lm", "eval", ...) from the repository root with `threads` OpenMP
    threads (None: the caller's environment); -> its stdout. A failure raises with the tail of its stderr."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    done = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(map(str, args[:3]))} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def write_json(path: Path, data, indent: int = 1) -> None:
    """Write `data` as JSON, atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    tmp.replace(path)


def read_jsons(folder: Path, pattern: str = "*.json") -> list[dict]:
    """Every JSON in `folder` matching `pattern`, in file-name order."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob(pattern))]


def write_lines(path: Path, lines: list[str]) -> str:
    """A markdown report: `lines` joined, a final newline; written to `path` and returned."""
    text = "\n".join(lines) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    return text


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished child processes."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(url: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    """Poll `url` (a /health route) until it answers; raise if `proc` exits first or time runs out."""
    deadline, direct = time.monotonic() + seconds, urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with direct.open(url, timeout=1):
                return
        except OSError:  # not listening yet
            time.sleep(0.2)
    raise RuntimeError(f"the server at {url} did not start (exit code {proc.poll()})")


def run_lanes(jobs: list[tuple[list[str], Path | None]], lanes: int, env: dict | None = None) -> list[str]:
    """Run (argv, log file or None) jobs `lanes` at a time, one torch thread each; -> the failed jobs' argv."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    todo, running, failed = list(jobs), [], []
    while todo or running:
        while todo and len(running) < lanes:
            argv, log = todo.pop(0)
            out = open(log, "a") if log else None
            running.append((argv, subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT if out
                                                   else None, env=env)))
            print(f"started {' '.join(argv[1:])}", flush=True)
        time.sleep(2)
        for item in list(running):
            if item[1].poll() is not None:
                running.remove(item)
                print(f"finished {' '.join(item[0][1:])}: exit {item[1].returncode}", flush=True)
                if item[1].returncode:
                    failed.append(" ".join(item[0][1:]))
    return failed


def run_pool(workers: int, ready, done) -> None:
    """A study's stages, `workers` processes at a time: ready() -> the jobs that can start now, as (key, fn,
    args) (a key already running is not started twice); done(key, result) as each finishes; until ready()
    offers nothing and nothing runs."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    running: dict = {}
    with ProcessPoolExecutor(workers) as pool:
        while True:
            for key, fn, args in ready():
                if len(running) < workers and key not in running.values():
                    running[pool.submit(fn, *args)] = key
                    print(f"start {key}", flush=True)
            if not running:
                return
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                done(running.pop(fut), fut.result())


def ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the Student-t 95 % interval; nan for one value)."""
    from scipy.stats import t

    m = statistics.fmean(values)
    if len(values) < 2:
        return m, float("nan")
    return m, float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, 95 % low, 95 % high) of ratios: a Student-t interval on their logs (nan bounds for one)."""
    m, h = ci([math.log(x) for x in ratios])
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def paired(seeds: list, ratios: list[float]) -> str:
    """Per-seed ratios and their geometric mean with its t 95 % interval on the logs: "s0 0.912, s1 0.934;
    geometric mean 0.923, 95 % t interval [0.812, 1.049]"."""
    geo, lo, hi = ratio_ci(ratios)
    return (", ".join(f"s{s} {x:.3f}" for s, x in zip(seeds, ratios)) + f"; geometric mean {geo:.3f}, "
            + (f"95 % t interval [{lo:.3f}, {hi:.3f}]" if len(ratios) > 1 else "no interval with one seed"))
