"""DiffusionBlocks language models: `db_ar` (B untied blocks) and `looped_db` (one weight-tied core)."""

from looped_lm.models import register
from looped_lm.models.db.model import DiffusionBlocksLM, build

__all__ = ["DiffusionBlocksLM"]

register("db_ar", build)
register("looped_db", build)  # one block (the weight-tied core), prelude and coda around it
