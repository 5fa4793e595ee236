"""The edges a hostile user finds (issue 24): every case ends in ONE line naming the problem, with exit code
2 for bad input (checked before the launcher starts, a model loads or a server binds, wherever the value
is known then) and 1 for a failure mid-run; nothing half-written. One table, one row per case."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from looped_lm import cli

REPO = Path(__file__).resolve().parents[1]
DB = {"model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
      "diffusion": {"num_blocks": 2}}


@pytest.fixture(scope="module")
def db_ckpt(tmp_path_factory, write_config):
    """A 2-step DB-AR checkpoint (B = 2, K up to model.max_iterations = 64)."""
    from looped_lm import trainer

    root = tmp_path_factory.mktemp("edges_db")
    cfg = write_config(root / "run.yaml", {**DB, "train": {"out_dir": str(root / "out")}})
    assert trainer.main(["--config", str(cfg)]) == 0
    return root / "out" / "step_0000002"


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def no_server(no_uvicorn):
    """serve must refuse before it binds (conftest's no_uvicorn)."""


def _non_utf8(tmp: Path) -> str:
    path = tmp / "latin1.txt"
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    return str(path)


def _run_dir(tmp: Path) -> str:
    run = tmp / "run"
    (run / "step_0000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    return str(run)


def _a_file(tmp: Path) -> str:
    (tmp / "a_file").write_text("x")
    return str(tmp / "a_file")


def _yaml(tmp: Path, name: str, text: str) -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


def _loop(tmp: Path) -> Path:
    """A symlink to itself: every path through it fails with ELOOP."""
    (tmp / "loop").symlink_to(tmp / "loop")
    return tmp / "loop"


BIG = 2 ** 70  # 1180591620717411303424
QUICKSTART_DB = str(REPO / "configs/quickstart_db.yaml")


# case: (argv builder (gpt checkpoint, db checkpoint, config, tmp dir, port) -> argv, exit code, fragments)
# `gpt` is a 30-step byte-level GPT, `db` a 2-step DB-AR (B = 2), `cfg` the gpt run's config
CASES = {
    # train: refused by the config's validators or preflight, before the launcher starts
    "train.eval_batches=0": (lambda g, d, c, t, p: ["train", "--config", c, "--set", "train.eval_batches=0"],
                             2, ["train.eval_batches must be >= 1"]),
    "train.seed=2**70": (lambda g, d, c, t, p: ["train", "--config", c, "--set", f"train.seed={2 ** 70}"],
                         2, ["train.seed must be in 0..2**62 - 1"]),
    "data.cache_dir is a file": (lambda g, d, c, t, p: ["train", "--config", c, "--set",
                                                        f"data.cache_dir={_a_file(t)}"],
                                 2, ["data.cache_dir", "is a file, not a directory"]),
    "--master-port -5": (lambda g, d, c, t, p: ["train", "--config", c, "--master-port", "-5"],
                         2, ["--master-port must be in 1..65535"]),
    "train --config DIR": (lambda g, d, c, t, p: ["train", "--config", str(t)], 2, ["is a directory", "YAML"]),
    "block_parallel, 1 rank for 2 blocks, network_gain": (
        lambda g, d, c, t, p: ["train", "--config", str(REPO / "configs/quickstart_db.yaml"), "--nproc", "1",
                               "--set", "train.mode=block_parallel", "--set", f"train.out_dir={t / 'bp'}"],
        2, ["block_sampling network_gain (the default)", "diffusion.block_sampling=uniform"]),
    # B: values that used to end in a traceback
    "train.grad_accum=2**70": (lambda g, d, c, t, p: ["train", "--config", c, "--set", f"train.grad_accum={BIG}"],
                               2, ["train.grad_accum must be in 1..2147483647", str(BIG)]),
    "model.vocab_size=10**9 (memory estimate)": (
        lambda g, d, c, t, p: ["train", "--config", c, "--set", "model.vocab_size=1000000000"],
        2, ["the model needs about 476.8 GiB", "AdamW state", "more than the", "model.vocab_size (1,000,000,000)"]),
    "YAML self-referencing anchor": (lambda g, d, c, t, p: ["train", "--config", _yaml(t, "a.yaml", "a: &x [*x]\n")],
                                     2, ["a.yaml", "self-referencing anchor"]),
    "--set with a self-referencing anchor": (
        lambda g, d, c, t, p: ["train", "--config", c, "--set", "train.lora_targets=&x [*x]"],
        2, ["--set train.lora_targets", "self-referencing anchor"]),
    "YAML 5000-digit integer": (lambda g, d, c, t, p: ["train", "--config",
                                                       _yaml(t, "big.yaml", "train:\n  seed: " + "9" * 5000 + "\n")],
                                2, ["big.yaml", "an integer has more than 4300 digits"]),
    "--set a 5000-digit integer": (lambda g, d, c, t, p: ["train", "--config", c, "--set", "train.seed=" + "9" * 5000],
                                   2, ["--set train.seed", "more than 4300 digits"]),
    # C: a bound instead of a silent hang
    "eval --draws 10**9": (lambda g, d, c, t, p: ["eval", "--checkpoint", d, "--draws", "1000000000"], 2,
                           ["--draws must be in 1..4096 (got 1000000000)"]),
    # D: output paths checked before the work starts (exit 2, not 1 after it)
    "data.cache_dir a symlink loop": (lambda g, d, c, t, p: ["train", "--config", c, "--set",
                                                             f"data.cache_dir={_loop(t) / 'cache'}"],
                                      2, ["data.cache_dir", "is a symlink loop"]),
    "data.cache_dir under /proc": (lambda g, d, c, t, p: ["train", "--config", c, "--set",
                                                          "data.cache_dir=/proc/looped_lm_cache"],
                                   2, ["data.cache_dir /proc/looped_lm_cache: cannot write into /proc"]),
    "eval --json under /proc": (lambda g, d, c, t, p: ["eval", "--checkpoint", g, "--json", "/proc/looped_lm.json"],
                                2, ["--json /proc/looped_lm.json: cannot write into /proc"]),
    "eval --json through a symlink loop": (lambda g, d, c, t, p: ["eval", "--checkpoint", g, "--json",
                                                                  str(_loop(t) / "r.json")],
                                           2, ["--json", "loop is a symlink loop"]),
    "export --out through a symlink loop": (lambda g, d, c, t, p: ["export", "--checkpoint", g, "--out",
                                                                   str(_loop(t) / "hf")],
                                            2, ["--out", "loop is a symlink loop"]),
    "merge --out under /proc": (lambda g, d, c, t, p: ["merge", d, "--out", "/proc/looped_lm_merged"], 2,
                                ["--out /proc/looped_lm_merged: cannot write into /proc"]),
    # E: silently accepted before
    "diffusion.num_iterations=2**70": (lambda g, d, c, t, p: ["train", "--config", QUICKSTART_DB, "--set",
                                                              f"diffusion.num_iterations={BIG}"],
                                       2, ["diffusion.num_iterations must be <= model.max_iterations (64)"]),
    "model.max_iterations=2**70": (lambda g, d, c, t, p: ["train", "--config", QUICKSTART_DB, "--set",
                                                          f"model.max_iterations={BIG}"],
                                   2, ["model.max_iterations must be in 1..4096"]),
    "train.lora_targets=[bogus] without LoRA": (
        lambda g, d, c, t, p: ["train", "--config", c, "--set", "train.lora_targets=[qkv, bogus]"],
        2, ["train.lora_targets has 'bogus'", "qkv, proj, gate_up, down"]),
    "a config with a NUL byte": (lambda g, d, c, t, p: ["train", "--config", _yaml(t, "nul.yaml",
                                                                                  "train:\n  seed: 1\0\n")],
                                 2, ["nul.yaml is not valid YAML", "#x0000"]),
    "eval --cfg-scale on a db_ar checkpoint": (lambda g, d, c, t, p: ["eval", "--checkpoint", d, "--cfg-scale", "2"],
                                               2, ["--cfg-scale", "for dit", "model.kind db_ar"]),
    "eval --features on a gpt checkpoint": (lambda g, d, c, t, p: ["eval", "--checkpoint", g, "--features", d],
                                            2, ["--features", "model.kind gpt"]),
    # eval: flags checked before the checkpoint is read; K by the model's bound
    "eval --json DIR": (lambda g, d, c, t, p: ["eval", "--checkpoint", g, "--json", str(t)], 2,
                        ["--json", "is a directory"]),
    "eval --device bogus": (lambda g, d, c, t, p: ["eval", "--checkpoint", g, "--device", "bogus"], 2,
                            ["--device 'bogus' is not a device"]),
    "eval --num-iterations 1,,2": (lambda g, d, c, t, p: ["eval", "--checkpoint", d, "--num-iterations", "1,,2"],
                                   2, ["--num-iterations must be comma-separated integers", "1,,2"]),
    "eval --num-iterations 100000": (lambda g, d, c, t, p: ["eval", "--checkpoint", d, "--num-iterations",
                                                            "2,100000"], 2, ["100000 is outside 0..64"]),
    "eval --data non-UTF-8": (lambda g, d, c, t, p: ["eval", "--checkpoint", g, "--data", _non_utf8(t)], 2,
                              ["latin1.txt is not UTF-8 text"]),
    "eval --candidates 0": (lambda g, d, c, t, p: ["eval", "--checkpoint", d, "--candidates", "0"], 2,
                            ["--candidates must be >= 1"]),
    "eval --max-tokens -1": (lambda g, d, c, t, p: ["eval", "--checkpoint", g, "--max-tokens", "-1"], 2,
                             ["--max-tokens must be >= 0 (got -1)"]),
    # generate
    "generate --num-samples -3": (lambda g, d, c, t, p: ["generate", "--checkpoint", g, "--prompt", "A",
                                                         "--num-samples", "-3"], 2, ["--num-samples must be >= 1"]),
    "generate --num-samples on a language model": (
        lambda g, d, c, t, p: ["generate", "--checkpoint", g, "--prompt", "A", "--num-samples", "3"], 2,
        ["--num-samples", "for dit / mdm"]),
    "generate --exit-threshold without adaptive exit": (
        lambda g, d, c, t, p: ["generate", "--checkpoint", g, "--prompt", "A", "--exit-threshold", "0.1"], 2,
        ["exit_rule", "no K"]),
    "generate --exit-threshold at the db_ar default K = B = 2 (it cannot cut a step)": (
        lambda g, d, c, t, p: ["generate", "--checkpoint", d, "--prompt", "A", "--exit-threshold", "0.1"], 2,
        ["--exit-threshold: does nothing at K = 2", "db_ar", "--num-iterations above 2"]),
    "generate --num-iterations 65": (lambda g, d, c, t, p: ["generate", "--checkpoint", d, "--prompt", "A",
                                                            "--num-iterations", "65"], 2, ["1..64"]),
    "generate: a prompt longer than the context": (
        lambda g, d, c, t, p: ["generate", "--checkpoint", g, "--prompt", "a" * 80, "--max-tokens", "2"], 2,
        ["--prompt is 80 tokens", "64"]),
    # export, prepare, verify
    "export --out /proc/x": (lambda g, d, c, t, p: ["export", "--checkpoint", g, "--out", "/proc/looped_lm_x"], 2,
                             ["--out /proc/looped_lm_x: cannot write into /proc"]),
    "prepare --out a run directory": (lambda g, d, c, t, p: ["prepare", "--source", "bible", "--tokenizer", "byte",
                                                             "--out", _run_dir(t)],
                                      2, ["not a prepared dataset", "--overwrite"]),
    "prepare a non-UTF-8 source": (lambda g, d, c, t, p: ["prepare", "--source", _non_utf8(t), "--tokenizer", "byte",
                                                          "--out", str(t / "data")], 2, ["is not UTF-8"]),
    "verify a missing directory": (lambda g, d, c, t, p: ["verify", str(t / "nope")], 2,
                                   ["checkpoint directory not found"]),
    # serve: every check before the model loads (or, for K against the model, before it binds)
    "serve --default-iterations 0": (lambda g, d, c, t, p: ["serve", "--checkpoint", d, "--default-iterations", "0"],
                                     2, ["--default-iterations must be >= 1"]),
    "serve --default-iterations 65": (lambda g, d, c, t, p: ["serve", "--checkpoint", d, "--default-iterations",
                                                             "65"], 2, ["--default-iterations 65 is outside 1..64"]),
    "serve on a port in use": (lambda g, d, c, t, p: ["serve", "--checkpoint", g, "--port", str(p)], 2,
                               ["already in use"]),
    "serve on an unresolvable host": (lambda g, d, c, t, p: ["serve", "--checkpoint", g, "--host",
                                                             "no-such-host.invalid"], 2, ["does not resolve"]),
    "serve --device bogus": (lambda g, d, c, t, p: ["serve", "--checkpoint", g, "--device", "bogus"], 2,
                             ["--device 'bogus'"]),
}
if torch.cuda.is_available():
    CASES["eval --device cuda:99"] = (lambda g, d, c, t, p: ["eval", "--checkpoint", g, "--device", "cuda:99"],
                                      2, ["--device cuda:99", "CUDA device"])
else:
    CASES["eval --device cuda without CUDA"] = (lambda g, d, c, t, p: ["eval", "--checkpoint", g, "--device", "cuda"],
                                                2, ["--device cuda: no CUDA device is available here"])


@pytest.mark.parametrize("case", list(CASES))
def test_every_edge_is_one_line(case, tiny_run, db_ckpt, tmp_path, taken_port, no_server, capsys, one_line_error):
    build, code, fragments = CASES[case]
    cfg, gpt, _ = tiny_run
    work = tmp_path / "work"
    work.mkdir()
    argv = build(str(gpt), str(db_ckpt), str(cfg), work, taken_port)
    before = sorted(p.name for p in work.rglob("*"))
    assert cli.main(argv) == code
    captured = capsys.readouterr()
    line = one_line_error(captured, *fragments)
    assert captured.err.strip() == line, captured.err  # the error line alone: no progress bar, no usage, no log
    after = sorted(p.name for p in work.rglob("*"))
    assert after == before, f"{case} left {set(after) - set(before)}"  # nothing half-written


def test_the_models_k_bound_is_one_rule(db_ckpt, capsys):
    """eval accepts exactly the K generate accepts: 1..model.max_iterations (and ppl@0)."""
    from looped_lm.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(db_ckpt)
    top = model.iteration_limits().max_iterations
    base = ["--checkpoint", str(db_ckpt)]
    assert cli.main(["generate", *base, "--prompt", "A", "--max-tokens", "1", "--num-iterations", str(top)]) == 0
    assert cli.main(["eval", *base, "--max-tokens", "32", "--draws", "1", "--no-progress",
                     "--num-iterations", f"0,{top}"]) == 0
    capsys.readouterr()
    for verb in (["generate", *base, "--prompt", "A"], ["eval", *base]):
        assert cli.main([*verb, "--num-iterations", str(top + 1)]) == 2
        err = capsys.readouterr().err
        assert f"1..{top}" in err or f"0..{top}" in err, err


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--checkpoint"], "argument --checkpoint: expected one argument"),
    (["evaluate"], "invalid choice: 'evaluate'"),
    (["eval", "--checkpoint", "x", "--draws", "many"], "argument --draws: invalid int value: 'many'"),
    (["eval", "--checkpoint", "x", "--seed", str(2 ** 70)], "argument --seed: must be in 0..2**62 - 1"),
    (["generate", "--checkpoint", "x", "--seed", str(2 ** 70)], "argument --seed: must be in 0..2**62 - 1"),
    (["eval", "--checkpoint", "x", "--cfg-scale", "nan"], "argument --cfg-scale: must be a finite number"),
    (["generate", "--checkpoint", "x", "--temperature", "inf"], "argument --temperature: must be a finite number"),
    (["generate", "--checkpoint", "x", "--exit-threshold", "nan"], "argument --exit-threshold: must be a finite"),
    (["generate", "--checkpoint", "x", "--cfg-scale=-inf"], "argument --cfg-scale: must be a finite number"),
])
def test_argparse_errors_are_one_line_and_point_to_help(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err and "--help`" in err
    assert "usage:" not in err


def test_block_parallel_on_the_quickstart_when_each_rank_owns_one_block():
    """network_gain (the default) is moot with one block per rank (B ranks): not refused; with fewer ranks the message
    names the value to set."""
    from looped_lm.config import load_config
    from looped_lm.errors import UserError
    from looped_lm.parallel import check_world

    cfg = load_config(str(REPO / "configs/quickstart_db.yaml"), ["train.mode=block_parallel"])
    assert cfg.diffusion.block_sampling == "network_gain"
    for world in (2, 4):  # B = 2 blocks: one per rank, or two ranks per block
        check_world(cfg, world)
    with pytest.raises(UserError, match="diffusion.block_sampling=uniform"):
        check_world(cfg, 1)
    check_world(load_config(str(REPO / "configs/quickstart_db.yaml"),
                            ["train.mode=block_parallel", "diffusion.block_sampling=uniform"]), 1)


def test_a_killed_rank_and_a_lost_peer_are_one_line(capsys):
    from looped_lm.launch import killed_rank
    from looped_lm.trainer import lost_peer

    assert killed_rank(256 - 9) == 1  # the launcher's exit status for a rank killed by SIGKILL
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "killed by SIGKILL" in err and "resumes" in err
    assert killed_rank(2) == 2 and killed_rank(0) == 0 and not capsys.readouterr().err
    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:16810: Connection reset by peer. This is typically caused by a remote worker")
    assert lost_peer(gloo) == "Read error [127.0.0.1]:16810: Connection reset by peer"
    assert lost_peer(RuntimeError("shapes do not match")) is None


def test_a_full_disk_under_tensorboard_is_one_error_naming_the_directory(tmp_path, capsys):
    """TensorBoard's writer thread fails (ENOSPC): no thread traceback; the next log() raises an OSError
    naming the tb directory, which the trainer prints as one line, exit 1."""
    import errno
    import time

    from looped_lm.trainer import MetricsLogger

    log = MetricsLogger(tmp_path, 0, 0)
    writer = log.tb._get_file_writer().event_writer._async_writer._writer

    def full(data):
        raise OSError(errno.ENOSPC, "No space left on device")
    writer.write = full
    with pytest.raises(OSError) as err:
        for step in range(1, 50):
            log.log(step, {"loss": 1.0})
            time.sleep(0.05)
    assert err.value.filename == str(tmp_path / "tb") and err.value.errno == errno.ENOSPC
    assert "Traceback" not in capsys.readouterr().err
