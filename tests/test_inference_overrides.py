"""`--set section.key=value` on generate / eval / serve / export: a checkpoint run with another inference setting
(config.INFERENCE_KEYS), here `diffusion.extra_calls: spread` on a B = 2 db_ar model trained with the default
(block0); anything that would change
what the weights compute is refused in one line, as is a bad value, and the checkpoint itself is untouched."""

from __future__ import annotations

import json

import openai
import pytest

from looped_lm import cli
from looped_lm.checkpoint import load_checkpoint
from looped_lm.serve.app import BackgroundServer
from test_server import serve_in_process, train_tiny_db

pytestmark = pytest.mark.usefixtures("one_thread")
SPREAD = "diffusion.extra_calls=spread"


@pytest.fixture(scope="module")
def db_ckpt(tmp_path_factory, write_config):
    return train_tiny_db(tmp_path_factory, write_config)


def test_a_loaded_checkpoint_runs_with_the_setting_and_keeps_its_own(db_ckpt):
    model, cfg, _ = load_checkpoint(db_ckpt, overrides=[SPREAD])
    assert cfg.diffusion.extra_calls == "spread" and model.grid().blocks(4) == [0, 0, 1, 1]
    assert model.iteration_limits().extra_calls == "spread"
    model, cfg, _ = load_checkpoint(db_ckpt)  # the manifest still says block0, the language models' default
    assert cfg.diffusion.extra_calls == "block0" and model.grid().blocks(4) == [0, 0, 0, 1]


def test_generate_above_b_says_where_the_extra_calls_run(db_ckpt, capsys):
    args = ["generate", "--checkpoint", str(db_ckpt), "--prompt", "And", "--max-tokens", "2", "--num-iterations", "4"]
    assert cli.main(args) == 0
    assert "the extra denoising calls run in block 0 and have measured no better than K = 2" in capsys.readouterr().err
    assert cli.main([*args, "--set", SPREAD]) == 0
    assert "spread over every block" in capsys.readouterr().err


@pytest.mark.parametrize("item, needles", [
    ("model.d_model=64", ["--set model.d_model", "may change only how it is run", "diffusion.extra_calls"]),
    ("diffusion.num_blocks=3", ["--set diffusion.num_blocks", "may change only how it is run"]),
    ("diffusion.extra_calls=middle", ["--set: diffusion.extra_calls must be one of spread, block0", "middle"]),
    ("diffusion=1", ["--set diffusion", "may change only how it is run"]),
])
@pytest.mark.parametrize("verb", ["generate", "eval", "export"])
def test_a_setting_that_is_not_an_inference_one_is_refused_in_one_line(db_ckpt, tmp_path, capsys, one_line_error,
                                                                        verb, item, needles):
    extra = {"generate": ["--prompt", "And"], "eval": [], "export": ["--out", str(tmp_path / "hf")]}[verb]
    assert cli.main([verb, "--checkpoint", str(db_ckpt), *extra, "--set", item]) == 2
    one_line_error(capsys.readouterr(), *needles)
    assert not (tmp_path / "hf").exists()


def test_eval_reports_each_k_under_the_setting(db_ckpt, tmp_path, capsys):
    out = {}
    for name, extra in (("block0", []), ("spread", ["--set", SPREAD])):
        path = tmp_path / f"{name}.json"
        assert cli.main(["eval", "--checkpoint", str(db_ckpt), "--num-iterations", "2,4", "--max-tokens", "48",
                         "--draws", "2", "--json", str(path), "--no-progress", *extra]) == 0
        out[name] = json.loads(path.read_text())
    capsys.readouterr()
    assert out["spread"]["set"] == [SPREAD] and "set" not in out["block0"]
    assert out["spread"]["mean_p_at_k"]["2"] == out["block0"]["mean_p_at_k"]["2"]  # K = B: the same chain
    assert out["spread"]["mean_p_at_k"]["4"] != out["block0"]["mean_p_at_k"]["4"]  # K = 2B: another one


def test_export_writes_the_setting_into_the_exported_config(db_ckpt, tmp_path):
    assert cli.main(["export", "--checkpoint", str(db_ckpt), "--out", str(tmp_path / "hf"), "--set", SPREAD]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["looped_lm_config"]["diffusion"]["extra_calls"] == "spread"


def test_serve_runs_the_setting_and_says_what_it_runs(db_ckpt, monkeypatch, capsys, one_line_error):
    """Through the `openai` client: K = 4 runs the spread grid, and the response's `warning` says so."""
    code, app = serve_in_process(monkeypatch, "--checkpoint", str(db_ckpt), "--kv-memory-gb", "0.01", "--set", SPREAD)
    assert code == 0
    assert app.state.serving.engine.model.grid().blocks(4) == [0, 0, 1, 1]
    with BackgroundServer(app) as server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        r = client.completions.create(model=client.models.list().data[0].id, prompt="And", max_tokens=2,
                                      extra_body={"num_iterations": 4})
        assert r.choices[0].text and "spread over every block" in r.warning
    assert serve_in_process(monkeypatch, "--checkpoint", str(db_ckpt), "--set", "train.lr=1")[0] == 2
    one_line_error(capsys.readouterr(), "--set train.lr", "may change only how it is run")
