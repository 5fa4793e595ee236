"""Scale-out: block-parallel training, independent block jobs joined by `looped_lm merge`, layers per block,
resume across world sizes and modes, and a kill during a save. Two processes on CPU (gloo, loopback).

`Replay` is the trainer's algorithm for a db_ar model in plain PyTorch, written from the definitions and
not from the trainer's code: one model holding every block's current weights, AdamW state per unit, one
torch RNG stream per rank, the batch of (seed, step, micro, rank). A block-parallel step: each rank's
block on its batch, each rank's gradient clipped by its own norm, the shared parameters' gradients
averaged. A data-parallel step: the step's block on every rank's batch, gradients averaged, then clipped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from looped_lm import checkpoint as ckpt_io
from looped_lm import cli, parallel
from looped_lm import trainer
from looped_lm.config import config_from_dict, load_config
from looped_lm.data.batches import data_source_string
from looped_lm.data.bin_dataset import TokenStream
from looped_lm.data.prepare import ensure_prepared
from looped_lm.models import build_model
from looped_lm.optim import cosine_with_warmup, param_groups
from looped_lm.settings import ScoreSettings

SEED = 1337
DB = {"model": {"kind": "db_ar", "n_layers": 4, "d_model": 32, "n_heads": 2, "seq_len": 16},
      "diffusion": {"layers_per_block": [3, 1], "block_sampling": "uniform"}}


def db_config(write_config, root: Path, name: str, **sections) -> Path:
    raw = {"model": dict(DB["model"]), "diffusion": dict(DB["diffusion"]),
           "train": {"out_dir": str(root / name), "max_steps": 4, "batch_size": 4, "lr": 1.0e-2, "grad_clip": 0.5,
                     "warmup_steps": 1, "log_every": 1, "save_every": 1, "keep_last": 10}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return write_config(root / f"{name}.yaml", raw)


def launch(cfg: Path, nproc: int, cwd: Path, env: dict, *sets: str) -> subprocess.CompletedProcess:
    """`looped_lm train --nproc N` (the DeepSpeed launcher, gloo ranks on loopback)."""
    args = [str(Path(sys.executable).parent / "looped_lm"), "train", "--nproc", str(nproc), "--config", str(cfg)]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# the reference


class Replay:
    """The trainer's algorithm for a db_ar model without DeepSpeed (see the module docstring)."""

    def __init__(self, cfg, world: int, ckpt: Path | None = None):
        self.cfg, self.world, t = cfg, world, cfg.train
        data = ensure_prepared(data_source_string(cfg), cfg.data.cache_dir, cfg.data.tokenizer,
                               cfg.data.val_fraction, t.seed, progress=False)
        self.stream = TokenStream(str(Path(data) / "train.bin"), cfg.model.seq_len)
        torch.manual_seed(t.seed)
        self.model = build_model(self._all_blocks(), 257)
        self.opt = torch.optim.AdamW(param_groups(self.model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                     eps=1e-8, foreach=False)
        self.rng = []
        for r in range(world):
            torch.manual_seed(t.seed + 1 + r)
            self.rng.append(torch.get_rng_state())
        if ckpt is not None:
            self.model.load_state_dict(load_file(str(ckpt / "model.safetensors")))
            for group in self.opt.param_groups:
                with safe_open(str(ckpt / "optimizer" / f"{group['unit']}.safetensors"), "pt") as f:
                    step = int(f.metadata()["step"])
                    for p in group["params"]:
                        name = self._name(p)
                        if step:
                            self.opt.state[p] = {"step": torch.tensor(float(step)),
                                                 "exp_avg": f.get_tensor(f"exp_avg/{name}"),
                                                 "exp_avg_sq": f.get_tensor(f"exp_avg_sq/{name}")}
            for r in range(world):
                if (ckpt / "rng" / f"rank{r}.pt").is_file():
                    self.rng[r] = torch.load(ckpt / "rng" / f"rank{r}.pt", weights_only=False)["torch"]

    def _all_blocks(self):
        cfg = self.cfg.model_copy(deep=True)
        cfg.train.mode = "data_parallel"  # the whole model trainable (config checks ran on the original)
        return cfg

    def _name(self, p) -> str:
        return next(n for n, q in self.model.named_parameters() if q is p)

    def grads(self, rank: int, step: int, cfg) -> tuple[float, int, dict]:
        """(loss, block, gradients) of rank `rank` at `step` on a copy of the current weights, the rank's
        model built from `cfg` (which decides its block), its RNG stream advanced."""
        model = build_model(cfg, 257)
        model.load_state_dict(self.model.state_dict())
        torch.set_rng_state(self.rng[rank])
        t, total = self.cfg.train, 0.0
        for micro in range(t.grad_accum):  # accumulation: the mean of the micro-batches' gradients
            x, y = self.stream.get_batch(t.batch_size, t.seed, step, micro, rank)
            loss, metrics = model.training_loss(x, y, step, t.seed)
            (loss / t.grad_accum).backward()
            total += loss.item() / t.grad_accum
        self.rng[rank] = torch.get_rng_state()
        return total, metrics["block"], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    def step(self, step: int, mode: str) -> dict[int, float]:
        """One optimiser step; -> {block: loss} (block parallel) or {block: rank 0's loss} (data parallel)."""
        t = self.cfg.train
        per_rank = []
        for r in range(self.world):
            cfg = parallel.rank_config(self.cfg, r, self.world) if mode == "block_parallel" else self._all_blocks()
            per_rank.append(self.grads(r, step, cfg))
        final: dict[str, torch.Tensor] = {}
        if mode == "block_parallel":
            for loss, block, g in per_rank:
                norm = torch.linalg.vector_norm(torch.stack([v.norm() for v in g.values()]))
                scale = min(1.0, t.grad_clip / (float(norm) + 1e-6))
                for n, v in g.items():
                    if n.startswith("blocks."):
                        final[n] = v * scale
                    else:
                        final[n] = final.get(n, 0) + v * scale / self.world
            losses = {block: loss for loss, block, _ in per_rank}
        else:
            for _, _, g in per_rank:
                for n, v in g.items():
                    final[n] = final.get(n, 0) + v / self.world
            norm = float(torch.linalg.vector_norm(torch.stack([v.norm() for v in final.values()])))
            final = {n: v * min(1.0, t.grad_clip / (norm + 1e-6)) for n, v in final.items()}
            losses = {per_rank[0][1]: per_rank[0][0]}
        for group in self.opt.param_groups:
            group["lr"] = cosine_with_warmup(step, t.warmup_steps, t.max_steps, t.lr, t.min_lr)
        for n, p in self.model.named_parameters():
            p.grad = final.get(n)  # None: an idle unit, untouched by AdamW
        self.opt.step()
        return losses

    def assert_weights(self, ckpt: Path, atol: float = 1e-5) -> None:
        """Within 1e-5 of the replay: 0.1% of one step's update at lr 1e-2 (Adam divides by the root of
        tiny second moments, which magnifies summation-order rounding to a few 1e-6)."""
        saved = load_file(str(ckpt / "model.safetensors"))
        for name, tensor in self.model.state_dict().items():
            torch.testing.assert_close(saved[name], tensor, atol=atol, rtol=0, msg=lambda m: f"{ckpt.name} {name}: {m}")


# ------------------------------------------------------------------------------------------------
# block parallel: the gradient exchange, exactly


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exchange_worker(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    """One gloo rank: rank `rank`'s block on a batch of its own, backward, then BlockParallel.reduce."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    grads, sent = _exchange_grads(raw, rank, world, dist)
    torch.save({"grads": grads, "bytes": sent}, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _exchange_grads(raw: dict, rank: int, world: int, dist=None):
    """Rank `rank`'s gradients: after the exchange with `dist`, or (dist None) its own, before it."""
    cfg = config_from_dict(raw)
    torch.manual_seed(0)
    model = build_model(parallel.rank_config(cfg, rank, world), 257)
    exchange = parallel.BlockParallel(cfg, model, dist) if dist is not None else None
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randint(0, 257, (4, 16), generator=g)
    torch.manual_seed(20 + rank)
    loss, _ = model.training_loss(x, x.roll(-1, 1), 0, 0)
    loss.backward()
    if exchange is not None:
        exchange.reduce(model.step_units(0, 0))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, exchange.bytes_sent if exchange is not None else 0


@pytest.mark.parametrize("blocks_to_train", [[], [1]], ids=["one_rank_per_block", "two_ranks_on_one_block"])
def test_block_parallel_exchange_is_exact(tmp_path, blocks_to_train):
    """Two gloo ranks. One rank per block: each keeps its block's gradient clipped by its own norm, and the
    shared gradients are the mean of the ranks' clipped ones; only the shared gradients travel. Two ranks on
    one block: both get the mean of their gradients (their joint batch), clipped once."""
    raw = {**DB, "diffusion": {**DB["diffusion"], "blocks_to_train": blocks_to_train},
           "train": {"mode": "block_parallel", "grad_clip": 0.05}}
    torch.multiprocessing.spawn(_exchange_worker, args=(2, _free_port(), raw, str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    own = [_exchange_grads(raw, r, 2)[0] for r in range(2)]
    shared = [n for n in own[0] if not n.startswith("blocks.")]
    model = build_model(config_from_dict(raw), 257)
    n_shared = sum(p.numel() for n, p in model.named_parameters() if n in shared)

    def clipped(g):
        norm = float(torch.linalg.vector_norm(torch.stack([v.norm() for v in g.values()])))
        assert norm > 0.05  # the clip binds: the test sees its scale
        return {n: v * min(1.0, 0.05 / (norm + 1e-6)) for n, v in g.items()}

    if not blocks_to_train:
        want = [clipped(g) for g in own]
        mean = {n: (want[0][n] + want[1][n]) / 2 for n in shared}
        for r in range(2):
            assert {n for n in got[r]["grads"] if n.startswith("blocks.")} == {n for n in own[r] if n.startswith(f"blocks.{r}.")}
            for n, v in got[r]["grads"].items():
                torch.testing.assert_close(v, mean[n] if n in shared else want[r][n], atol=1e-7, rtol=1e-5)
            assert got[r]["bytes"] == 4 * n_shared  # fp32 shared gradients, nothing of the blocks
    else:
        want = clipped({n: (own[0][n] + own[1][n]) / 2 for n in own[0]})
        for r in range(2):
            assert set(got[r]["grads"]) == set(want)
            for n, v in got[r]["grads"].items():
                torch.testing.assert_close(v, want[n], atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# block parallel through the launcher, and resume across modes and world sizes


@pytest.fixture(scope="module")
def bp_run(tmp_path_factory, write_config, clean_env):
    """2 ranks, block parallel, the uneven split [3, 1], 2 micro-batches per step: (root, config, out dir,
    process)."""
    root = tmp_path_factory.mktemp("bp")
    cfg = db_config(write_config, root, "bp", train={"mode": "block_parallel", "max_steps": 3, "grad_accum": 2})
    proc = launch(cfg, 2, root, clean_env)
    return root, cfg, root / "bp", proc


@pytest.mark.slow
def test_block_parallel_steps_match_one_rank_steps(bp_run):
    """Every block-parallel step changes each block exactly as a one-rank step of that block on the same
    batch (noise stream, accumulation, clipping), and the shared parameters by the mean of the ranks'
    gradients; fp32, weights and losses within 1e-5."""
    root, cfg_path, out, proc = bp_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train loss b0 " in proc.stdout and " b1 " in proc.stdout  # both blocks' losses, every step
    replay = Replay(load_config(str(cfg_path)), world=2)
    logged = [r for r in rows(out) if "blocks" in r]
    for step in range(3):
        losses = replay.step(step, "block_parallel")
        assert logged[step]["blocks"] == [0, 1]
        for b, loss in losses.items():
            assert logged[step][f"loss_block{b}"] == pytest.approx(loss, abs=1e-5), (step, b)
        replay.assert_weights(out / ckpt_io.step_dir_name(step + 1))
    manifest = json.loads((out / "step_0000003" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["ownership"] == {"blocks": [0, 1]}
    # each rank wrote the optimizer state of what it trains: block1 holds no other block's tensors
    _, block1 = ckpt_io.read_unit_state(out / "step_0000003", "block1")
    assert block1 and all(k.split("/", 1)[1].startswith("blocks.1.") for k in block1)


@pytest.mark.slow
def test_block_parallel_with_stacked_context_reads_the_current_blocks(tmp_path, write_config, clean_env):
    """context stacked: block 1's step runs block 0 forward, so every rank needs block 0's weights of this
    step, not those of the last checkpoint: with no save or eval in between, 3 block-parallel steps still
    equal 3 one-rank steps of the same blocks on the same batches."""
    cfg = db_config(write_config, tmp_path, "bps", diffusion={"context": "stacked"},
                    train={"mode": "block_parallel", "max_steps": 3, "save_every": 0, "eval_every": 0})
    proc = launch(cfg, 2, tmp_path, clean_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    replay = Replay(load_config(str(cfg)), world=2)
    for step in range(3):
        replay.step(step, "block_parallel")
    replay.assert_weights(tmp_path / "bps" / ckpt_io.step_dir_name(3))


def test_block_parallel_resumes_on_one_rank_in_data_parallel(bp_run, tmp_path):
    """A block-parallel 2-rank checkpoint resumes on 1 rank in data-parallel mode at ZeRO 1 (batch 8: the
    same global batch): the next step is the reference's from the saved weights, moments and step counts."""
    root, cfg_path, out, proc = bp_run
    assert proc.returncode == 0
    run = tmp_path / "dp"
    shutil.copytree(out / "step_0000002", run / "step_0000002")
    sets = [f"train.out_dir={run}", "train.mode=data_parallel", "train.batch_size=8", "deepspeed.zero_stage=1"]
    assert trainer.main(["--config", str(cfg_path), *[a for s in sets for a in ("--set", s)]]) == 0
    replay = Replay(load_config(str(cfg_path), sets), world=1, ckpt=out / "step_0000002")
    losses = replay.step(2, "data_parallel")
    (block, loss), = losses.items()
    row = next(r for r in rows(run) if r["step"] == 3 and "loss" in r)
    assert row["block"] == block and row["loss"] == pytest.approx(loss, abs=1e-5)
    replay.assert_weights(run / "step_0000003")


@pytest.mark.slow
def test_data_parallel_checkpoint_resumes_in_block_parallel_on_two_ranks(tmp_path, write_config, clean_env):
    """The reverse: a 1-rank data-parallel checkpoint (blocks stepped unevenly by the sampling) goes on in
    block-parallel mode on 2 ranks (batch 2 per rank: the same global batch)."""
    cfg = db_config(write_config, tmp_path, "dp")
    assert trainer.main(["--config", str(cfg), "--stop-after", "2"]) == 0
    ckpt = tmp_path / "dp" / "step_0000002"
    steps = {u: ckpt_io.read_unit_state(ckpt, u)[0] for u in ("shared", "block0", "block1")}
    assert steps["shared"] == 2 and steps["block0"] + steps["block1"] == 2
    proc = launch(cfg, 2, tmp_path, clean_env, "train.mode=block_parallel", "train.batch_size=2", "train.max_steps=3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train.mode data_parallel -> block_parallel" in proc.stdout and "world size 1 -> 2" in proc.stdout
    replay = Replay(load_config(str(cfg), ["train.mode=block_parallel", "train.batch_size=2", "train.max_steps=3"]),
                    world=2, ckpt=ckpt)
    losses = replay.step(2, "block_parallel")
    row = next(r for r in rows(tmp_path / "dp") if r["step"] == 3 and "blocks" in r)
    for b, loss in losses.items():
        assert row[f"loss_block{b}"] == pytest.approx(loss, abs=1e-5)
    replay.assert_weights(tmp_path / "dp" / "step_0000003")


def test_world_size_that_does_not_fit_the_blocks_is_refused(tmp_path, write_config, capsys, one_line_error):
    cfg = db_config(write_config, tmp_path, "run", model={"n_layers": 3}, diffusion={"layers_per_block": 1},
                    train={"mode": "block_parallel"})
    assert cli.main(["train", "--nproc", "2", "--config", str(cfg)]) == 2
    one_line_error(capsys.readouterr(), "world size 2", "3 trained blocks")
    assert not (tmp_path / "run").exists()


def test_resume_into_an_incompatible_mode_is_refused(tmp_path, write_config, capsys, one_line_error):
    """An independent job's checkpoint (block 0 only) cannot continue as a block-parallel run of every
    block (its other block has no optimizer state), and a checkpoint in DeepSpeed's own layout only resumes
    data parallel. One line each, nothing written."""
    cfg = db_config(write_config, tmp_path, "job", diffusion={"blocks_to_train": [0]}, train={"max_steps": 1})
    assert trainer.main(["--config", str(cfg)]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in (tmp_path / "job").iterdir())
    sets = ["--set", "diffusion.blocks_to_train=[]", "--set", "train.mode=block_parallel", "--set", "train.max_steps=2"]
    assert cli.main(["train", "--nproc", "2", "--config", str(cfg), *sets]) == 2
    one_line_error(capsys.readouterr(), "diffusion.blocks_to_train", "[0]", "[]")
    legacy = tmp_path / "job" / "step_0000001"
    manifest = json.loads((legacy / "manifest.json").read_text())
    del manifest["optimizer_layout"]
    ckpt_io.write_manifest(legacy, {k: v for k, v in manifest.items() if k not in ("files", "manifest_sha256")})
    assert cli.main(["train", "--nproc", "2", "--config", str(cfg), "--set", "train.mode=block_parallel",
                     "--set", "train.max_steps=2"]) == 2
    one_line_error(capsys.readouterr(), "train.mode block_parallel", "DeepSpeed's own optimizer files")
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == before


# ------------------------------------------------------------------------------------------------
# a kill during a save


@pytest.mark.slow
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, write_config, clean_env, capsys):
    """SIGKILL while step 4 is being saved (its optimizer and RNG files written, the weights and manifest
    not yet): step 2 still loads and resumes, and the restart clears the half-written directory."""
    cfg = db_config(write_config, tmp_path, "run", train={"save_every": 2})
    out = tmp_path / "run"
    script = ("import sys, time\n"
              "import looped_lm.checkpoint as c\n"
              "finalize = c.finalize\n"
              "def slow(out_dir, step, *a, **k):\n"
              "    if step == 4:\n"
              "        print('FINALIZING', flush=True)\n"
              "        time.sleep(120)\n"
              "    return finalize(out_dir, step, *a, **k)\n"
              "c.finalize = slow\n"
              "from looped_lm.train import main\n"
              f"sys.exit(main(['--config', {str(cfg)!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], env=clean_env, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("FINALIZING"):
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    half = out / ".tmp-step_0000004"
    assert (half / "optimizer" / "shared.safetensors").is_file() and not (out / "step_0000004").exists()
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000002"]
    assert cli.main(["eval", "--checkpoint", str(out / "step_0000002"), "--max-tokens", "64", "--draws", "1",
                     "--no-progress"]) == 0
    assert trainer.main(["--config", str(cfg)]) == 0
    text = capsys.readouterr().out
    assert f"removed {half}" in text and f"resumed from {out / 'step_0000002'} at step 2" in text
    assert [p.name for p in ckpt_io.list_checkpoints(out)][-1] == "step_0000004" and not half.exists()


# ------------------------------------------------------------------------------------------------
# independent block jobs and `looped_lm merge`


@pytest.fixture(scope="module")
def block_jobs(tmp_path_factory, write_config):
    """Two independent jobs of one [3, 1] model, block 0 and block 1, 3 steps each: (root, [ckpt0, ckpt1])."""
    root = tmp_path_factory.mktemp("jobs")
    ckpts = []
    for b in (0, 1):
        cfg = db_config(write_config, root, f"job{b}", diffusion={"blocks_to_train": [b]},
                        train={"max_steps": 3, "save_every": 0})
        assert trainer.main(["--config", str(cfg)]) == 0
        ckpts.append(root / f"job{b}" / "step_0000003")
    return root, ckpts


def _hand_assembled(shared: Path, blocks: dict[int, Path]):
    """The model a person builds from the same tensors: shared parameters from one job, each block from its own."""
    manifest = json.loads((shared / "manifest.json").read_text())
    cfg = config_from_dict(manifest["config"])
    cfg.diffusion.blocks_to_train = []
    model = build_model(cfg, 257, manifest["model_state"])
    state = load_file(str(shared / "model.safetensors"))
    for b, ckpt in blocks.items():
        state.update({k: v for k, v in load_file(str(ckpt / "model.safetensors")).items()
                      if k.startswith(f"blocks.{b}.")})
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("shared", [0, 1])
def test_merged_model_equals_the_hand_assembled_one(block_jobs, tmp_path, capsys, shared):
    root, (job0, job1) = block_jobs
    out = tmp_path / "merged"
    args = ["merge", str(job0), str(root / "job1"), "--out", str(out)]  # a run directory is taken too
    assert cli.main(args + (["--shared-from", str(job1)] if shared else [])) == 0
    assert f"-> {out}" in capsys.readouterr().out
    model, _, manifest = ckpt_io.load_checkpoint(out)
    assert manifest["ownership"] == {"blocks": [0, 1]} and manifest["config"]["diffusion"]["blocks_to_train"] == []
    assert [(m["blocks"], m["shared"]) for m in manifest["merged_from"]] == [([0], not shared), ([1], bool(shared))]
    hand = _hand_assembled([job0, job1][shared], {0: job0, 1: job1})
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    scores = []
    for m in (model, hand):
        g = torch.Generator().manual_seed(3)
        scores.append(m.score(x, x.roll(-1, 1), ScoreSettings(k_grid=(1, 2), draws=1), g))
    for k in (0, 1, 2):
        assert torch.equal(scores[0][k].nll, scores[1][k].nll)
    for name, tensor in hand.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    # the merge is not either job: block 1 is job1's, the shared parameters the chosen job's
    other = load_file(str([job1, job0][shared] / "model.safetensors"))
    assert not torch.equal(other["tok_emb.weight"], model.tok_emb.weight)


def test_every_verb_accepts_the_merged_checkpoint(block_jobs, tmp_path, write_config, capsys, monkeypatch):
    root, (job0, job1) = block_jobs
    out = tmp_path / "merged"
    assert cli.main(["merge", str(job0), str(job1), "--out", str(out)]) == 0
    assert cli.main(["eval", "--checkpoint", str(out), "--num-iterations", "2", "--draws", "1", "--max-tokens", "64",
                     "--no-progress"]) == 0
    assert cli.main(["generate", "--checkpoint", str(out), "--prompt", "And", "--max-tokens", "4"]) == 0
    assert cli.main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "hf")]) == 0
    uvicorn = pytest.importorskip("uvicorn")
    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw))
    assert cli.main(["serve", "--checkpoint", str(out), "--max-slots", "2"]) == 0 and served
    capsys.readouterr()
    # a merge holds weights only: resuming from it is refused in one line
    cfg = db_config(write_config, tmp_path, "resume", train={"resume": str(out), "max_steps": 5})
    assert trainer.main(["--config", str(cfg)]) == 2
    assert "a merge of block jobs" in capsys.readouterr().err


def _edited(ckpt: Path, dest: Path, **changes) -> Path:
    """A copy of `ckpt` whose manifest says otherwise (rewritten with a valid integrity record)."""
    shutil.copytree(ckpt, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            manifest["config"][section][field] = value
        else:
            manifest[key] = value
    ckpt_io.write_manifest(dest, {k: v for k, v in manifest.items() if k not in ("files", "manifest_sha256")})
    return dest


@pytest.mark.parametrize("case", ["overlap", "missing", "edges", "blocks", "split", "shapes", "tokenizer", "kind",
                                  "setting", "out_not_empty"])
def test_merge_refuses_inputs_that_disagree(block_jobs, tiny_run, tmp_path, write_config, capsys, one_line_error,
                                           case):
    root, (job0, job1) = block_jobs
    out = tmp_path / "merged"
    inputs, needles = [job0, job1], []
    if case == "overlap":
        # a manifest claiming a block its run did not train is refused before merging (checkpoint.check_agreement)
        inputs, needles = [job0, _edited(job1, tmp_path / "c", ownership={"blocks": [0]})], ["'ownership'", "[0]"]
    elif case == "missing":
        inputs, needles = [job0], ["no checkpoint owns block 1"]
    elif case == "edges":
        inputs[1] = _edited(job1, tmp_path / "c", model_state={"edges": [0.002, 1.0, 80.0], "num_blocks": 2})
        needles = ["edges", "[0.002, 1.0, 80.0]"]
    elif case == "blocks":
        cfg = db_config(write_config, tmp_path, "b4", diffusion={"layers_per_block": 1, "blocks_to_train": [1]},
                        train={"max_steps": 1})
        assert trainer.main(["--config", str(cfg)]) == 0
        inputs[1], needles = tmp_path / "b4" / "step_0000001", ["B = 4", "2"]
    elif case == "split":
        cfg = db_config(write_config, tmp_path, "even", diffusion={"layers_per_block": 2, "blocks_to_train": [1]},
                        train={"max_steps": 1})
        assert trainer.main(["--config", str(cfg)]) == 0
        inputs[1], needles = tmp_path / "even" / "step_0000001", ["layer split", "[2, 2]", "[3, 1]"]
    elif case == "shapes":
        cfg = db_config(write_config, tmp_path, "wide", model={"d_model": 64}, diffusion={"blocks_to_train": [1]},
                        train={"max_steps": 1})
        assert trainer.main(["--config", str(cfg)]) == 0
        inputs[1], needles = tmp_path / "wide" / "step_0000001", ["has tensor", "of shape"]
    elif case == "tokenizer":
        inputs[1], needles = _edited(job1, tmp_path / "c", tokenizer="gpt2"), ["'tokenizer' is 'gpt2'", "byte"]
    elif case == "kind":
        inputs[1], needles = tiny_run[1], ["model.kind gpt", "db_ar"]
    elif case == "setting":
        inputs[1] = _edited(job1, tmp_path / "c", diffusion__parameterization="edm")
        needles = ["diffusion.parameterization", "'edm'", "'likelihood'"]
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        needles = ["--out", "not an empty directory"]
    capsys.readouterr()
    assert cli.main(["merge", *map(str, inputs), "--out", str(out)]) == 2
    one_line_error(capsys.readouterr(), *needles)
    if case == "out_not_empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert not list(tmp_path.glob(".tmp-merge-*"))


# ------------------------------------------------------------------------------------------------
# layers per block, and the multi-node launch


def test_an_uneven_split_builds_trains_decodes_and_caches_per_block(tmp_path, write_config):
    cfg = load_config(str(db_config(write_config, tmp_path, "run")))
    model = build_model(cfg, 257)
    assert [len(block) for block in model.blocks] == [3, 1] and len(model.edges) == 3
    even = build_model(load_config(str(db_config(write_config, tmp_path, "even", diffusion={"layers_per_block": 2}))), 257)
    assert model.edges == even.edges  # edges follow B, not the depths
    state = model.new_cache(1, 8)
    assert [len(caches) for caches in state.blocks] == [3, 1]
    assert model.kv_bytes_per_token(state) == even.kv_bytes_per_token(even.new_cache(1, 8))  # 4 layers either way


def test_hostfile_launch_counts_the_slots(tmp_path):
    from looped_lm import launch

    hosts = tmp_path / "hostfile"
    hosts.write_text("# two nodes\nnode-a slots=4\nnode-b slots=4\n")
    assert launch.hostfile_slots(str(hosts)) == 8 and launch.hostfile_slots(str(hosts), per_node=2) == 4
    cmd = launch.command(0, 29500, ["--config", "x.yaml"], False, hostfile=str(hosts))
    assert cmd[1:5] == ["--hostfile", str(hosts), "--master_port", "29500"] and "--num_gpus" not in cmd
    hosts.write_text("node-a slots=four\n")
    with pytest.raises(Exception, match="hostfile"):
        launch.hostfile_slots(str(hosts))


def test_one_rank_owning_both_blocks_trains_them_in_bf16_with_fp32_state(tmp_path, write_config, capsys):
    """Block parallel on fewer ranks than blocks: the one rank owns both and trains one per step (here
    round robin among its own). With deepspeed.bf16 the blocks compute under autocast and the weights,
    optimizer state and the checkpoint's master copies stay fp32."""
    cfg = db_config(write_config, tmp_path, "run", diffusion={"block_sampling": "round_robin"},
                    train={"mode": "block_parallel", "max_steps": 4}, deepspeed={"bf16": True})
    assert trainer.main(["--config", str(cfg)]) == 0
    trained = [r["blocks"] for r in rows(tmp_path / "run") if "blocks" in r]
    assert trained == [[0], [1], [0], [1]]
    ckpt = tmp_path / "run" / "step_0000004"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}
    _, shared = ckpt_io.read_unit_state(ckpt, "shared")
    assert {k.split("/")[0] for k in shared} == {"exp_avg", "exp_avg_sq", "fp32"}
    assert {t.dtype for t in shared.values()} == {torch.float32}
    assert torch.equal(shared["fp32/tok_emb.weight"], weights["tok_emb.weight"])
