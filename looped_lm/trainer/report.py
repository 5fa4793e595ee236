"""What rank 0 reports of a run: the smoothed loss per block, the progress bar or plain lines, the MFU meter, and
metrics.jsonl with TensorBoard."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from looped_lm.config import Config


class FlopsMeter:
    """MFU between log steps: each step's FLOPs from the cost model (looped_lm/mfu.py), keyed by what decides
    them (the DB block, huginn's r; host values, no sync), and the curve refreshes', over the wall time, the
    world and the peak."""

    def __init__(self, step_flops, world: int, peak: float):
        self.step_flops, self.world, self.peak = step_flops, world, peak
        self.flops, self.t0 = 0.0, time.perf_counter()

    def add(self, key) -> None:
        flops = self.step_flops(key)
        self.flops = None if flops is None or self.flops is None else self.flops + self.world * flops

    def add_curve(self) -> None:
        """A CE(sigma) curve refresh: rank 0 measures it, so it counts once, not once per rank."""
        flops = self.step_flops.curve()
        if flops is not None and self.flops is not None:
            self.flops += flops

    def read(self) -> dict:
        """{"flops_per_s", "mfu"} since the last read (what is known), and start a new interval."""
        now = time.perf_counter()
        seconds, flops = now - self.t0, self.flops
        self.flops, self.t0 = 0.0, now
        if flops is None or seconds <= 0:
            return {}
        rate = {"flops_per_s": flops / seconds}
        if self.peak:
            rate["mfu"] = flops / seconds / (self.peak * self.world)
        return rate


class SmoothedLoss:
    """Moving averages of the training loss, one per block: DiffusionBlocks steps alternate blocks whose
    losses differ by an order of magnitude, so one average (or the last value) jumps between them.
    Debiased like Adam's moments, so the first steps read right. The sums and counts stay on the device
    (a loss is a device tensor): `values()` reads them, at log steps only."""

    def __init__(self, beta: float = 0.9):
        self.beta, self.sums, self.counts = beta, {}, {}

    def update(self, loss, metrics: dict) -> None:
        if "blocks" in metrics:  # block parallel: every block's loss of this step
            for b in metrics["blocks"]:
                self._add(f"b{b}", metrics[f"loss_block{b}"])
        else:
            self._add(f"b{metrics['block']}" if "block" in metrics else "", loss)

    def _add(self, key: str, loss) -> None:
        loss = torch.as_tensor(loss, dtype=torch.float64)
        finite = torch.isfinite(loss)  # a non-finite step (skipped, or about to stop the run) must not poison it
        old = self.sums.get(key, torch.zeros((), dtype=torch.float64, device=loss.device))
        self.sums[key] = torch.where(finite, self.beta * old + (1 - self.beta) * loss.nan_to_num(0.0), old)
        self.counts[key] = self.counts.get(key, 0) + finite.double()

    def values(self) -> dict[str, float]:
        return {k: float(self.sums[k] / (1 - self.beta ** self.counts[k])) for k in sorted(self.sums)
                if float(self.counts[k]) > 0}

    def __str__(self) -> str:
        return " ".join(f"{k} {v:.4f}".strip() for k, v in self.values().items())


class Report:
    """What rank 0 prints: a progress bar with the smoothed loss per block, and plain lines for
    validation, saves and the end of the run (nanoGPT's `step N: train loss X, val loss Y`)."""

    def __init__(self, cfg: Config, start_step: int, tokens_per_step: int, unit: str = "tokens"):
        self.cfg, self.start, self.tokens_per_step, self.unit = cfg, start_step, tokens_per_step, unit
        self.loss, self.val, self.done = SmoothedLoss(), None, start_step
        self.mfu: float | None = None  # the last log step's (FlopsMeter)
        self.t0 = time.perf_counter()
        self.bar = None
        if cfg.train.progress:
            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def tokens_per_s(self) -> float:
        return (self.done - self.start) * self.tokens_per_step / max(time.perf_counter() - self.t0, 1e-9)

    def step(self, loss, metrics: dict, show: bool = True) -> None:
        """Count a step; its loss joins the averages on the device. `show` (log steps): read them for the bar."""
        self.loss.update(loss, metrics)
        self.done += 1
        if show:
            rate = "tok" if self.unit == "tokens" else self.unit
            mfu = f", mfu {100 * self.mfu:.1f}%" if self.mfu is not None else ""
            status = f"loss {self.loss}, {self.tokens_per_s():,.0f} {rate}/s{mfu}"
            if self.bar is not None:
                self.bar.set_postfix_str(status, refresh=False)
            else:  # train.progress: false (logs, batch jobs): a plain line at each log step, as nanoGPT prints
                self.line(f"step {self.done}: {status}")
        if self.bar is not None:
            self.bar.update(1)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def validation(self, step: int, val: float) -> None:
        self.val = (step, val)
        self.line(f"step {step}: train loss {self.loss}, val loss {val:.4f}")

    def summary(self, end_step: int, last_ckpt: Path | None) -> None:
        seconds = time.perf_counter() - self.t0
        minutes, secs = divmod(int(round(seconds)), 60)
        val = f", val loss {self.val[1]:.4f} (step {self.val[0]})" if self.val else ""
        stopped = "" if end_step >= self.cfg.train.max_steps else \
            f" (stopped at {end_step} of {self.cfg.train.max_steps}: the same command resumes)"
        self.line(f"done: steps {self.start}-{end_step} in {minutes}m{secs:02d}s, "
                  f"{self.tokens_per_s():,.0f} {self.unit}/s; train loss {self.loss}{val}; checkpoint {last_ckpt}"
                  f"{stopped}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _quiet_writer_threads() -> None:
    """TensorBoard writes from a thread of its own; its failure (a full disk) would print that thread's
    traceback, then surface again at the next `add_scalar`, where MetricsLogger names the directory and
    main() prints one line. Only that thread's traceback is dropped."""
    previous = threading.excepthook
    if getattr(previous, "looped_lm", False):
        return

    def hook(args):
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)
    hook.looped_lm = True
    threading.excepthook = hook


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
            from torch.utils.tensorboard import SummaryWriter  # optional: minimal installs may lack tensorboard
        except ImportError:  # tensorboard is a dependency; tolerate its absence in minimal installs
            self.tb = None
            return
        _quiet_writer_threads()  # before the writer's thread starts: its very first write may fail (a full disk)
        try:
            self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        except OSError as e:
            self.file.close()
            raise OSError(e.errno, e.strerror or str(e), str(out_dir / "tb")) from None

    def log(self, step: int, values: dict) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            try:
                for k, v in values.items():
                    if isinstance(v, (int, float)):
                        self.tb.add_scalar(k, v, step)
            except OSError as e:  # the writer thread's failure (a full disk), surfaced here: name the directory
                raise OSError(e.errno, e.strerror or str(e), str(self.tb.log_dir)) from None

    def close(self, quiet: bool = False) -> None:
        """Close both logs. `quiet`: the run is failing already (its error is the one line said), so
        a failure to flush them (the same full disk) is dropped."""
        try:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
        except OSError as e:
            if not quiet:
                raise OSError(e.errno, e.strerror or str(e), e.filename or str(self.path.parent)) from None
