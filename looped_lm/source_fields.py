"""The model fields a pretrained source decides (`model.init_from`): what `load_config` takes from the source
where the user left them unset, and the one-line refusal where the user set another value."""

from __future__ import annotations

import numpy as np

from looped_lm.errors import UserError
from looped_lm.fields import DEFAULT_KIND
from looped_lm.kinds import get_kind, registered


SOURCE_SHAPE_FIELDS = ("d_model", "n_heads", "ffn_hidden", "norm_eps", "rope_theta", "vocab_size", "head_dim",
                       "qkv_bias", "qk_norm", "tie_embeddings", "attn_scalar", "sandwich_norm", "mlp_activation",
                       "embed_scale", "layer_types", "sliding_window", "rope_local_theta")
# 0 means "work it out": with a source, the source's
SOURCE_AUTO_ZERO = ("vocab_size", "ffn_hidden", "head_dim", "attn_scalar", "rope_local_theta")


def with_source_shape(raw: dict, source_shape) -> dict:
    """`raw` with the model fields a pretrained source decides (SOURCE_SHAPE_FIELDS, and n_layers where the kind
    maps every source layer) taken from the source where the user left them unset; a field the user set to
    another value is refused in one line (numbers compare as float32, as the GGUF stores them)."""
    model = raw.get("model")
    if not isinstance(model, dict) or not model.get("init_from"):
        return raw
    kind = model.get("kind", DEFAULT_KIND)
    if not (isinstance(kind, str) and kind in registered() and get_kind(kind).offers("init_from")):
        return raw  # the kind's own check refuses init_from (or the kind) in one line, naming the kind
    shape = dict(source_shape(str(model["init_from"])))
    n_source = shape.pop("n_source_layers")
    n_layers = get_kind(kind).source_n_layers(model, n_source)
    if n_layers is not None:
        shape["n_layers"] = n_layers
    filled = dict(model)
    for key, value in shape.items():
        if key not in model or (key in SOURCE_AUTO_ZERO and model[key] == 0):
            filled[key] = value
        elif not _same_number(model[key], value):
            has = f"{value!r}" if key != "n_layers" else \
                f"{n_source} layers ({value} for model.n_layers beside model.n_prelude and model.n_coda)"
            raise UserError(f"model.{key} is {model[key]!r} but model.init_from {model['init_from']} has {has}: "
                            f"leave model.{key} unset to take the source's")
    return {**raw, "model": filled}


def _same_number(a, b) -> bool:
    """Equal as float32 (the GGUF's 9.999999747378752e-06 is 1e-5); a YAML string such as '1e-5' is read as a number."""
    try:
        a, b = float(a), float(b)
    except (TypeError, ValueError):
        return a == b
    return bool(np.float32(a) == np.float32(b))
