"""train.lora_rank: peft adapters on a frozen pretrained base, per block; adapter checkpoints verified
against their base's sha256; export writes merged weights."""

from __future__ import annotations

import json

import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.errors import UserError
from looped_lm.models import build_model
from looped_lm.optim import param_groups
from looped_lm.pretrained import init_from_pretrained
from test_pretrained import D, FFN, HEADS, LAYERS, V, make_llama, tokens


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_lora")
    return root, make_llama(root)


def lora_config(kind, root, train=None, **model):
    m = {"kind": kind, "n_layers": LAYERS, "d_model": D, "n_heads": HEADS, "ffn_hidden": FFN, "seq_len": 16,
         "vocab_size": V, "init_from": str(root), **model}
    diffusion = m.pop("diffusion", {"num_blocks": 2 if kind == "db_ar" else 1})
    return config_from_dict({"model": m, "diffusion": diffusion,
                             "train": {"lora_rank": 4, "lora_alpha": 8.0, **(train or {})}})


def built(cfg):
    net = build_model(cfg, V)
    init_from_pretrained(net, cfg)
    return net


def optimizer_state_bytes(model) -> int:
    """AdamW keeps two fp32 moments per trainable element."""
    return sum(8 * p.numel() for g in param_groups(model, 0.1) for p in g["params"])


def test_gpt_adapters_start_as_the_source_and_only_they_train(llama):
    root, hf = llama
    net = built(lora_config("gpt", root)).eval()
    with torch.no_grad():
        torch.testing.assert_close(net(tokens())[0], hf(tokens()).logits, atol=1e-5, rtol=0)  # B = 0 at init
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[3] for n in trainable} == {"qkv", "proj", "gate_up", "down"}
    assert len(trainable) == LAYERS * 4 * 2  # A and B per target per layer


def test_db_ar_job_holds_adapters_for_its_blocks_only(llama):
    root, _ = llama
    split = {"n_layers": 2, "n_prelude": 1, "n_coda": 1, "diffusion": {"num_blocks": 2}}
    one = built(lora_config("db_ar", root, **{**split, "diffusion": {"num_blocks": 2, "blocks_to_train": [1]}}))
    trainable = [n for n, p in one.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("blocks.1.") for n in trainable)
    assert any(".ada." in n for n in trainable) and any("lora_" in n for n in trainable)
    assert not any("lora_" in n for n, _ in one.named_modules() if n.startswith(("blocks.0", "prelude", "coda")))
    everything = built(lora_config("db_ar", root, **split))
    full = config_from_dict({"model": {"kind": "db_ar", "n_layers": 2, "n_prelude": 1, "n_coda": 1, "d_model": D,
                                       "n_heads": HEADS, "ffn_hidden": FFN, "seq_len": 16}, "diffusion": {"num_blocks": 2}})
    full_state = optimizer_state_bytes(build_model(full, V))
    assert optimizer_state_bytes(one) < optimizer_state_bytes(everything) < full_state
    assert optimizer_state_bytes(one) <= full_state / 2  # at most 1/B of full fine-tuning's


def test_noisy_queries_see_the_adapters(llama):
    """The noisy stream's query-only projection (noisy_self false) goes through the adapter too."""
    root, _ = llama
    net = built(lora_config("db_ar", root, n_layers=2, n_prelude=1, n_coda=1))
    attn = net.blocks[0][0].attn
    x = torch.randn(1, 3, D)
    cos, sin = net.rope(torch.arange(3))
    with torch.no_grad():
        attn.qkv.lora_B["default"].weight.normal_()
        torch.testing.assert_close(attn.project_query(x, cos, sin), attn.project(x, cos, sin)[0])


@pytest.mark.parametrize("train, needle", [
    ({"lora_targets": ["q_proj"]}, "train.lora_targets has 'q_proj'"),
    ({"lora_targets": []}, "train.lora_targets is empty"),
])
def test_unknown_targets_are_named(llama, train, needle):
    with pytest.raises(UserError, match=needle.replace("'", ".")):
        lora_config("gpt", llama[0], train)  # at config validation: before anything is built or written


def test_lora_needs_a_base():
    with pytest.raises(UserError, match="train.lora_rank needs model.init_from"):
        config_from_dict({"train": {"lora_rank": 4}})


# ------------------------------------------------------------------------------------------------
# through the trainer: adapter checkpoints, their base's hash, export


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, llama, write_config):
    from looped_lm import train as trainer

    root, _ = llama
    tmp = tmp_path_factory.mktemp("lora_run")
    path = write_config(tmp / "run.yaml", {
        "model": {"kind": "gpt", "n_layers": LAYERS, "d_model": D, "n_heads": HEADS, "ffn_hidden": FFN,
                  "vocab_size": V, "init_from": str(root)},
        "data": {"cache_dir": str(tmp / "cache")},
        "train": {"out_dir": str(tmp / "out"), "max_steps": 3, "lr": 3e-2, "lora_rank": 4}})
    assert trainer.main(["--config", str(path)]) == 0
    return tmp / "out" / "step_0000003", path


def test_checkpoint_holds_the_adapters_and_loads_over_the_base(lora_run, llama):
    from safetensors import safe_open

    from looped_lm.checkpoint import load_checkpoint

    ckpt, _ = lora_run
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all("lora_" in n for n in names)
    model, _, manifest = load_checkpoint(ckpt)
    assert manifest["base"]["sha256"] and manifest["base"]["path"] == str(llama[0].resolve())
    lora_b = model.layers[0].attn.qkv.lora_B["default"].weight
    assert lora_b.abs().sum() > 0  # trained: no longer the zero init
    with torch.no_grad():
        assert not torch.allclose(model(tokens())[0], llama[1](tokens()).logits, atol=1e-4)


def test_export_writes_merged_weights(lora_run, tmp_path):
    from transformers import LlamaForCausalLM

    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.export import export

    ckpt, _ = lora_run
    out = export(ckpt, tmp_path / "hf")
    merged = LlamaForCausalLM.from_pretrained(out).eval()
    model, _, _ = load_checkpoint(ckpt)
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens()).logits, model(tokens())[0], atol=1e-4, rtol=0)


def test_adapters_on_a_different_base_are_refused(lora_run, llama, tmp_path, capsys, one_line_error):
    import shutil

    from safetensors.torch import load_file, save_file

    from looped_lm import cli

    ckpt, _ = lora_run
    root = llama[0]
    backup = tmp_path / "model.safetensors"
    shutil.copy(root / "model.safetensors", backup)
    try:
        weights = load_file(str(root / "model.safetensors"))
        weights["model.norm.weight"] = weights["model.norm.weight"] + 1
        save_file(weights, str(root / "model.safetensors"))
        assert cli.main(["eval", "--checkpoint", str(ckpt), "--no-progress"]) == 2
        one_line_error(capsys.readouterr(), "a different base", str(root.resolve()))
    finally:
        shutil.copy(backup, root / "model.safetensors")


def test_adapter_run_resumes(lora_run, tmp_path):
    import yaml

    from looped_lm import train as trainer

    ckpt, path = lora_run
    raw = yaml.safe_load(path.read_text())
    raw["train"]["max_steps"] = 4
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(raw))
    assert trainer.main(["--config", str(again)]) == 0
    manifest = json.loads((ckpt.parent / "step_0000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["base"]["sha256"]


def test_eval_and_generate_load_an_adapter_checkpoint(lora_run, capsys):
    from looped_lm import cli

    ckpt, _ = lora_run
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--max-tokens", "128", "--no-progress"]) == 0
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "And", "--max-tokens", "8"]) == 0
    assert "And" in capsys.readouterr().out


def test_a_block_job_checkpoints_its_blocks_adapters_and_state_only(tmp_path, llama, write_config):
    """db_ar LoRA job for block 1: its weights file and optimizer state name block 1 only."""
    from safetensors import safe_open

    from looped_lm import train as trainer

    root, _ = llama
    path = write_config(tmp_path / "run.yaml", {
        "model": {"kind": "db_ar", "n_layers": 2, "n_prelude": 1, "n_coda": 1, "d_model": D, "n_heads": HEADS,
                  "ffn_hidden": FFN, "vocab_size": V, "init_from": str(root)},
        "diffusion": {"num_blocks": 2, "blocks_to_train": [1], "block_sampling": "round_robin"},
        "data": {"cache_dir": str(tmp_path / "cache")},
        "train": {"out_dir": str(tmp_path / "out"), "max_steps": 2, "lora_rank": 4}})
    assert trainer.main(["--config", str(path)]) == 0
    ckpt = tmp_path / "out" / "step_0000002"
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        saved = list(f.keys())
    lora = [n for n in saved if "lora_" in n]
    assert lora and all(n.startswith("blocks.1.") for n in lora)
    assert sorted(p.name for p in (ckpt / "optimizer").iterdir()) == ["block1.safetensors"]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["ownership"] == {"blocks": [1]} and manifest["base"]["sha256"]
