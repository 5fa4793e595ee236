"""A checkpoint's manifest.json as a typed value: built in one place (`Manifest.of`: a run's saves and
`looped_lm merge`), read back field by field (`Manifest.from_dict` after checkpoint.read_manifest's checks).

On disk it stays the JSON object it always was: `to_dict` writes exactly the keys that are set (a field left
None is a key the manifest does not have), in the order earlier versions wrote them, so the same run writes
the same manifest, and `from_dict(d).to_dict() == d` for any manifest read (format 1 and 2; keys this version
does not know are kept in `extra`). checkpoint.write_manifest adds the integrity record (files, hashes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from looped_lm.config import Config
from looped_lm.kinds import kind_of

OPTIMIZER_BY_UNIT = "units"  # optimiser state by parameter name: any ZeRO stage, world size or mode resumes it
OPTIMIZER_BY_DEEPSPEED = "deepspeed"  # DeepSpeed's own engine files (checkpoints from before units)
STATELESS_SAMPLING = "stateless: batch(seed, step, micro_step, rank)"


@dataclass(frozen=True)
class Manifest:
    # what the run is (every verb reads these)
    config: dict | None = None
    model_kind: str | None = None
    vocab_size: int | None = None
    tokenizer: str | None = None
    model_state: dict | None = None  # the model's own metadata (edges...): checkpoint_state()
    data: dict | None = None  # {"dir", "position": {"step", "tokens_seen"}, "sampling"}
    world_size: int | None = None
    optimizer_layout: str | None = None  # None: written before the layout was recorded (DeepSpeed's files)
    conversion: dict | None = None  # train.max_steps 0: the model as built, weights only
    base: dict | None = None  # the pretrained source a run started from: {"path", "sha256", ...}
    ownership: dict | None = None  # {"blocks": [...]}: the blocks this checkpoint's run trained
    merged_from: list | None = None  # `looped_lm merge`: its inputs
    step: int | None = None
    # the integrity record (checkpoint.write_manifest); format 1 held weights_sha256 instead of files
    format_version: int | None = None
    looped_lm_version: str | None = None
    files: dict | None = None
    weights_sha256: str | None = None
    weights_dtypes: dict | None = None
    manifest_sha256: str | None = None
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as read

    @classmethod
    def of(cls, cfg: Config, *, vocab_size: int, tokenizer: str, model_state: dict, data: dict, world_size: int,
           step: int, optimizer_layout: str | None = None, conversion: dict | None = None, base: dict | None = None,
           merged_from: list | None = None) -> Manifest:
        """The one constructor of a new manifest (trainer/saving.run_manifest, merge): the config, its kind,
        and, for a kind whose block jobs merge, the blocks the config trains (`ownership`)."""
        owns = kind_of(cfg).offers("merge")
        return cls(config=cfg.to_dict(), model_kind=cfg.model.kind, vocab_size=vocab_size, tokenizer=tokenizer,
                   model_state=model_state, data=data, world_size=world_size, optimizer_layout=optimizer_layout,
                   conversion=conversion, base=base,
                   ownership={"blocks": cfg.diffusion.trained_blocks()} if owns else None,
                   merged_from=merged_from, step=step)

    @classmethod
    def from_dict(cls, raw: dict) -> Manifest:
        """A manifest as read (checkpoint.read_manifest has checked its fields' types)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        typed = {k: v for k, v in raw.items() if k in known and v is not None}  # a null stays a key, in extra
        return cls(**typed, extra={k: v for k, v in raw.items() if k not in typed})

    def to_dict(self) -> dict:
        """The JSON object on disk: every field that is set, in the order of the fields, then `extra`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra" and getattr(self, f.name) is not None}
        return {**out, **self.extra}

    def replace(self, **changes) -> Manifest:
        return dataclasses.replace(self, **changes)

    @property
    def layout(self) -> str:
        """units: optimiser state by parameter name; deepspeed: DeepSpeed's own files (older checkpoints)."""
        return self.optimizer_layout or OPTIMIZER_BY_DEEPSPEED

    @property
    def state(self) -> dict:
        return self.model_state or {}

    @property
    def edges(self) -> list[float]:
        return [float(e) for e in self.state.get("edges", [])]

    @property
    def owned_blocks(self) -> list[int] | None:
        """The blocks its run trained, None where the manifest does not say (a kind that does not merge)."""
        return sorted(self.ownership["blocks"]) if self.ownership else None

    @property
    def tokens_seen(self) -> int:
        return (self.data or {}).get("position", {}).get("tokens_seen", 0)

    @property
    def weights_only(self) -> str | None:
        """What a checkpoint without optimizer and RNG state is (None: a training checkpoint): a merge of block
        jobs, which no run resumes, or a conversion (train.max_steps 0), which a run resumes at step 0 with a
        fresh optimizer, as a run from the same source would start."""
        if self.merged_from is not None:
            return "a merge of block jobs (`looped_lm merge`)"
        if self.conversion is not None:
            return "the model as built, before any step (train.max_steps 0)"
        return None
