"""Tokenize a source into nanoGPT's format: train.bin / val.bin (flat uint16, or uint32 for a vocabulary
above 65,536 tokens) plus a meta.json sidecar that names the dtype.

Every document is followed by the end-of-text token, exactly as nanoGPT's OpenWebText script writes it,
so a directory prepared here and one prepared by nanoGPT are interchangeable. Files are written under
temporary names and renamed at the end, meta.json last: a directory with meta.json is complete, and an
interrupted run leaves nothing that looks finished (re-running starts it again).
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
from tqdm import tqdm

from looped_lm import __version__
from looped_lm.data.bin_dataset import token_dtype
from looped_lm.data.latents import prepare_latents
from looped_lm.data.sources import BUILTIN_SOURCES, HF_PREFIX, document_split, iter_documents
from looped_lm.data.tokenizer import TOKENIZER_NAMES, canonical_tokenizer, check_tokenizer_name, get_tokenizer
from looped_lm.errors import UserError
from looped_lm.fields import TEST, TRAIN, TRAINING_SPLITS, VAL, token_file

# nanoGPT holds out 0.0005 of OpenWebText's 8M documents; small corpora need more: 0.05 holds out
# 3 of the 66 Bible books and 2 of the 42 Shakespeare works (about 5% of the tokens).
DEFAULT_VAL_FRACTION = 0.05
BATCH_DOCS = 256  # documents per encode_batch call


def prepare_dataset(
    source: str,
    out_dir: str,
    tokenizer: str = "gpt2",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    test_fraction: float = 0.0,
) -> dict:
    """Write out_dir/{train.bin, val.bin, meta.json} for `source` (and test.bin with test_fraction > 0)
    and return the meta dict.

    Documents go to train, val (or test) whole (see `sources.document_split`); a single-document source is
    cut at the (1 - val_fraction) point of its tokens instead, the end-of-text token going with val (it
    cannot also have a test split). A test split that would get no document is refused.
    """
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if not 0.0 <= test_fraction < 1.0 - val_fraction:
        raise UserError(f"test_fraction must be in [0, 1 - val_fraction) = [0, {1 - val_fraction:g}) "
                        f"(got {test_fraction})")
    splits = TRAINING_SPLITS + ((TEST,) if test_fraction > 0 else ())
    tok = get_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path) and not overwrite:
        raise UserError(f"{out_dir} is already prepared (meta.json exists); pass --overwrite to replace it")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"output path {out_dir} exists and is not a directory")
    documents = iter_documents(source)
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)

    tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = {split: os.path.join(out_dir, f".{token_file(split)}{tag}") for split in splits}
    tokens = {split: 0 for split in splits}
    docs = {split: 0 for split in splits}
    files = {split: open(tmp[split], "wb", buffering=1 << 20) for split in splits}
    # shown after a second only: a source refused at its first document (not UTF-8) prints just its error
    bar = tqdm(desc=f"tokenizing {source}", unit=" docs", disable=not progress, delay=1.0)

    def write(split: str, ids: list[int], ends_document: bool = True) -> None:
        ids = ids + [tok.eot_id] if ends_document else ids
        files[split].write(np.asarray(ids, dtype=dtype).tobytes())
        tokens[split] += len(ids)
        docs[split] += 1

    try:
        # The newest document is held back so that, once the stream ends, the last one can go wherever a
        # split is still empty.
        pending, count = None, 0
        for batch in _batches(documents, BATCH_DOCS):
            for ids in tok.encode_batch(batch):
                if pending is not None:
                    write(document_split(count - 1, val_fraction, seed, test_fraction), pending)
                pending, count = ids, count + 1
            bar.update(len(batch))
            # refresh=False: a refresh draws the bar inside its delay, and close() would then leave the line open
            bar.set_postfix(tokens=f"{sum(tokens.values()):,}", refresh=False)
        if count == 0:
            raise UserError(f"data source {source} has no documents")
        if count == 1 and test_fraction > 0:
            raise UserError(f"data source {source} is one document: a test split needs whole documents "
                            "(set test_fraction 0, or give the corpus as several documents)")
        if count == 1:
            cut = _single_document_cut(len(pending), val_fraction)
            write(TRAIN, pending[:cut], ends_document=False)
            write(VAL, pending[cut:])
        else:  # the last document goes to the first split still empty, else where the rule puts it
            empty = [split for split in splits if docs[split] == 0]
            write(empty[0] if empty else document_split(count - 1, val_fraction, seed, test_fraction), pending)
        empty = [split for split in splits if docs[split] == 0]
        if empty:
            raise UserError(f"the {' and '.join(empty)} split{'s' if len(empty) > 1 else ''} of {source} got no "
                            f"document ({count} documents; val_fraction {val_fraction:g}, test_fraction "
                            f"{test_fraction:g}): raise the fraction, or use a corpus with more documents")
        for f in files.values():
            f.close()

        meta = {
            "format": "nanogpt-bin",
            "tokenizer": tok.name,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "dtype": dtype,
            "source": source,
            "val_fraction": val_fraction,
            "test_fraction": test_fraction,
            "seed": seed,
            "split_rule": "within-document" if count == 1 else "by-document",
            "splits": {s: {"tokens": tokens[s], "documents": docs[s]} for s in splits},
            "looped_lm_version": __version__,
        }
        if os.path.exists(meta_path):  # overwriting: the old output stops counting as finished first
            os.remove(meta_path)
        for split in splits:
            os.replace(tmp[split], os.path.join(out_dir, token_file(split)))
        tmp_meta = os.path.join(out_dir, f".meta.json{tag}")
        with open(tmp_meta, "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        os.replace(tmp_meta, meta_path)
        return meta
    finally:
        bar.close()
        for f in files.values():
            f.close()
        for path in (*tmp.values(), os.path.join(out_dir, f".meta.json{tag}")):
            if os.path.exists(path):
                os.remove(path)
        if created and not os.listdir(out_dir):  # a refused source leaves no directory behind either
            os.rmdir(out_dir)


def ensure_prepared(
    source: str,
    cache_root: str,
    tokenizer: str = "gpt2",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = 0,
    progress: bool = True,
    test_fraction: float = 0.0,
) -> str:
    """A directory with train.bin and val.bin (and test.bin with test_fraction > 0) for `source`, preparing
    it into `cache_root` at most once.

    A directory that already holds train.bin and val.bin (ours, or nanoGPT's OpenWebText output, which has
    no meta.json) is returned as it is. Anything else is prepared into cache_root/<slug>, where the slug
    hashes the source (and, for local files, their sizes and modification times), tokenizer, val_fraction
    and seed. Processes that race each prepare into their own temporary directory and rename it into place;
    the first rename wins and the others reuse its result.
    """
    if os.path.isdir(source) and all(os.path.isfile(os.path.join(source, token_file(s))) for s in TRAINING_SPLITS):
        meta_path = os.path.join(source, "meta.json")
        if os.path.isfile(meta_path):
            try:
                with open(meta_path) as f:
                    prepared_with = json.load(f).get("tokenizer")
            except (ValueError, AttributeError):
                raise UserError(f"{meta_path} is not a valid meta.json") from None
            if prepared_with is not None and canonical_tokenizer(prepared_with) != canonical_tokenizer(tokenizer):
                raise UserError(f"{source} was prepared with tokenizer {prepared_with}, but data.tokenizer is {tokenizer}")
        return source
    final = os.path.join(cache_root, _cache_slug(source, tokenizer, val_fraction, seed, test_fraction))
    if os.path.isfile(os.path.join(final, "meta.json")):
        return final
    if os.path.isdir(final):  # no meta.json: left by something other than this function; start afresh
        shutil.rmtree(final)
    os.makedirs(cache_root, exist_ok=True)
    tmp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        prepare_dataset(source, tmp, tokenizer, val_fraction, seed, progress=progress, test_fraction=test_fraction)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "meta.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _cache_slug(source: str, tokenizer: str, val_fraction: float, seed: int, test_fraction: float = 0.0) -> str:
    """Readable name plus a hash of everything that changes the output."""
    local = source not in BUILTIN_SOURCES and not source.startswith(HF_PREFIX) and os.path.exists(source)
    key = {
        "source": os.path.abspath(source) if local else source,
        "files": _fingerprint(source) if local else None,
        "tokenizer": tokenizer,
        "val_fraction": val_fraction,
        "seed": seed,
        "format": 1,
    }
    if test_fraction > 0:  # only then: the slugs of data prepared without a test split stay as they were
        key["test_fraction"] = test_fraction
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(os.path.normpath(source)) or source).strip("-.")
    label = tokenizer if tokenizer in TOKENIZER_NAMES else "hf"  # a tokenizer.json path: in the digest only
    return f"{name[:40] or 'data'}-{label}-{digest}"


def _fingerprint(path: str) -> list:
    paths = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
    )
    return [(os.path.relpath(p, path), os.path.getsize(p), os.stat(p).st_mtime_ns) for p in paths]


def _single_document_cut(n: int, val_fraction: float) -> int:
    """Where to cut one document of n tokens: both sides keep at least one token when n >= 2."""
    if n < 2:
        return n
    return min(max(round(n * (1.0 - val_fraction)), 1), n - 1)


def _batches(items, size):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `looped_lm prepare`."""
    parser.add_argument("--source", required=True,
                        help="bible | shakespeare | PATH (.txt/.jsonl/.parquet or a directory) | hf:NAME[:CONFIG][@SPLIT]"
                        " | imagefolder:PATH (with --vae)")
    parser.add_argument("--out", required=True, help="output directory for train.bin, val.bin and meta.json")
    parser.add_argument("--tokenizer", default="gpt2",
                        help=f"{' | '.join(TOKENIZER_NAMES)} | the path of a tokenizer.json, a model directory holding "
                        "one (a pretrained source's: Qwen, Gemma, Llama...) or a GGUF file (default: gpt2)")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                        help=f"share of documents held out for validation (default: {DEFAULT_VAL_FRACTION})")
    parser.add_argument("--test-fraction", type=float, default=0.0,
                        help="share of documents held out as a test split (test.bin), apart from val: choose "
                        "settings on val, report on test (`looped_lm eval --split test`); default 0: none")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document split (default: 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing prepared directory")
    vae = parser.add_argument_group("VAE latents for dit (`--source imagefolder:PATH`, the latents extra)")
    vae.add_argument("--vae", default=None, metavar="DIR",
                     help="encode the images of --source imagefolder:PATH (train/<class>/*, val/<class>/*) with the "
                     "diffusers AutoencoderKL saved in DIR (local files only) into latent shards in --out")
    vae.add_argument("--image-size", type=int, default=256, help="center crop side before encoding (default: 256)")
    vae.add_argument("--batch-size", type=int, default=32, help="images per VAE call (default: 32)")
    vae.add_argument("--device", default="cpu", help="where the VAE runs (default: cpu)")


def run(args: argparse.Namespace) -> int:
    """`looped_lm prepare`: prepare, then print one line with the token (or latent) counts."""
    out = Path(args.out)
    check_tokenizer_name(args.tokenizer, "--tokenizer")
    if out.is_dir() and not (out / "meta.json").exists() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"--out {out} is a non-empty directory but not a prepared dataset (no meta.json): choose a "
                        "new or empty directory, or pass --overwrite to write train.bin / val.bin there anyway")
    if args.vae is not None or args.source.startswith("imagefolder:"):
        if args.vae is None:
            raise UserError("--source imagefolder:PATH is encoded into VAE latents: pass --vae DIR (a local "
                            "diffusers AutoencoderKL)")
        if args.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1 (got {args.batch_size})")
        meta = prepare_latents(args.source, args.out, args.vae, image_size=args.image_size,
                               batch_size=args.batch_size, device=args.device, overwrite=args.overwrite)
        print(f"prepared {args.source} as VAE latents {meta['shape']} in {args.out}: train "
              f"{meta['splits'][TRAIN]:,}, val {meta['splits'][VAL]:,} images, {meta['num_classes']} classes")
        return 0
    meta = prepare_dataset(args.source, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                           seed=args.seed, overwrite=args.overwrite, test_fraction=args.test_fraction)
    counts = ", ".join(f"{split} {c['tokens']:,} tokens ({c['documents']:,} documents)"
                       for split, c in meta["splits"].items())
    print(f"prepared {args.source} ({meta['tokenizer']}) in {args.out}: {counts}")
    return 0
