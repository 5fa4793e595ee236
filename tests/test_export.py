"""`looped_lm export`: gpt as a stock LlamaForCausalLM that transformers loads without looped_lm (logits
equal to LLAMA_ATOL in fp32, greedy tokens and text equal to `looped_lm generate --temperature 0`), and
the Hugging Face wrapper (`--format looped_lm`): the exported directory loads through the Auto classes
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
    "db_ar_stacked": {"model": {"kind": "db_ar", "n_layers": 2, "n_prelude": 1},
                      "diffusion": {"num_blocks": 2, "context": "stacked"}},
    "looped_db": {"model": {"kind": "looped_db", "n_layers": 1, "n_prelude": 1, "n_coda": 1},
                  "diffusion": {"num_blocks": 1, "num_iterations": 3}},
}
PROMPT = "In the beginning"
N = 10


@pytest.fixture(scope="module")
def exported(tmp_path_factory, write_config):
    """kind -> (checkpoint dir, exported HF dir): 3-step runs of each kind, exported through the CLI."""
    from looped_lm import trainer

    root = tmp_path_factory.mktemp("export")
    out = {}
    for kind, extra in KINDS.items():
        cfg = write_config(root / f"{kind}.yaml", {**extra, "train": {"out_dir": str(root / kind), "max_steps": 3}})
        assert trainer.main(["--config", str(cfg)]) == 0
        ckpt = root / kind / "step_0000003"
        fmt = ["--format", "looped_lm"] if kind == "gpt" else []  # gpt's default is the stock Llama export
        assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(root / f"hf_{kind}"), *fmt]) == 0
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


def test_a_k_above_the_usual_chain_is_logged_by_the_wrapper(exported, monkeypatch):
    """The transformers wrapper says what generate and the server say, through transformers' logger: K = 4
    on the B = 2 model gets the note, K = 2 none."""
    import looped_lm  # noqa: F401
    import looped_lm.hf.modeling as modeling
    from transformers import AutoModelForCausalLM

    said = []
    monkeypatch.setattr(modeling.logger, "warning_once", said.append)
    model = AutoModelForCausalLM.from_pretrained(exported["db_ar"][1])
    ids = torch.tensor([get_tokenizer("byte").encode(PROMPT)])
    model.generate(ids, max_new_tokens=2, do_sample=False, num_iterations=2)
    assert said == []
    model.generate(ids, max_new_tokens=2, do_sample=False, num_iterations=4)
    assert said and all(s.startswith("note: num_iterations=4 is above the default K = 2") for s in said), said


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
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(hf), "--overwrite", "--format", "looped_lm"]) == 0
    db_ckpt, _ = exported["db_ar"]
    assert cli.main(["export", "--checkpoint", str(db_ckpt), "--out", str(tmp_path / "l"), "--format", "llama"]) == 2
    one_line_error(capsys.readouterr(), "--format llama", "model.kind db_ar does not offer export_llama")
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "l"), "--num-iterations", "2"]) == 2
    one_line_error(capsys.readouterr(), "--num-iterations")
    assert not (tmp_path / "l").exists() and not (tmp_path / ".tmp-l").exists()


# --- gpt as a stock LlamaForCausalLM ------------------------------------------------------------------

# Logits agree to float rounding: Llama computes RoPE angles position x inv_freq in float32, ours in
# float64 (cast after), a difference of up to position x 6e-8 rad; at the <= 48 positions used here the
# logits (scale ~10) differ by ~1e-5.
LLAMA_ATOL = 1e-4
LLAMA_SHAPE = {"kind": "gpt", "n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "rope_theta": 500.0,
               "ffn_hidden": 96, "norm_eps": 1e-6, "init_std": 0.2}  # non-default theta, eps, ffn: all read
# Runs in a fresh interpreter where importing looped_lm fails: only transformers' own classes can load it.
HF_ONLY = r"""
import json, sys
sys.modules["looped_lm"] = None  # any `import looped_lm` now raises ImportError
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
hf_dir, prompt, n, ids_path, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
tok = AutoTokenizer.from_pretrained(hf_dir)
model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
prompt_ids = tok(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(torch.load(ids_path)).logits
    out = model.generate(prompt_ids, max_new_tokens=n, do_sample=False)
new = out[0, prompt_ids.shape[1]:].tolist()
torch.save(logits, out_path)
print("RESULT " + json.dumps({
    "class": type(model).__name__, "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
    "prompt_ids": prompt_ids[0].tolist(), "new": new,
    "text": prompt + tok.decode([t for t in new if t != tok.eos_token_id]),
    "looped_lm_loaded": any(m.startswith("looped_lm") and sys.modules[m] is not None for m in sys.modules)}))
"""


@pytest.fixture(scope="module")
def llama_exported(tmp_path_factory):
    """(checkpoint, HF dir) of a random-init gpt (weights at std 0.2, so greedy has no near-ties), exported
    by the CLI with the default format."""
    from looped_lm.checkpoint import finalize, tmp_dir_for
    from looped_lm.config import config_from_dict
    from looped_lm.models import build_model
    from looped_lm.tensor_files import write_rank_files

    root = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    cfg = config_from_dict({"model": LLAMA_SHAPE, "data": {"tokenizer": "byte"}})
    write_rank_files(tmp_dir_for(root / "run", 1), 0)
    manifest = {"config": cfg.to_dict(), "vocab_size": 257, "tokenizer": "byte", "model_state": {}, "world_size": 1}
    ckpt = finalize(root / "run", 1, build_model(cfg, 257), manifest, keep_last=1)
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(root / "hf")]) == 0
    return ckpt, root / "hf"


@pytest.mark.slow
def test_gpt_exports_as_a_stock_llama_that_loads_without_looped_lm(llama_exported, tmp_path, capsys):
    ckpt, hf = llama_exported
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["rope_parameters"]["rope_theta"] == 500.0
    assert config["intermediate_size"] == 96 and config["rms_norm_eps"] == 1e-6 and config["head_dim"] == 16
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.gate_proj.weight" in keys and "model.layers.0.self_attn.k_proj.weight" in keys
    assert not any("lm_head" in k or "qkv" in k or "gate_up" in k for k in keys)

    ids = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    proc = subprocess.run([sys.executable, "-c", HF_ONLY, str(hf), PROMPT, str(N), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt")], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["class"] == "LlamaForCausalLM" and got["tied"] and not got["looped_lm_loaded"]

    native, _, _ = load_checkpoint(ckpt)
    with torch.no_grad():
        ref = native(ids)[0]
    hf_logits = torch.load(tmp_path / "logits.pt")
    assert hf_logits.shape == ref.shape
    assert (hf_logits[:, 0] - ref[:, 0]).abs().max() < 1e-5  # position 0: no rotation, the weights alone
    assert (hf_logits - ref).abs().max() < LLAMA_ATOL, (hf_logits - ref).abs().max()

    byte = get_tokenizer("byte")
    assert got["prompt_ids"] == byte.encode(PROMPT)
    tokens = generate(native, torch.tensor([got["prompt_ids"]]), N, eot_id=byte.eot_id)[0, len(got["prompt_ids"]):]
    assert got["new"] == tokens.tolist()
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", PROMPT, "--max-tokens", str(N),
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == got["text"]


def test_rope_pairs_are_llamas_rotate_half():
    """apply_rope rotates (x[:D/2], x[D/2:]) pairs: transformers' Llama rotate_half convention, not the
    interleaved (x[0::2], x[1::2]) pairs of GPT-J / Meta's original checkpoints."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from looped_lm.models.layers import RotaryEmbedding, apply_rope

    D, T, theta = 16, 64, 500.0
    q, k = torch.randn(2, 1, 4, T, D).unbind(0)
    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D,
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    cos_hf, sin_hf = LlamaRotaryEmbedding(cfg)(q, torch.arange(T)[None])
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cos, sin = RotaryEmbedding(D, T, theta)(torch.arange(T))
    assert torch.allclose(apply_rope(q, cos, sin), q_hf, atol=1e-5)
    assert torch.allclose(apply_rope(k, cos, sin), k_hf, atol=1e-5)
    x1, x2 = q[..., 0::2], q[..., 1::2]  # the interleaved convention rotates other pairs: the check tells them apart
    interleaved = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
    assert not torch.allclose(interleaved, q_hf, atol=1e-2)
