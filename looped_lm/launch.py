"""`looped_lm train` -> `deepspeed --num_gpus N --module looped_lm.train ...`: check the run (preflight) before
anything starts, find the launcher, start it, and pass on what the user reads.

The launcher is the one installed beside the running Python (a venv's bin/, which need not be on PATH),
else the one on PATH. Its own log lines (hostfile search, world info, CUDA_VISIBLE_DEVICES, the command
it ran, exit codes) and DeepSpeed's INFO lines are dropped unless `--verbose`: what remains is the
trainer's own output and real warnings.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from looped_lm import checkpoint as ckpt_io
from looped_lm import preflight
from looped_lm.config import describe_fields
from looped_lm.errors import UserError
from looped_lm.trainer import args as trainer

# DeepSpeed's log format: "[2026-01-01 12:00:00,123] [INFO] [launch.py:152:main] ..."
_DS_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(?P<level>[A-Z]+)\] \[(?P<file>[\w.]+):\d+:")


def find_launcher() -> str:
    beside = Path(sys.executable).parent / "deepspeed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("deepspeed")
    if found is None:
        raise UserError(f"the `deepspeed` launcher is neither beside this Python ({beside.parent}) nor on PATH; "
                        "pip install deepspeed")
    return found


def command(nproc: int, port: int, trainer_argv: list[str], verbose: bool, hostfile: str | None = None) -> list[str]:
    """The launcher's command: `nproc` processes on this node, or with a hostfile one process per slot on
    every node it lists (`nproc` > 0 caps the processes per node), reached over ssh by DeepSpeed."""
    where = (["--hostfile", hostfile] if hostfile else []) + (["--num_gpus", str(nproc)] if nproc or not hostfile else [])
    return [find_launcher(), *where, "--master_port", str(port), "--log_level", "info" if verbose else "error",
            "--module", "looped_lm.train", *trainer_argv]


def hostfile_slots(path: str, per_node: int = 0) -> int:
    """Processes a DeepSpeed hostfile asks for: the sum of its `host slots=N` lines (# starts a comment),
    each capped at `per_node` (the launcher's --num_gpus) if given."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read hostfile {path}: {e.strerror}") from None
    total = 0
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"\S+\s+slots=(\d+)", line)
        if m is None:
            raise UserError(f"hostfile {path} line {n}: expected `hostname slots=N`, got {line!r}")
        total += min(int(m.group(1)), per_node) if per_node else int(m.group(1))
    if total == 0:
        raise UserError(f"hostfile {path} lists no slots")
    return total


def is_noise(line: str) -> bool:
    """A launcher line the user does not need: the launcher's own logging, or DeepSpeed INFO/DEBUG."""
    m = _DS_LOG.match(line)
    return bool(m) and (m["file"] in ("runner.py", "launch.py") or m["level"] in ("INFO", "DEBUG"))


def run_launcher(cmd: list[str], env: dict, verbose: bool = False) -> int:
    """Run the launcher; its stdout goes through the noise filter, stderr (the progress bar, errors)
    straight to the terminal. Returns its exit code."""
    if verbose:
        return subprocess.run(cmd, env=env).returncode
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        for line in proc.stdout:
            if not is_noise(line):
                sys.stdout.write(line)
                sys.stdout.flush()
    except KeyboardInterrupt:  # the launcher got the same SIGINT and stops its ranks
        proc.wait()
        raise
    return proc.wait()


# --- the `looped_lm train` verb: the same trainer as `deepspeed looped_lm/train.py`, through the launcher


def add_arguments(p) -> None:
    """`looped_lm train`'s flags: the trainer's own (train.add_arguments) and the launcher's."""
    trainer.add_arguments(p)
    p.add_argument("--nproc", type=int, default=0,
                   help="processes on this node (GPUs; on CPU, gloo ranks); 0 = all GPUs, or 1 on CPU; with "
                        "--hostfile, processes per node (0 = each node's slots)")
    p.add_argument("--hostfile", default=None, metavar="FILE",
                   help="DeepSpeed hostfile (`host slots=N` per line): run on every node it lists, over ssh "
                        "(README: multi-node)")
    p.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a free one; 29500 "
                   "with --hostfile)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config, build the model on the meta device, print its parameters, FLOPs per step, "
                        "memory per rank, the decisions taken on --device-type and the launcher command for --nproc "
                        "processes; train nothing, read no data")
    p.add_argument("--device-type", choices=("cuda", "cpu"), default="cuda",
                   help="the device a --dry-run plans for (default cuda)")


def run(args) -> int:
    """`looped_lm train`: check the config and the run (preflight) here, then start the launcher."""
    if args.help_config is not None:
        print(describe_fields(kind=args.help_config or None))
        return 0
    cfg = trainer.config_from_args(args)
    if args.nproc < 0:
        raise UserError(f"--nproc must be >= 0 (got {args.nproc})")
    if not 0 <= args.master_port <= 65535:
        raise UserError(f"--master-port must be in 1..65535, or 0 for a free one (got {args.master_port})")
    if args.no_verify:
        print(ckpt_io.no_verify_note(), file=sys.stderr)
    import torch  # torch: seconds at start-up, not at `looped_lm train --help` or a bad flag

    from looped_lm import devices  # imports torch: seconds at start-up

    if args.hostfile:  # every node's slots, capped by --nproc
        nproc, world = args.nproc, hostfile_slots(args.hostfile, args.nproc)
    else:
        nproc = world = args.nproc or (torch.cuda.device_count() or 1)
    if args.dry_run:
        from looped_lm import dryrun  # imports torch: seconds at start-up

        cmd = command(world, 29500, trainer.forward_args(args), verbose=False)
        print("\n".join(dryrun.report(cfg, args.config or "--set overrides", cmd, world, args.device_type)))
        return 0
    # config, world size, data, out_dir and the checkpoint to resume: checked here, before the launcher starts
    plan = preflight.preflight(cfg, verify=not args.no_verify, world_size=world)
    for note in plan.notes:
        print(f"note: {note}", flush=True)
    if preflight.nothing_to_train(plan, cfg):
        print(preflight.nothing_to_train(plan, cfg))
        return 0
    port = args.master_port or (29500 if args.hostfile else trainer.free_port())
    cmd = command(nproc, port, trainer.forward_args(args), args.verbose, args.hostfile)
    env = {**os.environ, trainer.PREFLIGHT_DONE: "1", "PYTHONUNBUFFERED": "1"}
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.update(devices.cpu_thread_env(env, len(os.sched_getaffinity(0)), nproc or 1))
    if args.hostfile:
        return killed_rank(run_launcher(cmd, env, verbose=args.verbose))

    with tempfile.TemporaryDirectory(prefix="looped_lm-rendezvous-") as rendezvous:  # one node: loopback only
        env[trainer.RENDEZVOUS_FILE] = os.path.join(rendezvous, "store")
        return killed_rank(run_launcher(cmd, env, verbose=args.verbose))


def killed_rank(code: int) -> int:
    """The launcher's exit code; a rank killed by a signal (DeepSpeed then stops the others before they can
    say anything) becomes one line and exit code 1."""
    if code < 0 or code > 128:
        number = -code if code < 0 else 256 - code
        try:
            name = signal.Signals(number).name
        except ValueError:
            return code
        why = " (out of memory, or killed by hand)" if name == "SIGKILL" else ""
        print(f"error: a training rank was killed by {name}{why}; the launcher stopped the others: the same command "
              "resumes from the newest checkpoint", file=sys.stderr)
        return 1
    return code
