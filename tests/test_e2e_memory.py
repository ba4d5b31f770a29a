"""The shared memory end to end (SmolLM2-135M-Instruct, float32, greedy):
output identical to vanilla vLLM with the memory on, for repeated prompts,
copies of one prompt running together and batches; drafts from the memory are accepted; requests of
another ``cache_salt`` and requests that opt out never draft from it;
``reset_prefix_cache`` clears it."""

from __future__ import annotations

import pytest

from tests.engine_utils import (
    LOOKAHEAD,
    engine,
    first_mismatch,
    flush,
    generate_ids,
    proposer,
    real_prompt_ids,
    token_prompts,
)

pytestmark = pytest.mark.e2e

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def ids(smollm2_path):
    return real_prompt_ids(smollm2_path, 3, 3)


@pytest.fixture(scope="module")
def vanilla(smollm2_path, ids):
    from vllm import SamplingParams

    with engine(smollm2_path, max_num_seqs=16) as llm:
        return generate_ids(llm, token_prompts(ids), SamplingParams(temperature=0.0,
                                                                    max_tokens=MAX_TOKENS))


def _memory_accepted(llm) -> int:
    flush(llm)
    return proposer(llm).get_stats()["accepted_by_source"]["memory"]


def _salted(ids, salt):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(t), cache_salt=salt) for t in ids]


def test_memory_exact_repeated_and_n_samples_isolated_and_cleared(smollm2_path, ids, vanilla):
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with engine(smollm2_path, LOOKAHEAD, max_num_seqs=16) as llm:
        # First pass (batched), then the same prompts again one at a time:
        # the second pass finds the first's answers in the memory.
        first = generate_ids(llm, token_prompts(ids), greedy, batch=True)
        before = _memory_accepted(llm)
        again = generate_ids(llm, token_prompts(ids), greedy, batch=False)
        repeat_gain = _memory_accepted(llm) - before
        # Three copies of each prompt at once (vLLM refuses n > 1 when
        # greedy; greedy copies are what n samples are at temperature 0).
        copies = generate_ids(llm, token_prompts([t for t in ids for _ in range(3)]), greedy)
        n_samples = [copies[3 * i: 3 * i + 3] for i in range(len(ids))]
        for run in (first, again):
            for i, (got, want) in enumerate(zip(run, vanilla)):
                assert got == want, (i, first_mismatch(got, want))
        for i, samples in enumerate(n_samples):
            assert len(samples) == 3 and all(s == vanilla[i] for s in samples), i
        assert repeat_gain > len(ids) * 4, repeat_gain

        stats = proposer(llm).get_stats()["shared_memory"]
        assert stats["documents"] > 0 and stats["tokens"] <= stats["capacity_tokens"]
        # every step ran the full tree (LOOKAHEAD: adaptive off): the
        # windows' n-grams went to the memory too
        assert stats["harvested_ngrams"] > 0, stats

        # cache_salt: a tenant drafts only from its own text.
        one = ids[:2]
        generate_ids(llm, _salted(one, "tenant-a"), greedy)
        before = _memory_accepted(llm)
        out_b = generate_ids(llm, _salted(one, "tenant-b"), greedy, batch=False)
        assert _memory_accepted(llm) == before  # nothing of tenant-a's, nor the unsalted
        out_a = generate_ids(llm, _salted(one, "tenant-a"), greedy, batch=False)
        assert _memory_accepted(llm) > before
        assert out_a == out_b == vanilla[:2]

        # A request that opts out neither reads nor feeds the memory.
        docs = proposer(llm).get_stats()["shared_memory"]["documents"]
        before = _memory_accepted(llm)
        opt_out = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                 extra_args={"lookahead": {"shared_memory": False}})
        out = generate_ids(llm, token_prompts(ids[:2]), opt_out, batch=False)
        assert out == vanilla[:2]
        assert _memory_accepted(llm) == before
        assert proposer(llm).get_stats()["shared_memory"]["documents"] == docs

        # vLLM's reset_prefix_cache clears the memory (patch 13).
        assert llm.reset_prefix_cache()
        cleared = proposer(llm).get_stats()["shared_memory"]
        assert cleared["documents"] == 0 and cleared["harvested_ngrams"] == 0
        before = _memory_accepted(llm)
        out = generate_ids(llm, token_prompts(ids[:1]), greedy, batch=False)
        assert out == vanilla[:1] and _memory_accepted(llm) == before


def test_memory_off_by_setting(smollm2_path, ids, vanilla):
    from vllm import SamplingParams

    spec = {**LOOKAHEAD, "shared_memory": False}
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with engine(smollm2_path, spec, max_num_seqs=16) as llm:
        for _ in range(2):
            assert generate_ids(llm, token_prompts(ids[:2]), greedy) == vanilla[:2]
        st = proposer(llm).get_stats()
        assert st["shared_memory"] is None and st["accepted_by_source"]["memory"] == 0


def test_lookups_past_n_exact_and_drafted_long(smollm2_path, ids, vanilla):
    """``lookup_len`` 24 (lookups past N, as far as their match is long):
    output identical to vanilla, batched and asked again one at a time,
    and drafts of more than N tokens were verified, some of them from
    matches of the request's own text past 4 tokens."""
    from vllm import SamplingParams

    spec = {"method": "lookahead", "lookup_len": 24, "cost_model": "off"}
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with engine(smollm2_path, spec, max_num_seqs=16) as llm:
        assert llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens == 24
        first = generate_ids(llm, token_prompts(ids), greedy, batch=True)
        again = generate_ids(llm, token_prompts(ids), greedy, batch=False)
        for run in (first, again):
            for i, (got, want) in enumerate(zip(run, vanilla)):
                assert got == want, (i, first_mismatch(got, want))
        flush(llm)
        st = proposer(llm).get_stats()
        shapes = st["shape_steps"]
        past_n = {s: c for s, c in shapes.items()
                  if s.startswith("draft:") and int(s.split(":")[1]) > 4}
        assert past_n, shapes
        assert st["accepted_by_source"]["memory"] > 0
        # the request's own text matched past 4 tokens, learnt by length
        long = [k for k in st["drafts_by_kind"] if k.rstrip("+-") in ("suffix8", "suffix16",
                                                                       "suffix24")]
        assert long, st["drafts_by_kind"]
