"""DiffusionBlocks language models: `db_ar` (B untied blocks) and `looped_db` (one weight-tied core)."""

from looped_lm.models.db.model import DiffusionBlocksLM, build

__all__ = ["DiffusionBlocksLM", "build"]
