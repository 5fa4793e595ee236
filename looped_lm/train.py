"""The trainer: `deepspeed looped_lm/train.py --config X.yaml [--set section.key=value ...]`.

Also runs as one process without the launcher (`python -m looped_lm.train --config X.yaml`).
Every model kind trains through the same loop: the model offers
    training_loss(x, y, step, seed) -> (loss, metrics)    one micro-batch
    step_units(step, seed) -> set of unit names | None    which parameter units this step updates
    validation_loss(x, y, seed) -> loss                   held-out loss (DB models: at sigma_hi)
    checkpoint_state() -> dict                            metadata saved in the manifest (edges...)
DeepSpeed owns the optimiser, gradient accumulation, clipping and ZeRO; the model knows nothing of it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.pop(0)  # run as a file: keep looped_lm/ itself off the import path

import torch

from looped_lm import checkpoint as ckpt_io
from looped_lm.config import Config, describe_fields, load_config
from looped_lm.errors import UserError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="looped_lm train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML run config (see configs/README.md)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable)")
    p.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="save and exit after N steps of this launch (preemptible jobs); 0 = run to max_steps")
    p.add_argument("--help-config", action="store_true", help="list every config field and exit")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# distributed set-up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed():
    """Set up torch.distributed through DeepSpeed: NCCL on GPUs, gloo on CPU; one process works too."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # launched without the deepspeed launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    import deepspeed
    import deepspeed.ops

    # init_distributed otherwise JIT-compiles a shared-memory comm op with g++ (~1 min, needs a compiler)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": cfg.deepspeed.bf16},
        "steps_per_print": 10 ** 9,  # our own logging
        "wall_clock_breakdown": False,
        # BlockwiseAdamW is torch AdamW plus per-unit skipping; ZeRO 1/2 keep its group dicts
        "zero_allow_untested_optimizer": True,
    }


class TrainingModule(torch.nn.Module):
    """What DeepSpeed wraps: forward returns the loss of one micro-batch, metrics kept aside."""

    def __init__(self, model: torch.nn.Module, seed: int):
        super().__init__()
        self.model, self.seed, self.last_metrics = model, seed, {}

    def forward(self, x, y, step: int):
        loss, self.last_metrics = self.model.training_loss(x, y, step=step, seed=self.seed)
        return loss


# ---------------------------------------------------------------------------------------------
# data


def data_source_string(cfg: Config) -> str:
    d = cfg.data
    return {"bible": "bible", "shakespeare": "shakespeare", "files": d.path, "hf": f"hf:{d.path}",
            "bin": d.path}[d.source]


def prepare_data(cfg: Config, rank: int):
    """Tokenize the corpus once (rank 0; the others wait), then open train/val token streams."""
    import deepspeed.comm as dist

    from looped_lm.data.bin_dataset import TokenStream
    from looped_lm.data.prepare import ensure_prepared

    if cfg.data.source == "bin":
        root = Path(cfg.data.path)
        for split in ("train.bin", "val.bin"):
            if not (root / split).is_file():
                raise UserError(f"data.path {root} has no {split} (expected nanoGPT's train.bin / val.bin)")
    args = (data_source_string(cfg), cfg.data.cache_dir, cfg.data.tokenizer, cfg.data.val_fraction, cfg.train.seed)
    error = None
    if rank == 0:
        try:
            ensure_prepared(*args)
        except UserError as e:
            error = e
    dist.barrier()
    if error is not None:
        raise error
    data_dir = Path(ensure_prepared(*args))
    seq_len = cfg.model.seq_len
    return TokenStream(str(data_dir / "train.bin"), seq_len), TokenStream(str(data_dir / "val.bin"), seq_len), data_dir


# ---------------------------------------------------------------------------------------------
# resume


def find_resume(cfg: Config, out_dir: Path) -> Path | None:
    r = cfg.train.resume
    if r == "never":
        return None
    if r == "auto":
        return ckpt_io.latest_checkpoint(out_dir)
    return Path(r)


def check_resume_compatible(manifest: dict, cfg: Config, vocab_size: int, world_size: int) -> None:
    """Refuse a checkpoint whose model, vocabulary, edges or optimiser layout differ from this run's."""
    saved = manifest["config"]
    saved_stage = saved.get("deepspeed", {}).get("zero_stage", 0)
    if saved_stage != cfg.deepspeed.zero_stage:
        raise UserError(f"cannot resume: the checkpoint was written with deepspeed.zero_stage {saved_stage}, "
                        f"this run uses {cfg.deepspeed.zero_stage} (their optimizer files differ)")
    if saved_stage > 0 and manifest.get("world_size") != world_size:
        raise UserError(f"cannot resume: the checkpoint's ZeRO optimizer state is partitioned over "
                        f"{manifest.get('world_size')} ranks, this run has world size {world_size}")
    for section in ("model", "diffusion"):
        mine = getattr(cfg, section).__dict__
        for key, value in saved.get(section, {}).items():
            if key in ("num_iterations", "bridge", "max_iterations"):
                continue  # inference-time settings may change between runs
            if mine.get(key) != value:
                raise UserError(f"cannot resume from checkpoint: {section}.{key} is {value!r} there but "
                                f"{mine.get(key)!r} in this config")
    if manifest.get("vocab_size") != vocab_size:
        raise UserError(f"cannot resume: the checkpoint's vocab_size {manifest.get('vocab_size')} "
                        f"differs from this run's {vocab_size}")


def check_resume_model_state(saved: dict, model) -> None:
    """The model checks the saved state against its own and adopts what was measured in training."""
    model.restore_state(saved)


def refresh_curve(model, val_stream, cfg: Config, device, rank: int, step: int) -> dict | None:
    """Measure held-out CE(sigma) on rank 0 and give every rank the same curve (so every rank
    keeps the same edges and draws the same blocks)."""
    import deepspeed.comm as dist

    curve = [None]
    if rank == 0:
        was_training = model.training
        model.eval()
        x, y = val_stream.get_batch(cfg.train.batch_size, cfg.train.seed, -2, 0, 0)
        curve[0] = model.measure_curve(x.to(device), y.to(device), seed=cfg.train.seed + step)
        model.train(was_training)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(curve, src=0)
    model.apply_curve(curve[0])
    return curve[0]


# ---------------------------------------------------------------------------------------------
# the loop


def train(cfg: Config, stop_after: int = 0) -> Path | None:
    """Run training; return the final checkpoint directory (on every rank)."""
    device = init_distributed()
    try:
        return _train(cfg, device, stop_after)
    finally:
        import deepspeed.comm as dist

        # a barrier before teardown avoids a rare abort of gloo ranks at exit
        dist.barrier()
        dist.destroy_process_group()


def _train(cfg: Config, device: torch.device, stop_after: int) -> Path | None:
    import deepspeed
    import deepspeed.comm as dist

    from looped_lm.data.tokenizer import get_tokenizer
    from looped_lm.models import build_model
    from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups

    rank, world = dist.get_rank(), dist.get_world_size()
    t = cfg.train
    out_dir = Path(t.out_dir)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise UserError(f"model.vocab_size ({vocab_size}) is smaller than the {tokenizer.name} tokenizer's "
                        f"{tokenizer.vocab_size}")
    train_stream, val_stream, data_dir = prepare_data(cfg, rank)

    resume_from = find_resume(cfg, out_dir)
    manifest = None
    if resume_from is not None:
        manifest = ckpt_io.read_manifest(resume_from)
        ckpt_io.verify_weights(resume_from, manifest)

    if manifest is not None:
        check_resume_compatible(manifest, cfg, vocab_size, world)
    torch.manual_seed(t.seed)  # identical init on every rank
    model = build_model(cfg, vocab_size)  # edges from the config: a resume must agree with them
    if manifest is not None:
        check_resume_model_state(manifest.get("model_state", {}), model)
    torch.manual_seed(t.seed + 1 + rank)  # noise draws (sigma, z, slots) differ across ranks

    optimizer = BlockwiseAdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                               eps=1e-8, fused=False, foreach=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, t.warmup_steps, t.max_steps, t.lr, t.min_lr) / t.lr)
    engine, _, _, _ = deepspeed.initialize(model=TrainingModule(model, t.seed), optimizer=optimizer,
                                           lr_scheduler=schedule, config=deepspeed_config(cfg, world),
                                           dist_init_required=False)
    # ZeRO wraps our optimiser; keep the handle on ours to choose the active units each step

    start_step = 0
    if resume_from is not None:
        engine.load_checkpoint(str(resume_from / "optimizer"), tag="ds", load_optimizer_states=True,
                               load_lr_scheduler_states=True)
        rng_file = resume_from / "rng" / f"rank{rank}.pt"
        if rng_file.is_file():
            ckpt_io.set_rng_state(torch.load(rng_file, weights_only=False))
        start_step = manifest["step"]
        if rank == 0:
            print(f"resumed from {resume_from} at step {start_step}", flush=True)

    logger = MetricsLogger(out_dir, rank, start_step) if rank == 0 else None
    tokens_per_step = t.batch_size * t.grad_accum * world * cfg.model.seq_len
    end_step = t.max_steps if stop_after <= 0 else min(t.max_steps, start_step + stop_after)
    bar = _progress(cfg, start_step, rank)
    last_ckpt = resume_from
    step = start_step
    t0 = time.perf_counter()
    for step in range(start_step, end_step):
        optimizer.set_active_units(model.step_units(step, t.seed))
        loss_sum, metrics, lr = 0.0, {}, schedule.get_last_lr()[0]
        for micro in range(t.grad_accum):
            x, y = train_stream.get_batch(t.batch_size, t.seed, step, micro, rank)
            loss = engine(x.to(device), y.to(device), step)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.item() / t.grad_accum
            metrics = engine.module.last_metrics
        done = step + 1
        if logger is not None and (done % t.log_every == 0 or done == end_step):
            elapsed = time.perf_counter() - t0
            logger.log(done, {"loss": loss_sum, "lr": lr,
                              "tokens": done * tokens_per_step,
                              "tokens_per_s": (done - start_step) * tokens_per_step / max(elapsed, 1e-9),
                              **metrics})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum:.4f}", tok_s=f"{(done - start_step) * tokens_per_step / max(time.perf_counter() - t0, 1e-9):.0f}")
        d = cfg.diffusion
        if model.uses_curve() and done % d.curve_every == 0 and \
                (d.curve_until == 0 or done <= d.curve_until):
            curve = refresh_curve(model, val_stream, cfg, device, rank, done)
            if logger is not None:
                logger.log(done, {"edges": model.edges, "curve_ce": curve["ce"]})
        if t.eval_every and done % t.eval_every == 0:
            val = evaluate_loss(model, val_stream, cfg, device, rank)
            if logger is not None:
                logger.log(done, {"val_loss": val})
        if (t.save_every and done % t.save_every == 0) or done == end_step:
            model_state = model.checkpoint_state()
            last_ckpt = save(engine, model, cfg, out_dir, done, vocab_size, tokenizer.name, model_state,
                             data_dir, tokens_per_step, rank)
    if bar is not None:
        bar.close()
    if logger is not None:
        logger.close()
    return last_ckpt


@torch.no_grad()
def evaluate_loss(model, stream, cfg: Config, device, rank: int) -> float:
    """Mean held-out loss over a fixed set of batches (the same ones at every evaluation)."""
    was_training = model.training
    model.eval()
    losses = []
    for i in range(cfg.train.eval_batches):
        x, y = stream.get_batch(cfg.train.batch_size, cfg.train.seed, -1, i, rank)
        losses.append(model.validation_loss(x.to(device), y.to(device), seed=cfg.train.seed + i).item())
    model.train(was_training)
    import deepspeed.comm as dist

    value = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def save(engine, model, cfg: Config, out_dir: Path, step: int, vocab_size: int, tokenizer: str,
         model_state: dict, data_dir: Path, tokens_per_step: int, rank: int) -> Path:
    import deepspeed.comm as dist

    tmp = ckpt_io.tmp_dir_for(out_dir, step)
    if rank == 0:
        if tmp.exists():  # left by a crash during an earlier save of this step
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    engine.save_checkpoint(str(tmp / "optimizer"), tag="ds")
    ckpt_io.write_rank_files(tmp, rank)
    dist.barrier()
    final = out_dir / ckpt_io.step_dir_name(step)
    if rank == 0:
        manifest = {"config": cfg.to_dict(), "model_kind": cfg.model.kind, "vocab_size": vocab_size,
                    "tokenizer": tokenizer, "model_state": model_state,
                    "data": {"dir": str(Path(data_dir).resolve()), "position": {"step": step, "tokens_seen": step * tokens_per_step},
                             "sampling": "stateless: batch(seed, step, micro_step, rank)"},
                    "world_size": dist.get_world_size()}
        final = ckpt_io.finalize(out_dir, step, model, manifest, cfg.train.keep_last)
    dist.barrier()
    return final


class MetricsLogger:
    """metrics.jsonl (truncated to the resume step, so the file is the true curve) + TensorBoard."""

    def __init__(self, out_dir: Path, rank: int, start_step: int):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        kept = []
        if self.path.exists() and start_step > 0:
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= start_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    continue
        self.path.write_text("".join(k + "\n" for k in kept))
        self.file = open(self.path, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        except ImportError:  # tensorboard is a dependency; tolerate its absence in minimal installs
            self.tb = None

    def log(self, step: int, values: dict) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _progress(cfg: Config, start_step: int, rank: int):
    if rank != 0 or not cfg.train.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", dynamic_ncols=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.help_config:
        print(describe_fields())
        return 0
    try:
        if args.config is None and not args.set:
            raise UserError("give --config FILE (and/or --set section.key=value overrides)")
        cfg = load_config(args.config, args.set)
        train(cfg, stop_after=args.stop_after)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
