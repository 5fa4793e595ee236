"""Packaging beyond pyproject.toml: the repository's `serve/` directory installs as `looped_lm.serve`,
so no generic top-level `serve` import name lands in site-packages (editable and wheel installs alike)."""

from setuptools import find_packages, setup

SERVE = ["looped_lm.serve"] + [f"looped_lm.serve.{p}" for p in find_packages("serve")]

setup(packages=find_packages(include=["looped_lm", "looped_lm.*"]) + SERVE, package_dir={"looped_lm.serve": "serve"})
