"""`looped_lm {prepare,train,eval,generate}` end to end: help, prepared files, eval numbers recomputed by
hand, generation determinism, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
import torch
import torch.nn.functional as F

from looped_lm import cli
from looped_lm.checkpoint import load_checkpoint
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.generate import generate


# ------------------------------------------------------------------------------------------------
# help


def test_console_script_help(clean_env):
    proc = subprocess.run(["looped_lm", "--help"], env=clean_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for verb in ("prepare", "train", "eval", "generate"):
        assert verb in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize("argv", [["--help"], ["prepare", "--help"], ["train", "--help"], ["eval", "--help"],
                                  ["generate", "--help"], ["--version"]])
def test_help_exits_zero(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: looped_lm") or out.startswith("looped_lm 0.")
    if argv[0] == "eval":
        assert "--stride" in out and "--json" in out
    if argv[0] == "generate":
        assert "--temperature" in out and "--seed" in out


def test_train_help_config_lists_fields(capsys):
    assert cli.main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "  lr (float, default 0.001)" in out and "  zero_stage (int, default 0)" in out
    assert "  bridge (" in out and "  cfg_scale (" in out and "  mean_recurrence (" in out  # every kind's
    assert cli.main(["train", "--help-config", "gpt"]) == 0  # one kind's: no diffusion field, no other kind's
    gpt = capsys.readouterr().out
    assert "  lr (" in gpt and "  activation_checkpointing (" in gpt
    assert "  bridge (" not in gpt and "  mean_recurrence (" not in gpt and "trains end to end" in gpt
    assert cli.main(["train", "--help-config", "db_ar"]) == 0
    db = capsys.readouterr().out
    assert "  layers_per_block (" in db and "  bridge (" in db and "  cfg_scale (" not in db


def test_unknown_verb_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["fly"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# prepare


def test_prepare_writes_bins_and_refuses_to_overwrite(tmp_path, capsys, one_line_error):
    text = "In the beginning was a small test corpus, written by a test.\nSecond line: ünïcödé.\n"
    src = tmp_path / "corpus.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "prepared"
    argv = ["prepare", "--source", str(src), "--out", str(out), "--tokenizer", "byte"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    # one document, cut at 95% of its tokens; the end-of-text token (256) closes it, in val
    raw = list(text.encode("utf-8")) + [256]
    assert list(train) + list(val) == raw
    assert len(train) == round((len(raw) - 1) * 0.95)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 257 and meta["eot_id"] == 256
    assert meta["splits"]["train"]["tokens"] == len(train) and meta["splits"]["val"]["tokens"] == len(val)
    assert f"train {len(train):,} tokens" in printed

    (out / "train.bin").write_bytes(b"")  # so that we can see whether a refused run touched anything
    assert cli.main(argv) == 2
    one_line_error(capsys.readouterr(), "already prepared", "--overwrite")
    assert (out / "train.bin").read_bytes() == b""
    assert cli.main(argv + ["--overwrite"]) == 0
    assert list(np.fromfile(out / "train.bin", dtype=np.uint16)) == list(train)


def test_prepare_bad_source_is_one_line(tmp_path, capsys, one_line_error):
    assert cli.main(["prepare", "--source", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o"),
                     "--tokenizer", "byte"]) == 2
    one_line_error(capsys.readouterr(), "does not exist")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------
# eval


def _val_tokens(ckpt: Path, limit: int) -> np.ndarray:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return np.fromfile(Path(manifest["data"]["dir"]) / "val.bin", dtype=np.uint16)[:limit].astype(np.int64)


def _nll_sum(model, windows: list[tuple[int, int]], tokens: np.ndarray, T: int) -> float:
    """Sum of -log p over the last `n` targets of each window starting at s: [(s, n), ...]."""
    x = torch.stack([torch.from_numpy(tokens[s:s + T]) for s, _ in windows])
    y = torch.stack([torch.from_numpy(tokens[s + 1:s + T + 1]) for s, _ in windows])
    with torch.no_grad():
        logits, _ = model(x)
    nll = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").double()  # (windows, T)
    return sum(float(row[T - n:].sum()) for row, (_, n) in zip(nll, windows))


def test_eval_json_table_and_hand_computed_perplexity(tiny_run, tmp_path, capsys):
    _, ckpt, _ = tiny_run
    out_json = tmp_path / "r" / "eval.json"
    N = 2000
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--json", str(out_json), "--max-tokens", str(N),
                     "--batch-size", "32", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out_json.read_text())
    assert {"ppl", "nll", "tokens", "block_size", "stride", "tokenizer"} <= set(rep)
    assert abs(rep["ppl"] - math.exp(rep["nll"])) <= 1e-9 * rep["ppl"]
    T = 16
    assert (rep["block_size"], rep["stride"], rep["tokenizer"], rep["protocol"]) == (T, T, "byte", "disjoint")
    n_blocks = (N - 1) // T  # 124 disjoint blocks, each scoring all of its 16 targets
    assert rep["tokens"] == n_blocks * T == 1984
    assert f"| exact | {rep['ppl']:.3f} |" in printed and "tokens 1984  block 16  stride 16" in printed

    model, _, _ = load_checkpoint(ckpt)
    tokens = _val_tokens(ckpt, N)
    nll = _nll_sum(model, [(i * T, T) for i in range(n_blocks)], tokens, T) / rep["tokens"]
    assert abs(rep["nll"] - nll) < 1e-5
    assert abs(rep["ppl"] - math.exp(nll)) < 1e-4 * rep["ppl"]
    assert rep["ppl"] < 257 and rep["ppl"] > 1.0  # a trained model beats uniform guessing


def test_eval_stride_scores_every_target_once(tiny_run, tmp_path, capsys):
    _, ckpt, _ = tiny_run
    N, T, S = 2000, 16, 8
    common = ["eval", "--checkpoint", str(ckpt), "--max-tokens", str(N), "--batch-size", "32", "--no-progress"]
    assert cli.main(common + ["--json", str(tmp_path / "d.json")]) == 0
    assert cli.main(common + ["--stride", str(S), "--json", str(tmp_path / "s.json")]) == 0
    capsys.readouterr()
    disjoint = json.loads((tmp_path / "d.json").read_text())
    strided = json.loads((tmp_path / "s.json").read_text())
    k = (N - 1 - T) // S + 1  # windows at 0, 8, ..., while s + T <= N - 1
    assert strided["tokens"] == T + (k - 1) * S == 1992
    assert (strided["stride"], strided["protocol"]) == (S, "strided")
    assert strided["ppl"] != disjoint["ppl"]
    model, _, _ = load_checkpoint(ckpt)
    windows = [(0, T)] + [(i * S, S) for i in range(1, k)]
    nll = _nll_sum(model, windows, _val_tokens(ckpt, N), T) / strided["tokens"]
    assert abs(strided["nll"] - nll) < 1e-5
    assert abs(strided["ppl"] - math.exp(strided["nll"])) <= 1e-9 * strided["ppl"]


def test_eval_errors_are_one_line(tiny_run, tmp_path, capsys, one_line_error):
    _, ckpt, _ = tiny_run
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00" * 40 + b"\x07")
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--data", str(odd), "--no-progress"]) == 2
    one_line_error(capsys.readouterr(), "odd byte length", "odd.bin")
    assert cli.main(["eval", "--checkpoint", str(tmp_path / "no_such_ckpt"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    one_line_error(captured, "checkpoint directory not found", "no_such_ckpt")
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--stride", "99", "--no-progress"]) == 2
    one_line_error(capsys.readouterr(), "--stride")
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--num-iterations", "2", "--no-progress"]) == 2
    one_line_error(capsys.readouterr(), "--num-iterations")
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--block-size", "65", "--no-progress"]) == 2
    one_line_error(capsys.readouterr(), "--block-size 65", "64 positions")


# ------------------------------------------------------------------------------------------------
# generate


def _generate(capsys, ckpt, *extra) -> str:
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "And God said", "--max-tokens", "24",
                     *extra]) == 0
    return capsys.readouterr().out


def test_generate_is_seeded_and_starts_with_the_prompt(tiny_run, capsys):
    _, ckpt, _ = tiny_run
    a = _generate(capsys, ckpt, "--seed", "3", "--temperature", "1.0")
    b = _generate(capsys, ckpt, "--seed", "3", "--temperature", "1.0")
    c = _generate(capsys, ckpt, "--seed", "4", "--temperature", "1.0")
    assert a.startswith("And God said") and a.endswith("\n")
    assert a == b and a != c
    assert len(a) > len("And God said\n")


def test_generate_temperature_zero_is_the_greedy_continuation(tiny_run, capsys):
    _, ckpt, _ = tiny_run
    a = _generate(capsys, ckpt, "--temperature", "0", "--seed", "1")
    b = _generate(capsys, ckpt, "--temperature", "0", "--seed", "2")
    assert a == b
    model, _, _ = load_checkpoint(ckpt)
    tok = get_tokenizer("byte")
    ids = tok.encode("And God said")
    out = generate(model, torch.tensor([ids]), 24, eot_id=tok.eot_id)[0, len(ids):].tolist()
    if tok.eot_id in out:
        out = out[:out.index(tok.eot_id)]
    assert a == "And God said" + tok.decode(out) + "\n"


def test_generate_errors_are_one_line(tiny_run, tmp_path, capsys, one_line_error):
    _, ckpt, _ = tiny_run
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--temperature", "-1"]) == 2
    one_line_error(capsys.readouterr(), "temperature")
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--max-tokens", "100"]) == 2
    one_line_error(capsys.readouterr(), "64 positions")
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--num-iterations", "4"]) == 2
    one_line_error(capsys.readouterr(), "num_iterations", "no K")
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x"]) == 2
    one_line_error(capsys.readouterr(), "checkpoint directory not found")


def test_eval_finds_the_run_data_from_another_directory(tmp_path, write_config, monkeypatch, capsys):
    """With the default relative `data.cache_dir` ("data_cache"), the manifest must still locate val.bin
    when `looped_lm eval` runs from another working directory (the checkpoint is given by absolute path)."""
    from looped_lm import trainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "train_here").mkdir()
    (tmp_path / "eval_here").mkdir()
    monkeypatch.chdir(tmp_path / "train_here")
    cfg = write_config(tmp_path / "run.yaml", {
        "data": {"source": "files", "path": str(corpus), "cache_dir": "data_cache"},
        "train": {"out_dir": "out"}})
    assert trainer.main(["--config", str(cfg)]) == 0
    ckpt = (tmp_path / "train_here" / "out" / "step_0000002").resolve()
    monkeypatch.chdir(tmp_path / "eval_here")
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--no-progress"]) == 0, capsys.readouterr().err
    assert "| exact |" in capsys.readouterr().out


def test_eval_zero_batch_size_is_one_line(tiny_run, capsys, one_line_error):
    """`--batch-size 0` is bad input: one `error:` line naming the flag, not a ValueError traceback from
    range(0, n, 0) inside eval.perplexity."""
    _, ckpt, _ = tiny_run
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--batch-size", "0", "--max-tokens", "500",
                     "--no-progress"]) == 2
    one_line_error(capsys.readouterr(), "--batch-size")


# ------------------------------------------------------------------------------------------------
# what the CLI imports and prints


def test_help_and_flag_errors_import_no_heavy_library(tmp_path, clean_env):
    """`looped_lm --help`, a verb's --help and a mistyped flag answer without importing torch, DeepSpeed or
    transformers (each costs seconds). Measured as the set of imported modules, in one fresh process."""
    script = f"""
import json, sys
from looped_lm import cli
heavy = ("torch", "deepspeed", "transformers")
found = {{}}
for argv in {[["--help"], ["fly"], ["train", "--help"], ["train", "--bogus"], ["generate", "--bogus"],
              ["prepare", "--bogus"], ["export", "--bogus"], ["serve", "--bogus"], ["eval", "--bogus"],
              ["eval", "--help"], ["merge", "--help"], ["verify", "--help"], ["generate", "--help"],
              ["train", "--config", str(tmp_path / "missing.yaml")], ["train", "--set", "train.lrr=1"]]!r}:
    try:
        cli.main(argv)
    except SystemExit:
        pass
    found[" ".join(argv)] = sorted({{m.split(".")[0] for m in sys.modules}} & set(heavy))
print(json.dumps(found))
"""
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found and all(mods == [] for mods in found.values()), found
    assert "error: config file not found" in proc.stderr and "unknown config key 'train.lrr'" in proc.stderr


def test_the_launcher_beside_the_interpreter_comes_first(tmp_path, monkeypatch, one_line_error):
    from looped_lm import launch
    from looped_lm.errors import UserError

    venv_bin, other_bin = tmp_path / "venv" / "bin", tmp_path / "other"
    for d in (venv_bin, other_bin):
        d.mkdir(parents=True)
        (d / "deepspeed").write_text("#!/bin/sh\n")
        (d / "deepspeed").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(other_bin))
    assert launch.find_launcher() == str(venv_bin / "deepspeed")  # not activated, not on PATH: still found
    (venv_bin / "deepspeed").unlink()
    assert launch.find_launcher() == str(other_bin / "deepspeed")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="neither beside this Python .* nor on PATH"):
        launch.find_launcher()


def test_launcher_noise_is_filtered():
    from looped_lm import launch

    noise = [
        "[2026-12-01 12:04:28,966] [WARNING] [runner.py:214:fetch_hostfile] Unable to find hostfile, will proceed\n",
        "[2026-12-01 12:04:32,298] [INFO] [launch.py:174:main] Setting CUDA_VISIBLE_DEVICES=0\n",
        "[2026-12-01 12:04:47,894] [ERROR] [launch.py:259:sigkill_handler] ['python'] exits with return code = 2\n",
        "[2026-12-01 12:04:30,000] [INFO] [config.py:1000:print] DeepSpeedEngine configuration:\n",
    ]
    kept = ["step 250: train loss b0 3.2100 b1 0.1500, val loss 1.6012\n",
            "[2026-12-01 12:04:30,000] [WARNING] [engine.py:10:init] a real warning from a rank\n",
            "resumed from out/step_0000004 at step 4\n"]
    assert [launch.is_noise(line) for line in noise] == [True] * len(noise)
    assert [launch.is_noise(line) for line in kept] == [False] * len(kept)
    assert launch.command(2, 1234, ["--config", "x.yaml"], verbose=False)[-5:] == \
        ["error", "--module", "looped_lm.train", "--config", "x.yaml"]
    assert "info" in launch.command(2, 1234, [], verbose=True)


def test_warnings_are_one_plain_line(capsys):
    import warnings

    from looped_lm.console import plain_warnings

    with warnings.catch_warnings():
        plain_warnings()
        warnings.warn("num_iterations=1 < 2 blocks: block 1 never runs", UserWarning)
        warnings.warn_explicit("old API", DeprecationWarning, "site-packages/torch/x.py", 3, module="torch.x")
    err = capsys.readouterr().err
    assert err == "warning: num_iterations=1 < 2 blocks: block 1 never runs\n"  # the library's deprecation: hidden
    with warnings.catch_warnings():
        plain_warnings(verbose=True)
        warnings.warn_explicit("old API", DeprecationWarning, "site-packages/torch/x.py", 3, module="torch.x")
    assert capsys.readouterr().err == "warning: old API\n"


# ------------------------------------------------------------------------------------------------
# the README's commands, in the order written

README = Path(__file__).resolve().parents[1] / "README.md"
SCALE = 250  # README steps / these steps: 1000-step quickstarts become 4 steps, saves every 2
TINY = ["--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.seq_len=32",
        "--set", "train.batch_size=2", "--set", "train.max_steps=4", "--set", "train.save_every=2",
        "--set", "train.eval_every=2", "--set", "train.eval_batches=1", "--set", "train.warmup_steps=1",
        "--set", "train.progress=false"]
CURVE = ["--set", "diffusion.curve_every=2"]  # the kinds whose block sampling re-measures a curve


def readme_commands() -> list[str]:
    """The shell commands of the quickstart block and of the "Using it" block, in order, `&&` split."""
    text = README.read_text()
    quick = text[text.index("## Quickstart"):]
    using = text[text.index("## Using it"):]
    blocks = [re.search(r"```bash\n(.*?)```", part, re.S).group(1) for part in (quick, using)]
    commands = []
    for block in blocks:
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
            commands += [c.strip() for c in line.split("&&") if c.strip()]
    return commands


def scaled(command: str) -> list[str]:
    """The command at tiny size: README step numbers / SCALE, tiny model flags on every training run."""
    command = re.sub(r"max_steps=(\d+)", lambda m: f"max_steps={int(m.group(1)) // SCALE}", command)
    command = re.sub(r"step_(\d{7})", lambda m: f"step_{int(m.group(1)) // SCALE:07d}", command)
    command = re.sub(r"--max-tokens (\d{4,})", "--max-tokens 256", command)  # eval's 8192: 256 here
    argv = shlex.split(command)
    if argv[:2] == ["looped_lm", "train"] and "--help-config" not in argv:
        argv[2:2] = TINY + _curve(argv)  # before the README's own --set: its values win
    if "looped_lm/train.py" in argv:
        at = argv.index("looped_lm/train.py") + 1
        argv[at:at] = TINY + _curve(argv)
    return argv


def _curve(argv: list[str]) -> list[str]:
    """diffusion.curve_every for a config whose kind has it (a gpt config refuses diffusion fields)."""
    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    kind = (yaml.safe_load((README.parent / config).read_text()) or {}).get("model", {}).get("kind") if config else None
    return CURVE if kind in ("db_ar", "looped_db") else []


@pytest.mark.slow
def test_the_readme_commands_hold_in_the_order_written(tmp_path, monkeypatch, clean_env, capsys):
    """Every `looped_lm` command of the quickstart and "Using it" blocks, top to bottom, in one working
    directory (tiny model, steps / 250): each exits 0 (about 5 launches of the trainer: minutes; 21 on a
    machine loaded 5x over). Skipped: pip, GPU-only recipes (configs/paper_*, whose
    data is not here) and model.init_from (a local Hugging Face directory)."""
    uvicorn = pytest.importorskip("uvicorn")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)  # serve: everything up to binding
    (tmp_path / "configs").symlink_to(README.parent / "configs")
    (tmp_path / "looped_lm").symlink_to(README.parent / "looped_lm")
    monkeypatch.chdir(tmp_path)
    ran = []
    for command in readme_commands():
        if command.startswith("pip ") or "configs/paper_" in command or "init_from" in command:
            continue
        argv = scaled(command)
        if argv[0] == "looped_lm":
            code = cli.main(argv[1:])
        else:  # `DS_ACCELERATOR=cpu deepspeed ... looped_lm/train.py`: the launcher itself
            env = dict(clean_env)
            while "=" in argv[0]:
                key, _, value = argv.pop(0).partition("=")
                env[key] = value
            launcher = Path(sys.executable).parent / argv[0]
            proc = subprocess.run([str(launcher), *argv[1:]], env=env, capture_output=True, text=True, timeout=600)
            code = proc.returncode
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
        assert code == 0, (command, capsys.readouterr().err[-3000:])
        ran.append(argv[:2])
    assert len(ran) >= 12, ran  # train, generate, prepare, resume, 2 ranks, verify, eval, looped, serve, export...
    assert (tmp_path / "out" / "quickstart_db" / "step_0000004").is_dir()  # the quickstart's checkpoint survived
    assert (tmp_path / "hf" / "quickstart_db" / "config.json").is_file()


@pytest.mark.parametrize("kind", ["gpt", "db_ar"])
def test_eval_scores_the_test_split_of_a_run_prepared_with_one(kind, tmp_path, write_config, capsys, one_line_error):
    """data.test_fraction holds out a test split that training never reads; `eval --split test` scores it
    (gpt: recomputed by hand on test.bin; db_ar at K = 2 through the same path), and a run without one,
    or --split with --data, is one line."""
    from looped_lm import trainer

    model = {"kind": kind, "n_layers": 2} if kind == "db_ar" else {}
    cfg = write_config(tmp_path / "run.yaml", {
        "model": model, "diffusion": {"num_blocks": 2} if kind == "db_ar" else {},
        "data": {"test_fraction": 0.1, "cache_dir": str(tmp_path / "cache")}, "train": {"out_dir": str(tmp_path / "out")}})
    assert trainer.main(["--config", str(cfg)]) == 0
    ckpt = tmp_path / "out" / "step_0000002"
    data_dir = Path(json.loads((ckpt / "manifest.json").read_text())["data"]["dir"])
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["splits"]["test"]["documents"] >= 1 and (data_dir / "test.bin").is_file()
    N, T = 400, 16
    args = ["eval", "--checkpoint", str(ckpt), "--max-tokens", str(N), "--no-progress"]
    k = ["--num-iterations", "2", "--draws", "2"] if kind == "db_ar" else []
    assert cli.main(args + k + ["--split", "test", "--json", str(tmp_path / "t.json")]) == 0
    assert cli.main(args + k + ["--json", str(tmp_path / "v.json")]) == 0
    capsys.readouterr()
    test, val = (json.loads((tmp_path / f"{s}.json").read_text()) for s in ("t", "v"))
    assert test["data"].endswith("test.bin") and val["data"].endswith("val.bin")
    if kind == "gpt":
        m, _, _ = load_checkpoint(ckpt)
        tokens = np.fromfile(data_dir / "test.bin", dtype=np.uint16)[:N].astype(np.int64)
        n_windows = (N - 1) // T
        assert abs(test["nll"] - _nll_sum(m, [(i * T, T) for i in range(n_windows)], tokens, T) / test["tokens"]) < 1e-5
        assert test["ppl"] != val["ppl"]
    else:
        assert test["ppl_at_k"]["2"] != val["ppl_at_k"]["2"] and "0" in test["ppl_at_k"]
    assert cli.main(args + ["--split", "test", "--data", str(data_dir / "val.bin")]) == 2
    one_line_error(capsys.readouterr(), "--split test", "--data")


def test_eval_split_test_without_a_test_split_is_one_line(tiny_run, capsys, one_line_error):
    _, ckpt, _ = tiny_run
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--split", "test", "--no-progress"]) == 2
    one_line_error(capsys.readouterr(), "has no test split", "data.test_fraction")
