"""Text <-> token ids for the server: prompt encoding, the chat template, incremental detokenization
and stop strings. The engine never sees text.

Prompt text follows the Hugging Face / vLLM convention: the literal "<|endoftext|>" is the end-of-text
token (as in `Tokenizer.to_hf()`), so /tokenize, completions and lm-evaluation-harness's remote
tokenizer agree on every id. (`looped_lm generate` and the data pipeline read that string as plain
text instead, like nanoGPT's `encode_ordinary`.)
"""

from __future__ import annotations

import codecs
import functools

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

from looped_lm.data.tokenizer import EOT_TEXT, Tokenizer, _bytes_to_unicode

# A plain chat template: one "Role: content" line per message, then "Assistant:" to continue.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
TURN_STOPS = ("\nUser:", "\nSystem:")  # a chat reply ends where the model starts the next turn


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`; each "<|endoftext|>" in it is the end-of-text token."""
    ids: list[int] = []
    for i, part in enumerate(text.split(EOT_TEXT)):
        if i:
            ids.append(tok.eot_id)
        if part:
            ids += tok.encode(part)
    return ids


@functools.lru_cache(maxsize=1)
def _chat_template():
    return ImmutableSandboxedEnvironment(keep_trailing_newline=True).from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """[{"role", "content"}, ...] -> the prompt text, through CHAT_TEMPLATE (also served by /tokenizer_info)."""
    return _chat_template().render(messages=messages, add_generation_prompt=add_generation_prompt)


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for (a byte-level token may hold part of a UTF-8 character)."""
    if token_id == tok.eot_id:
        return EOT_TEXT.encode()
    if tok.name == "byte":
        return bytes([token_id])
    table = _byte_of_char()
    return bytes(table[c] for c in tok.backend.id_to_token(token_id))


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
