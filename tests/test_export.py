"""`looped_lm export` and the Hugging Face wrapper: the exported directory loads through the Auto classes
after `import looped_lm`, and `generate` gives the native engine's greedy tokens for every exported kind
(logits equal to 1e-5 for gpt; DB models share the native K-step chain and its seeded noise)."""

import json
import subprocess
import sys

import pytest
import torch

from looped_lm import cli
from looped_lm.checkpoint import load_checkpoint
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.generate import generate
from looped_lm.models.contract import Iterative
from looped_lm.sampling import GREEDY
from looped_lm.settings import resolve_settings


def greedy_settings(model, K=None):
    limits = model.iteration_limits() if isinstance(model, Iterative) else None
    return resolve_settings(limits, num_iterations=K, sampling=GREEDY)

KINDS = {
    "gpt": {"model": {"kind": "gpt"}},
    "db_ar": {"model": {"kind": "db_ar", "n_layers": 2, "n_prelude": 1}, "diffusion": {"num_blocks": 2}},
    "looped_db": {"model": {"kind": "looped_db", "n_layers": 1, "n_prelude": 1, "n_coda": 1},
                  "diffusion": {"num_blocks": 1, "num_iterations": 3}},
}
PROMPT = "In the beginning"
N = 10


@pytest.fixture(scope="module")
def exported(tmp_path_factory, write_config):
    """kind -> (checkpoint dir, exported HF dir): 3-step runs of each kind, exported through the CLI."""
    from looped_lm import train as trainer

    root = tmp_path_factory.mktemp("export")
    out = {}
    for kind, extra in KINDS.items():
        cfg = write_config(root / f"{kind}.yaml", {**extra, "train": {"out_dir": str(root / kind), "max_steps": 3}})
        assert trainer.main(["--config", str(cfg)]) == 0
        ckpt = root / kind / "step_0000003"
        assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(root / f"hf_{kind}")]) == 0
        out[kind] = (ckpt, root / f"hf_{kind}")
    return out


def native_greedy(ckpt, ids, n):
    model, _, manifest = load_checkpoint(ckpt)
    return generate(model, ids, n, greedy_settings(model), seed=0, return_logits=True)  # the CLI's default seed 0


def test_export_writes_the_hugging_face_layout(exported):
    ckpt, hf = exported["looped_db"]
    names = {p.name for p in hf.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    config = json.loads((hf / "config.json").read_text())
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert config["model_type"] == "looped_lm" and config["kind"] == "looped_db"
    assert config["architectures"] == ["LoopedLMForCausalLM"]
    assert config["model_state"] == manifest["model_state"] and config["vocab_size"] == manifest["vocab_size"]
    assert config["num_iterations"] == 3 and config["looped_lm_config"] == manifest["config"]
    gen = json.loads((hf / "generation_config.json").read_text())
    assert gen["num_iterations"] == 3 and gen["eos_token_id"] == 256 and gen["seed"] == 0
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.tok_emb.weight" in keys and not any("lm_head" in k for k in keys)  # tied: stored once


@pytest.mark.parametrize("kind", list(KINDS))
def test_auto_classes_load_and_generate_the_native_greedy_tokens(exported, kind):
    import looped_lm  # noqa: F401  (registers model_type "looped_lm" with transformers)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ckpt, hf = exported[kind]
    assert type(AutoConfig.from_pretrained(hf)).__name__ == "LoopedLMConfig"
    model = AutoModelForCausalLM.from_pretrained(hf)
    ids = torch.tensor([AutoTokenizer.from_pretrained(hf)(PROMPT)["input_ids"]])
    assert ids[0].tolist() == get_tokenizer("byte").encode(PROMPT)
    ref_tokens, ref_logits = native_greedy(ckpt, ids, N)
    out = model.generate(ids, max_new_tokens=N, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert out.sequences.tolist() == ref_tokens.tolist()
    logits = torch.stack(out.logits, dim=1)
    if kind == "gpt":
        assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)
        full = model(ids, use_cache=False).logits  # the uncached forward: every position
        assert torch.allclose(full[:, -1], ref_logits[:, 0], atol=1e-5, rtol=0)
    else:
        assert torch.equal(logits, ref_logits)  # same chain, same noise draws


def test_db_generation_follows_k_and_seed_of_the_call(exported):
    import looped_lm  # noqa: F401
    from transformers import AutoModelForCausalLM

    ckpt, hf = exported["db_ar"]
    model = AutoModelForCausalLM.from_pretrained(hf)
    native, _, _ = load_checkpoint(ckpt)
    ids = torch.tensor([get_tokenizer("byte").encode(PROMPT)])
    for K, seed in ((4, 0), (2, 7)):
        ref = generate(native, ids, N, greedy_settings(native, K), seed=seed)
        got = model.generate(ids, max_new_tokens=N, do_sample=False, num_iterations=K, seed=seed)
        assert got.tolist() == ref.tolist()


def test_import_stays_light_and_registers_lazily():
    code = ("import sys, looped_lm; assert 'transformers' not in sys.modules and 'torch' not in sys.modules; "
            "from transformers import AutoConfig; from transformers.models.auto.configuration_auto import CONFIG_MAPPING; "
            "assert 'looped_lm' in CONFIG_MAPPING")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_export_errors_are_one_line(exported, tmp_path, capsys, one_line_error):
    ckpt, hf = exported["gpt"]
    assert cli.main(["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys.readouterr(), "not found")
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(hf)]) == 2
    one_line_error(capsys.readouterr(), "not empty", "--overwrite")
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(hf), "--overwrite"]) == 0
