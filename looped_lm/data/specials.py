"""A tokenizer's special tokens and chat template, as the model's own files give them: eos / bos / unk /
pad, every added token, the tokens that end a turn, and the Jinja chat template.

    gpt2, byte          eos = bos = unk = "<|endoftext|>" (Hugging Face's GPT-2), no pad, no template
    tokenizer.json      tokenizer_config.json beside it (bos_token, unk_token, pad_token, chat_template;
                        special_tokens_map.json fills what it lacks; a chat_template.jinja overrides its
                        template), as transformers reads them; eos is the tokenizer's end-of-text id
    FILE.gguf           the GGUF's tokenizer.ggml.{bos,unknown,padding}_token_id and tokenizer.chat_template

The server encodes prompts with these (the literal text of any added token is that token, the Hugging
Face convention) and renders chat through the template; the export writes them to tokenizer_config.json.
The training data pipeline never uses them: there, special-token text is ordinary text.

Imports nothing from looped_lm.data.tokenizer (which imports this module for `Tokenizer.specials`).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass, field

from looped_lm.data.gguf_file import is_gguf
from looped_lm.errors import UserError

# A plain chat template for models without one: one "Role: content" line per message, then "Assistant:".
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# Tokens that end a turn or a text, where the vocabulary holds them as special tokens: generation stops
# at each (ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>, ...), besides the eos token.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>",
               "<|end|>", "</s>", "<eos>")
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # loads any tokenizer.json, in transformers 4 and 5
ROLES = ("bos", "eos", "unk", "pad")


@dataclass(frozen=True)
class Specials:
    """eos_token / eos_token_id ... pad_token / pad_token_id (None: the tokenizer has none), `added`:
    every added token's text -> its id, `stop_ids`: eos first, then the end-of-turn tokens,
    `chat_template`: the model's (None: it has none)."""

    eos_token: str
    eos_token_id: int
    bos_token: str | None = None
    bos_token_id: int | None = None
    unk_token: str | None = None
    unk_token_id: int | None = None
    pad_token: str | None = None
    pad_token_id: int | None = None
    added: dict[str, int] = field(default_factory=dict)
    stop_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    tokenizer_class: str = TOKENIZER_CLASS

    def named(self) -> dict[str, str]:
        """{"bos_token": ..., "eos_token": ...} for the tokens this tokenizer has: what transformers hands a
        chat template (`special_tokens_map`) and writes to tokenizer_config.json."""
        return {f"{r}_token": getattr(self, f"{r}_token") for r in ROLES if getattr(self, f"{r}_token") is not None}


def read_specials(name: str, backend, eot_id: int) -> Specials:
    """The specials of the tokenizer `name` ("gpt2", "byte", a tokenizer.json path or a GGUF path) whose
    `tokenizers.Tokenizer` is `backend` and end-of-text id `eot_id`."""
    added = {t.content: i for i, t in sorted(backend.get_added_tokens_decoder().items())}
    special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    eos = backend.id_to_token(eot_id)
    if name in ("gpt2", "byte"):
        tokens, template, extra_stops = {"bos": eos, "unk": eos}, None, []
    elif is_gguf(name):
        tokens, template, extra_stops = _gguf_specials(name, backend)
    else:
        tokens, template, extra_stops = _file_specials(name, backend)
    values = {}
    for role in ("bos", "unk", "pad"):
        text = tokens.get(role)
        token_id = backend.token_to_id(text) if text is not None else None
        values[f"{role}_token"], values[f"{role}_token_id"] = (text, token_id) if token_id is not None else (None, None)
    stops = [eot_id, *extra_stops, *(special[t] for t in END_OF_TURN if t in special)]
    return Specials(eos_token=eos, eos_token_id=eot_id, added=added, stop_ids=tuple(dict.fromkeys(stops)),
                    chat_template=template, **values)


def _token_text(value) -> str | None:
    """A tokenizer_config.json token entry: "<s>", or {"content": "<s>", ...} (an AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def _pick_template(value) -> str | None:
    """tokenizer_config.json's chat_template: one template, or named ones ([{"name", "template"}]), of
    which transformers uses "default"."""
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict):
        value = value.get("default")
    return value if isinstance(value, str) and value else None


def _file_specials(path: str, backend) -> tuple[dict, str | None, list[int]]:
    """tokenizer_config.json (then special_tokens_map.json, then chat_template.jinja) beside a
    tokenizer.json, and generation_config.json's eos ids (more tokens to stop at)."""
    folder = os.path.dirname(path)
    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    mapped = _read_json(os.path.join(folder, "special_tokens_map.json"))
    tokens = {}
    for role in ("bos", "unk", "pad"):
        text = _token_text(config.get(f"{role}_token"))
        tokens[role] = text if text is not None else _token_text(mapped.get(f"{role}_token"))
    template = _pick_template(config.get("chat_template"))
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read() or template
    eos = _read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    vocab = backend.get_vocab_size()
    return tokens, template, [i for i in eos if isinstance(i, int) and 0 <= i < vocab]


def _gguf_specials(path: str, backend) -> tuple[dict, str | None, list[int]]:
    """A GGUF's tokenizer.ggml.{bos,unknown,padding}_token_id, tokenizer.chat_template, and its
    end-of-turn / end-of-message ids (tokenizer.ggml.eot_token_id, eom_token_id: more tokens to stop at)."""
    fields = gguf_fields(path, _GGUF_KEYS)
    tokens = {}
    for role, key in (("bos", "bos_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id")):
        token_id = fields.get(f"tokenizer.ggml.{key}")
        tokens[role] = backend.id_to_token(token_id) if isinstance(token_id, int) else None
    template = fields.get("tokenizer.chat_template")
    vocab = backend.get_vocab_size()
    stops = [fields.get(f"tokenizer.ggml.{key}") for key in ("eot_token_id", "eom_token_id")]
    return (tokens, template if isinstance(template, str) and template else None,
            [i for i in stops if isinstance(i, int) and 0 <= i < vocab])


_GGUF_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
              "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.chat_template")
# GGUF value types (llama.cpp's gguf.md): scalar type -> struct format; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_fields(path: str, keys: tuple[str, ...]) -> dict:
    """The scalar and string metadata values `keys` of a GGUF file (version 2 or 3, little-endian), read
    from its header alone: the arrays (the vocabulary) are stepped over, never decoded, so this takes
    milliseconds where gguf's GGUFReader parses everything. A key the file lacks is left out."""
    where = f"data.tokenizer {path}"
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            magic, version, _, count = struct.unpack_from("<4sIQQ", m, 0)
            if magic != b"GGUF" or version not in (2, 3):
                raise UserError(f"{where}: a GGUF file of version {version} (looped_lm reads versions 2 and 3)")
            at, out = 24, {}

            def string() -> str:
                nonlocal at
                (n,) = struct.unpack_from("<Q", m, at)
                at += 8 + n
                return m[at - n:at].decode("utf-8", errors="replace")

            def skip(kind: int) -> None:
                nonlocal at
                if kind == 8:
                    (n,) = struct.unpack_from("<Q", m, at)
                    at += 8 + n
                elif kind == 9:
                    inner, n = struct.unpack_from("<IQ", m, at)
                    at += 12
                    if inner in _SCALARS:
                        at += n * struct.calcsize("<" + _SCALARS[inner])
                    else:
                        for _ in range(n):
                            skip(inner)
                else:
                    at += struct.calcsize("<" + _SCALARS[kind])

            for _ in range(count):
                key = string()
                (kind,) = struct.unpack_from("<I", m, at)
                at += 4
                if key in keys and kind == 8:
                    out[key] = string()
                elif key in keys and kind in _SCALARS:
                    (out[key],) = struct.unpack_from("<" + _SCALARS[kind], m, at)
                    skip(kind)
                else:
                    skip(kind)
            return out
    except (OSError, ValueError, KeyError, struct.error) as e:  # a cut-off or damaged header
        raise UserError(f"{where} is not a readable GGUF file ({type(e).__name__}: {e})") from None
