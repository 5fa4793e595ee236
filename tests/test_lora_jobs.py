"""LoRA block jobs end to end: `looped_lm merge` joins per-block adapter jobs by ownership (same base
hash, disjoint complete coverage) into an adapter checkpoint that eval, generate, export and serve load;
a LoRA checkpoint served through the real `openai` client (in process, and the `looped_lm serve` verb)."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import torch

from looped_lm import checkpoint as ckpt_io
from looped_lm import cli
from looped_lm.lora import ADA_WEIGHT
from test_pretrained import D, FFN, HEADS, V, make_llama

pytestmark = pytest.mark.usefixtures("one_thread")

SPLIT = {"kind": "db_ar", "n_layers": 2, "n_prelude": 1, "n_coda": 1, "d_model": D, "n_heads": HEADS,
         "ffn_hidden": FFN, "vocab_size": V, "seq_len": 16}


def _job(write_config, root, base, name: str, blocks: list[int] | None, seed: int = 0, **train):
    """A 3-step LoRA db_ar job (B = 2, context independent) over `base` training `blocks` -> its checkpoint
    (adaLN by its adapter, train.lora_ada lora, unless `train` says otherwise)."""
    from looped_lm import trainer

    train = {"lora_ada": "lora", **train}

    diffusion = {"num_blocks": 2, "block_sampling": "round_robin"}
    if blocks is not None:
        diffusion["blocks_to_train"] = blocks
    path = write_config(root / f"{name}.yaml", {
        "model": {**SPLIT, "init_from": str(base)}, "diffusion": diffusion,
        "train": {"out_dir": str(root / name), "max_steps": 3, "lr": 3e-2, "lora_rank": 4, "seed": seed, **train}})
    assert trainer.main(["--config", str(path)]) == 0
    return root / name / "step_0000003"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_jobs_base")
    make_llama(root)
    return root


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, write_config, base):
    """LoRA jobs for block 0 and block 1 of one model, over the same base (adaLN by its adapter)."""
    root = tmp_path_factory.mktemp("lora_jobs")
    return root, [_job(write_config, root, base, f"job{b}", [b]) for b in (0, 1)]


@pytest.fixture(scope="module")
def merged(jobs, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_merged") / "merged"
    assert cli.main(["merge", *map(str, jobs[1]), "--out", str(out)]) == 0
    return out


def block_loss(model, b: int) -> torch.Tensor:
    """Block b's per-slot CE at a fixed sigma in its interval, fixed noise: a function of block b and the
    shared parts only."""
    g = torch.Generator().manual_seed(b)
    x = torch.randint(0, V, (2, 16), generator=g)
    y = torch.randint(0, V, (2, 16), generator=g)
    lo, hi = model.train_ranges[b]  # block 0 = the highest noise
    sigma = torch.full((2,), hi if b else (lo * hi) ** 0.5)  # block 1: its top (below, z gives y away)
    noise = torch.randn(2, 16, D, generator=g)
    with torch.no_grad():
        return model.objective.slot_losses(x, y, b, sigma, noise, None)


def test_merged_adapters_are_each_jobs_blocks(jobs, merged, base):
    from safetensors import safe_open

    _, (job0, job1) = jobs
    model, cfg, manifest = ckpt_io.load_checkpoint(merged)
    parts = [ckpt_io.load_checkpoint(j)[0] for j in (job0, job1)]
    assert manifest["ownership"] == {"blocks": [0, 1]} and cfg.diffusion.blocks_to_train == []
    assert manifest["base"] == json.loads((job0 / "manifest.json").read_text())["base"]
    assert manifest["base"]["path"] == str(base.resolve())
    for b, part in enumerate(parts):
        torch.testing.assert_close(block_loss(model, b), block_loss(part, b), atol=0, rtol=0)
    # not trivially so: each job's other block is the untrained base, unlike the merged one
    assert not torch.allclose(block_loss(model, 1), block_loss(parts[0], 1))
    assert not torch.allclose(block_loss(model, 0), block_loss(parts[1], 0))
    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        shared_b = [f.get_tensor(n) for n in names if "lora_B" in n and n.startswith(("prelude", "coda"))]
    assert {n.split(".")[1] for n in names if n.startswith("blocks.") and "lora_" in n} == {"0", "1"}
    assert shared_b and all(not t.any() for t in shared_b)  # no block job adapts them: no update
    for ckpt in (merged, job0, job1):  # the frozen zero `ada` weights are rebuilt by the init, not saved
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            assert not [n for n in f.keys() if ADA_WEIGHT.search(n)]
            assert {n.rsplit(".ada.", 1)[1] for n in f.keys() if ".ada." in n} >= {
                "base_layer.bias", "lora_A.default.weight", "lora_B.default.weight"}


def test_full_ada_block_jobs_merge_and_hold_more(jobs, merged, write_config, base, tmp_path):
    """lora_ada full: each job trains its blocks' whole `ada` and saves no frozen one (the other block's, the
    coda's: zero from the init); the merge computes each job's block, and weighs far more than the lora one."""
    full_jobs = [_job(write_config, tmp_path, base, f"full{b}", [b], lora_ada="full") for b in (0, 1)]
    out = tmp_path / "merged_full"
    assert cli.main(["merge", *map(str, full_jobs), "--out", str(out)]) == 0
    model, cfg, _ = ckpt_io.load_checkpoint(out)
    assert cfg.train.lora_ada == "full"
    for b, job in enumerate(full_jobs):
        torch.testing.assert_close(block_loss(model, b), block_loss(ckpt_io.load_checkpoint(job)[0], b), atol=0, rtol=0)
    from safetensors import safe_open

    with safe_open(str(full_jobs[0] / "model.safetensors"), "pt") as f:
        assert sorted(n for n in f.keys() if ADA_WEIGHT.search(n)) == ["blocks.0.0.ada.weight"]
    low, full = ((ckpt / "model.safetensors").stat().st_size for ckpt in (merged, out))
    assert low < 0.55 * full, (low, full)


def test_every_verb_loads_the_merged_adapter_checkpoint(merged, tmp_path, capsys):
    assert cli.main(["verify", str(merged)]) == 0
    assert "a merge of block jobs" in capsys.readouterr().out
    assert cli.main(["eval", "--checkpoint", str(merged), "--num-iterations", "2", "--draws", "1",
                     "--max-tokens", "64", "--no-progress"]) == 0
    assert cli.main(["generate", "--checkpoint", str(merged), "--prompt", "And", "--max-tokens", "4"]) == 0
    assert "And" in capsys.readouterr().out
    out = tmp_path / "plain"
    assert cli.main(["export", "--checkpoint", str(merged), "--out", str(out)]) == 0
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from looped_lm.hf import register

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not [n for n in f.keys() if "lora_" in n or "base_layer" in n]  # plain weights, adapters folded
    register()
    plain = AutoModelForCausalLM.from_pretrained(out).model.eval()
    model = ckpt_io.load_checkpoint(merged)[0]
    for b in (0, 1):  # computes what the adapters did
        torch.testing.assert_close(block_loss(plain, b), block_loss(model, b), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["base", "mixed", "alpha", "seed", "ada"])
def test_merge_refuses_lora_jobs_that_disagree(case, jobs, base, tmp_path, write_config, capsys, one_line_error):
    _, (job0, job1) = jobs
    if case == "base":  # adapters trained on another base: one line naming the hash mismatch
        other = tmp_path / "other_base"
        make_llama(other, seed=1)
        inputs, needles = [job0, _job(write_config, tmp_path, other, "other", [1])], ["a different base", str(other)]
    elif case == "mixed":
        inputs = [job0, _full_job(write_config, tmp_path, base)]
        needles = ["is a LoRA job", "holds full weights"]
    elif case == "alpha":
        inputs = [job0, _job(write_config, tmp_path, base, "alpha", [1], lora_alpha=4.0)]
        needles = ["train.lora_alpha", "4.0", "16.0"]
    elif case == "ada":  # block 1's adaLN trained fully, block 0's by its adapter
        inputs = [job0, _job(write_config, tmp_path, base, "ada", [1], lora_ada="full")]
        needles = ["train.lora_ada", "'full'", "'lora'"]
    else:  # another seed: the frozen shared init (noise embedding) differs from job 0's
        inputs = [job0, _job(write_config, tmp_path, base, "seed1", [1], seed=1)]
        needles = ["trained against different ones", "train.seed"]
    out = tmp_path / "merged"
    capsys.readouterr()
    assert cli.main(["merge", *map(str, inputs), "--out", str(out)]) == 2
    one_line_error(capsys.readouterr(), *needles)
    assert not out.exists() and not list(tmp_path.glob(".tmp-merge-*"))


def _full_job(write_config, root, base):
    from looped_lm import trainer

    path = write_config(root / "full.yaml", {
        "model": {**SPLIT, "init_from": str(base)}, "diffusion": {"num_blocks": 2, "blocks_to_train": [1]},
        "train": {"out_dir": str(root / "full"), "max_steps": 1}})
    assert trainer.main(["--config", str(path)]) == 0
    return root / "full" / "step_0000001"


# ------------------------------------------------------------------------------------------------
# serving an adapter checkpoint through the real openai client


@pytest.fixture(scope="module")
def gpt_adapters(tmp_path_factory, write_config, base):
    from looped_lm import trainer

    root = tmp_path_factory.mktemp("lora_gpt")
    path = write_config(root / "run.yaml", {
        "model": {"kind": "gpt", "n_layers": 4, "d_model": D, "n_heads": HEADS, "ffn_hidden": FFN, "vocab_size": V,
                  "seq_len": 16, "init_from": str(base)},
        "train": {"out_dir": str(root / "out"), "max_steps": 3, "lr": 3e-2, "lora_rank": 4}})
    assert trainer.main(["--config", str(path)]) == 0
    return root / "out" / "step_0000003"


def _served(ckpt, name):
    from looped_lm.data.tokenizer import get_tokenizer
    from looped_lm.engine.engine import Engine
    from looped_lm.serve.app import BackgroundServer, build_app

    model, _, manifest = ckpt_io.load_checkpoint(ckpt)
    tok = get_tokenizer(manifest["tokenizer"])
    engine = Engine.from_memory_budget(model, 0.25, vocab_size=tok.vocab_size)
    return model, tok, BackgroundServer(build_app(engine, tok, name))


@pytest.mark.parametrize("which", ["gpt", "db_ar merged"])
def test_an_adapter_checkpoint_is_served_to_the_openai_client(which, gpt_adapters, merged):
    ckpt = gpt_adapters if which == "gpt" else merged
    model, tok, server = _served(ckpt, "lora")
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data][0] == "lora"
        r = client.completions.create(model="lora", prompt="And the", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5 and len(r.choices[0].text) > 0
        chat = client.chat.completions.create(model="lora", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3
        if which == "gpt":  # greedy: the served tokens are the adapted model's own argmax continuation
            ids = tok.encode("And the")
            want = []
            with torch.no_grad():
                for _ in range(5):
                    logits = model(torch.tensor([ids + want]))[0][0, -1]
                    want.append(int(logits.argmax()))
            assert r.choices[0].text == tok.decode(want)


@pytest.mark.slow
def test_serve_verb_on_an_adapter_checkpoint(gpt_adapters, clean_env):
    from test_server import free_port, wait_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "looped_lm", "serve", "--checkpoint", str(gpt_adapters), "--port", str(port),
           "--max-slots", "2", "--served-model-name", "lora-gpt", "--log-level", "warning", "--threads", "1"]
    proc = subprocess.Popen(cmd, env=clean_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=120)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="lora-gpt", prompt="And", max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "serving lora-gpt (gpt)" in out and "Traceback" not in out
