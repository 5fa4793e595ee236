"""The OpenAI-compatible server, through real clients: the `openai` package and raw httpx, against
servers on loopback serving tiny checkpoints trained here (a byte-level GPT and a B = 2 DB-AR model).

Covered: /v1/models with NAME@K aliases, completions (all prompt shapes, n, seed, stop, stream), chat
(plain and streamed), K per request (extra_body, alias, default) reported back, echo + logprobs exactly
as lm-evaluation-harness's `local-completions` reads them and equal to the model's own log-probs, the
tokenizer endpoints, /health, /metrics, the OpenAPI document, API keys, client disconnects freeing
slots, and the `looped_lm serve` verb. Bad and extreme input: tests/test_server_input.py.
"""

from __future__ import annotations

import codecs
import json
import os
import random
import socket
import subprocess
import sys
import time
from operator import itemgetter
from pathlib import Path

import httpx
import openai
import pytest
import torch

from conftest import DIST_VARS
from looped_lm.checkpoint import load_checkpoint
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.engine import Engine, scoring_seed
from looped_lm.models.contract import split_logprobs
from looped_lm.serve.app import BackgroundServer, build_app
from looped_lm.serve.text import Detokenizer, StopStrings


pytestmark = pytest.mark.usefixtures("one_thread")


DB_MODEL = {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16}


def train_tiny_db(tmp_path_factory, write_config) -> Path:
    """A 30-step byte-level DB-AR run (B = 2), trained once per session (the load test reuses it)."""
    from looped_lm import trainer

    root = tmp_path_factory.getbasetemp() / "serve_tiny_db"
    ckpt = root / "out" / "step_0000030"
    if (ckpt / "manifest.json").is_file():
        return ckpt
    cfg = write_config(root / "run.yaml", {
        "model": DB_MODEL, "diffusion": {"num_blocks": 2},
        "train": {"out_dir": str(root / "out"), "max_steps": 30, "batch_size": 8, "lr": 3.0e-3, "warmup_steps": 3}})
    before = {k: os.environ.get(k) for k in DIST_VARS}
    try:
        assert trainer.main(["--config", str(cfg)]) == 0
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return ckpt


class Served:
    """A running server and what the tests compare it with."""

    def __init__(self, ckpt: Path, name: str, api_key: str | None = None, max_request_work: int | None = None,
                 **engine_kw):
        self.model, self.cfg, manifest = load_checkpoint(ckpt)
        self.tok = get_tokenizer(manifest["tokenizer"])
        self.engine = Engine.from_memory_budget(self.model, 0.25, vocab_size=self.tok.vocab_size, **engine_kw)
        self.name = name
        self.server = BackgroundServer(build_app(self.engine, self.tok, name, api_key=api_key,
                                                 max_request_work=max_request_work))

    def __enter__(self):
        self.server.__enter__()
        self.url = self.server.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        return self

    def __exit__(self, *exc):
        self.http.close()
        self.client.close()
        self.server.__exit__(*exc)


@pytest.fixture(scope="module")
def gpt(tiny_run):
    with Served(tiny_run[1], "tiny-gpt") as s:
        yield s


@pytest.fixture(scope="module")
def db(tmp_path_factory, write_config):
    with Served(train_tiny_db(tmp_path_factory, write_config), "tiny-db") as s:
        yield s


def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.num_running or engine.num_waiting:
        assert time.monotonic() < deadline, "the engine still holds requests"
        time.sleep(0.01)


# --- models, completions, chat ---------------------------------------------------------------------


def test_models_list_the_model_and_its_k_aliases(gpt, db):
    assert [m.id for m in gpt.client.models.list().data] == ["tiny-gpt"]
    cards = {m.id: m for m in db.client.models.list().data}
    ks = [1, 2, 4, 8, 16, 32, 64]  # powers of two up to model.max_iterations (64), B = 2 among them
    assert list(cards) == ["tiny-db"] + [f"tiny-db@{k}" for k in ks]
    assert cards["tiny-db"].num_iterations == 2  # the default: diffusion.num_iterations = 0 -> B
    assert cards["tiny-db@8"].num_iterations == 8 and cards["tiny-db@8"].parent == "tiny-db"
    assert cards["tiny-db"].max_model_len == db.model.max_positions


def test_completion_greedy_is_deterministic_and_counts_usage(gpt):
    kw = dict(model="tiny-gpt", prompt="And God said", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})  # exactly max_tokens tokens
    a, b = gpt.client.completions.create(**kw), gpt.client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and len(a.choices[0].text) > 0
    assert a.choices[0].finish_reason == "length" and a.object == "text_completion" and a.model == "tiny-gpt"
    assert (a.usage.prompt_tokens, a.usage.completion_tokens, a.usage.total_tokens) == (12, 12, 24)
    assert a.num_iterations is None  # a GPT has no K
    ids = gpt.tok.encode("And God said")
    by_ids = gpt.client.completions.create(**{**kw, "prompt": ids})
    assert by_ids.choices[0].text == a.choices[0].text


def test_every_prompt_shape_and_n_with_seeds(gpt):
    c = gpt.client.completions
    texts = ["In the beginning", "Blessed"]
    ids = [gpt.tok.encode(t) for t in texts]
    sampled = dict(model="tiny-gpt", max_tokens=8, temperature=1.0, seed=5, n=2, extra_body={"ignore_eos": True})
    for prompt in (texts, ids):
        r = c.create(prompt=prompt, **sampled)
        assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
        assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 32
        again = c.create(prompt=prompt, **sampled)
        assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # same seed, same text
    # choice j of n samples with seed + j: it equals a single request with that seed
    one = c.create(prompt=texts[0], **{**sampled, "n": 1, "seed": 6})
    assert one.choices[0].text == r.choices[1].text
    assert r.choices[0].text != r.choices[1].text


def test_stream_equals_the_whole_response(gpt, db):
    for s, extra in ((gpt, {"extra_body": {"ignore_eos": True}}),
                     (db, {"extra_body": {"num_iterations": 4, "ignore_eos": True}})):
        kw = dict(model=s.name, prompt="And the LORD", max_tokens=10, temperature=0.8, seed=3, **extra)
        whole = s.client.completions.create(**kw)
        chunks = list(s.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == whole.choices[0].text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
        assert all(ch.num_iterations == whole.num_iterations for ch in chunks)
    raw = gpt.http.post("/v1/completions", json={"prompt": "And", "max_tokens": 3, "stream": True})
    events = [line for line in raw.text.split("\n\n") if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_stop_strings_cut_the_text(gpt):
    kw = dict(model="tiny-gpt", prompt="And God said", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = gpt.client.completions.create(**kw).choices[0].text
    stop = full[6:9]
    expected = full[:full.index(stop)]
    r = gpt.client.completions.create(stop=[stop, "@@@"], **kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = list(gpt.client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    wait_idle(gpt.engine)  # the stopped request left its slot


def test_chat_completion_plain_and_streamed(gpt):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]
    kw = dict(model="tiny-gpt", messages=messages, max_tokens=16, temperature=0)
    r = gpt.client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    prompt = "System: Be brief.\nUser: Who?\nAssistant:"
    assert r.usage.prompt_tokens == len(gpt.tok.encode(prompt))
    chunks = list(gpt.client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    with_lp = gpt.client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    content = with_lp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == text and all(len(t.top_logprobs) == 3 for t in content)
    tok = gpt.http.post("/tokenize", json={"messages": messages}).json()
    assert tok["tokens"] == gpt.tok.encode(prompt)


def test_k_per_request_body_alias_and_default(db):
    c = db.client.completions
    base = dict(prompt="And", max_tokens=6, temperature=0, seed=1)
    assert c.create(model="tiny-db", **base).num_iterations == 2
    by_body = c.create(model="tiny-db", extra_body={"num_iterations": 8}, **base)
    by_alias = c.create(model="tiny-db@8", **base)
    assert by_body.num_iterations == by_alias.num_iterations == 8
    assert by_body.choices[0].text == by_alias.choices[0].text and by_alias.model == "tiny-db@8"
    chat = db.client.chat.completions.create(model="tiny-db@4", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4)
    assert chat.num_iterations == 4
    with pytest.raises(openai.BadRequestError, match="num_iterations"):
        c.create(model="tiny-db", extra_body={"num_iterations": 65}, **base)
    with pytest.raises(openai.BadRequestError, match="contradicts"):
        c.create(model="tiny-db@2", extra_body={"num_iterations": 4}, **base)


def test_client_errors_map_to_openai_exceptions(gpt, db):
    c = gpt.client.completions
    with pytest.raises(openai.NotFoundError) as e:
        c.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        gpt.client.completions.create(model="tiny-gpt@2", prompt="x", max_tokens=1)  # a GPT has no aliases
    for bad in (dict(temperature=-1), dict(top_p=0), dict(n=0), dict(max_tokens=10 ** 6), dict(logprobs=99)):
        with pytest.raises(openai.BadRequestError) as e:
            c.create(model="tiny-gpt", prompt="x", **{"max_tokens": 1, **bad})
        assert e.value.body["type"] == "invalid_request_error" and e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="no K"):
        c.create(model="tiny-gpt", prompt="x", max_tokens=1, extra_body={"num_iterations": 2})
    with pytest.raises(openai.BadRequestError):
        db.client.chat.completions.create(model="tiny-db@999", messages=[{"role": "user", "content": "x"}])


# --- echo + logprobs: what lm-evaluation-harness reads ----------------------------------------------


def lm_eval_parse_logprobs(outputs: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm_eval/models/openai_completions.py, LocalCompletionsAPI.parse_logprobs (the reader we must fit)."""
    res = []
    for choice, ctxlen in zip(sorted(outputs["choices"], key=itemgetter("index")), ctxlens):
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((logprobs, is_greedy))
    return res


def reference_logprobs(served: Served, ids: list[int], k: int | None, seed: int) -> torch.Tensor:
    """The model's `token_logprobs` at every prompt position (gpt: log_softmax of its logits; DB: the K-step
    sampler's estimated marginal), drawn from the engine's scoring stream of a request with `seed`."""
    scoring = torch.Generator().manual_seed(scoring_seed(seed, ids))
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    with torch.no_grad():
        return split_logprobs(served.model.token_logprobs(x, y, served.engine.score_settings, k, scoring))[0][0].float()


@pytest.mark.parametrize("which", ["gpt", "db"])
def test_echo_logprobs_are_what_lm_eval_reads(which, request):
    s: Served = request.getfixturevalue(which)
    k = None if which == "gpt" else 2
    contexts = ["And God said, Let there be", "In the beginning God"]
    continuations = [" light", " created"]
    prompts = [s.tok.encode(c) + s.tok.encode(x) for c, x in zip(contexts, continuations)]
    ctxlens = [len(s.tok.encode(c)) for c in contexts]
    payload = {"model": s.name, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}  # LocalCompletionsAPI._create_payload(generate=False)
    out = s.http.post("/v1/completions", json=payload)
    assert out.status_code == 200, out.text
    out = out.json()
    for choice, ids, ctxlen in zip(out["choices"], prompts, ctxlens):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert choice["text"].startswith(s.tok.decode(ids))
        ref = reference_logprobs(s, ids, k, seed=1234)
        for t in range(1, len(ids)):
            assert lp["token_logprobs"][t] == pytest.approx(float(ref[t - 1, ids[t]]), abs=1e-4)
            top = lp["top_logprobs"][t]
            assert lp["tokens"][t] in top and top[lp["tokens"][t]] == lp["token_logprobs"][t]
            assert max(top.values()) == pytest.approx(float(ref[t - 1].max()), abs=1e-4)
    parsed = lm_eval_parse_logprobs(out, ctxlens)
    for (ll, greedy), ids, ctxlen in zip(parsed, prompts, ctxlens):
        ref = reference_logprobs(s, ids, k, seed=1234)
        targets = torch.tensor(ids[ctxlen:])
        assert ll == pytest.approx(float(ref[ctxlen - 1:].gather(1, targets[:, None]).sum()), abs=1e-3)
        assert greedy == bool((ref[ctxlen - 1:].argmax(-1) == targets).all())

    # max_tokens = 0 (vLLM-style scoring): the prompt only, through the openai client too
    zero = s.client.completions.create(model=s.name, prompt=prompts[0], max_tokens=0, echo=True, logprobs=1,
                                       seed=1234)
    lp0 = zero.choices[0].logprobs
    assert len(lp0.token_logprobs) == len(prompts[0]) and zero.usage.completion_tokens == 0
    assert lp0.token_logprobs[1:] == pytest.approx(out["choices"][0]["logprobs"]["token_logprobs"][1:-1], abs=1e-5)
    assert zero.choices[0].text == s.tok.decode(prompts[0])


def test_echo_with_generation_and_token_id_strings(db):
    r = db.http.post("/v1/completions", json={"model": "tiny-db@4", "prompt": [65, 110, 100], "max_tokens": 5,
                                              "echo": True, "logprobs": 2, "seed": 9, "temperature": 0,
                                              "return_tokens_as_token_ids": True, "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"][:3] == ["token_id:65", "token_id:110", "token_id:100"] and len(lp["tokens"]) == 8
    assert r["choices"][0]["text"].startswith("And") and lp["text_offset"][:4] == [0, 1, 2, 3]
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_detokenizer_never_splits_a_character_and_ends_as_decode(name):
    tok = get_tokenizer(name)
    text = "héllo → wörld 😀 日本"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # characters span several tokens
    d = Detokenizer(tok)
    pieces = [d.add(i) for i in ids]
    assert "".join(pieces) + d.flush() == text and all("\ufffd" not in p for p in pieces)
    rng = random.Random(0)  # any ids, broken UTF-8 and the end-of-text token included: the text of decode
    alphabet = [*ids, tok.eot_id, *rng.sample(range(tok.vocab_size), 20)]
    for _ in range(200):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 24))]
        d = Detokenizer(tok)
        assert "".join(d.add(i) for i in ids) + d.flush() == tok.decode(ids), ids


def _char_of_each_byte(raw: bytes) -> list[int]:
    """Reference for text offsets: the index of the character each byte lands in, in
    raw.decode("utf-8", "replace"), read off the decoder's own error spans (one U+FFFD per maximal invalid
    subpart), each marked with a lone surrogate that valid UTF-8 never decodes to."""
    spans: list[tuple[int, int]] = []

    def record(err: UnicodeDecodeError):
        spans.append((err.start, err.end))
        return "\udcff", err.end

    codecs.register_error("record_spans", record)
    text, where, byte = raw.decode("utf-8", "record_spans"), [], 0
    for c, ch in enumerate(text):
        size = (lambda s: s[1] - s[0])(spans.pop(0)) if ch == "\udcff" else len(ch.encode())
        where += [c] * size
        byte += size
    assert byte == len(raw)
    return where


# prompt (text or byte ids for the byte tokenizer) -> every token's text offset
OFFSET_TABLE = [
    ("\ufffd\ufffd\ufffd", [0, 0, 0, 1, 1, 1, 2, 2, 2]),  # a literal U+FFFD: three bytes, one character
    (bytes([0xE4, 0xB8, 0x41, 0xE4, 0xB8, 0xAD]), [0, 0, 1, 2, 2, 2]),  # a broken character, then "A", then 中
    ("a\ufffdb c\ufffd", [0, 1, 1, 1, 2, 3, 4, 5, 5, 5]),
    (bytes([0x80, 0x41, 0xF0, 0x9F, 0x98]), [0, 1, 2, 2, 2]),  # a lone continuation byte; a cut-off emoji
    ("é\ufffd<|endoftext|>x", [0, 0, 1, 1, 1, 2, 15]),  # the end-of-text token is its 13 characters
]


@pytest.mark.parametrize("prompt,offsets", OFFSET_TABLE)
def test_text_offsets_after_replacement_characters_and_broken_utf8(prompt, offsets):
    from looped_lm.serve.text import encode

    tok = get_tokenizer("byte")
    ids = list(prompt) if isinstance(prompt, bytes) else encode(tok, prompt)
    d = Detokenizer(tok)
    assert [d.add_with_offset(i)[1] for i in ids] == offsets


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_text_offsets_are_where_each_tokens_first_byte_lands(name):
    """Any ids (broken UTF-8, literal U+FFFD and end-of-text included): the offset of each token is the
    character its first byte decodes into, by the reference above."""
    from looped_lm.serve.text import token_bytes

    tok = get_tokenizer(name)
    rng = random.Random(1)
    alphabet = [*tok.encode("\ufffdé日😀 a"), tok.eot_id, *rng.sample(range(tok.vocab_size), 30)]
    for _ in range(200):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 24))]
        parts = [token_bytes(tok, i) for i in ids]
        where = _char_of_each_byte(b"".join(parts))
        starts = [sum(map(len, parts[:j])) for j in range(len(ids))]
        d = Detokenizer(tok)
        got = [d.add_with_offset(i)[1] for i in ids]
        assert got == [where[b] if b < len(where) else len(where) for b in starts], ids


def test_stop_strings_hold_back_their_prefixes():
    s = StopStrings(["STOP", "xyz"])
    assert [s.push(p) for p in ["ab", "cS", "TO", "P tail"]] == [("ab", False), ("c", False), ("", False), ("", True)]
    s = StopStrings(["STOP"])
    assert [s.push(p) for p in ["aS", "Tb"]] == [("a", False), ("STb", False)]
    s = StopStrings(["é!"])  # a stop string of a multi-byte character, met across pieces
    assert [s.push(p) for p in ["caf", "é", "!x"]] == [("caf", False), ("", False), ("", True)]


def test_streamed_text_equals_the_whole_text_across_split_characters(gpt):
    """Echo a prompt whose characters span several byte tokens, then sample bytes (the tiny model emits
    broken UTF-8 too): the streamed pieces join to the whole text, which is the decoded ids."""
    prompt = gpt.tok.encode("Noé → 😀")
    for seed in range(4):
        body = {"prompt": prompt, "echo": True, "max_tokens": 12, "temperature": 1.5, "seed": seed, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        whole = gpt.http.post("/v1/completions", json=body).json()["choices"][0]
        assert whole["text"].startswith("Noé → 😀")
        ids = [int(t.removeprefix("token_id:")) for t in whole["logprobs"]["tokens"]]
        assert ids[:len(prompt)] == prompt and whole["text"] == gpt.tok.decode(ids)
        raw = gpt.http.post("/v1/completions", json={**body, "stream": True}).text
        events = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
        assert "".join(c["text"] for e in events for c in e["choices"]) == whole["text"]


# --- tokenizer endpoints, health, metrics, OpenAPI ---------------------------------------------------


def test_tokenizer_endpoints_agree_with_the_tokenizer(gpt):
    info = gpt.http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["eos_token_id"] == gpt.tok.eot_id == 256
    assert info["model_max_length"] == gpt.engine.max_len and "{% for message in messages %}" in info["chat_template"]
    r = gpt.http.post("/tokenize", json={"prompt": "Hé<|endoftext|>", "add_special_tokens": False}).json()
    assert r["tokens"] == [72, 195, 169, 256] and r["count"] == 4  # HF convention: the EOT text is the EOT id
    eos = gpt.http.post("/tokenize", json={"prompt": info["eos_token"]}).json()["tokens"]
    assert eos == [gpt.tok.eot_id]  # what lm-eval's remote tokenizer takes as eos_token_id
    assert gpt.http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hé<|endoftext|>"}


def test_health_metrics_and_openapi(gpt):
    assert gpt.http.get("/health").json() == {"status": "ok"}
    gpt.client.completions.create(model="tiny-gpt", prompt="A", max_tokens=3)
    metrics = gpt.http.get("/metrics").text
    for name in ("looped_lm_generation_tokens_total", "looped_lm_num_requests_waiting", "looped_lm_kv_slots",
                 "looped_lm_time_to_first_token_seconds_count", "looped_lm_e2e_request_latency_seconds_count",
                 "looped_lm_iterations_total", 'looped_lm_http_requests_total{method="POST",path="/v1/completions"'):
        assert name in metrics, name
    doc = gpt.http.get("/openapi.json").json()
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
            "/tokenizer_info", "/health", "/metrics"} <= set(doc["paths"])
    assert {"prompt", "stream", "top_k", "ignore_eos"} <= set(doc["components"]["schemas"]["CompletionRequest"]["properties"])
    responses = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "400" in responses and "422" not in responses  # as the server answers


# --- disconnects ---------------------------------------------------------------------------------------


def test_a_client_that_disconnects_frees_its_slot(db):
    engine = db.engine
    aborted = engine.stats.finished["abort"]
    ended = sum(engine.stats.finished.values())
    generated = engine.stats.generation_tokens
    # K = 64 and the whole context: far longer than noticing a disconnect takes, on any machine
    max_tokens = engine.max_len - 4
    body = {"model": "tiny-db@64", "prompt": "And", "max_tokens": max_tokens, "ignore_eos": True}
    with db.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    wait_idle(engine)
    assert sum(engine.stats.finished.values()) == ended + 1
    assert engine.stats.finished["abort"] == aborted + 1
    assert engine.stats.generation_tokens - generated < max_tokens

    completed = engine.stats.finished["length"]
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        db.http.post("/v1/completions", json=body, timeout=0.25)
    wait_idle(engine)
    # aborted in the engine, or (on a loaded machine) dropped before it reached the engine: never completed
    assert engine.stats.finished["abort"] in (aborted + 1, aborted + 2)
    assert engine.stats.finished["length"] == completed
    assert engine.num_free_slots == engine.stats.num_slots


# --- the CLI verb, with an API key ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, timeout: float) -> None:
    """Until a `looped_lm serve` subprocess answers /health (its output in the failure if it exits)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def test_serve_verb_with_an_api_key(tiny_run, clean_env):
    port = free_port()
    cmd = [sys.executable, "-m", "looped_lm", "serve", "--checkpoint", str(tiny_run[1]), "--port", str(port),
           "--api-key", "s3cret", "--max-slots", "4", "--served-model-name", "cli-gpt", "--log-level", "warning",
           "--threads", "1"]
    proc = subprocess.Popen(cmd, env=clean_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=90)  # /health needs no key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url + "/v1/completions", content=b"{bad").status_code == 401  # the key comes first
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["cli-gpt"]
        r = client.completions.create(model="cli-gpt", prompt="And", max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "serving cli-gpt (gpt) at http://127.0.0.1" in out and "Traceback" not in out


def serve_in_process(monkeypatch, *flags: str):
    """`looped_lm serve FLAGS` up to where uvicorn would start: -> (exit code, the app it would serve)."""
    import uvicorn

    from looped_lm.cli import main

    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app))
    return main(["serve", *flags]), started.get("app")


def test_the_served_context_is_the_trained_one_unless_a_flag_asks(tiny_run, monkeypatch, capsys):
    ckpt = str(tiny_run[1])
    seq_len = load_checkpoint(ckpt)[1].model.seq_len  # 16; the model has 4 x 16 positions
    code, app = serve_in_process(monkeypatch, "--checkpoint", ckpt)
    err = capsys.readouterr().err
    assert code == 0 and app.state.serving.engine.max_len == seq_len
    assert f"slots of {seq_len} tokens" in err and "warning" not in err
    code, app = serve_in_process(monkeypatch, "--checkpoint", ckpt, "--max-model-len", str(3 * seq_len))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert code == 0 and app.state.serving.engine.max_len == 3 * seq_len
    assert warnings == [f"warning: --max-model-len {3 * seq_len} exceeds the trained context of {seq_len} tokens "
                        "(model.seq_len / model.max_positions); text past it may be poor"]
    code, app = serve_in_process(monkeypatch, "--checkpoint", ckpt, "--max-model-len", str(seq_len // 2))
    assert code == 0 and app.state.serving.engine.max_len == seq_len // 2
    assert "warning" not in capsys.readouterr().err
    for bad in (0, 4 * seq_len + 1):
        code, app = serve_in_process(monkeypatch, "--checkpoint", ckpt, "--max-model-len", str(bad))
        err = capsys.readouterr().err.strip()
        assert code == 2 and app is None and err.startswith("error: --max-model-len must be in 1..") and "\n" not in err
