"""bf16 weights (DeepSpeed's pure-bf16 path at ZeRO 0-3 on GPUs: the module is cast, there is no autocast):
every LM kind trains a step and generates. The DB kinds keep their diffusion maths in fp32 (targets, sigma,
likelihoods) and must cast at each module boundary; an fp32 tensor reaching a bf16 Linear fails the step
(as it did on the first GPU run: the noise embedding's Fourier features)."""

import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.engine.engine import Engine, Request
from looped_lm.engine.generate import generate
from looped_lm.models import build_model
from looped_lm.models.contract import Iterative
from looped_lm.sampling import GREEDY
from looped_lm.settings import resolve_settings

CASES = {
    "gpt": ({}, None),
    "db_ar": ({}, {"num_blocks": 2, "clean_lm_weight": 1.0}),
    "db_ar edm": ({}, {"num_blocks": 2, "parameterization": "edm"}),
    "db_ar noisy_self": ({}, {"num_blocks": 2, "noisy_self": True}),
    "db_ar stacked clean_state cosine": ({"loss_chunk": 8}, {"num_blocks": 2, "context": "stacked",
                                                             "noisy_input": "clean_state", "head": "cosine"}),
    "db_ar topk posterior": ({"n_prelude": 1}, {"num_blocks": 2, "posterior_input": "topk", "posterior_topk": 8,
                                                "noisy_input": "noise", "target_fraction": 0.5}),
    "looped_db": ({"n_prelude": 1, "n_coda": 1}, {"num_blocks": 1}),
    "huginn": ({"n_prelude": 1, "n_coda": 1, "mean_recurrence": 3, "backprop_depth": 2}, None),
}


def build(case):
    extra, diffusion = CASES[case]
    raw = {"model": {"kind": case.split()[0], "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16, **extra}}
    if diffusion:
        raw["diffusion"] = diffusion
    torch.manual_seed(0)
    return build_model(config_from_dict(raw), 257).to(torch.bfloat16)


@pytest.mark.parametrize("case", list(CASES))
def test_a_bf16_model_trains_a_step_and_generates(case, one_thread):
    model = build(case).train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 257, (2, 16), generator=g), torch.randint(0, 257, (2, 16), generator=g)
    for step in range(2):  # both blocks of a B = 2 model
        loss, _ = model.training_loss(x, y, step=step, seed=0)
        loss.backward()
        assert torch.isfinite(loss.float())
    assert all(p.grad is None or p.grad.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.isfinite(model.validation_loss(x, y, seed=0).float())  # what the trainer's eval runs
    if hasattr(model, "uses_curve") and model.uses_curve():  # network_gain's CE(sigma) curve
        assert model.measure_curve(x, y, seed=0)
    model.eval()
    limits = model.iteration_limits() if isinstance(model, Iterative) else None
    settings = resolve_settings(limits, num_iterations=2 if limits else None, sampling=GREEDY)
    out = generate(model, x[:, :4], 3, settings)
    assert out.shape == (2, 7) and int(out.max()) < 257
    engine = Engine(model, num_slots=2, max_len=16)  # the server's path: batched rows, KV pool, scoring
    outs = engine.run([Request(prompt=x[i, :4].tolist(), max_tokens=3, seed=0, sampling=GREEDY) for i in range(2)])
    assert [len(o.token_ids) for o in outs] == [3, 3]


@pytest.mark.parametrize("case", ["db_ar", "looped_db"])
def test_a_compiled_bf16_db_step_runs(case, one_thread):
    """The trainer's CUDA default: pure-bf16 weights and train.compile (aot_eager: the graphs inductor gets)."""
    from looped_lm.compile import compile_for_training
    from looped_lm.kinds import get_kind

    model = build(case).train()
    assert compile_for_training(model, get_kind(case), backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 257, (2, 16), generator=g), torch.randint(0, 257, (2, 16), generator=g)
    loss, _ = model.training_loss(x, y, step=0, seed=0)
    loss.backward()
    assert torch.isfinite(loss.float())


def test_the_noise_embeddings_keep_fp32_frequencies_under_bf16_weights():
    """Fourier frequencies up to 1000 (two_stream) rounded to bf16 would move the angles by radians, and a model
    trained with bf16 weights would then read different features when evaluated in fp32."""
    from looped_lm.models.adaln import TimestepEmbedding
    from looped_lm.models.two_stream import NoiseEmbedding

    for make in (lambda: NoiseEmbedding(32), lambda: TimestepEmbedding(32)):
        module = make()
        fp32 = module.freqs.clone()
        module.to(torch.bfloat16)
        assert module.freqs.dtype == torch.float32 and torch.equal(module.freqs, fp32)
        ref = make()  # a fresh fp32 module with the same (bf16-rounded) weights: only the arithmetic differs
        ref.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
        c = torch.linspace(-2, 2, 5)
        assert torch.allclose(module(c).float(), ref(c), atol=0.05)
