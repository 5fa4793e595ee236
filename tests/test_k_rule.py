"""One K rule for every verb: a kind's configured default K (db_ar / looped_db `diffusion.num_iterations`,
huginn `model.num_iterations`), set here to differ from its structural default (the block count, the
mean recurrence), is the K that generate, eval, serve, export and the Hugging Face wrapper all use (huginn: no export)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import DIST_VARS

RUNS = {  # kind -> (its config beyond the base, the configured default K, the structural one it overrides)
    "db_ar": ({"model": {"kind": "db_ar", "n_layers": 2, "max_iterations": 8}, "diffusion": {"num_blocks": 2,
               "num_iterations": 3, "block_sampling": "uniform"}}, 3, 2),
    "looped_db": ({"model": {"kind": "looped_db", "n_layers": 1, "n_prelude": 1, "n_coda": 1, "max_iterations": 8},
                   "diffusion": {"num_blocks": 1, "num_iterations": 3, "block_sampling": "uniform"}}, 3, 1),
    "huginn": ({"model": {"kind": "huginn", "n_layers": 1, "n_prelude": 1, "n_coda": 1, "mean_recurrence": 2,
                          "backprop_depth": 1, "num_iterations": 3, "max_iterations": 8}}, 3, 2),
}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory, write_config):
    from looped_lm import trainer

    overrides, want, structural = RUNS[request.param]
    root = tmp_path_factory.mktemp(f"k_rule_{request.param}")
    cfg = write_config(root / "run.yaml", {**overrides, "train": {"out_dir": str(root / "out"), "max_steps": 1}})
    before = {k: os.environ.get(k) for k in DIST_VARS}
    try:
        assert trainer.main(["--config", str(cfg)]) == 0
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return request.param, root / "out" / "step_0000001", want, structural


def test_every_verb_uses_the_configured_default_k(run, tmp_path, monkeypatch):
    from looped_lm import cli
    from looped_lm.engine import generate as decoding
    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.engine.engine import Engine
    from looped_lm.kinds import kind_of

    name, ckpt, want, structural = run
    assert want != structural, "the test needs a default that differs from the structural one"
    model, cfg, manifest = load_checkpoint(ckpt)
    assert model.iteration_limits().default_iterations == want

    # generate: the settings that reach the decoder
    seen = []
    real = decoding.generate
    monkeypatch.setattr(decoding, "generate", lambda m, p, n, settings, **kw: seen.append(settings) or
                        real(m, p, n, settings, **kw))
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "In", "--max-tokens", "2"]) == 0
    assert [s.num_iterations for s in seen] == [want]

    # eval: the K its perplexity is reported at (DB kinds add ppl@0, the one call at sigma_top)
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--max-tokens", "32", "--draws", "1", "--json", str(out),
                     "--no-progress"]) == 0
    rep = json.loads(out.read_text())
    ks = {int(k) for k in rep["ppl_at_k"]} - ({0} if name != "huginn" else set())
    assert ks == {want}, rep["ppl_at_k"]

    # serve: a request that names no K
    engine = Engine(model, num_slots=1)
    assert engine.resolve().num_iterations == want

    # export and the Hugging Face wrapper that reads it (the vLLM plugin reads the same config field)
    if not kind_of(cfg).offers("export_native"):  # huginn exports to neither
        return
    hf = tmp_path / "hf"
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(hf)]) == 0
    assert json.loads((hf / "config.json").read_text())["num_iterations"] == want
    import looped_lm  # noqa: F401  (registers model_type "looped_lm" with transformers)
    from transformers import AutoModelForCausalLM

    wrapper = AutoModelForCausalLM.from_pretrained(hf)
    assert wrapper.call_settings().num_iterations == want
