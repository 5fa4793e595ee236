"""Inference settings over HTTP: one resolution per request, the CLI's rules, the bridge and the exit rule.

- `bridge` in the body is the bridge `looped_lm generate --bridge` runs: the same greedy tokens, and the
  engine receives it (a spy on the settings each engine request carries);
- an exit rule (`exit_threshold`, `exit_criterion`) cuts the denoising calls a looped_db model runs;
- bad values, and an exit rule on a model without adaptive exit (gpt; huginn, whose cache depends on K),
  are a 400 naming the field, never a 500;
- a request's settings are resolved once, whatever its number of prompts and choices (a counter on the
  engine's `resolve_settings`).
"""

from __future__ import annotations

import pytest

import looped_lm.engine.engine as engine_module
from looped_lm import cli
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.engine import Engine
from looped_lm.serve.app import BackgroundServer, build_app
from test_server import Served, serve_in_process, train_tiny_db
from tiny_models import build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["And", "The LORD", "In the", "Then"]


@pytest.fixture(scope="module")
def db_ckpt(tmp_path_factory, write_config):
    return train_tiny_db(tmp_path_factory, write_config)


@pytest.fixture(scope="module")
def db(db_ckpt):
    with Served(db_ckpt, "tiny-db") as s:
        yield s


@pytest.fixture(scope="module")
def gpt(tiny_run):
    with Served(tiny_run[1], "tiny-gpt") as s:
        yield s


class TinyServer:
    """An untrained tiny model of `kind` (tests/tiny_models.py: 47 token ids, K up to 8) behind the real
    app; prompts are token ids, which the byte tokenizer still detokenizes."""

    def __init__(self, kind: str):
        import httpx

        self.model = build_tiny(kind)
        self.engine = Engine(self.model, 2)
        self.server = BackgroundServer(build_app(self.engine, get_tokenizer("byte"), f"tiny-{kind}"))
        self.server.__enter__()
        self.http = httpx.Client(base_url=self.server.url, timeout=60)

    def close(self):
        self.http.close()
        self.server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def looped():
    s = TinyServer("looped_db")
    yield s
    s.close()


@pytest.fixture(scope="module")
def huginn():
    s = TinyServer("huginn")
    yield s
    s.close()


def cli_text(capsys, ckpt, prompt: str, *flags: str) -> str:
    """What `looped_lm generate` prints after the prompt."""
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", prompt, *flags]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and out.endswith("\n")
    return out[len(prompt):-1]


@pytest.fixture
def engine_settings(monkeypatch):
    """The settings of every request the engine accepts, in order (a spy on Engine.add_request)."""
    seen = []
    original = Engine.add_request

    def spy(self, request, sink):
        settings = original(self, request, sink)
        seen.append(settings)
        return settings

    monkeypatch.setattr(Engine, "add_request", spy)
    return seen


def test_the_bridge_over_http_is_the_bridge_generate_runs(db, db_ckpt, capsys, engine_settings):
    """Greedy: the openai client's `bridge` gives the text `looped_lm generate --bridge` prints (both stop
    at the end-of-text token), the engine runs the bridge asked for, and the bridges differ."""
    texts = {}
    for bridge in ("hard", "soft"):
        for prompt in PROMPTS:
            r = db.client.completions.create(model="tiny-db", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"bridge": bridge})
            assert r.num_iterations == 2 and engine_settings[-1].bridge == bridge
            texts[bridge, prompt] = r.choices[0].text
        # the CLI agrees (one prompt per bridge: each CLI call loads the checkpoint)
        assert cli_text(capsys, db_ckpt, PROMPTS[0], "--bridge", bridge, "--temperature", "0",
                        "--max-tokens", "8") == texts[bridge, PROMPTS[0]]
    assert any(texts["hard", p] != texts["soft", p] for p in PROMPTS), texts
    db.client.completions.create(model="tiny-db", prompt="And", max_tokens=1)
    assert engine_settings[-1].bridge == "sample"  # nothing asked: the config's diffusion.bridge
    chat = db.client.chat.completions.create(model="tiny-db", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=2, extra_body={"bridge": "soft"})
    assert chat.choices[0].finish_reason and engine_settings[-1].bridge == "soft"


def test_an_exit_rule_over_http_cuts_the_iterations_of_a_looped_model(looped, engine_settings):
    """K = 8 on every token without a rule; `exit_threshold` (KL eps) or `exit_criterion` stop a token's
    chain early (a huge eps: as soon as two steps can be compared), counted by the engine and /metrics."""
    body = {"prompt": [5, 9, 2, 33], "max_tokens": 6, "temperature": 0, "num_iterations": 8, "ignore_eos": True}

    def iterations(extra: dict) -> int:
        before = looped.engine.stats.iterations
        r = looped.http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["num_iterations"] == 8 and r.json()["usage"]["completion_tokens"] == 6
        return looped.engine.stats.iterations - before

    assert iterations({}) == 8 * 6
    assert engine_settings[-1].exit_rule is None
    assert iterations({"exit_threshold": 1e9}) == 2 * 6  # the first comparison is possible after 2 steps
    assert engine_settings[-1].exit_rule.kl_threshold == 1e9
    assert iterations({"exit_criterion": "kl:1e9"}) == 2 * 6
    assert iterations({"exit_criterion": "argmax-stable:1"}) < 8 * 6
    assert engine_settings[-1].exit_rule.argmax_stable == 1
    assert iterations({"exit_threshold": 0}) == 8 * 6  # KL < 0 never holds: every token runs K
    metrics = looped.http.get("/metrics").text
    assert f"looped_lm_iterations_total {float(looped.engine.stats.iterations)}" in metrics


BAD_SETTINGS = [  # (which server, body fields, the field the 400 names)
    ("db", {"bridge": "medium"}, "bridge"),
    ("db", {"bridge": 1}, "bridge"),
    ("db", {"exit_threshold": -0.5}, "exit_threshold"),
    ("db", {"exit_threshold": "0.1"}, "exit_threshold"),
    ("db", {"exit_criterion": "entropy:3"}, "exit_criterion"),
    ("db", {"exit_criterion": "kl:abc"}, "exit_criterion"),
    ("db", {"exit_criterion": "argmax-stable:0"}, "exit_criterion"),
    ("db", {"num_iterations": 65}, "num_iterations"),
    ("db", {"model": "tiny-db@65"}, "model"),
    ("gpt", {"bridge": "hard"}, "bridge"),  # no chain, no bridge
    ("gpt", {"exit_threshold": 0.1}, "exit_threshold"),
    ("huginn", {"exit_threshold": 0.1}, "exit_threshold"),  # no adaptive exit: its cache depends on K
    ("huginn", {"exit_criterion": "argmax-stable:2"}, "exit_criterion"),
    ("huginn", {"bridge": "soft"}, "bridge"),  # a recurrence, no DiffusionBlocks chain
    ("gpt", {"num_iterations": 2}, "num_iterations"),
    ("looped", {"num_iterations": 9}, "num_iterations"),  # above this model's max_iterations (8)
    ("looped", {"exit_criterion": "kl:-1"}, "exit_criterion"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_settings_are_a_400_naming_the_field(db, gpt, looped, huginn, path):
    servers = {"db": db, "gpt": gpt, "looped": looped, "huginn": huginn}
    for which, fields, param in BAD_SETTINGS:
        tiny = which in ("looped", "huginn")  # 47 token ids: prompts are ids (the chat template's bytes are not)
        if tiny and path != "/v1/completions":
            continue
        base = {"prompt": [1, 2] if tiny else "Hi"} if path == "/v1/completions" else \
            {"messages": [{"role": "user", "content": "Hi"}]}
        r = servers[which].http.post(path, json={**base, "max_tokens": 1, **fields})
        assert r.status_code == 400, (which, fields, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(param), (fields, error)
        assert "\n" not in error["message"]
    # streamed: refused before the stream starts (a 400 envelope, not an error event inside a 200 stream)
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = db.http.post(path, json={**base, "max_tokens": 1, "stream": True, "exit_criterion": "kl:x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "exit_criterion"


def test_a_request_is_resolved_once_for_all_its_choices(db, looped, monkeypatch, engine_settings):
    """Two prompts x n = 3 are six engine requests and ONE resolution of their settings, which every
    engine request carries unchanged (the engine resolves nothing)."""
    calls = []
    original = engine_module.resolve_settings

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine_module, "resolve_settings", counting)
    r = db.client.completions.create(model="tiny-db@4", prompt=["And", "The"], n=3, max_tokens=2, seed=5,
                                     extra_body={"bridge": "hard"})
    assert len(r.choices) == 6 and r.num_iterations == 4
    assert len(calls) == 1 and calls[0]["num_iterations"] == 4 and calls[0]["bridge"] == "hard"
    assert len(engine_settings) == 6 and all(s is engine_settings[0] for s in engine_settings)
    stream = db.client.chat.completions.create(model="tiny-db", messages=[{"role": "user", "content": "Hi"}],
                                               n=2, max_tokens=2, stream=True)
    assert sum(1 for _ in stream) > 0 and len(calls) == 2
    r = looped.http.post("/v1/completions", json={"prompt": [[1, 2], [3, 4]], "n": 2, "max_tokens": 2,
                                                  "exit_criterion": "argmax-stable:2"})
    assert r.status_code == 200 and len(calls) == 3 and calls[2]["exit_rule"].argmax_stable == 2


def test_the_openapi_document_lists_the_chain_fields_where_they_apply(db, gpt, looped, huginn):
    for server, chain, exit_rule in ((db, True, True), (looped, True, True), (huginn, False, False),
                                     (gpt, False, False)):
        props = server.http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]
        assert ("bridge" in props) == chain and ("exit_threshold" in props) == ("exit_criterion" in props) == exit_rule
    props = db.http.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["bridge"]["anyOf"][0]["enum"] == ["soft", "hard", "sample"]
    assert props["exit_threshold"]["anyOf"][0]["minimum"] == 0
    assert "argmax-stable" in props["exit_criterion"]["pattern"]  # (pattern applies to strings only)


def test_a_k_above_the_usual_chain_is_answered_with_a_warning(db, gpt, looped, huginn, db_ckpt, capsys, caplog):
    """K above both B and the default K on a DiffusionBlocks model runs extra denoising calls, measured worse
    on fine-tuned models: the response carries one `warning` line naming the K and the command that measures
    it (completions, chat, every streamed chunk), the server logs it once per K, and `looped_lm generate`
    prints the same line. K = B and models without a bridge (gpt, huginn) carry none; K < B says what it skips.
    /v1/models gives B for DiffusionBlocks models."""
    ask = lambda k: db.client.completions.create(model="tiny-db", prompt="And", max_tokens=1,  # noqa: E731
                                                 extra_body={"num_iterations": k})
    assert ask(2).warning is None
    warned = [ask(4).warning, ask(4).warning]
    assert warned[0] == warned[1] and warned[0].startswith("num_iterations=4 is above the default K = 2"), warned
    assert "looped_lm eval --num-iterations 2,4" in warned[0] and "\n" not in warned[0]
    with caplog.at_level("WARNING", logger="looped_lm.serve"):  # K = 7: asked nowhere else in this module
        assert ask(7).warning and ask(7).warning
    assert sum("num_iterations=7" in r.getMessage() for r in caplog.records) == 1  # logged once per K
    assert "1 block(s) are skipped" in ask(1).warning
    chat = db.client.chat.completions.create(model="tiny-db@4", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=1)
    assert chat.warning == warned[0]
    chunks = list(db.client.completions.create(model="tiny-db@4", prompt="And", max_tokens=2, stream=True))
    assert chunks and all(c.warning == warned[0] for c in chunks)
    assert gpt.client.completions.create(model="tiny-gpt", prompt="And", max_tokens=1).warning is None
    # looped_db: one block, default K 1 here; huginn (no bridge: a recurrence meant to take more K) never warns
    for server, k, warns in ((looped, 8, True), (huginn, 8, False)):
        r = server.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "num_iterations": k})
        assert r.status_code == 200 and (r.json()["warning"] is not None) == warns, r.text
    cards = {c["id"]: c for c in db.http.get("/v1/models").json()["data"]}
    assert cards["tiny-db"]["num_blocks"] == 2 and cards["tiny-db@4"]["num_blocks"] == 2
    assert all(c["num_blocks"] is None for c in gpt.http.get("/v1/models").json()["data"])
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(db_ckpt), "--prompt", "And", "--num-iterations", "4",
                     "--max-tokens", "2"]) == 0
    assert "note: " + warned[0] in capsys.readouterr().err


def test_serve_says_at_start_up_when_requests_may_ask_above_the_usual_chain(db_ckpt, tiny_run, monkeypatch, capsys):
    """A DiffusionBlocks model whose cap is above max(B, default K) gets one start-up line; capped at B, none;
    gpt, none."""
    ckpt = str(db_ckpt)
    assert serve_in_process(monkeypatch, "--checkpoint", ckpt, "--kv-memory-gb", "0.01")[0] == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "above K = 2 (B = 2) gets a `warning` in its response" in notes[0], notes
    for flags in (["--checkpoint", ckpt, "--max-iterations", "2"], ["--checkpoint", str(tiny_run[1])]):
        assert serve_in_process(monkeypatch, *flags, "--kv-memory-gb", "0.01")[0] == 0
        assert "note:" not in capsys.readouterr().err
