"""Models and prompt sets: the models a run can use and the prompts of each
dataset, as token ids for one model's tokenizer."""

from __future__ import annotations

from pathlib import Path

DATASETS = ("humaneval", "mtbench")
MODEL_NAMES = ("smollm2", "qwen-coder")  # vllm_lookahead.tools.MODELS


def _prepare_model(name: str) -> Path:
    from vllm_lookahead.tools import MODELS

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name]()


def _load_prompts(dataset: str, n: int, tokenizer) -> list[list[int]]:
    from vllm_lookahead.tools import chat_prompts, load_humaneval, load_mtbench

    if dataset == "humaneval":
        texts = load_humaneval(n)
    elif dataset == "mtbench":
        texts = chat_prompts(tokenizer, load_mtbench(n))
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    # Token ids, like the demo: no tokenizer-added BOS, the same ids for
    # every method.
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
