"""The Manifest type (looped_lm/manifest.py): a manifest read and written back is the same JSON object, key
order included (old checkpoints, format 1 and 2, keep their manifest_sha256), and no other module builds one
by hand."""

import ast
from pathlib import Path

from looped_lm import checkpoint as ckpt_io
from looped_lm.manifest import Manifest

ROOT = Path(__file__).resolve().parents[1]

FORMAT_2 = {"config": {"model": {"kind": "gpt"}}, "model_kind": "gpt", "vocab_size": 257, "tokenizer": "byte",
            "model_state": {}, "data": {"dir": "d", "position": {"step": 2, "tokens_seen": 128}, "sampling": "s"},
            "world_size": 1, "optimizer_layout": "units", "step": 2, "format_version": 2,
            "looped_lm_version": "0.1.0", "files": {"model.safetensors": {"size": 1, "sha256": "0" * 64}},
            "weights_dtypes": {"w": "F32"}, "manifest_sha256": "x", "a_key_from_the_future": [1]}
FORMAT_1 = {"config": {"model": {"kind": "gpt"}}, "step": 5, "vocab_size": 257, "tokenizer": "byte",
            "format_version": 1, "weights_sha256": "0" * 64, "base": None}


def test_a_manifest_read_and_written_back_is_the_same_json():
    for raw in (FORMAT_2, FORMAT_1):
        back = Manifest.from_dict(raw).to_dict()
        assert back == raw
        assert ckpt_io.manifest_digest(back) == ckpt_io.manifest_digest(raw)
    m = Manifest.from_dict(FORMAT_2)
    assert list(m.to_dict()) == list(FORMAT_2)  # in the order this version writes them
    assert (m.step, m.layout, m.tokens_seen, m.weights_only) == (2, "units", 128, None)
    old = Manifest.from_dict(FORMAT_1)
    assert (old.layout, old.state, old.tokens_seen, old.owned_blocks) == ("deepspeed", {}, 0, None)
    assert old.to_dict() == FORMAT_1  # a null kept as a null


def test_only_the_manifest_module_builds_a_manifest_by_hand():
    """A dict literal with manifest keys (model_kind and vocab_size together) outside looped_lm/manifest.py is a
    second place that builds one: Manifest.of is the one."""
    def literals(source: str) -> int:
        return sum(1 for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Dict)
                   and {"model_kind", "vocab_size"} <= {k.value for k in node.keys if isinstance(k, ast.Constant)})

    assert literals('m = {"config": c, "model_kind": k, "vocab_size": 3}\n') == 1  # the check sees one
    offenders = [p.relative_to(ROOT).as_posix() for p in sorted(ROOT.glob("looped_lm/**/*.py"))
                 if p.name != "manifest.py" and literals(p.read_text())]
    assert not offenders, offenders
