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
    from looped_lm import trainer

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

    from looped_lm import trainer

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

    from looped_lm import trainer

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


# ------------------------------------------------------------------------------------------------
# train.lora_ada: the adaLN modulation through a low-rank adapter; its frozen zero weight is not saved

SPLIT = {"n_layers": 2, "n_prelude": 1, "n_coda": 1}


def two_stream_layers(net):
    return [*net.coda, *(layer for block in net.blocks for layer in block)]


def slot_loss(net, b: int = 0) -> torch.Tensor:
    """Block b's per-slot CE at a fixed sigma and noise: it runs the noisy stream, so every `ada`."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, V, (2, 12), generator=g), torch.randint(0, V, (2, 12), generator=g)
    with torch.no_grad():
        return net.objective.slot_losses(x, y, b, torch.full((2,), 1.0), torch.randn(2, 12, D, generator=g), None)


def seeded(cfg, seed: int = 0):
    torch.manual_seed(seed)
    return built(cfg)


def test_low_rank_ada_starts_as_adaln_zero_and_trains_its_adapter_and_bias(llama):
    root, _ = llama
    low = seeded(lora_config("db_ar", root, {"lora_ada": "lora"}, **SPLIT))
    full = seeded(lora_config("db_ar", root, {"lora_ada": "full"}, **SPLIT))
    cond = torch.randn(3, D)
    for layer in two_stream_layers(low):
        ada = layer.ada
        assert not ada.base_layer.weight.requires_grad and not ada.base_layer.weight.any()
        assert ada.base_layer.bias.requires_grad
        assert ada.lora_A["default"].weight.requires_grad and ada.lora_B["default"].weight.requires_grad
        with torch.no_grad():  # B = 0: the bias alone (the opened gates), as adaLN-Zero starts
            torch.testing.assert_close(ada(cond), ada.base_layer.bias.expand(3, -1), atol=0, rtol=0)
    torch.testing.assert_close(slot_loss(low), slot_loss(full), atol=0, rtol=0)  # the same model at the start

    def ada_trainable(net):
        return sum(p.numel() for n, p in net.named_parameters() if ".ada." in n and p.requires_grad)

    assert ada_trainable(low) == 3 * (4 * (D + 6 * D) + 6 * D)  # rank 4: A (4 x D), B (6D x 4), bias
    assert ada_trainable(full) == 3 * (6 * D * D + 6 * D)
    # a block job: the other block's `ada` is neither adapted nor trained
    job = built(lora_config("db_ar", root, {"lora_ada": "lora"}, **SPLIT,
                            diffusion={"num_blocks": 2, "blocks_to_train": [1]}))
    assert type(job.blocks[0][0].ada) is torch.nn.Linear and not job.blocks[0][0].ada.weight.requires_grad
    assert {n for n, p in job.named_parameters() if p.requires_grad and ".ada." in n} == {
        f"blocks.1.0.ada.{t}" for t in ("base_layer.bias", "lora_A.default.weight", "lora_B.default.weight")}


@pytest.mark.parametrize("blocks", [[], [1]], ids=["every block", "a block job"])
def test_an_adapter_file_rebuilds_the_trained_model_without_ada_weights(llama, tmp_path, blocks):
    """What the job trains is saved; the frozen zero `ada` weights are not, and a model built again (another
    seed: other LoRA A inits) from the base and that file computes exactly what the trained one did."""
    from safetensors import safe_open

    from looped_lm.tensor_files import load_weights, save_weights
    from looped_lm.lora import ADA_WEIGHT

    root, _ = llama
    diffusion = {"num_blocks": 2, "blocks_to_train": blocks}
    sizes, ada_sizes = {}, {}
    for ada in ("full", "lora"):
        cfg = lora_config("db_ar", root, {"lora_ada": ada}, **SPLIT, diffusion=diffusion)
        trained = seeded(cfg, 0)
        with torch.no_grad():  # "training": every trainable tensor moves
            for p in trained.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
        path = tmp_path / f"{ada}.safetensors"
        save_weights(trained, path)
        sizes[ada] = path.stat().st_size
        with safe_open(str(path), "pt") as f:
            names = set(f.keys())
            ada_sizes[ada] = sum(4 * f.get_slice(n).get_shape()[0] * (f.get_slice(n).get_shape() + [1])[1]
                                 for n in names if ".ada." in n)
        if ada == "lora":
            assert not [n for n in names if ADA_WEIGHT.search(n)]  # no full `ada` weight, trained or not
        assert {n for n, p in trained.named_parameters() if p.requires_grad} <= names
        again = seeded(cfg, 1)
        load_weights(again, path)
        for b in (0, 1):
            torch.testing.assert_close(slot_loss(again, b), slot_loss(trained, b), atol=0, rtol=0)
    # D = 32, rank 4: `ada` 5.8x smaller (4.6x in the block job), the file 2.2x (1.9x); SmolLM2-135M at rank 8:
    # the file 16x (docs/pretrained.md)
    assert ada_sizes["lora"] < ada_sizes["full"] / 4 and sizes["lora"] < 0.55 * sizes["full"], (ada_sizes, sizes)


def test_an_older_adapter_file_with_zero_ada_weights_still_loads(llama, tmp_path):
    """Before train.lora_ada a block job saved its frozen `ada` weights (zeros): a load accepts them."""
    from safetensors.torch import load_file, save_file

    from looped_lm.tensor_files import load_weights, save_weights

    root, _ = llama
    cfg = lora_config("db_ar", root, {"lora_ada": "full"}, **SPLIT, diffusion={"num_blocks": 2, "blocks_to_train": [1]})
    net = seeded(cfg)
    save_weights(net, tmp_path / "w.safetensors")
    tensors = load_file(str(tmp_path / "w.safetensors"))
    assert "blocks.0.0.ada.weight" not in tensors and "blocks.1.0.ada.weight" in tensors
    tensors["blocks.0.0.ada.weight"] = torch.zeros(6 * D, D)
    tensors["coda.0.ada.weight"] = torch.zeros(6 * D, D)
    save_file(tensors, str(tmp_path / "old.safetensors"))
    again = seeded(cfg, 1)
    load_weights(again, tmp_path / "old.safetensors")
    torch.testing.assert_close(slot_loss(again, 1), slot_loss(net, 1), atol=0, rtol=0)


@pytest.fixture(scope="module")
def ada_runs(tmp_path_factory, llama, write_config):
    """db_ar LoRA runs over the base, 4 steps with a checkpoint every 2: lora_ada lora straight through, the same
    stopped after 2 and resumed, and lora_ada full."""
    from looped_lm import trainer

    root, _ = llama
    tmp = tmp_path_factory.mktemp("lora_ada")

    def config(name, ada):
        return write_config(tmp / f"{name}.yaml", {
            "model": {"kind": "db_ar", **SPLIT, "d_model": D, "n_heads": HEADS, "ffn_hidden": FFN, "vocab_size": V,
                      "seq_len": 16, "init_from": str(root)},
            "diffusion": {"num_blocks": 2, "block_sampling": "round_robin"},
            "train": {"out_dir": str(tmp / name), "max_steps": 4, "save_every": 2, "keep_last": 5, "lr": 3e-2,
                      "lora_rank": 4, "lora_ada": ada, "resume": "auto"}})

    for name, ada in (("lora", "lora"), ("full", "full")):
        assert trainer.main(["--config", str(config(name, ada))]) == 0
    resumed = config("resumed", "lora")
    assert trainer.main(["--config", str(resumed), "--stop-after", "2"]) == 0
    assert trainer.main(["--config", str(resumed)]) == 0
    return tmp


def test_low_rank_ada_run_resumes_exactly_and_loads_as_trained(ada_runs, llama):
    from safetensors.torch import load_file

    from looped_lm.checkpoint import load_checkpoint
    from looped_lm.lora import ADA_WEIGHT

    straight, resumed = (ada_runs / name / "step_0000004" for name in ("lora", "resumed"))
    want, got = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not [n for n in want if ADA_WEIGHT.search(n)]
    assert {n.rsplit(".ada.", 1)[1] for n in want if ".ada." in n} == {
        "base_layer.bias", "lora_A.default.weight", "lora_B.default.weight"}
    a, cfg, _ = load_checkpoint(straight)
    b, _, _ = load_checkpoint(resumed)
    assert cfg.train.lora_ada == "lora"
    assert any(layer.ada.lora_B["default"].weight.any() for layer in two_stream_layers(a))  # it trained
    assert all(not layer.ada.base_layer.weight.any() for layer in two_stream_layers(a))  # rebuilt: zero
    for block in (0, 1):
        torch.testing.assert_close(slot_loss(a, block), slot_loss(b, block), atol=0, rtol=0)
    x = tokens(16)
    torch.testing.assert_close(a.validation_loss(x, x, seed=0), b.validation_loss(x, x, seed=0), atol=0, rtol=0)


def test_low_rank_ada_checkpoint_is_much_smaller(ada_runs):
    """The same run with lora_ada full: its weights and optimizer state hold every `ada` weight."""
    lora, full = (ada_runs / name / "step_0000004" for name in ("lora", "full"))
    size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())  # noqa: E731
    assert (lora / "model.safetensors").stat().st_size < 0.5 * (full / "model.safetensors").stat().st_size
    assert size(lora / "optimizer") < 0.5 * size(full / "optimizer")


def test_a_resume_that_changes_lora_ada_is_refused(ada_runs, write_config, tmp_path, capsys, one_line_error):
    import shutil

    import yaml

    from looped_lm import trainer

    raw = yaml.safe_load((ada_runs / "lora.yaml").read_text())
    shutil.copytree(ada_runs / "lora" / "step_0000002", tmp_path / "out" / "step_0000002")
    raw["train"].update({"out_dir": str(tmp_path / "out"), "lora_ada": "full"})
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert trainer.main(["--config", str(path)]) == 2
    one_line_error(capsys.readouterr(), "train.lora_ada is 'lora' there but 'full'")


def test_an_adapter_checkpoint_from_before_lora_ada_reads_as_full(ada_runs):
    """A manifest whose config has no train.lora_ada was written when `ada` always trained fully."""
    from looped_lm.checkpoint import config_of
    from looped_lm.config import Config

    manifest = json.loads((ada_runs / "full" / "step_0000004" / "manifest.json").read_text())
    del manifest["config"]["train"]["lora_ada"]
    assert config_of(manifest).train.lora_ada == "full"
    assert config_of({"config": {"train": {}}}).train.lora_ada == Config().train.lora_ada  # no LoRA: not read
