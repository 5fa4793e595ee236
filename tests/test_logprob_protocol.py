"""lm-evaluation-harness's rolling log-likelihood through the HTTP API equals `looped_lm eval` on the same
windows: exactly for gpt; for a DiffusionBlocks model at K = 1 and K = B, whose log-probs on both sides are
independent estimates of the K-step sampler's marginal (docs/method.md §6), within 0.5 % at K = 1 and
within three combined standard errors at K = B (this tiny, barely trained model is the estimator's hard
case; `bench/logprob_check.py lm-eval` measures the agreement on a trained checkpoint).

Each window of `block` tokens is scored the way lm-eval's `loglikelihood_rolling` scores a document
through `local-completions`: the window's tokens plus the next one as the prompt, `echo`, `max_tokens: 0`,
`logprobs`; the log-probs of prompt tokens 1.. are the window's targets.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from looped_lm.checkpoint import load_checkpoint
from looped_lm.data.bin_dataset import TokenStream
from looped_lm.eval import perplexity
from looped_lm.settings import ScoreSettings
from test_server import Served, train_tiny_db

BLOCK, WINDOWS, DRAWS = 16, 8, 32
pytestmark = pytest.mark.usefixtures("one_thread")


def val_file(ckpt: Path) -> str:
    _, _, manifest = load_checkpoint(ckpt)
    return str(Path(manifest["data"]["dir"]) / "val.bin")


def http_ppl(served: Served, data: str, model_name: str) -> float:
    stream = TokenStream(data, BLOCK)
    total, count = 0.0, 0
    for x, y, _ in stream.iter_blocks(BLOCK, None, BLOCK * WINDOWS):
        prompt = x.tolist() + [int(y[-1])]
        r = served.http.post("/v1/completions", json={"model": model_name, "prompt": prompt, "max_tokens": 0,
                                                       "echo": True, "logprobs": 0, "seed": count})
        assert r.status_code == 200, r.text
        lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert lps[0] is None and len(lps) == BLOCK + 1
        total -= sum(lps[1:])
        count += BLOCK
    return math.exp(total / count)


def eval_ppl(model, data: str, k: int | None, with_se: bool = False):
    settings = ScoreSettings(k_grid=None if k is None else (k,), draws=DRAWS)
    sums, var, tokens = perplexity(model, data, BLOCK, max_tokens=BLOCK * WINDOWS, settings=settings, progress=False)
    label = "exact" if k is None else k
    ppl = math.exp(sums[label] / tokens)
    return (ppl, math.sqrt(var.get(label, 0.0)) / tokens) if with_se else ppl


def test_gpt_rolling_loglikelihood_over_http_equals_eval(tiny_run):
    _, ckpt, _ = tiny_run
    with Served(ckpt, "tiny-gpt") as served:
        data = val_file(ckpt)
        assert http_ppl(served, data, "tiny-gpt") == pytest.approx(eval_ppl(served.model, data, None), rel=1e-5)


@pytest.fixture(scope="module")
def db_ckpt(tmp_path_factory, write_config):
    return train_tiny_db(tmp_path_factory, write_config)


@pytest.mark.parametrize("K", [1, 2])  # K = 1 and K = B
def test_db_rolling_loglikelihood_over_http_equals_eval(db_ckpt, K):
    with Served(db_ckpt, "tiny-db", score_settings=ScoreSettings(draws=DRAWS)) as served:
        data = val_file(db_ckpt)
        over_http = http_ppl(served, data, f"tiny-db@{K}")
        evaluated, se = eval_ppl(served.model, data, K, with_se=True)  # se: of the mean NLL
        if K == 1:
            assert over_http == pytest.approx(evaluated, rel=0.005), (over_http, evaluated)
        else:  # both sides carry the same standard error: the difference's is sqrt(2) se
            assert abs(math.log(over_http / evaluated)) < 3 * math.sqrt(2) * se, (over_http, evaluated, se)
        # a tiny model after a few steps (measured ~87): below the uniform 257, far above a read-back's 1
        assert 20 < evaluated < 200
