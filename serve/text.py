"""Text <-> token ids for the server: prompt encoding, the chat template, incremental detokenization
and stop strings. The engine never sees text.

Prompt text follows the Hugging Face / vLLM convention: the literal text of any of the model's added
tokens (its end-of-text, `<|im_end|>` for a ChatML model, ...: `Tokenizer.specials`) is that token, as in
`Tokenizer.to_hf()`, so /tokenize, completions and lm-evaluation-harness's remote tokenizer agree on every
id. (`looped_lm generate` and the data pipeline read such text as plain text instead, like nanoGPT's
`encode_ordinary`: a document cannot forge a boundary.)

Chat goes through the model's chat template (tokenizer_config.json's `chat_template`, a chat_template.jinja
beside it, or the GGUF's `tokenizer.chat_template`; `--chat-template` overrides it), rendered as
transformers' `apply_chat_template` renders it; a model without one gets PLAIN_CHAT_TEMPLATE.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import tokenizers
from jinja2 import ext, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

from looped_lm.data.specials import PLAIN_CHAT_TEMPLATE
from looped_lm.data.tokenizer import Tokenizer, _bytes_to_unicode
from looped_lm.errors import UserError

CHAT_TEMPLATE = PLAIN_CHAT_TEMPLATE  # one "Role: content" line per message, then "Assistant:" to continue
TURN_STOPS = ("\nUser:", "\nSystem:")  # with the plain template, a reply ends where the model starts the next turn


@functools.lru_cache(maxsize=8)
def _prompt_backend(tok: Tokenizer) -> tokenizers.Tokenizer:
    """A copy of the tokenizer that matches added tokens in text (the data pipeline's does not)."""
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    backend.encode_special_tokens = False
    return backend


@functools.lru_cache(maxsize=8)
def _added_pattern(tok: Tokenizer) -> re.Pattern:
    return re.compile("|".join(re.escape(t) for t in sorted(tok.specials.added, key=len, reverse=True)))


def encode(tok: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; the literal text of each added token (`<|endoftext|>`, `<|im_end|>`, ...) is
    that token. add_special_tokens: what the tokenizer's post-processor adds (a BOS for some models; none
    for gpt2, byte and SmolLM2), as transformers' `encode` does by default."""
    if tok.name != "byte":
        return _prompt_backend(tok).encode(text, add_special_tokens=add_special_tokens).ids
    ids: list[int] = []
    at = 0
    for m in _added_pattern(tok).finditer(text):
        ids += tok.encode(text[at:m.start()])
        ids.append(tok.specials.added[m.group()])
        at = m.end()
    return ids + tok.encode(text[at:])


# --- chat templates, as transformers renders them (transformers/utils/chat_template_utils.py) ------------


class _Generation(ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` block (it marks assistant tokens for
    training masks): here it renders its body, as apply_chat_template does."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` refusing underscore attributes, as transformers' TemplateNamespace."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r} on a namespace")


class _Dict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' environment: the sandbox, trim_blocks and lstrip_blocks, loop controls, the
    generation block, its tojson, and the globals raise_exception, strftime_now, dict and namespace."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=_Dict(), namespace=_Namespace)
    return env


def _compile(source: str, where: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"{where}: the chat template does not compile (line {e.lineno}: {e.message})") from None


class ChatTemplate:
    """A compiled chat template and the special tokens it sees (bos_token, eos_token, unk_token,
    pad_token: transformers' `special_tokens_map`). `where` names the template in a compile error. plain:
    the plain template (whose replies end at a "\\nUser:" line: TURN_STOPS)."""

    def __init__(self, source: str, tok: Tokenizer, where: str):
        self.template = _compile(source, where)
        self.source = source
        self.tokens = tok.specials.named()
        self.plain = source == PLAIN_CHAT_TEMPLATE

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """[{"role", "content", ...}, ...] -> the prompt text, as `apply_chat_template(messages,
        tokenize=False, add_generation_prompt=...)` gives it (keys whose value is None are dropped, as
        there). A template's raise_exception (or any template error) raises jinja2.TemplateError."""
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self.template.render(messages=messages, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.tokens)


def chat_template(tok: Tokenizer, override: str | None = None) -> ChatTemplate:
    """The template chat renders through: `override` (--chat-template), else the model's, else the plain one."""
    if override is not None:
        return ChatTemplate(override, tok, "--chat-template")
    if tok.specials.chat_template is not None:
        return ChatTemplate(tok.specials.chat_template, tok, f"the chat template of {tok.name}")
    return ChatTemplate(PLAIN_CHAT_TEMPLATE, tok, "the plain chat template")


def load_chat_template(value: str) -> str:
    """--chat-template FILE_OR_STRING, as vLLM reads it: a file's text; else, if the value looks like a
    template (it holds "{", "}" or a newline), the value itself, its backslash escapes decoded ("\\n"
    typed on a command line is a newline)."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--chat-template {value}: cannot read it ({e})") from None
        _compile(template, f"--chat-template {value}")
        return template
    if not any(c in value for c in "{}\n"):
        raise UserError(f"--chat-template {value}: no such file (give a template file, or the template itself)")
    try:  # characters beyond latin-1 pass through as \uXXXX escapes, which decode back to themselves
        template = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeError:  # a malformed escape (a lone "\x"): taken as written
        template = value
    _compile(template, "--chat-template")
    return template


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for (a byte-level token may hold part of a UTF-8 character; an added
    token, such as the end-of-text, is its text)."""
    added = tok.backend.id_to_token(token_id)
    if added in tok.specials.added and tok.specials.added[added] == token_id:
        return added.encode()
    if tok.name == "byte":
        return bytes([token_id])
    table = _byte_of_char()
    try:
        return bytes(table[c] for c in added)
    except KeyError:  # not a byte-level vocabulary: the token's decoded text
        return tok.decode([token_id]).encode()


def token_text(tok: Tokenizer, token_id: int) -> str:
    """A token's name in log-probs: its text, or (part of a UTF-8 character) "bytes:\\xNN..." as OpenAI
    writes it. Every token gets its own name, so no two share a top_logprobs entry (decoding alone, every
    partial byte would read U+FFFD)."""
    raw = token_bytes(tok, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Detokenizer:
    """The text of a growing token list, piece by piece: `tokenizers`' DecodeStream, which releases a
    piece once its tokens decode to whole characters (a byte-level token may hold part of a UTF-8
    character). `flush` gives what is still held when the tokens end. Each token's text offset (the
    character its first byte lands in) comes from the bytes themselves, through Python's incremental UTF-8
    decoder with the same replacement rule, so it holds after a literal U+FFFD or a broken sequence, which
    DecodeStream keeps holding."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.stream, self.held = tok, DecodeStream(skip_special_tokens=False), []
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0  # characters the bytes so far have completed

    def add(self, token_id: int) -> str:
        return self.add_with_offset(token_id)[0]

    def add_with_offset(self, token_id: int) -> tuple[str, int]:
        """(the text released now, the token's text offset from the start of this detokenizer's text)."""
        offset = self._offset(token_bytes(self.tok, token_id))
        piece = self.stream.step(self.tok.backend, token_id)
        self.held = self.held + [token_id] if piece is None else []
        return piece or "", offset

    def _offset(self, raw: bytes) -> int:
        """Index of the character raw's first byte belongs to. A byte the decoder still holds (part of a
        character not yet complete) belongs to the next character to come, after any replacement its
        arrival forced for the bytes held before it; a byte that completes output belongs to the last
        character output."""
        first = self.chars
        for i in range(len(raw)):
            emitted = len(self.utf8.decode(raw[i:i + 1]))
            held = bool(self.utf8.getstate()[0])
            if i == 0:
                first = self.chars + emitted - (0 if held else 1)
            self.chars += emitted
        return first

    def flush(self) -> str:
        """The held tokens' text (an incomplete character decodes to U+FFFD)."""
        text, self.held = self.tok.decode(self.held), []
        self.stream = DecodeStream(skip_special_tokens=False)
        return text


class StopStrings:
    """Cuts generated text before the first stop string. While streaming, a tail that could be the
    start of a stop string is held back until it is decided."""

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text, self.sent = "", 0

    def push(self, piece: str) -> tuple[str, bool]:
        """Add generated text -> (text that may be sent now, whether a stop string was found)."""
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            out, self.sent = self.text[self.sent:min(hits)], min(hits)
            return out, True
        safe = max(self.sent, len(self.text) - self._held())
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for k in range(min(self.longest - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
