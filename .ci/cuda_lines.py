"""The CUDA-only lines of looped_lm/ and serve/ that the suite does not run, against a committed list.

A line is CUDA-only when it is a statement in the branch that a CUDA check selects: the body of an `if` whose
test mentions cuda (`device.type == "cuda"`, `torch.cuda.is_available()`, `self.cuda_graphs`, `a and cuda`), or its
`else` when the test is negated (`not cuda`, `!= "cuda"`, `not in ("cpu", "cuda")`). The suite runs on CPU, so such a line runs only where
a test takes the branch (a policy function called with "cuda", a check monkeypatched, a stub recording the call).
The rest must be named in .ci/cuda_only.txt, one line each: `path: the statement as written  # why it stays`.

    python .ci/cuda_lines.py [--data .coverage] [--list .ci/cuda_only.txt] [--show]

Fails (exit 1) when a CUDA-only line is neither run by the suite nor listed, when a listed line is no longer
CUDA-only or now runs (so the list only shrinks), or when more than MAX_LISTED lines are listed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("looped_lm", "serve")
MAX_LISTED = 40


def _mentions_cuda(test: ast.expr) -> bool:
    return "cuda" in ast.unparse(test)


def _negated(test: ast.expr) -> bool:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    return isinstance(test, ast.Compare) and all(isinstance(op, (ast.NotEq, ast.NotIn)) for op in test.ops)


def _cuda_branch(node: ast.If) -> list[ast.stmt]:
    """The statements only CUDA reaches in this `if` (none where the test does not decide on CUDA alone)."""
    test = node.test
    if isinstance(test, ast.BoolOp):
        if isinstance(test.op, ast.And) and any(_mentions_cuda(v) and not _negated(v) for v in test.values):
            return node.body
        return []
    if not _mentions_cuda(test):
        return []
    return node.orelse if _negated(test) else node.body


def cuda_only_lines(source: str) -> dict[int, str]:
    """{line number: the statement's first line, stripped} of every CUDA-only statement in `source`."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            for stmt in _cuda_branch(node):
                for inner in ast.walk(stmt):
                    if isinstance(inner, ast.stmt):
                        found[inner.lineno] = lines[inner.lineno - 1].strip()
    return found


def read_list(path: Path) -> Counter:
    """The listed lines as a multiset of (path, statement); each needs a reason after `  # `."""
    listed = Counter()
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip() or raw.startswith("#"):
            continue
        entry, sep, reason = raw.partition("  # ")
        file, colon, statement = entry.partition(": ")
        if not (sep and reason.strip() and colon):
            sys.exit(f"{path}:{n}: expected `path: statement  # reason`, got {raw!r}")
        listed[(file.strip(), statement.strip())] += 1
    return listed


def executed_lines(data_file: Path) -> dict[str, set[int]]:
    from coverage import CoverageData

    data = CoverageData(basename=str(data_file))
    data.read()
    out = {}
    for name in data.measured_files():
        path = Path(name).resolve()
        if path.is_relative_to(ROOT):
            out[path.relative_to(ROOT).as_posix()] = set(data.lines(name) or ())
    return out


def unrun(executed: dict[str, set[int]] | None) -> Counter:
    """(path, statement) of each CUDA-only line the suite did not run (every one, without coverage data)."""
    missing = Counter()
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            ran = (executed or {}).get(rel, set())
            for line, statement in sorted(cuda_only_lines(file.read_text()).items()):
                if line not in ran:
                    missing[(rel, statement)] += 1
    return missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=ROOT / ".coverage", help="the suite's combined coverage data")
    p.add_argument("--list", type=Path, default=ROOT / ".ci" / "cuda_only.txt")
    p.add_argument("--show", action="store_true", help="print every CUDA-only line the suite did not run")
    args = p.parse_args(argv)
    if not args.data.exists():
        print(f"cuda_lines: no coverage data at {args.data} (run the suite with --cov first)", file=sys.stderr)
        return 2
    missing, listed = unrun(executed_lines(args.data)), read_list(args.list)
    if args.show:
        for (file, statement), count in sorted(missing.items()):
            print(f"{file}: {statement}" + (f"  (x{count})" if count > 1 else ""))
    unlisted, stale = missing - listed, listed - missing
    for (file, statement), _ in sorted(unlisted.items()):
        print(f"cuda_lines: {file}: `{statement}` runs only on CUDA and no test runs it: take the branch in a "
              f"test on CPU, or name it in {args.list.name} with its reason", file=sys.stderr)
    for (file, statement), _ in sorted(stale.items()):
        print(f"cuda_lines: {args.list.name} names `{file}: {statement}`, which is no longer an unrun CUDA-only "
              "line: take it off the list", file=sys.stderr)
    total = sum(listed.values())
    if total > MAX_LISTED:
        print(f"cuda_lines: {total} lines listed, at most {MAX_LISTED}", file=sys.stderr)
    ok = not unlisted and not stale and total <= MAX_LISTED
    print(f"cuda_lines: {sum(missing.values())} CUDA-only lines unrun by the suite, {total} listed: "
          f"{'ok' if ok else 'FAILED'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
