"""looped_lm: language models trained with DiffusionBlocks, with end-to-end and BPTT baselines."""

__version__ = "0.1.0"
