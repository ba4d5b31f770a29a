"""An engine whose attention backend cannot serve the lookahead branch starts,
says so in one log line naming the backend, and drafts from prompt lookup
with the planner: no crash at start or at the first request, output
identical to vanilla vLLM (greedy, float32, real prompts, batched).

The backend is made unservable here by a layout probe that fails, as it
would on a backend whose cache the probe cannot read."""

from __future__ import annotations

import logging

import pytest

from tests.engine_utils import engine, first_mismatch, generate_ids, real_prompt_ids, token_prompts

pytestmark = pytest.mark.e2e


def test_unservable_backend_falls_back_to_prompt_lookup(smollm2_path, monkeypatch):
    from vllm import SamplingParams

    from vllm_lookahead import get_lookahead_stats, worker
    from vllm_lookahead.branch.kv_layout import UnsupportedLayout

    prompts = token_prompts(real_prompt_ids(smollm2_path, 3, 2))
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    with engine(smollm2_path) as llm:
        vanilla = generate_ids(llm, prompts, greedy)

    def probe(*args, **kwargs):
        raise UnsupportedLayout("test: a page layout the probe cannot read")

    monkeypatch.setattr(worker, "probe_page_layout", probe)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.vllm_lookahead.proposer")  # the proposer's logger
    log.addHandler(handler)
    try:
        with engine(smollm2_path, speculative_config={"method": "lookahead"}) as llm:
            ours = generate_ids(llm, prompts, greedy)
            stats = get_lookahead_stats(llm)
    finally:
        log.removeHandler(handler)
    for i, (a, b) in enumerate(zip(vanilla, ours)):
        assert a == b, (i, first_mismatch(a, b))
    why = stats["trees_unsupported"]
    assert why and "CPUAttentionBackendImpl" in why and "probe cannot read" in why, why
    assert stats["fused_trees"] == 0 and stats["lookahead_passes"] == 0
    assert stats["arm_steps"]["tree"] == 0
    assert stats["cost_model"]["source"] == "assumed"
    logged = [r.getMessage() for r in records if "cannot run on this engine" in r.getMessage()]
    assert len(logged) == 1 and "attention backend CPUAttentionBackendImpl" in logged[0]
