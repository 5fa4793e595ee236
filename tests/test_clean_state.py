"""`diffusion.noisy_input: clean_state` (docs/method.md §4): the noisy slot for the token after x_t starts from
its block's clean input state at t (context independent: embedding + prelude; stacked: the states the blocks
before it in stack_order hand on) plus the posterior-mean embedding minus the table's mean row.

The layout's guarantees, on tiny models: cached decoding (the engine's path) equals recomputing the window
at every K, for context independent and stacked in both orders; no training or scoring slot reads its own
target or anything after it (and each reads its context); the training CE is the scoring path's; a stacked
step of block b still gives the blocks before it no gradient, while in the first block of the stack the
shared embedding + prelude get one through the slot's input; at sigma_top the input is the clean state
itself up to the posterior's departure from uniform.
"""

import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.engine.generate import generate
from looped_lm.errors import UserError
from looped_lm.models import build_model
from looped_lm.models.db.contexts import WindowContext
from looped_lm.models.layers import token_cross_entropy
from looped_lm.sampling import GREEDY, SharedGenerator
from looped_lm.settings import ScoreSettings, resolve_settings
from tiny_models import perturb_adaln, shifted_batch, uncached_next_logits

pytestmark = pytest.mark.usefixtures("one_thread")

V, T = 53, 12
CLEAN_STATE = {"parameterization": "likelihood", "noisy_input": "clean_state", "noisy_self": False,
               "bridge": "sample", "block_sampling": "uniform"}
LAYOUTS = {  # name -> (diffusion fields, model fields)
    "independent": ({"context": "independent"}, {}),
    "stacked_high": ({"context": "stacked"}, {}),
    "stacked_low": ({"context": "stacked", "stack_order": "low_noise_first"}, {}),
    "looped_db": ({}, {"kind": "looped_db", "n_layers": 2, "n_coda": 1}),
}


def make(layout="stacked_low", num_blocks=2, n_layers=4, seed=0, **diffusion):
    fields, model_fields = LAYOUTS[layout]
    model = {"kind": "db_ar", "n_layers": n_layers, "d_model": 32, "n_heads": 4, "seq_len": 16, "n_prelude": 1,
             "init_std": 0.2, "max_iterations": 16, **model_fields}
    if model["kind"] == "looped_db":
        num_blocks = 1
    cfg = config_from_dict({"model": model, "diffusion": {"num_blocks": num_blocks, **CLEAN_STATE, **fields,
                                                          **diffusion}})
    torch.manual_seed(seed)
    return perturb_adaln(build_model(cfg, V)).eval()


def batch(g, B=3):
    return shifted_batch(g, B, vocab=V, T=T)


# --- the input -----------------------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("layout", ["independent", "stacked_low"])
def test_the_slot_starts_from_its_blocks_clean_input_state(layout):
    """At sigma_top the posterior is near uniform: the input is the clean state (block_input at t) up to
    (posterior - uniform) @ E; the other noisy inputs are untouched (prev_token still adds E[x_t])."""
    model = make(layout)
    x, y = batch(torch.Generator().manual_seed(0))
    pos = torch.arange(T)
    b = model.stack_order[-1]  # stacked: the last block of the stack, whose clean input is deepest
    clean = model.block_input(b, model.clean_inputs(x), pos)
    sigma = torch.full((3,), 1e4)
    z = model.targets(y) + sigma[:, None, None] * torch.randn(3, T, 32, generator=torch.Generator().manual_seed(1))
    h, _, _ = model.noisy_input(z, sigma, x, clean)
    torch.testing.assert_close(h, clean, rtol=0, atol=1e-4)
    with pytest.raises(UserError, match="clean_state"):
        model.noisy_input(z, sigma, x)
    # at low sigma the posterior names the token: its embedding minus the mean row, on top of the state
    sigma = torch.full((3,), 1e-3)
    z = model.targets(y)
    h, _, _ = model.noisy_input(z, sigma, x, clean)
    E = model.tok_emb.weight
    torch.testing.assert_close(h, clean + E[y] - E.mean(0), rtol=0, atol=1e-5)


# --- no leak; training path = scoring path ---------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_slot_sees_no_target_and_reads_its_context(layout):
    model = make(layout)
    g = torch.Generator().manual_seed(4)
    x, y = batch(g)
    noise = torch.randn(3, T, 32, generator=g)
    sigma = torch.tensor([0.05, 0.5, 5.0])
    for block in range(len(model.blocks)):
        base = model.objective.slot_losses(x, y, block, sigma, noise)
        for t in (0, 4, 10):
            x2, y2, n2 = x.clone(), torch.randint(0, V, y.shape, generator=g), noise.clone()
            x2[:, t + 1:] = torch.randint(0, V, x2[:, t + 1:].shape, generator=g)  # x[t+1] is the target itself
            y2[:, t] = y[:, t]
            others = torch.arange(T) != t
            n2[:, others] = torch.randn(n2[:, others].shape, generator=g)
            torch.testing.assert_close(model.objective.slot_losses(x2, y2, block, sigma, n2)[:, t], base[:, t],
                                       rtol=0, atol=1e-5)
            x3 = x.clone()  # the slot reads its context, its own previous token included (the clean state at t)
            x3[:, t] = (x3[:, t] + 1) % V
            assert (model.objective.slot_losses(x3, y, block, sigma, noise)[:, t] - base[:, t]).abs().max() > 1e-4
        # a subset of slots (target_fraction < 1) reads the same clean states at its slots
        slots = torch.tensor([[1, 4, 10]] * 3)
        sub = model.objective.slot_losses(x, y, block, sigma, noise.gather(1, slots[..., None].expand(-1, -1, 32)),
                                          slots)
        torch.testing.assert_close(sub, base.gather(1, slots), rtol=1e-5, atol=1e-5)
        # the training CE is the scoring path's (which never sees y)
        z = model.targets(y) + sigma[:, None, None] * noise
        scoring = token_cross_entropy(WindowContext(model, x).denoise(block, z, sigma), y)
        torch.testing.assert_close(base, scoring, rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("layout", ["independent", "stacked_high", "stacked_low"])
def test_scoring_slot_sees_no_target(layout):
    model = make(layout, n_layers=2)
    settings = ScoreSettings(k_grid=(1, 2, 4), draws=2)
    g = torch.Generator().manual_seed(6)
    x, y = batch(g, B=2)
    base = model.score(x, y, settings, torch.Generator().manual_seed(5))
    for t in (0, 4, 10):
        x2, y2 = x.clone(), torch.randint(0, V, y.shape, generator=g)
        x2[:, t + 1:] = torch.randint(0, V, x2[:, t + 1:].shape, generator=g)
        y2[:, t] = y[:, t]
        moved = model.score(x2, y2, settings, torch.Generator().manual_seed(5))
        for k in base:
            torch.testing.assert_close(moved[k].nll[:, t], base[k].nll[:, t], rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", ["independent", "stacked_high", "stacked_low"])
def test_gradients(layout):
    """A step of block b gives no other block a gradient (stacked: the clean input it continues from, and so
    the slot's input, is computed without one); the shared embedding + prelude get one exactly when block b
    reads them directly (independent, or the first block of the stack), as with the other noisy inputs."""
    model = make(layout, num_blocks=2, n_layers=2).train()
    x, y = batch(torch.Generator().manual_seed(3))
    sigma = torch.full((3,), 0.3)
    noise = torch.randn(3, T, 32)
    for b in range(2):
        model.zero_grad(set_to_none=True)
        model.objective.slot_losses(x, y, b, sigma, noise).mean().backward()
        for j in range(2):
            grads = [p.grad for p in model.blocks[j].parameters()]
            if j == b:
                assert all(g is not None and g.abs().sum() > 0 for g in grads)
            else:
                assert all(g is None for g in grads), f"block {j} got a gradient in a step of block {b}"
        prelude = [p.grad for p in model.prelude.parameters()]
        if model.feeder(b) is None:
            assert all(g is not None and g.abs().sum() > 0 for g in prelude)
        else:
            assert all(g is None for g in prelude)


@pytest.mark.parametrize("layout", ["independent", "stacked_low"])
@pytest.mark.parametrize("posterior_input", ["full", "topk"])
def test_chunked_loss_equals_the_plain_one(layout, posterior_input):
    """model.loss_chunk (the posterior-mean input recomputed per chunk) gives the same loss and gradients."""
    runs = []
    for chunk in (0, 5):
        model = make(layout, num_blocks=2, n_layers=2, posterior_input=posterior_input, posterior_topk=5).train()
        model.loss_chunk = chunk
        x, y = batch(torch.Generator().manual_seed(8))
        sigma = torch.tensor([0.05, 0.5, 5.0])
        noise = torch.randn(3, T, 32, generator=torch.Generator().manual_seed(9))
        loss = model.objective.slot_losses(x, y, 0, sigma, noise).mean()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-6)
    assert runs[0][1].keys() == runs[1][1].keys() and "tok_emb.weight" in runs[0][1]
    for n in runs[0][1]:
        torch.testing.assert_close(runs[0][1][n], runs[1][1][n], rtol=1e-4, atol=1e-6, msg=n)


# --- decoding: cached = recompute ------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("layout,num_blocks,n_layers,K", [
    *((layout, *shape) for layout in ("independent", "stacked_high", "stacked_low")
      for shape in ((2, 2, 1), (2, 2, 2), (2, 2, 5), (4, 4, 2), (4, 4, 4))),
    ("looped_db", 1, 2, 1), ("looped_db", 1, 2, 3)])
def test_cached_decoding_equals_recompute(layout, num_blocks, n_layers, K):
    """The engine's generate path (prompt prefill, then one token at a time, fused or catch-up calls; K < B
    skips blocks whose states later ones still need) against the whole window recomputed per token."""
    model = make(layout, num_blocks=num_blocks, n_layers=n_layers, bridge="hard", last_call="edge")
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(7))
    settings = resolve_settings(model.iteration_limits(), num_iterations=K, bridge="hard", sampling=GREEDY)
    g = SharedGenerator(torch.Generator().manual_seed(11))
    noise = [model.initial_noise(2, 1, g) for _ in range(5)]
    out, logits = generate(model, prompt, 5, settings, return_logits=True, noise=noise)
    for i in range(5):
        ref = uncached_next_logits(model, out[:, :5 + i], settings, noise[i])
        scale = ref.abs().amax(-1, keepdim=True)
        assert ((logits[:, i] - ref).abs() <= 1e-5 + 1e-6 * scale).all()
        assert torch.equal(out[:, 5 + i], ref.argmax(-1))
