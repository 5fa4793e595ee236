"""A training step reads nothing back from the device: losses and metrics stay there and are read at log
steps only (on a GPU each read drains the queue, and under gradient accumulation once per micro-batch).

Counted: every `.item()`, `float()`, `int()`, `bool()`, `.tolist()`, `.cpu()` and `.numpy()` on a tensor
while the trainer runs, for 3 and for 8 steps with nothing logged, evaluated or saved between the first
and the last step: the two runs must read the same number of times. Not counted, because those tensors
live on the host by design whatever the device: torch's optimizers' step counters (`torch/optim`, CPU
scalars unless `capturable`/`fused`), the data loader's batches before they move to the device
(`looped_lm/data`), and the draws from a CPU generator of which block a DB step trains and of huginn's
recurrence (`choose_block`, `sample_recurrence`), which decide the step's shape on the host.
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch

from looped_lm import trainer

READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")
HOST_BY_DESIGN_FILES = ("torch/optim/", "looped_lm/data/")
HOST_BY_DESIGN_FUNCTIONS = ("choose_block", "sample_recurrence")

MODELS = {
    "gpt": ({}, None),
    # round robin: both blocks train within the first 3 steps, so both runs save and report the same units
    "db_ar": ({}, {"num_blocks": 2, "block_sampling": "round_robin", "clean_lm_weight": 1.0}),
    "looped_db": ({"n_prelude": 1, "n_coda": 1}, {"num_blocks": 1, "curve_every": 1000}),
    "huginn": ({"n_prelude": 1, "n_coda": 1, "mean_recurrence": 3, "backprop_depth": 2}, None),
}


@pytest.fixture
def reads(monkeypatch):
    """A Counter of host reads by call site, filled while `reads.on` is True."""
    counter = Counter()
    counter.on = False

    def wrap(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if counter.on:
                caller = traceback.extract_stack(limit=3)[-2]
                if not (any(f in caller.filename for f in HOST_BY_DESIGN_FILES)
                        or caller.name in HOST_BY_DESIGN_FUNCTIONS):
                    counter[f"{caller.filename}:{caller.lineno} {name}"] += 1
            return real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)

    for name in READS:
        wrap(name)
    return counter


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_training_step_reads_nothing_back_from_the_device(kind, reads, tmp_path, write_config, one_thread):
    extra, diffusion = MODELS[kind]
    per_run = {}
    for steps in (3, 8):
        raw = {"model": {"kind": kind, "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16, **extra},
               "train": {"out_dir": str(tmp_path / f"out{steps}"), "max_steps": steps, "batch_size": 4,
                         "grad_accum": 2, "log_every": 1000, "save_every": 0, "eval_every": 0}}
        if diffusion:
            raw["diffusion"] = diffusion
        cfg = write_config(tmp_path / f"run{steps}.yaml", raw)
        reads.clear()
        reads.on = True
        try:
            assert trainer.main(["--config", str(cfg)]) == 0
        finally:
            reads.on = False
        per_run[steps] = Counter(reads)
    more = {site: n for site, n in (per_run[8] - per_run[3]).items() if n}
    assert not more, f"reads that grow with the steps (5 more steps): {more}"
    assert sum(per_run[3].values()) > 0  # the counter sees the log / save reads: the check is not vacuous
