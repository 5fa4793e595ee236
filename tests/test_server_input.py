"""Input the server must survive, against the tiny GPT and DB-AR servers of test_server.py:

- sampling parameters at numeric extremes behave (a tiny temperature or top_p is greedy) or are refused
  with a 400 naming the field, in completions and chat, plain and streamed; a stream never carries an
  error event for them;
- a table of bad input: always OpenAI's 400 envelope, the offending field named in `param` and in the
  message, never a 500;
- the OpenAPI document declares bearer auth exactly on the routes that enforce it.
"""

from __future__ import annotations

import json
import re

import pytest

from test_server import Served, train_tiny_db

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt(tiny_run):
    with Served(tiny_run[1], "tiny-gpt") as s:
        yield s


@pytest.fixture(scope="module")
def db(tmp_path_factory, write_config):
    with Served(train_tiny_db(tmp_path_factory, write_config), "tiny-db") as s:
        yield s


def post(served: Served, path: str, body: dict | bytes | str):
    if isinstance(body, dict):
        return served.http.post(path, json=body)
    return served.http.post(path, content=body, headers={"content-type": "application/json"})


def sse_events(text: str) -> list[dict | str]:
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


# --- sampling parameters at numeric extremes ------------------------------------------------------------

EXTREMES = [  # (raw JSON fields, expected status, "greedy" if the text equals temperature 0's / the 400's param)
    ('"temperature": 1e-40', 200, "greedy"),
    ('"temperature": 5e-324', 200, "greedy"),
    ('"temperature": 1e-300', 200, "greedy"),
    ('"temperature": 1e300', 200, None),
    ('"temperature": 1.7976931348623157e308', 200, None),
    ('"top_p": 5e-324', 200, "greedy"),
    ('"top_p": 1e-40', 200, "greedy"),
    ('"top_p": 0.9999999999999999', 200, None),
    ('"top_k": 1', 200, "greedy"),
    ('"top_k": 256', 200, None),  # the byte vocabulary: 257 ids
    ('"top_k": 257', 200, None),
    ('"top_k": 258', 400, "top_k"),  # past the vocabulary: a typo or an attack, not a setting
    ('"top_k": 9223372036854775808', 400, "top_k"),
    ('"top_k": 1000000000000000000000000000000', 400, "top_k"),
    ('"temperature": 1e-40, "top_p": 5e-324, "top_k": 1', 200, "greedy"),
    ('"temperature": 1e300, "top_k": 1', 200, None),
    ('"temperature": 1e300, "top_p": 5e-324', 200, None),
    ('"temperature": 1e-40, "top_p": 0.9999999999999999, "top_k": 257', 200, "greedy"),
    ('"seed": 18446744073709551615', 200, None),
    ('"seed": -9223372036854775808', 200, None),
    ('"temperature": 1e309', 400, "temperature"),  # JSON's 1e309 is infinity
    ('"temperature": -5e-324', 400, "temperature"),
    ('"top_p": 1.0000000000000002', 400, "top_p"),
    ('"top_p": -5e-324', 400, "top_p"),
    ('"top_p": 1e309', 400, "top_p"),
    ('"top_k": -2', 400, "top_k"),
    ('"top_k": -9223372036854775809', 400, "top_k"),
    ('"seed": 18446744073709551616', 400, "seed"),
]
ENDPOINTS = {  # path -> (the request's other fields, the text of a plain answer, of a streamed chunk)
    "/v1/completions": ('"prompt": "And God", "max_tokens": 6, "ignore_eos": true, "seed": 3',
                        lambda c: c["text"], lambda c: c["text"]),
    "/v1/chat/completions": ('"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 6, '
                             '"ignore_eos": true, "seed": 3',
                             lambda c: c["message"]["content"], lambda c: c["delta"].get("content") or ""),
}


@pytest.mark.parametrize("which", ["gpt", "db"])
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_sampling_extremes_behave_or_are_refused_plain_and_streamed(which, path, request):
    s: Served = request.getfixturevalue(which)
    common, plain_text, chunk_text = ENDPOINTS[path]
    greedy = post(s, path, f'{{{common}, "temperature": 0}}').json()["choices"][0]
    for fields, status, expect in EXTREMES:
        for stream in (False, True):
            body = f'{{{common}, {fields}, "stream": {json.dumps(stream)}}}'
            r = post(s, path, body)
            assert r.status_code == status, (body, r.text)
            if status != 200:
                error = r.json()["error"]
                assert error["param"] == expect and expect in error["message"], (body, error)
                continue
            if stream:
                events = sse_events(r.text)
                assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), (body, r.text)
                chunks = [c for e in events[:-1] for c in e["choices"]]
                text = "".join(chunk_text(c) for c in chunks)
                assert chunks[-1]["finish_reason"] == "length", body
            else:
                choice = r.json()["choices"][0]
                text = plain_text(choice)
                assert choice["finish_reason"] == "length", body
            if expect == "greedy" and which == "gpt":  # DB: the chain's noise draws follow the sampler's
                assert text == plain_text(greedy), body
    assert 'status="500"' not in s.http.get("/metrics").text


# --- bad input: always the 400 envelope naming its field, never a 500 -------------------------------------

CHAT = {"messages": [{"role": "user", "content": "x"}]}
BAD = [  # (path, body: dict -> JSON, bytes -> raw, expected status, param or None)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[]", 400, None),
    ("/v1/completions", b'"a string"', 400, None),
    ("/v1/completions", b"null", 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": None}, 400, "prompt"),
    ("/v1/completions", {"prompt": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [True, 2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1], [2, 10 ** 20]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * 100, "max_tokens": 1}, 400, "prompt"),  # the prompt alone is too long
    ("/v1/completions", {"prompt": [1] * 10, "max_tokens": 60}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 10 ** 4}, 400, "n"),
    ("/v1/completions", {"prompt": ["a"] * 10, "n": 64}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", ""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "num_iterations": 0}, 400, "num_iterations"),
    ("/v1/completions", {"prompt": "hi", "num_iterations": 1000}, 400, "num_iterations"),
    ("/v1/completions", {"prompt": "hi", "num_iterations": "2"}, 400, "num_iterations"),
    ("/v1/completions", {"prompt": "hi", "model": "tiny-db@999"}, 400, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "tiny-db@2", "num_iterations": 4}, 400, "num_iterations"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -1}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "model": "tiny-db@0"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "tiny-db@two"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1000, "max_completion_tokens": 2}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "stop": ""}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 1}, 400, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": -100}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": None, "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/completions", {"prompt": [1.5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 2.5}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": "2"}, 400, "n"),
]


def test_bad_input_is_a_400_envelope_naming_its_field_and_never_a_500(db):
    for path, body, status, param in BAD:
        r = post(db, path, body)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, (body, error)
        assert param is None or re.search(rf"\b{param}\b", error["message"]), (body, error)
        assert "\n" not in error["message"]
    wrong_type = db.http.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    assert wrong_type.status_code == 400
    assert db.http.get("/v1/nothing").status_code == 404 and db.http.get("/v1/completions").status_code == 405
    assert db.http.get("/v1/nothing").json()["error"]["code"] == "not_found"
    assert db.http.get("/health").status_code == 200
    assert db.client.completions.create(model="tiny-db", prompt="A", max_tokens=2).choices[0].finish_reason
    assert 'status="500"' not in db.http.get("/metrics").text


def test_integers_written_as_integral_floats_are_integers(db):
    """JSON Schema's `integer` includes 5.0; so does the server (5.5, "5" and true stay refused)."""
    body = {"prompt": [65.0, 110.0], "max_tokens": 3.0, "n": 2.0, "seed": 7.0, "temperature": 0, "ignore_eos": True}
    as_floats = post(db, "/v1/completions", body).json()
    as_ints = post(db, "/v1/completions", {k: int(v) if isinstance(v, float) else [int(t) for t in v]
                                           if isinstance(v, list) else v for k, v in body.items()}).json()
    assert [c["text"] for c in as_floats["choices"]] == [c["text"] for c in as_ints["choices"]]
    assert len(as_floats["choices"]) == 2 and as_floats["usage"]["completion_tokens"] == 6
    assert post(db, "/detokenize", {"tokens": [65.0, 110]}).json() == {"prompt": "An"}


def test_neutral_values_of_unsupported_fields_are_accepted(db):
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tool_choice": "none",
               "tools": [], "response_format": {"type": "text"}, "stop": "\n\n", "max_tokens": 2}
    assert post(db, "/v1/chat/completions", {**CHAT, **neutral}).status_code == 200
    assert post(db, "/v1/completions", {"prompt": "hi", "best_of": 2, "n": 2, "suffix": "", "max_tokens": 2}
                ).status_code == 200


# --- the OpenAPI document: this server's bounds, its streams, its auth ------------------------------------


def test_openapi_states_this_servers_bounds_and_streams(gpt, db):
    for s, k in ((gpt, None), (db, db.engine.max_iterations)):
        doc = s.http.get("/openapi.json").json()
        schemas = doc["components"]["schemas"]
        completion = schemas["CompletionRequest"]["properties"]
        assert ("num_iterations" in completion) == (k is not None)  # a GPT has no K
        if k is not None:
            assert completion["num_iterations"]["anyOf"][0]["maximum"] == k
        assert completion["max_tokens"]["anyOf"][0]["maximum"] == s.engine.max_len
        assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {
            "type": "integer", "minimum": 0, "maximum": s.tok.vocab_size - 1}
        assert not {"presence_penalty", "logit_bias", "best_of", "suffix"} & set(completion)  # refused, undocumented
        assert schemas["TokenizeRequest"]["oneOf"] == [{"required": ["prompt"]}, {"required": ["messages"]}]
        for path in ("/v1/completions", "/v1/chat/completions"):
            ok = doc["paths"][path]["post"]["responses"]["200"]["content"]
            assert set(ok) == {"application/json", "text/event-stream"}
        assert "num_iterations" in schemas["CompletionResponse"]["properties"]  # responses keep reporting K
    wrong = db.http.request("TRACE", "/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST" and wrong.json()["error"]["code"]



def test_openapi_declares_bearer_auth_only_where_it_is_enforced(tiny_run):
    with Served(tiny_run[1], "tiny-gpt", api_key="k3y") as s:
        doc = s.http.get("/openapi.json").json()
        assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
        assert "security" not in doc  # no document-wide requirement: each route says
        secured, open_ = set(), set()
        for path, operations in doc["paths"].items():
            for method, op in operations.items():
                (secured if op.get("security") == [{"bearer": []}] else open_).add((method, path))
        assert open_ == {("get", "/health"), ("get", "/metrics")}
        assert {("post", "/v1/completions"), ("get", "/v1/models"), ("post", "/tokenize")} <= secured
        for method, path in sorted(secured):
            assert s.http.request(method, path).status_code == 401, path
        for method, path in sorted(open_) + [("get", "/openapi.json"), ("get", "/docs")]:
            assert s.http.request(method, path).status_code == 200, path
    with Served(tiny_run[1], "tiny-gpt") as s:  # no key: no scheme at all
        doc = s.http.get("/openapi.json").json()
        assert "securitySchemes" not in doc.get("components", {})
        assert not any("security" in op for ops in doc["paths"].values() for op in ops.values())
