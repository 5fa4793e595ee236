"""Tiny models of every kind, shared by the decoding, batching and engine tests and by the supporting
modules' tests (vit, dit, mdm)."""

import torch

from looped_lm.config import config_from_dict
from looped_lm.models import build_model, network_args

V, D = 47, 32
# The paper's layout (docs/method.md §4-5), which the mechanism tests (caches, batching, export) pin so their
# logits stay O(1); the product's defaults (docs/results.md) have their own tests in test_dblm.py.
PAPER = {"parameterization": "edm", "noisy_self": True, "noisy_input": "noise", "bridge": "hard",
         "block_sampling": "uniform", "last_call": "edge"}


def build_tiny(kind: str, seq_len: int = 16, **diffusion):
    """A 2-layer d-32 model of `kind` (db_ar: B = 2; looped kinds: prelude 1 + core 2 + coda 1), with
    adaLN weights perturbed (adaLN-Zero starts at zero) so the noise level matters, in eval mode."""
    model = {"kind": kind, "n_layers": 2, "d_model": D, "n_heads": 4, "seq_len": seq_len, "init_std": 0.2}
    if kind != "gpt":
        model["max_iterations"] = 8
    if kind in ("looped_db", "huginn"):
        model.update(n_prelude=1, n_coda=1)
    if kind == "huginn":
        model.update(mean_recurrence=3, backprop_depth=2)
    if kind == "db_ar":
        model["n_prelude"] = 1
    diffusion = {"num_blocks": 2 if kind == "db_ar" else 1, **PAPER, **diffusion}
    torch.manual_seed(0)
    m = build_model(config_from_dict({"model": model, "diffusion": diffusion}), V)
    return perturb_adaln(m).eval()


def perturb_adaln(model):
    """adaLN-Zero starts at zero: give the noisy stream's modulation some weight, so sigma matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ada" in name:
                p.normal_(0, 0.2)
    return model


def shifted_batch(generator, B: int = 3, *, vocab: int, T: int):
    """(x, y) of B random windows of T tokens, y = x shifted by one plus a fresh last token (real text's shape)."""
    x = torch.randint(0, vocab, (B, T), generator=generator)
    return x, torch.cat([x[:, 1:], torch.randint(0, vocab, (B, 1), generator=generator)], dim=1)


def markov_batch(generator, batch: int = 16, T: int = 16, stay: float = 0.7):
    """A tiny synthetic language: the next token is (token + 1) mod V with probability `stay`, else
    uniform. (x, y) with y = x shifted by one."""
    seq = torch.empty(batch, T + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, V, (batch,), generator=generator)
    for t in range(T):
        keep = torch.rand(batch, generator=generator) < stay
        seq[:, t + 1] = torch.where(keep, (seq[:, t] + 1) % V, torch.randint(0, V, (batch,), generator=generator))
    return seq[:, :-1], seq[:, 1:]


_TRAINED: dict = {}


def trained_tiny_db(steps: int = 300, stay: float = 0.7, **diffusion):
    """A tiny db_ar model with the product's DB defaults, trained on `markov_batch` (its `stay`) for `steps`
    steps (cached per settings): confident where the language is, so its chains commit like a real model's."""
    key = (steps, stay, tuple(sorted(diffusion.items())))
    if key not in _TRAINED:
        settings = {"parameterization": "likelihood", "noisy_self": False, "noisy_input": "prev_token",
                    "bridge": "sample", "block_sampling": "round_robin", **diffusion}
        torch.manual_seed(0)
        cfg = config_from_dict({"model": {"kind": "db_ar", "n_layers": 2, "d_model": D, "n_heads": 4, "seq_len": 16,
                                          "n_prelude": 1},
                                "diffusion": {"num_blocks": 2, **settings}})
        model = build_model(cfg, V).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        with torch.enable_grad():  # callers may be inside no_grad
            _train(model, opt, g, steps, stay)
        _TRAINED[key] = model.eval()
    return _TRAINED[key]


def _train(model, opt, g, steps, stay=0.7):
    for step in range(steps):
        x, y = markov_batch(g, stay=stay)
        loss, _ = model.training_loss(x, y, step, seed=0)
        opt.zero_grad()
        loss.backward()
        opt.step()


@torch.no_grad()
def uncached_next_logits(model, prefix: torch.Tensor, settings, z: torch.Tensor) -> torch.Tensor:
    """Reference for cached decoding: the K-step chain of the token after prefix (B, P), recomputed over
    the whole prefix without a cache, from starting noise z (B, 1, d). Deterministic bridges only."""
    from looped_lm.diffusion.chain import run_chain
    from looped_lm.models.db.contexts import WindowContext
    from looped_lm.sampling import SharedGenerator

    B, P = prefix.shape
    window = WindowContext(model, prefix)
    z_all = torch.zeros(B, P, z.shape[-1])
    z_all[:, -1:] = z
    result = run_chain(window.denoise, model.grid(), [settings] * B, z_all, SharedGenerator(None), model.targets,
                       model.target_table)
    return result.logits[:, -1]


# --- the supporting modules (looped_lm/models/{vit,dit,mdm}.py) ---------------------------------------

TINY_MODULES = {  # kind -> (fields of a tiny model, parameter names that start at zero besides adaLN)
    "vit": (dict(image_size=8, channels=1, num_classes=10, patch=2, n_layers=3, d_model=32, n_heads=2,
                 num_blocks=3), ("head",)),
    "dit": (dict(image_size=8, channels=1, num_classes=10, patch=2, n_layers=2, d_model=32, n_heads=2,
                 num_blocks=2), ("out.",)),
    "mdm": (dict(seq_len=16, n_layers=3, d_model=32, n_heads=2, num_blocks=3), ()),
}
# the paper's module recipes (the official code's), which the mechanism tests pin; the config's defaults
# (configs/README.md) differ where a measurement chose otherwise
MODULE_RECIPES = {
    "vit": dict(overlap=0.05, block_sampling="uniform", loss_weight="batch_mean", bridge="soft",
                parameterization="edm", norm_eps=1e-6),
    "dit": dict(overlap=0.05, block_sampling="uniform", norm_eps=1e-6),
    "mdm": dict(overlap=0.05, block_sampling="uniform", norm_eps=1e-6),
}


def module_config(kind: str, **fields):
    """A run config of a tiny `kind` module: TINY_MODULES' shape and MODULE_RECIPES' recipe, then `fields`
    (each to the section that has it; validated as a user's YAML is)."""
    from looped_lm.kinds import get_kind

    model, diffusion = {"kind": kind}, {}
    for key, value in {**TINY_MODULES[kind][0], **MODULE_RECIPES[kind], **fields}.items():
        (model if key in get_kind(kind).section.model_fields else diffusion)[key] = value
    data = {"source": "bible" if kind == "mdm" else "digits"}
    return config_from_dict({"model": model, "diffusion": diffusion, "data": data}, flat_era=False)


def tiny_module(kind: str, perturb: bool = True, **fields):
    """A tiny vit, dit or mdm. adaLN (and the vit head / dit output layer) start at zero, so `perturb`
    gives them weights: otherwise the block layers get no gradient and the noise level does not reach
    the output through them."""
    from looped_lm.models.dit import DiffusionDiT
    from looped_lm.models.mdm import MaskedDiffusionLM
    from looped_lm.models.vit import DiffusionViT

    cls = {"vit": DiffusionViT, "dit": DiffusionDiT, "mdm": MaskedDiffusionLM}[kind]
    zero_init = TINY_MODULES[kind][1]
    torch.manual_seed(0)
    model = cls(network_args(module_config(kind, **fields), 0))  # the network alone (no build_model's finish_build)
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "ada" in name or name.startswith(zero_init):
                    p.normal_(0, 0.2)
    return model


def image_batch(n: int = 6, seed: int = 0):
    """n random 1x8x8 images in [-1, 1] and labels in 0..9."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g) * 2 - 1, torch.randint(10, (n,), generator=g)


def grads_of_one_block(model, b: int) -> set[str]:
    """After a training step on block b: no other block's parameter has a gradient (one block per step),
    block b's layers got one; returns the names of every parameter with a nonzero gradient."""
    for name, p in model.named_parameters():
        unit = model.param_unit(name)
        if unit.startswith("block") and unit != f"block{b}":
            assert p.grad is None, name
    got = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any(n.startswith(f"blocks.{b}.") for n in got)
    return got
