"""Helpers for the end-to-end tests: in-process, eager vLLM engines."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: Engine settings shared by every e2e test (float32: exact-match tests).
ENGINE_DEFAULTS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=2048,
    seed=0,
    kv_cache_memory_bytes=512 << 20,
)

#: N=4 W=5 G=5; lookahead on at every batch size (the CPU default turns it
#: off from 2 decoding requests, which would leave batching untested) and at
#: every step (no pay-off gate: its timing-driven choices would make the
#: statistics the tests check vary from run to run).
LOOKAHEAD = {
    "method": "lookahead",
    "ngram_size": 4,
    "window_size": 5,
    "guess_set_size": 5,
    "disable_batch_size": 0,
    "adaptive": False,
}


def make_llm(model, speculative_config=None, **kwargs):
    from vllm import LLM

    args = {**ENGINE_DEFAULTS, **kwargs}
    return LLM(str(model), speculative_config=speculative_config, **args)


@contextmanager
def engine(model, speculative_config=None, **kwargs):
    """An LLM that is shut down and freed on exit."""
    llm = make_llm(model, speculative_config, **kwargs)
    try:
        yield llm
    finally:
        shutdown(llm)


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def runner(llm):
    """The model runner of an in-process engine."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def proposer(llm):
    return runner(llm).drafter


def flush(llm) -> None:
    """Run the engine step that tells the workers about requests finished in
    the last step (vLLM sends finished ids with the next schedule)."""
    core = llm.llm_engine.engine_core.engine_core
    while core.scheduler.has_requests():
        core.step()


def token_prompts(token_lists):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(t)) for t in token_lists]


def generate_ids(llm, prompts, params, batch: bool = True) -> list[list[int]]:
    """Token ids generated for each prompt: all submitted together, or one
    request at a time (batch size 1)."""
    if batch:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]


def real_prompt_ids(model_path, n_humaneval: int, n_mtbench: int) -> list[list[int]]:
    """Token ids of real prompts: HumanEval prompts as raw code completions,
    MT-Bench first turns through the chat template."""
    from transformers import AutoTokenizer

    from vllm_lookahead.tools import chat_prompts, load_humaneval, load_mtbench

    tok = AutoTokenizer.from_pretrained(str(model_path))
    texts = load_humaneval(n_humaneval) + chat_prompts(tok, load_mtbench(n_mtbench))
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def first_mismatch(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))
