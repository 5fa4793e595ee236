"""The tensor files of a checkpoint: the weights (`model.safetensors`: written by safetensors' own save, read
back only after their names, shapes, dtypes and finiteness are checked against the model the manifest builds)
and each rank's RNG states (`rng/rank{r}.pt`). checkpoint.py holds the layout, the manifest and its checks,
and imports this module only where tensors are read or written (torch costs seconds at start-up)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from looped_lm.errors import UserError
from looped_lm.lora import adapter_names, adapter_state, is_adapted, rebuilt_names

# the dtypes a save writes for a floating tensor: fp32, or DeepSpeed's bf16 weights (deepspeed.bf16 at ZeRO 0)
WRITTEN_FLOAT_DTYPES = ("F32", "BF16")
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def save_weights(model, path: Path) -> None:
    """safetensors' own save: tied tensors are stored once (load_weights restores the aliases)."""
    bad = nonfinite_tensor(model.state_dict().items())
    if bad is not None:  # a diverged state is never written (and so never prunes a finite checkpoint)
        raise UserError(f"the weights hold NaN or Inf ({bad}): not saved to {path}")
    if is_adapted(model):  # LoRA: the adapters and new parts only; the base is model.init_from's (its sha256)
        save_file(adapter_state(model), str(path), metadata={"format": "looped_lm", "content": "adapters"})
        return
    tensors = list(model.state_dict().values())
    if any(t.untyped_storage().nbytes() != t.numel() * t.element_size() for t in tensors):
        # ZeRO 1/2 turn parameters into views of one flat buffer, which safetensors cannot tell from a
        # partial tie: save a copy whose tensors own their storage (deepcopy keeps tied ones tied)
        model = copy.deepcopy(model)
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    save_model(model, str(path), metadata={"format": "looped_lm"})


def weights_header(path: Path) -> tuple[dict, dict]:
    """({name: shape}, {name: safetensors dtype such as "F32"}) from a safetensors header (no tensor read)."""
    try:
        with safe_open(str(path), "pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            return ({k: tuple(s.get_shape()) for k, s in slices.items()},
                    {k: s.get_dtype() for k, s in slices.items()})
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def nonfinite_tensor(named) -> str | None:
    """The name of the first floating tensor of `named` ((name, tensor) pairs) that holds NaN or Inf, else
    None: one flag per tensor, read from the device once."""
    floats = [(n, t) for n, t in named if t.is_floating_point() and t.device.type != "meta"]
    if not floats:
        return None
    flags = torch.stack([torch.isfinite(t).all().to(floats[0][1].device) for _, t in floats])
    if bool(flags.all()):
        return None
    return next(n for (n, _), ok in zip(floats, flags.tolist()) if not ok)


def refuse_nonfinite(path: Path, name: str | None) -> None:
    if name is not None:
        raise UserError(f"{path} holds {name} with NaN or Inf values: refusing to load it (the weights of a diverged "
                        "run; an earlier checkpoint of the run may be finite)")


def check_finite_file(path: Path) -> None:
    """Every floating tensor of a safetensors file is finite (read one tensor at a time)."""
    try:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                refuse_nonfinite(path, nonfinite_tensor([(name, f.get_tensor(name))]))
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def check_weights_fit(path: Path, model, recorded_dtypes: dict | None = None) -> None:
    """Names, shapes and dtypes in the safetensors header against the model the manifest builds, and the
    dtypes against those the manifest records (`weights_dtypes`; absent in older checkpoints)."""
    shapes, dtypes = weights_header(path)
    state = model.state_dict(keep_vars=True)
    required = None
    if is_adapted(model):  # an adapter checkpoint holds the adapters only (the base is model.init_from's)
        required = set(adapter_names(model))  # and may hold the frozen zero `ada` weights (older ones did)
        names = required | set(rebuilt_names(model))
        state = {n: t for n, t in state.items() if n in names}
    want = {k: tuple(v.shape) for k, v in state.items()}
    for name, shape in sorted(shapes.items()):
        if name not in want:
            raise UserError(f"{path} holds {name}, which the model in its manifest does not have")
        if want[name] != shape:  # (vocab_size, config.model.* and model_state build the model)
            raise UserError(f"{path} holds {name} of shape {list(shape)}, but the model in its manifest has "
                            f"{list(want[name])}")
        check_dtype(path, name, dtypes[name], state[name], (recorded_dtypes or {}).get(name))
    by_tensor: dict = {}  # tied tensors (one object under several names) are stored once
    for name, t in state.items():
        by_tensor.setdefault(id(t), []).append(name)
    for names in by_tensor.values():
        if not any(n in shapes for n in names) and (required is None or any(n in required for n in names)):
            raise UserError(f"{path} lacks {names[0]}, which the model in its manifest has")


def check_dtype(path: Path, name: str, dtype: str, tensor, recorded: str | None) -> None:
    """A tensor's stored dtype: the one its manifest records, and one a save writes for the model's tensor
    (a load would otherwise convert an fp16 or int64 rewrite silently)."""
    if recorded is not None and dtype != recorded:
        raise UserError(f"{path} holds {name} as {dtype}, but its manifest records {recorded}")
    own = SAFETENSORS_DTYPES.get(str(tensor.dtype).removeprefix("torch."), str(tensor.dtype))
    allowed = WRITTEN_FLOAT_DTYPES if tensor.is_floating_point() else (own,)
    if dtype not in allowed:
        raise UserError(f"{path} holds {name} as {dtype}, but the model in its manifest has {own} "
                        f"(a save writes {' or '.join(allowed)})")


def load_weights(model, path: Path, device="cpu", recorded_dtypes: dict | None = None) -> None:
    """Weights from a checked safetensors file into `model`: names, shapes and dtypes must all match,
    and every value must be finite."""
    check_weights_fit(path, model, recorded_dtypes)
    if is_adapted(model):  # adapters over a base already loaded (pretrained.load_base): exactly the adapters
        tensors = load_file(str(path), device=str(device))
        missing = sorted(set(adapter_names(model)) - set(tensors))
        if missing:
            raise UserError(f"{path} does not hold {missing[0]}: not the adapters of the model in its manifest")
        refuse_nonfinite(path, nonfinite_tensor(tensors.items()))
        model.load_state_dict(tensors, strict=False)
        return
    try:
        load_model(model, str(path), strict=True, device=str(device))
    except RuntimeError as e:  # missing tensors: the shapes matched, the names did not all
        raise UserError(f"{path} does not fit the model in its manifest: "
                        f"{str(e).strip().splitlines()[-1].strip()}") from None
    refuse_nonfinite(path, nonfinite_tensor(model.state_dict().items()))


def rng_state() -> dict:
    """This process's torch, numpy and python RNG states (a resumed run continues every stream)."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def write_rank_files(tmp: Path, rank: int) -> None:
    """Per-rank part of a save (all ranks, before the barrier)."""
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank{rank}.pt")
