"""looped_lm: language models trained with DiffusionBlocks, with end-to-end and BPTT baselines."""

__version__ = "0.1.0"

from looped_lm.hf import install_hook as _install_hf_hook  # noqa: E402  (cheap: no transformers import)

_install_hf_hook()  # AutoConfig / AutoModelForCausalLM know model_type "looped_lm" once transformers loads
