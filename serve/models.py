"""The names this server answers to: the model, and one alias NAME@K per offered K.

lm-evaluation-harness's log-likelihood payload cannot carry extra fields, so K travels in the model
name there. Any NAME@K with K in 1..max is accepted; /v1/models lists the powers of two, the model's
block count and the server default. Models without K (gpt) have no aliases.
"""

from __future__ import annotations

import time

from looped_lm.engine.engine import Engine
from looped_lm.serve.errors import APIError
from looped_lm.serve.protocol import ModelCard, ModelList


class ServedModels:
    def __init__(self, name: str, engine: Engine):
        if not name or "@" in name:
            raise ValueError(f"served model name {name!r} must be non-empty and contain no '@'")
        self.name, self.engine, self.created = name, engine, int(time.time())

    @property
    def has_iterations(self) -> bool:
        return self.engine.limits is not None

    def offered_iterations(self) -> list[int]:
        if not self.has_iterations:
            return []
        top = self.engine.max_iterations
        ks = {2 ** i for i in range(top.bit_length()) if 2 ** i <= top} | {top, self.engine.default_iterations}
        blocks = self.engine.limits.num_blocks
        if blocks <= top:
            ks.add(blocks)
        return sorted(ks)

    def resolve(self, requested: str | None, num_iterations: int | None) -> tuple[str, int | None]:
        """(the name to answer with, the K asked for: None = the server default). Only the name is checked
        here; the K itself is checked with the request's other settings (`Engine.resolve`)."""
        name = self.name if requested is None else requested  # "" names no model: 404, not the default
        base, at, k_text = name.partition("@")
        if base != self.name or (at and not (self.has_iterations and k_text.isdigit() and k_text[0] != "0")):
            raise APIError(404, f"The model `{name}` does not exist (this server has `{self.name}`"
                                + (f" and aliases `{self.name}@K`" if self.has_iterations else "") + ")",
                           param="model", code="model_not_found")
        alias_k = int(k_text) if at else None
        if alias_k is not None and num_iterations is not None and alias_k != num_iterations:
            raise APIError.bad_request(f"num_iterations={num_iterations} contradicts the model alias `{name}`",
                                       "num_iterations")
        return name, num_iterations if num_iterations is not None else alias_k

    def cards(self) -> ModelList:
        limits = self.engine.limits
        blocks = limits.num_blocks if limits and limits.default_bridge else None  # DiffusionBlocks models only
        common = dict(created=self.created, root=self.name, max_model_len=self.engine.max_len, num_blocks=blocks)
        data = [ModelCard(id=self.name, num_iterations=self.engine.default_iterations, **common)]
        data += [ModelCard(id=f"{self.name}@{k}", parent=self.name, num_iterations=k, **common)
                 for k in self.offered_iterations()]
        return ModelList(data=data)
