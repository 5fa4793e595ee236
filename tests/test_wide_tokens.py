"""Token files for a vocabulary above 65,536 tokens (Qwen2/Qwen3, Gemma 3): uint32, the dtype in meta.json.

A WordLevel tokenizer of 70,000 words, whose corpus words and end-of-text token all sit above 65,535, goes
through `prepare_dataset`, a few training steps of a tiny gpt, and `looped_lm eval` (on the run's val.bin
and on a .txt tokenized by eval itself); a uint32 file whose meta.json disagrees with it is one line.
"""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
from conftest import DIST_VARS
from tokenizers import Tokenizer, models, pre_tokenizers

from looped_lm import cli, trainer
from looped_lm.data import load_tokens, prepare_dataset
from looped_lm.data.bin_dataset import token_dtype
from looped_lm.errors import UserError

VOCAB = 70_000
WORDS = [f"w{i}" for i in range(65_600, 65_640)]  # the corpus's words: every id above uint16's range


def _corpus(path, words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(words)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory, write_config):
    """(prepared data directory, checkpoint) of a 3-step tiny gpt on a 70,000-word tokenizer."""
    root = tmp_path_factory.mktemp("wide_run")
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"</s>": VOCAB - 1}  # "</s>": the end-of-text token
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(root / "tokenizer.json"))
    data = root / "prepared"
    prepare_dataset(_corpus(root / "corpus.txt", 3000), str(data), tokenizer=str(root), progress=False)
    cfg = write_config(root / "run.yaml", {
        # the model directory, not its tokenizer.json: the same tokenizer the data was prepared with
        "data": {"source": "bin", "path": str(data), "tokenizer": str(root)},
        "train": {"out_dir": str(root / "out"), "max_steps": 3}})
    before = {k: os.environ.get(k) for k in DIST_VARS}  # train() sets a world of one in os.environ
    try:
        assert trainer.main(["--config", str(cfg)]) == 0
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return data, root / "out" / "step_0000003"


def test_token_dtype_is_the_narrowest_that_holds_the_vocabulary():
    assert [token_dtype(n) for n in (257, 50257, 65536, 65537, 151_936, 262_144)] == \
        ["uint16"] * 3 + ["uint32"] * 3


def test_prepare_writes_uint32_and_says_so(wide_run):
    data, _ = wide_run
    meta = json.loads((data / "meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", VOCAB, VOCAB - 1)
    for split in ("train", "val"):
        tokens = np.fromfile(data / f"{split}.bin", dtype=np.uint32)
        assert len(tokens) == meta["splits"][split]["tokens"] and tokens.min() >= 65_600
        assert load_tokens(str(data / f"{split}.bin"), vocab_size=VOCAB).tolist() == tokens.tolist()


def test_eval_scores_uint32_tokens(wide_run, tmp_path, capsys):
    """The run's val.bin (uint32, read through its meta.json) and a .txt eval tokenizes itself."""
    _, ckpt = wide_run
    args = ["eval", "--checkpoint", str(ckpt), "--max-tokens", "100", "--no-progress"]
    assert cli.main(args + ["--json", str(tmp_path / "val.json")]) == 0
    assert cli.main(args + ["--data", _corpus(tmp_path / "other.txt", 200, seed=1),
                            "--json", str(tmp_path / "txt.json")]) == 0
    capsys.readouterr()
    for name in ("val", "txt"):
        rep = json.loads((tmp_path / f"{name}.json").read_text())
        assert rep["tokens"] == 96 and math.isfinite(rep["ppl"]) and 1.0 < rep["ppl"] < VOCAB


def test_a_uint32_file_that_disagrees_with_its_meta_is_one_line(wide_run, tmp_path, capsys, one_line_error):
    _, ckpt = wide_run
    path, meta = tmp_path / "val.bin", tmp_path / "meta.json"
    path.write_bytes(np.arange(65_600, 65_700, dtype=np.uint32).tobytes() + b"\x00\x00")  # 402 bytes
    meta.write_text(json.dumps({"dtype": "uint32", "vocab_size": VOCAB}))
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--data", str(path), "--no-progress"]) == 2
    one_line_error(capsys.readouterr(), "byte length not a multiple of 4 (402 bytes)", "not a uint32 token file")

    np.arange(65_600, 65_700, dtype=np.uint32).tofile(path)
    meta.write_text(json.dumps({"dtype": "uint16", "vocab_size": VOCAB}))  # its dtype cannot hold its vocabulary
    with pytest.raises(UserError, match="dtype uint16, which cannot hold the ids of its vocab_size 70000"):
        load_tokens(str(path))
    meta.write_text(json.dumps({"dtype": "int64"}))
    with pytest.raises(UserError, match="dtype int64, but token files are uint16 or uint32"):
        load_tokens(str(path))
    meta.write_text(json.dumps({"dtype": "uint32", "vocab_size": VOCAB}))
    np.arange(1, 3001, dtype=np.uint16).tofile(path)  # uint16 ids read as uint32: ids far above the vocabulary
    with pytest.raises(UserError, match="vocabulary of 70000: not tokens of this tokenizer"):
        load_tokens(str(path))
    np.arange(1, 3000, dtype=np.uint64).tofile(path)
    with pytest.raises(UserError, match="looks like 64-bit integers"):
        load_tokens(str(path))


def test_prepare_takes_a_model_directory_and_refuses_an_unknown_name(wide_run, tmp_path, capsys, one_line_error):
    data, _ = wide_run
    root = data.parent
    out = tmp_path / "by_cli"
    assert cli.main(["prepare", "--source", _corpus(tmp_path / "c.txt", 500), "--out", str(out),
                     "--tokenizer", str(root)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["tokenizer"] == str(root / "tokenizer.json")
    capsys.readouterr()
    assert cli.main(["prepare", "--source", str(tmp_path / "c.txt"), "--out", str(tmp_path / "x"),
                     "--tokenizer", "qwen"]) == 2
    one_line_error(capsys.readouterr(), "--tokenizer 'qwen'", "tokenizer.json")
