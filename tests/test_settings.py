"""looped_lm/settings.py: every boundary's settings come from one resolution, by one rule.

- eval's K grid: every K checked against the model's limits (the bound generate and serve apply), one
  line naming the bad K, exit 2, before anything is scored; resolved once per command;
- a server's --default-iterations / --max-iterations narrow the model's limits once (`serving_limits`);
- the supporting modules' step counts: the flag, else the config's default, else the kind's (dit 50,
  mdm the sample's length, vit B), at least one per block (`resolve_steps`, through the models);
- the exit rule's flags or body fields are named in its errors.
"""

from __future__ import annotations

import pytest

import looped_lm.settings as settings_module
from looped_lm import cli
from looped_lm.errors import UserError
from looped_lm.settings import (DIT_SAMPLE_STEPS, ExitRule, resolve_score_settings, resolve_settings, resolve_steps,
                                serving_limits)
from tiny_models import build_tiny, tiny_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def db_ckpt(tmp_path_factory, write_config):
    from test_server import train_tiny_db

    return train_tiny_db(tmp_path_factory, write_config)


# --- eval's K grid --------------------------------------------------------------------------------


def test_eval_refuses_a_k_outside_the_models_range_in_one_line(db_ckpt, capsys, one_line_error, tmp_path):
    out = tmp_path / "ppl.json"
    base = ["eval", "--checkpoint", str(db_ckpt), "--max-tokens", "32", "--draws", "1", "--no-progress",
            "--json", str(out)]
    for grid, bad in (("1,65,2", "65"), ("2,100000", "100000"), ("-1", "-1")):
        assert cli.main([*base, "--num-iterations", grid]) == 2
        one_line_error(capsys.readouterr(), f"--num-iterations {bad} is outside 0..64")
        assert not out.exists()  # refused before anything was scored
    # the same bound as generate's: 64 runs there and here, 65 is refused by both
    assert cli.main(["generate", "--checkpoint", str(db_ckpt), "--prompt", "A", "--num-iterations", "65"]) == 2
    one_line_error(capsys.readouterr(), "num_iterations must be an integer in 1..64")


def test_eval_resolves_its_settings_once(db_ckpt, capsys, monkeypatch):
    calls = []
    original = settings_module.resolve_score_settings

    def counting(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(settings_module, "resolve_score_settings", counting)
    assert cli.main(["eval", "--checkpoint", str(db_ckpt), "--max-tokens", "32", "--draws", "1", "--no-progress",
                     "--num-iterations", "0,2"]) == 0
    assert calls == [[0, 2]]
    assert "| 0 |" in capsys.readouterr().out  # ppl@0: a DiffusionBlocks model's one call at sigma_top


def test_the_k_grid_rule_per_kind():
    db, huginn = build_tiny("db_ar").iteration_limits(), build_tiny("huginn").iteration_limits()
    assert resolve_score_settings(db, [0, 1, 8], draws=2).k_grid == (0, 1, 8)  # tiny models: max_iterations 8
    assert resolve_score_settings(db, None).k_grid == (db.default_iterations,)  # the default generate uses
    assert resolve_score_settings(huginn, None).k_grid == (huginn.default_iterations,)
    assert resolve_score_settings(None, None).k_grid is None  # gpt: no K
    with pytest.raises(UserError, match=r"--num-iterations 9 is outside 0\.\.8") as e:
        resolve_score_settings(db, [2, 9])
    assert e.value.param == "num_iterations"
    with pytest.raises(UserError, match=r"--num-iterations 0 is outside 1\.\.8"):  # huginn: exact PPL at K >= 1
        resolve_score_settings(huginn, [0])
    with pytest.raises(UserError, match="a gpt model has no K"):
        resolve_score_settings(None, [2], kind="gpt")
    with pytest.raises(UserError, match="draws"):
        resolve_score_settings(db, [2], draws=0)


# --- a server's limits ------------------------------------------------------------------------------


def test_serving_limits_narrow_the_models_once():
    limits = build_tiny("looped_db").iteration_limits()  # K up to 8
    served = serving_limits(limits, default_iterations=3, max_iterations=4)
    assert (served.default_iterations, served.max_iterations) == (3, 4)
    assert resolve_settings(served).num_iterations == 3
    with pytest.raises(UserError, match=r"num_iterations must be an integer in 1\.\.4"):
        resolve_settings(served, num_iterations=5)
    with pytest.raises(UserError, match=r"--max-iterations must be in 1\.\.8"):
        serving_limits(limits, max_iterations=9)
    with pytest.raises(UserError, match=r"--default-iterations 5 is outside 1\.\.4"):
        serving_limits(limits, default_iterations=5, max_iterations=4)
    with pytest.raises(UserError, match="no K"):
        serving_limits(None, default_iterations=2)
    assert serving_limits(None) is None


# --- the supporting modules' step counts ------------------------------------------------------------


def test_module_steps_default_in_one_place():
    assert resolve_steps(None, 2, fallback=DIT_SAMPLE_STEPS) == 50
    assert resolve_steps(None, 2, configured=7, fallback=50) == 7
    assert resolve_steps(3, 2, configured=7, fallback=50) == 3
    with pytest.raises(UserError, match=r"steps \(1\) must be >= the number of blocks \(2\)"):
        resolve_steps(None, 2, configured=1, fallback=50, what="steps")
    with pytest.raises(UserError, match="must be an integer"):
        resolve_steps(2.5, 2)
    dit = tiny_module("dit")  # B = 2, no configured sample_steps
    assert dit.resolve_steps(None) == DIT_SAMPLE_STEPS and dit.resolve_steps(4) == 4
    assert tiny_module("dit", sample_steps=6).resolve_steps(None) == 6
    with pytest.raises(UserError, match=r"num_iterations \(sampler steps\) \(1\)"):
        dit.resolve_steps(1)
    mdm = tiny_module("mdm")  # B = 3: one unmasking step per character by default
    assert mdm.resolve_steps(None, 10) == 10 and mdm.resolve_steps(5, 10) == 5
    assert tiny_module("mdm", sample_steps=4).resolve_steps(None, 10) == 4
    with pytest.raises(UserError, match="must be >= the number of blocks"):
        mdm.resolve_steps(None, 2)  # 2 characters, 3 blocks: ask for --num-iterations


# --- the exit rule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("names", [("--exit-threshold", "--exit-criterion"), ("exit_threshold", "exit_criterion")])
def test_exit_rule_errors_name_where_the_rule_came_from(names):
    threshold, criterion = names
    assert ExitRule.parse(0.1, None, names) == ExitRule(kl_threshold=0.1)
    assert ExitRule.parse(None, "argmax-stable:3", names) == ExitRule(argmax_stable=3)
    for args, param in (((-1.0, None), threshold), ((None, "kl:x"), criterion), ((None, "kl:-2"), criterion),
                        ((None, "argmax-stable:0"), criterion), ((None, "entropy:3"), criterion)):
        with pytest.raises(UserError, match=param) as e:
            ExitRule.parse(*args, names)
        assert e.value.param == param
    rule = ExitRule.parse(None, "kl:0.5", names)
    with pytest.raises(UserError, match="adaptive exit") as e:  # huginn's cache grows with K: no exit rule
        resolve_settings(build_tiny("huginn").iteration_limits(), exit_rule=rule)
    assert e.value.param == criterion
    with pytest.raises(UserError, match="no K") as e:
        resolve_settings(None, exit_rule=rule)
    assert e.value.param == criterion


def test_a_cap_below_the_models_default_k_asks_for_a_default():
    limits = build_tiny("huginn").iteration_limits()  # default K: the mean recurrence, 3
    with pytest.raises(UserError, match=r"default K \(3\) exceeds --max-iterations 2: pass --default-iterations"):
        serving_limits(limits, max_iterations=2)
    assert serving_limits(limits, default_iterations=2, max_iterations=2).default_iterations == 2


def test_the_hf_wrapper_resolves_once_per_generate_call(db_ckpt, tmp_path, monkeypatch):
    """`generate()` of an exported DB model resolves its settings once, however many tokens it makes
    (each step reuses the cache's settings), and a bad K is refused there, by the same rule."""
    import looped_lm  # noqa: F401 (registers the architecture)
    import looped_lm.hf.modeling as hf_modeling
    import torch
    from transformers import AutoModelForCausalLM

    assert cli.main(["export", "--checkpoint", str(db_ckpt), "--out", str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    calls = []
    original = hf_modeling.resolve_settings
    monkeypatch.setattr(hf_modeling, "resolve_settings",
                        lambda *a, **k: calls.append(k.get("num_iterations")) or original(*a, **k))
    out = model.generate(torch.tensor([[65, 110, 100]]), max_new_tokens=6, do_sample=False, num_iterations=4)
    assert out.shape[1] == 3 + 6 and calls == [4]
    with pytest.raises(UserError, match=r"num_iterations must be an integer in 1\.\.64"):
        model.generate(torch.tensor([[65]]), max_new_tokens=1, do_sample=False, num_iterations=65)


def test_the_iterations_note_names_k_below_b_and_k_above_the_usual_chain():
    """K < B skips blocks; K above max(B, the default K) on a model with a bridge is said (with the eval command
    that measures it; with the calls spread, the setting that runs them in block 0); K at the default, or above it
    on a model without a bridge (huginn), is not."""
    from looped_lm.kinds.base import IterationLimits
    from looped_lm.settings import InferenceSettings, iterations_note

    def note(k, blocks=2, default=2, bridge="hard", extra_calls="spread"):
        limits = IterationLimits(default, 64, blocks, bridge, bridge is not None, extra_calls)
        return iterations_note(limits, InferenceSettings(num_iterations=k))

    assert note(1) == "note: num_iterations=1 < 2 blocks: 1 block(s) are skipped"
    assert note(2) is None and note(3, bridge=None) is None
    assert note(3).startswith("note: num_iterations=3 is above the default K = 2 (2 blocks), with the extra")
    assert "--num-iterations 2,3" in note(3) and "--set diffusion.extra_calls=block0" in note(3)
    assert note(3, extra_calls="block0").startswith("note: num_iterations=3 is above the default K = 2 (2 blocks): "
                                                    "the extra denoising calls run in block 0 and have measured no")
    assert "--num-iterations 2,3" in note(3, extra_calls="block0") and "--set" not in note(3, extra_calls="block0")
    assert note(1, extra_calls="block0").endswith("skipped") and note(2, extra_calls="block0") is None
    assert note(4, blocks=1, default=4) is None and "default K = 4" in note(5, blocks=1, default=4)  # looped_db
    assert note(5, blocks=1, default=4, extra_calls="block0") == note(5, blocks=1, default=4)  # one core: no choice
    assert "extra_calls" not in note(5, blocks=1, default=4)
    assert note(3, default=1).startswith("note: num_iterations=3 is above the default K = 2")  # B rules
    assert iterations_note(None, InferenceSettings()) is None
