"""Every served log-prob is a number a client can add up, and a request's work is bounded.

DiffusionBlocks log-probs are Monte-Carlo estimates of the K-step sampler's marginal. Where a token's
estimate is unresolved after the first draws (standard error > 1 nat), the estimator draws again for those
slots alone, doubling up to a cap; the value is always finite and <= 0, its standard error travels in an
extension field (`token_logprob_se`, chat's `logprob_se`) that clients may ignore. lm-evaluation-harness
sums `token_logprobs`: a null there aborts its run. Also here: the slot subset the extra draws run on
equals the full window, authentication cannot be switched off by an empty key, and the server's bounds on
a request's work, its `top_k`, its model name and its `stop` field.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from looped_lm import cli
from looped_lm.errors import UserError
from looped_lm.models.db.contexts import WindowContext
from looped_lm.settings import ScoreSettings
from test_server import Served, train_tiny_db
from tiny_models import build_tiny, markov_batch, trained_tiny_db

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def db_ckpt(tmp_path_factory, write_config):
    return train_tiny_db(tmp_path_factory, write_config)


@pytest.fixture(scope="module")
def db(db_ckpt):
    """The server's defaults: 4 draws, up to 64 where a token is unresolved."""
    with Served(db_ckpt, "tiny-db") as s:
        yield s


# --- the estimator: extra draws where unresolved ---------------------------------------------------


@pytest.mark.parametrize("K", [4, 8, 16])
def test_extra_draws_resolve_what_the_first_draws_leave_unresolved(K):
    """Same seed, 2 draws fixed vs 2 draws growing to 64: the fixed estimate leaves tokens unresolved (the
    regime shows the problem), the adaptive one resolves every one; tokens resolved at first keep their
    value bit for bit (no draw is added or changed for them)."""
    model = trained_tiny_db(last_call="sigma_min")
    x, y = markov_batch(torch.Generator().manual_seed(3), batch=1, T=16, stay=0.7)
    fixed = model.token_logprobs(x, y, ScoreSettings(draws=2), K, torch.Generator().manual_seed(5))
    grown = model.token_logprobs(x, y, ScoreSettings(draws=2, max_draws=64), K, torch.Generator().manual_seed(5))
    at = lambda e: e.logp.gather(-1, y[..., None])[..., 0]  # noqa: E731
    assert int((fixed.se > 1).sum()) >= 1
    assert int((grown.se > 1).sum()) == 0
    resolved = fixed.se <= 1
    assert torch.equal(at(fixed)[resolved], at(grown)[resolved])
    for e in (fixed, grown):
        assert bool(torch.isfinite(at(e)).all()) and float(at(e).max()) <= 0


def test_a_capped_estimate_is_still_a_number_with_its_se():
    """One draw and no room to grow: no spread, so the se is infinite (served as null), the value finite."""
    model = trained_tiny_db(last_call="sigma_min")
    x, y = markov_batch(torch.Generator().manual_seed(3), batch=1, T=8, stay=0.7)
    one = model.token_logprobs(x, y, ScoreSettings(draws=1, max_draws=1), 8, torch.Generator().manual_seed(5))
    values = one.logp.gather(-1, y[..., None])[..., 0]
    assert bool(torch.isfinite(values).all()) and bool(torch.isinf(one.se).all())


@pytest.mark.parametrize("diffusion", [{}, {"noisy_self": False}, {"context": "stacked", "noisy_self": False}],
                         ids=["noisy_self", "no_self", "stacked"])
def test_a_slot_subset_gives_the_full_windows_logits(diffusion):
    """The extra draws run on some slots of the window only: each slot's logits must not depend on which
    other slots run (a slot sees clean keys and itself)."""
    model = build_tiny("db_ar", **diffusion)
    x, _ = markov_batch(torch.Generator().manual_seed(0), batch=2, T=12)
    z = torch.randn(2, 12, model.tok_emb.weight.shape[1], generator=torch.Generator().manual_seed(1))
    sigma = torch.full((2,), 0.7)
    cols = torch.tensor([0, 3, 4, 11])
    with torch.no_grad():
        for b in range(2):
            full = WindowContext(model, x).denoise(b, z, sigma)
            part = WindowContext(model, x).at(cols).denoise(b, z[:, cols], sigma)
            torch.testing.assert_close(part, full[:, cols], rtol=1e-5, atol=1e-5)


# --- the server: numbers at every K ---------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 2, 4, 8, 16, 32])
def test_echo_and_chat_logprobs_are_numbers_at_every_k(db, K):
    """lm-eval's rolling request (echo, max_tokens 0, logprobs, seed 1234) and a chat request with
    logprobs: every token's log-prob is a finite number <= 0 (only the first prompt token, which has
    nothing before it, is null), and the standard error sits beside it."""
    text = "And God said, Let there be light: and there was light."
    r = db.http.post("/v1/completions", json={"model": f"tiny-db@{K}", "prompt": text, "max_tokens": 0,
                                               "echo": True, "logprobs": 1, "seed": 1234, "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    values, ses = lp["token_logprobs"], lp["token_logprob_se"]
    assert len(values) == len(ses) == len(lp["tokens"]) > 50
    assert values[0] is None and ses[0] is None
    assert all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in values[1:]), values
    assert all(s is None or s >= 0 for s in ses[1:])
    if K > 1:  # estimated: a spread is known for the tokens that had more than one draw
        assert sum(s is not None for s in ses[1:]) == len(ses) - 1
    total = sum(values[1:])  # what lm-eval's parse_logprobs does
    assert math.isfinite(total)

    chat = db.http.post("/v1/chat/completions", json={
        "model": f"tiny-db@{K}", "messages": [{"role": "user", "content": "Say"}], "max_tokens": 4,
        "logprobs": True, "top_logprobs": 2, "seed": 3, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert isinstance(entry["logprob"], float) and entry["logprob"] <= 0
        assert "logprob_se" in entry
        assert all(isinstance(t["logprob"], float) for t in entry["top_logprobs"])


# --- authentication -----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "   ", "\t"])
def test_an_empty_api_key_is_refused_not_read_as_off(db_ckpt, key, capsys, monkeypatch):
    monkeypatch.delenv("LOOPED_LM_API_KEY", raising=False)
    assert cli.main(["serve", "--checkpoint", str(db_ckpt), "--api-key", key]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --api-key") and "empty" in err and "\n" not in err
    monkeypatch.setenv("LOOPED_LM_API_KEY", key)  # the environment variable, too
    assert cli.main(["serve", "--checkpoint", str(db_ckpt)]) == 2
    assert "empty" in capsys.readouterr().err
    with pytest.raises(UserError, match="empty"):
        from looped_lm.serve.app import build_app

        build_app(None, None, "x", api_key=key)


def test_two_authorization_headers_are_refused(db_ckpt):
    with Served(db_ckpt, "tiny-db", api_key="sesame") as s:
        body = {"model": "tiny-db", "prompt": "And", "max_tokens": 1}
        ok = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        for pair in (["Bearer wrong", "Bearer sesame"], ["Bearer sesame", "Bearer wrong"],
                     ["Bearer sesame", "Bearer sesame"]):
            r = httpx.post(s.url + "/v1/completions", json=body,
                           headers=[("Authorization", pair[0]), ("Authorization", pair[1])])
            assert r.status_code == 401 and "exactly one" in r.json()["error"]["message"], pair
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 401


# --- bounds on a request ------------------------------------------------------------------------


def test_a_request_over_the_work_bound_is_refused_up_front(db_ckpt):
    with Served(db_ckpt, "tiny-db", max_request_work=1000) as s:
        # 16 tokens x K 8 x n 4 = 512 token-steps: runs
        ok = s.http.post("/v1/completions", json={"model": "tiny-db@8", "prompt": "And", "max_tokens": 16, "n": 4})
        assert ok.status_code == 200, ok.text
        # 16 x 8 x 8 = 1024: refused before it runs, naming the bound
        r = s.http.post("/v1/completions", json={"model": "tiny-db@8", "prompt": "And", "max_tokens": 16, "n": 8})
        assert r.status_code == 400 and "--max-request-work of 1,000" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "max_tokens"
        assert s.engine.stats.requests == 4  # the refused request never reached the engine (n = 4 ran)
        # echo scoring is charged K x the most draws per prompt token: 3 x 8 x 64 > 1000
        r = s.http.post("/v1/completions", json={"model": "tiny-db@8", "prompt": "And", "max_tokens": 0, "echo": True,
                                                  "logprobs": 0})
        assert r.status_code == 400
        # a chat request without max_tokens gets the tokens that fit (1000 // 32 = 31 at K = 32), not the context
        chat = s.http.post("/v1/chat/completions", json={
            "model": "tiny-db@32", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True,
            "exit_criterion": "kl:0"})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] <= 31
        assert chat.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("field,value,status,fragment", [
    ("top_k", 2 ** 70, 400, "top_k must be at most the vocabulary size"),
    ("top_k", 258, 400, "top_k must be at most the vocabulary size"),  # the byte vocabulary is 257
    ("model", "", 404, "The model `` does not exist"),
    ("stop", ["a"] * 17, 400, "stop: "),
    ("stop", 5, 400, "stop: "),
])
def test_request_fields_beyond_their_range(db, field, value, status, fragment):
    r = db.http.post("/v1/completions", json={"model": "tiny-db", "prompt": "And", "max_tokens": 1, field: value})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == field
    assert "stop.str" not in error["message"] and "list[str]" not in error["message"]
