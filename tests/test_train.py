"""The DeepSpeed trainer: exact resume, gradient accumulation, resume checks, the real launcher on 2 ranks,
logs, and data errors.

`reference_run` replays the trainer's arithmetic in plain PyTorch (same init seed, same stateless batches
per (seed, step, micro, rank), gradients averaged over ranks and micro-batches, global-norm clipping,
AdamW with the cosine schedule). The losses DeepSpeed logs must match it step by step: that is what
"ZeRO 1/2 on 2 gloo ranks and gradient accumulation are correct" means in numbers.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from looped_lm import checkpoint as ckpt_io
from looped_lm import trainer
from looped_lm.config import load_config
from looped_lm.data.batches import data_source_string
from looped_lm.data.bin_dataset import TokenStream
from looped_lm.data.prepare import ensure_prepared
from looped_lm.models import build_model
from looped_lm.optim import cosine_with_warmup, param_groups


def metrics(out: Path, key: str = "loss") -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def reference_run(cfg_path: Path, steps: int, world: int = 1, sets=()):
    """(rank-0 loss per step, final model) of the trainer's algorithm, replayed without DeepSpeed."""
    cfg = load_config(str(cfg_path), list(sets))
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, 257)
    opt = _adamw(cfg, model)
    return _replay(cfg, model, opt, 0, steps, world)


def reference_continue(cfg_path: Path, ckpt: Path, steps: int, world: int = 1, sets=()):
    """The same, for `steps` more steps from checkpoint `ckpt`: its weights, and its AdamW moments and step
    count read straight from optimizer/shared.safetensors (one optimiser unit: a gpt model)."""
    cfg = load_config(str(cfg_path), list(sets))
    model = build_model(cfg, 257)
    model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)  # the head is tied
    opt = _adamw(cfg, model)
    with safe_open(str(ckpt / "optimizer" / "shared.safetensors"), "pt") as f:
        unit_step = int(f.metadata()["step"])
        for name, p in model.named_parameters():
            opt.state[p] = {"step": torch.tensor(float(unit_step)), "exp_avg": f.get_tensor(f"exp_avg/{name}"),
                            "exp_avg_sq": f.get_tensor(f"exp_avg_sq/{name}")}
    start = json.loads((ckpt / "manifest.json").read_text())["step"]
    return _replay(cfg, model, opt, start, start + steps, world)


def _adamw(cfg, model):
    t = cfg.train
    return torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                             foreach=False)


def _replay(cfg, model, opt, start: int, end: int, world: int):
    t = cfg.train
    data_dir = Path(ensure_prepared(data_source_string(cfg), cfg.data.cache_dir, cfg.data.tokenizer,
                                    cfg.data.val_fraction, t.seed, progress=False))
    stream = TokenStream(str(data_dir / "train.bin"), cfg.model.seq_len)
    losses = []
    for step in range(start, end):
        for group in opt.param_groups:
            group["lr"] = cosine_with_warmup(step, t.warmup_steps, t.max_steps, t.lr, t.min_lr)
        opt.zero_grad()
        rank0 = 0.0
        for rank in range(world):
            for micro in range(t.grad_accum):
                x, y = stream.get_batch(t.batch_size, t.seed, step, micro, rank)
                _, loss = model(x, y)
                (loss / (t.grad_accum * world)).backward()
                if rank == 0:
                    rank0 += loss.item() / t.grad_accum
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        losses.append(rank0)
    return losses, model


def test_cosine_schedule_values():
    assert cosine_with_warmup(0, 4, 20, 1.0, 0.1) == pytest.approx(1 / 5)
    assert cosine_with_warmup(3, 4, 20, 1.0, 0.1) == pytest.approx(4 / 5)
    assert cosine_with_warmup(4, 4, 20, 1.0, 0.1) == pytest.approx(1.0)
    assert cosine_with_warmup(12, 4, 20, 1.0, 0.1) == pytest.approx(0.55)  # halfway: the mean of lr and min
    assert cosine_with_warmup(20, 4, 20, 1.0, 0.1) == pytest.approx(0.1)
    assert cosine_with_warmup(99, 4, 20, 1.0, 0.1) == pytest.approx(0.1)


# ------------------------------------------------------------------------------------------------
# (1) resume exactness


def test_resume_is_exact(tmp_path, write_config, capsys):
    overrides = {"max_steps": 8, "save_every": 4, "log_every": 1, "warmup_steps": 2, "lr": 1.0e-2, "min_lr": 1.0e-3}
    cfg_a = write_config(tmp_path / "a.yaml", {"train": {"out_dir": str(tmp_path / "a"), **overrides}})
    cfg_b = write_config(tmp_path / "b.yaml", {"train": {"out_dir": str(tmp_path / "b"), "resume": "auto",
                                                         **overrides}})
    assert trainer.main(["--config", str(cfg_a)]) == 0
    assert trainer.main(["--config", str(cfg_b), "--stop-after", "4"]) == 0
    assert [p.name for p in ckpt_io.list_checkpoints(tmp_path / "b")] == ["step_0000004"]
    assert [s for s, _ in metrics(tmp_path / "b")] == [1, 2, 3, 4]
    capsys.readouterr()
    assert trainer.main(["--config", str(cfg_b)]) == 0
    assert f"resumed from {tmp_path / 'b' / 'step_0000004'} at step 4" in capsys.readouterr().out

    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 9))  # no duplicated rows after resume
    for (step, la), (_, lb) in zip(a, b):
        assert abs(la - lb) <= 1e-6, (step, la, lb)
    assert metrics(tmp_path / "a", "lr") == metrics(tmp_path / "b", "lr")
    assert a[-1][1] < a[0][1]
    for step in ("step_0000004", "step_0000008"):
        wa = load_file(str(tmp_path / "a" / step / "model.safetensors"))
        wb = load_file(str(tmp_path / "b" / step / "model.safetensors"))
        assert set(wa) == set(wb)
        for name in wa:
            assert torch.equal(wa[name], wb[name]), (step, name)
    # the uninterrupted run is the trainer's algorithm, step for step
    ref, _ = reference_run(cfg_a, 8)
    for (step, got), want in zip(a, ref):
        assert abs(got - want) < 1e-5, (step, got, want)
    # a finished run resumed again trains nothing and keeps its curve
    assert trainer.main(["--config", str(cfg_b)]) == 0
    assert metrics(tmp_path / "b") == b


# ------------------------------------------------------------------------------------------------
# (2) gradient accumulation


@pytest.mark.slow
def test_grad_accum_matches_reference_and_loss_decreases(tmp_path, write_config):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "ga.yaml", {
        "model": {"seq_len": 32},
        "train": {"out_dir": str(out), "max_steps": 40, "batch_size": 8, "grad_accum": 2, "lr": 3.0e-3,
                  "warmup_steps": 5, "log_every": 1}})
    assert trainer.main(["--config", str(cfg)]) == 0
    got = metrics(out)
    assert [s for s, _ in got] == list(range(1, 41))
    losses = [v for _, v in got]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    # step 1 is the mean of two micro-batch losses at the initial weights; later steps need one optimiser
    # update per 2 micro-batches (not per micro-batch) to match
    ref, _ = reference_run(cfg, 40)
    for step, (g, r) in enumerate(zip(losses, ref), start=1):
        assert abs(g - r) < 1e-5, (step, g, r)
    tokens = metrics(out, "tokens")
    assert tokens[-1] == (40, 40 * 8 * 2 * 32)


def test_logged_lr_is_the_lr_of_that_step(tmp_path, write_config):
    """Row `step: s` reports the loss of the s-th update; its `lr` must be the one that update used,
    cosine_with_warmup(s - 1), read before engine.step() advances the schedule (reading it after the
    step reports the lr of the *next* step, and the last row always shows min_lr)."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "lr.yaml", {"train": {"out_dir": str(out), "max_steps": 4, "warmup_steps": 2,
                                                        "lr": 1.0e-2, "min_lr": 1.0e-3}})
    assert trainer.main(["--config", str(cfg)]) == 0
    want = [(s, cosine_with_warmup(s - 1, 2, 4, 1.0e-2, 1.0e-3)) for s in range(1, 5)]
    got = metrics(out, "lr")
    assert [s for s, _ in got] == [1, 2, 3, 4]
    for (step, g), (_, w) in zip(got, want):
        assert g == pytest.approx(w, rel=1e-9), (step, g, w)


# ------------------------------------------------------------------------------------------------
# (3) resume refuses a different model


def test_resume_with_a_changed_model_is_refused(tmp_path, write_config, capsys, one_line_error):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out)}})
    assert trainer.main(["--config", str(cfg)]) == 0
    capsys.readouterr()
    before = (out / "metrics.jsonl").read_text()
    assert trainer.main(["--config", str(cfg), "--set", "model.d_model=64", "--set", "train.max_steps=4"]) == 2
    one_line_error(capsys.readouterr(), "model.d_model", "32", "64")
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000002"]
    assert (out / "metrics.jsonl").read_text() == before  # the refused run touched nothing
    assert trainer.main(["--config", str(cfg), "--set", "model.n_layers=2", "--set", "train.max_steps=4"]) == 2
    one_line_error(capsys.readouterr(), "model.n_layers")
    assert trainer.main(["--config", str(cfg), "--set", f"train.resume={tmp_path / 'nowhere'}"]) == 2
    one_line_error(capsys.readouterr(), "checkpoint directory not found")
    # resume: never starts afresh with the new shape
    assert trainer.main(["--config", str(cfg), "--set", "model.d_model=64", "--set", "train.resume=never"]) == 0


# ------------------------------------------------------------------------------------------------
# (4) the real launcher: `looped_lm train --nproc 2` (deepspeed launcher, gloo on loopback)


@pytest.fixture(scope="module", params=[1, 2], ids=["zero1", "zero2"])
def two_rank_run(request, tmp_path_factory, write_config, clean_env):
    """`looped_lm train --nproc 2 ... --set deepspeed.zero_stage=N`: (config, out dir, stage, process).
    The launcher is found beside the interpreter (PATH has no venv), ZeRO 2 runs with --verbose."""
    root = tmp_path_factory.mktemp(f"two_ranks_zero{request.param}")
    out = root / "out"
    cfg = write_config(root / "run.yaml", {"train": {"out_dir": str(out), "max_steps": 5, "lr": 1.0e-2,
                                                     "log_every": 1, "eval_every": 5, "eval_batches": 1}})
    env = {**clean_env, "PATH": "/usr/bin:/bin"}
    verbose = ["--verbose"] if request.param == 2 else []
    proc = subprocess.run([str(Path(sys.executable).parent / "looped_lm"), "train", "--nproc", "2",
                           "--config", str(cfg), "--set", f"deepspeed.zero_stage={request.param}", *verbose],
                          cwd=root, env=env, capture_output=True, text=True, timeout=240)
    return cfg, out, request.param, proc


@pytest.mark.slow
def test_the_terminal_shows_what_a_user_reads(two_rank_run):
    """Quiet by default: the trainer's lines, none of the launcher's log; --verbose brings it back."""
    cfg, out, zero_stage, proc = two_rank_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("step 5: train loss ") and ", val loss " in line for line in lines), proc.stdout
    assert f"step 5: saved {out / 'step_0000005'}" in lines
    assert any(line.startswith("done: steps 0-5 in ") and f"checkpoint {out / 'step_0000005'}" in line
               for line in lines), proc.stdout
    launcher_log = [line for line in lines if "[INFO]" in line or "hostfile" in line]
    if zero_stage == 1:
        assert launcher_log == [] and "CUDA_VISIBLE_DEVICES" not in proc.stdout, proc.stdout
        assert "Traceback" not in proc.stderr and "Warning:" not in proc.stderr, proc.stderr
    else:
        assert any("hostfile" in line for line in launcher_log), proc.stdout


def test_two_ranks_through_the_launcher(two_rank_run):
    cfg, out, zero_stage, proc = two_rank_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = out / "step_0000005"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["config"]["deepspeed"]["zero_stage"] == zero_stage
    assert (ckpt / "rng" / "rank0.pt").is_file() and (ckpt / "rng" / "rank1.pt").is_file()
    got = metrics(out)
    assert [s for s, _ in got] == [1, 2, 3, 4, 5]
    losses = [v for _, v in got]
    assert losses[-1] < losses[0] - 0.1, losses
    # step 1: identical init on both ranks (same seed), rank 0 draws the batch a 1-rank run draws first,
    # so the logged loss (rank 0's) equals the 1-rank step-1 loss
    ref1, _ = reference_run(cfg, 1, world=1)
    assert abs(losses[0] - ref1[0]) < 1e-6
    # later steps: the gradient is the mean over both ranks' batches (ZeRO partitions, then all-gathers)
    ref2, model = reference_run(cfg, 5, world=2)
    for step, (g, r) in enumerate(zip(losses, ref2), start=1):
        assert abs(g - r) < 1e-5, (step, g, r)
    saved = load_file(str(ckpt / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, atol=1e-5, rtol=0)


def test_a_two_rank_zero_checkpoint_resumes_on_one_rank(two_rank_run, tmp_path, capsys):
    """ZeRO 1/2 partition the optimizer state over the ranks; the checkpoint stores it whole, by parameter
    name, so one rank continues from exactly the state the two left (batch_size doubled: the same
    global batch). The steps after the switch are the reference algorithm's from the saved state."""
    cfg, out, zero_stage, proc = two_rank_run
    assert proc.returncode == 0
    run = tmp_path / "out"
    shutil.copytree(out / "step_0000005", run / "step_0000005")
    sets = [f"train.out_dir={run}", "train.max_steps=7", "train.batch_size=8", f"deepspeed.zero_stage={zero_stage}"]
    assert trainer.main(["--config", str(cfg), *[a for s in sets for a in ("--set", s)]]) == 0
    assert "note: world size 2 -> 1: the optimizer state is re-sharded by parameter name" in capsys.readouterr().out
    want, model = reference_continue(cfg, out / "step_0000005", 2, world=1, sets=sets)
    got = [v for s, v in metrics(run) if s > 5]
    assert got == pytest.approx(want, abs=1e-5)
    saved = load_file(str(run / "step_0000007" / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, atol=1e-5, rtol=0)


def test_resume_across_zero_stages_continues_the_curve(tmp_path, write_config, capsys):
    """The optimizer state is stored by parameter name: a run that switches ZeRO 0 -> 1 -> 2 on resume
    logs the losses of a run that never switched."""
    straight, switched = tmp_path / "straight", tmp_path / "switched"
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(straight), "max_steps": 6, "lr": 1.0e-2}})
    assert trainer.main(["--config", str(cfg)]) == 0
    for stage in (0, 1, 2):
        assert trainer.main(["--config", str(cfg), "--stop-after", "2", "--set", f"train.out_dir={switched}",
                             "--set", f"deepspeed.zero_stage={stage}"]) == 0
    assert "deepspeed.zero_stage 1 -> 2: the optimizer state is re-sharded" in capsys.readouterr().out
    a, b = metrics(straight), metrics(switched)
    assert [s for s, _ in b] == list(range(1, 7))
    for (step, la), (_, lb) in zip(a, b):
        assert abs(la - lb) < 1e-5, (step, la, lb)


def test_resume_with_another_precision_is_refused(tmp_path, write_config, capsys, one_line_error):
    """bf16 keeps other optimizer state (bf16 moments at ZeRO 0): switching it on resume is refused by name."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out)}})
    assert trainer.main(["--config", str(cfg)]) == 0
    capsys.readouterr()
    code = trainer.main(["--config", str(cfg), "--set", "deepspeed.bf16=true", "--set", "train.max_steps=4"])
    assert code == 2
    one_line_error(capsys.readouterr(), "deepspeed.bf16", "False", "True")


# ------------------------------------------------------------------------------------------------
# (5) logs and data errors


def test_metrics_tensorboard_and_validation_loss(tmp_path, write_config):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out), "max_steps": 3, "eval_every": 2,
                                                         "eval_batches": 3, "save_every": 2}})
    assert trainer.main(["--config", str(cfg)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = metrics(out)
    assert [s for s, _ in losses] == [1, 2, 3]
    assert all(math.isfinite(v) and 4.0 < v < 6.5 for _, v in losses)
    assert all({"loss", "lr", "tokens", "tokens_per_s"} <= set(r) for r in rows if "loss" in r)
    val = metrics(out, "val_loss")
    assert [s for s, _ in val] == [2]
    # the validation loss is the mean CE of the model at step 2 over the fixed val batches (step -1)
    model, conf, manifest = ckpt_io.load_checkpoint(out / "step_0000002")
    stream = TokenStream(str(Path(manifest["data"]["dir"]) / "val.bin"), 16)
    with torch.no_grad():
        want = sum(float(model(*stream.get_batch(4, conf.train.seed, -1, i, 0))[1]) for i in range(3)) / 3
    assert abs(val[0][1] - want) < 1e-5

    events = list((out / "tb").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert {"loss", "lr", "val_loss"} <= set(acc.Tags()["scalars"])
    tb = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in tb] == [1, 2, 3]
    for (_, a), (_, b) in zip(tb, losses):
        assert abs(a - b) < 1e-5


def test_seq_len_longer_than_the_data_is_refused(tmp_path, write_config, capsys, one_line_error):
    text = tmp_path / "tiny.txt"
    text.write_text("A very small corpus.\nIt has forty-odd bytes.\n")
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", {
        "model": {"seq_len": 64}, "data": {"source": "files", "path": str(text), "cache_dir": str(tmp_path / "c")},
        "train": {"out_dir": str(out)}})
    assert trainer.main(["--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), "seq_len", "65")
    assert not ckpt_io.list_checkpoints(out)


def test_db_training_lines_show_the_loss_per_block(tmp_path, write_config, capsys):
    """DB steps alternate blocks: the printed train loss is a smoothed loss per block."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "db.yaml", {
        "model": {"kind": "db_ar", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
        "diffusion": {"num_blocks": 2, "block_sampling": "round_robin"},
        "train": {"out_dir": str(out), "max_steps": 4, "eval_every": 4, "eval_batches": 1}})
    assert trainer.main(["--config", str(cfg)]) == 0
    lines = capsys.readouterr().out.splitlines()
    val = [line for line in lines if line.startswith("step 4: train loss ")]
    assert len(val) == 1 and " b0 " in val[0] and " b1 " in val[0] and ", val loss " in val[0], lines
    assert lines[-1].startswith("done: steps 0-4") and "b0 " in lines[-1], lines


def test_smoothed_loss_is_per_block_and_debiased():
    s = trainer.SmoothedLoss(beta=0.9)
    for step in range(6):
        s.update(4.0 if step % 2 == 0 else 0.5, {"block": step % 2})
    assert s.values() == {"b0": pytest.approx(4.0), "b1": pytest.approx(0.5)}  # no drift toward 2.25, no bias to 0
    assert str(s) == "b0 4.0000 b1 0.5000"
    g = trainer.SmoothedLoss(beta=0.5)
    g.update(2.0, {})
    g.update(1.0, {})
    assert g.values() == {"": pytest.approx((0.5 * 2.0 * 0.5 + 0.5 * 1.0) / 0.75)} and str(g) == "1.3333"


@pytest.mark.slow
def test_zero0_resume_on_more_ranks_continues_the_optimizer(tmp_path, write_config, clean_env):
    """ZeRO 0 keeps the optimizer state whole: a 1-rank checkpoint resumes on 2 ranks (the changed global
    batch allowed), and the optimizer continues from its saved moments (AdamW's step count goes on)."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", {"train": {"out_dir": str(out), "resume_changes": "allow"}})
    assert trainer.main(["--config", str(cfg)]) == 0
    proc = subprocess.run([str(Path(sys.executable).parent / "looped_lm"), "train", "--nproc", "2", "--config",
                           str(cfg), "--set", "train.max_steps=4"],
                          cwd=tmp_path, env=clean_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "note: world size 1 -> 2" in proc.stdout and "global batch 4 -> 8" in proc.stdout
    step, _ = ckpt_io.read_unit_state(out / "step_0000004", "shared")
    assert step == 4
    assert json.loads((out / "step_0000004" / "manifest.json").read_text())["world_size"] == 2
