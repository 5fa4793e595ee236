"""MFU on the log line: a step's FLOPs from the cost model, checked against a count by hand, and the peak
each device is divided by."""

import pytest
import torch

from looped_lm import mfu
from looped_lm.config import config_from_dict


def gpt_config(**train):
    return config_from_dict({"model": {"kind": "gpt", "n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 16},
                             "train": {"batch_size": 2, **train}})


def test_gpt_step_flops_equal_a_count_by_hand():
    """Per token and layer: q, k, v, o projections 8 d^2, SwiGLU 6 d h, causal attention 4 d per visible key
    ((T + 1) / 2 on average); the tied head 2 d V; backward twice the forward (input and weight gradients,
    and the score and value gradients of attention). grad_accum multiplies the optimizer step."""
    d, h, T, V, L, batch = 64, 192, 16, 100, 2, 2  # h: Llama's rule, 64 * ceil(8 * 64 / 3 / 64)
    rows = batch * T
    forward = rows * (L * (8 * d * d + 6 * d * h + 4 * d * (T + 1) / 2) + 2 * d * V)
    assert mfu.StepFlops(gpt_config(), V)() == pytest.approx(3 * forward)
    assert mfu.StepFlops(gpt_config(grad_accum=3), V)() == pytest.approx(9 * forward)


def test_a_lora_step_is_charged_without_the_frozen_bases_weight_gradients():
    """LoRA: forward 1x and input gradients 1x run; the frozen weights' gradients (the second 1x) do not, so
    a step is charged 2x its forward (adapters' rank-r matmuls aside), not full fine-tuning's 3x."""
    d, h, T, V, L, batch = 64, 192, 16, 100, 2, 2
    rows = batch * T
    attention = rows * L * 4 * d * (T + 1) / 2  # no weights: scores and values get both gradients
    weights = rows * (L * (8 * d * d + 6 * d * h) + 2 * d * V)
    lora = config_from_dict({"model": {"kind": "gpt", "n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 16,
                                       "init_from": "/a/base"},  # never read: only the cost is asked for
                             "train": {"batch_size": 2, "lora_rank": 4}})
    assert mfu.StepFlops(lora, V)() == pytest.approx(2 * weights + 3 * attention)
    assert mfu.StepFlops(gpt_config(), V)() == pytest.approx(3 * (weights + attention))


def test_db_step_flops_depend_on_the_block_and_are_cached():
    cfg = config_from_dict({"model": {"kind": "db_ar", "n_layers": 4, "d_model": 32, "n_heads": 2, "seq_len": 16},
                            "diffusion": {"num_blocks": 2, "layers_per_block": [1, 3]}})
    flops = mfu.StepFlops(cfg, 257)
    assert flops(0) < flops(1)  # block 1 has three layers
    from looped_lm import cost

    shape = cost.Shape(d=32, layers=4, heads=2, vocab=257, seq=16, batch=cfg.train.batch_size)
    expected = cost.db_train(shape, cost.DBLayout(blocks=2, layers_per_block=(1, 3)), 1).total()
    assert flops(1) == expected * cfg.train.grad_accum


def test_kinds_without_a_cost_model_log_no_mfu():
    cfg = config_from_dict({"model": {"kind": "vit"}, "diffusion": {"block_sampling": "uniform"}, "data": {"source": "digits"}})
    assert mfu.StepFlops(cfg, 10)() is None
    assert mfu.mfu(None, 1.0, 1e12) is None and mfu.mfu(1e12, 1.0, 0.0) is None
    assert mfu.mfu(2e12, 4.0, 1e12) == pytest.approx(0.5)


def test_peaks(monkeypatch):
    assert mfu.peak_flops(torch.device("cpu"), torch.float32, override_tflops=123.0) == 123e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert mfu.peak_flops(torch.device("cuda"), torch.bfloat16) == 989e12
    assert mfu.peak_flops(torch.device("cuda"), torch.float32) == 494.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert mfu.peak_flops(torch.device("cuda"), torch.bfloat16) == 0.0  # unknown: no MFU, not a guess
    cpu = mfu.measured_cpu_peak(1, n=256, repeats=2)
    assert 1e8 < cpu < 1e13  # a measured fp32 matmul rate


def test_measuring_the_cpu_peak_leaves_the_global_rng_alone():
    """The trainer measures the peak after seeding its noise (and after a resume restores it): a draw from
    the global generator here would change every later sigma and z, and break a bit-exact resume."""
    state = torch.random.get_rng_state()
    mfu.measured_cpu_peak.cache_clear()
    mfu.measured_cpu_peak(1, n=64, repeats=1)
    assert torch.equal(state, torch.random.get_rng_state())


def test_a_curve_refresh_is_charged_once_whatever_the_world():
    """network_gain re-measures CE(sigma) on rank 0 every curve_every steps: the meter adds the cost model's
    refresh FLOPs once (not per rank), and kinds without a curve add nothing."""
    from looped_lm import cost
    from looped_lm.trainer import FlopsMeter

    cfg = config_from_dict({"model": {"kind": "db_ar", "n_layers": 4, "d_model": 32, "n_heads": 2, "seq_len": 16},
                            "diffusion": {"num_blocks": 2, "block_sampling": "network_gain"}})
    flops = mfu.StepFlops(cfg, 257)
    shape = cost.Shape(d=32, layers=4, heads=2, vocab=257, seq=16, batch=cfg.train.batch_size)
    assert flops.curve() == cost.db_curve(shape, cost.DBLayout(blocks=2)).total() > 0
    meter = FlopsMeter(flops, world=4, peak=0.0)
    meter.add(0)
    meter.add_curve()
    assert meter.flops == pytest.approx(4 * flops(0) + flops.curve())
    gpt = FlopsMeter(mfu.StepFlops(gpt_config(), 100), world=2, peak=0.0)
    gpt.add(None)
    gpt.add_curve()
    assert gpt.flops == pytest.approx(2 * mfu.StepFlops(gpt_config(), 100)())
