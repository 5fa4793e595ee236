"""Project structure rules (style.md): who imports what, and docs that must not drift from code."""

import ast
from pathlib import Path

from looped_lm.config import describe_fields

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_trainer_imports_deepspeed_and_nothing_imports_a_server():
    files = sorted((ROOT / "looped_lm").rglob("*.py"))
    assert len(files) > 10
    for path in files:
        mods = imported_modules(path)
        rel = path.relative_to(ROOT).as_posix()
        if rel != "looped_lm/train.py":
            assert "deepspeed" not in mods, f"{rel} imports deepspeed: only the trainer may"
        assert not mods & {"fastapi", "uvicorn", "vllm"}, f"{rel} imports a serving library"


def test_model_code_knows_nothing_of_files_or_training_infrastructure():
    for path in sorted((ROOT / "looped_lm" / "models").glob("*.py")):
        mods = imported_modules(path)
        assert not mods & {"deepspeed", "safetensors", "tqdm", "json", "yaml"}, path.name


def test_config_reference_matches_the_code():
    text = (ROOT / "configs" / "README.md").read_text()
    assert describe_fields() in text, "configs/README.md is stale: paste `looped_lm train --help-config`"
