"""How the project installs: the repository's `serve/` directory is the package `looped_lm.serve`, in an
editable install and in a wheel, and no generic top-level `serve` lands in site-packages."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import importlib.metadata, importlib.util, json, looped_lm.serve.app, looped_lm.serve.vllm_plugin
plugins = [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "looped_lm"]
print(json.dumps([looped_lm.serve.app.__file__, importlib.util.find_spec("serve") is None, plugins]))
"""


def probe(cwd: Path, env: dict) -> tuple[str, bool, list[str]]:
    """Import the server as an installed user would: from a directory outside the repository."""
    import json

    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return tuple(json.loads(out.stdout))


def test_the_editable_install_maps_serve_to_looped_lm_serve(tmp_path, clean_env):
    app, no_serve, plugins = probe(tmp_path, clean_env)
    assert Path(app) == ROOT / "serve" / "app.py"
    assert no_serve, "a top-level `serve` is importable"
    assert plugins == ["looped_lm.serve.vllm_plugin:register"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="building a wheel needs setuptools")
def test_the_wheel_holds_looped_lm_serve_and_no_top_level_serve(tmp_path, clean_env):
    src = tmp_path / "src"  # build from a copy: the build leaves build/ beside the sources
    for name in ("looped_lm", "serve"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src],
                   check=True, capture_output=True, env=clean_env)
    wheel, = (tmp_path / "dist").glob("looped_lm-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True, capture_output=True,
                   env=clean_env)
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == ["bin", "looped_lm"]
    app, no_serve, plugins = probe(tmp_path, {**clean_env, "PYTHONPATH": str(site)})
    assert Path(app) == site / "looped_lm" / "serve" / "app.py"
    assert no_serve
    assert "looped_lm.serve.vllm_plugin:register" in plugins
    assert (site / "looped_lm" / "serve" / "vllm_plugin" / "db_model.py").is_file()
