"""Request lifecycle with lookahead: every way a request can end or pause
gives vanilla vLLM's greedy output, and frees the proposer's state.

SmolLM2-135M-Instruct, float32, greedy. Scenarios: tiny ``max_tokens``
(drafts longer than what is left), stop strings that trigger mid-draft, EOS,
more requests than ``max_num_seqs``, abort mid-generation (LLMEngine API),
preemption (a KV cache of three blocks); the soak is tests/test_e2e_soak.py.
After each one (and a ``flush``: vLLM tells the workers about finished
requests in the next step) the proposer holds no request state.
"""

from __future__ import annotations

import pytest

from tests.engine_utils import (
    LOOKAHEAD,
    engine,
    first_mismatch,
    flush,
    proposer,
    real_prompt_ids,
    token_prompts,
)

pytestmark = pytest.mark.e2e

#: Engine of most scenarios: few slots, so most of them also queue requests.
MAX_NUM_SEQS = 3
#: SmolLM2-135M: 30 layers x (K + V) x 3 KV heads x 64 x float32, 128-token
#: blocks on CPU.
KV_BLOCK_BYTES = 30 * 2 * 3 * 64 * 4 * 128
EOS_QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "Say hello.",
    "Is the sun a star? Answer yes or no.",
]


# --------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_ids(smollm2_path):
    """12 real prompts: 6 HumanEval, 6 MT-Bench first turns (chat)."""
    return real_prompt_ids(smollm2_path, 6, 6)


@pytest.fixture(scope="module")
def la(smollm2_path):
    with engine(smollm2_path, LOOKAHEAD, max_num_seqs=MAX_NUM_SEQS) as llm:
        yield llm


@pytest.fixture(scope="module")
def va(smollm2_path):
    with engine(smollm2_path, max_num_seqs=16) as llm:
        yield llm


def greedy(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, **kwargs)


def run(llm, token_lists, params):
    """Completions (``CompletionOutput``) of the prompts, submitted together."""
    outs = llm.generate(token_prompts(token_lists), params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_same_tokens(got, want):
    bad = [
        (i, first_mismatch(list(g.token_ids), list(w.token_ids)))
        for i, (g, w) in enumerate(zip(got, want))
        if list(g.token_ids) != list(w.token_ids)
    ]
    assert len(got) == len(want)
    assert not bad, f"differ from vanilla (index, first bad token): {bad}"


def assert_freed(llm):
    flush(llm)
    drafter = proposer(llm)
    assert drafter.states == {}, sorted(drafter.states)
    st = drafter.get_stats()
    assert st["live_requests"] == 0 and st["pool_ngrams"] == 0, st


class DraftRecorder:
    """Wraps the proposer instance's ``propose_for_runner`` to record the
    draft lengths it hands vLLM."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.lengths: list[int] = []

    def __enter__(self):
        inner = self.drafter.propose_for_runner

        def wrapped(runner, sampled):
            drafts = inner(runner, sampled)
            self.lengths.extend(len(d) for d in drafts if d)
            return drafts

        self.drafter.propose_for_runner = wrapped
        return self

    def __exit__(self, *exc):
        del self.drafter.propose_for_runner  # back to the class method


# --------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [(1, 2, 3), (17,)], ids=["1-2-3", "17"])
def test_small_max_tokens(la, va, prompt_ids, max_tokens):
    """Exactly ``max_tokens`` tokens, equal to vanilla, although drafts run
    past max_tokens: a request with r tokens left is verified on drafts of up
    to 4 tokens (vLLM schedules whole drafts), so up to 5 - r tokens too many
    can be accepted; e.g. a max_tokens=1 request still gets a draft after its
    prefill, a max_tokens=2 one overshoots with any accepted draft token."""
    prompts = prompt_ids[:2] + prompt_ids[6:8]
    tokens = [p for p in prompts for _ in max_tokens]
    params = [greedy(max_tokens=m) for _ in prompts for m in max_tokens]
    want = run(va, tokens, params)
    with DraftRecorder(proposer(la)) as rec:
        got = run(la, tokens, params)
    assert_same_tokens(got, want)
    for g, p in zip(got, params):
        assert len(g.token_ids) == p.max_tokens and g.finish_reason == "length", g
    if max(max_tokens) > 3:
        # Fused mode drafts the checked chain minus its last token, so a
        # request's first steps may carry no draft; 17 tokens always do.
        assert rec.lengths, "no drafts"
        assert max(rec.lengths) >= 2, rec.lengths  # multi-token drafts too
    assert_freed(la)


def _stop_string(text: str, prefix: str) -> str | None:
    """A stop string that first occurs right after ``prefix`` in ``text``."""
    if not text.startswith(prefix):
        return None
    for width in (4, 6, 8, 12):
        s = text[len(prefix) : len(prefix) + width]
        if len(s) == width and s.strip() and text.find(s) == len(prefix):
            return s
    return None


def test_stop_strings(la, va, prompt_ids, smollm2_path):
    """Stop strings taken from vanilla's output (so they trigger mid
    generation, where lookahead accepts several tokens per step): same text,
    same tokens, finish_reason "stop"."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    prompts = prompt_ids[:3] + prompt_ids[6:9]
    full = run(va, prompts, greedy(max_tokens=48))
    cases = []
    for p, out in zip(prompts, full):
        ids = list(out.token_ids)
        for k in range(10, 30):
            stop = _stop_string(out.text, tok.decode(ids[:k]))
            if stop is not None:
                cases.append((p, stop, out.text[: out.text.find(stop)]))
                break
    assert len(cases) >= 4, "no usable stop strings in vanilla's outputs"
    tokens = [c[0] for c in cases]
    params = [greedy(max_tokens=48, stop=[c[1]]) for c in cases]
    want = run(va, tokens, params)
    got = run(la, tokens, params)
    for (_, stop, text), w, g in zip(cases, want, got):
        assert w.text == text and w.finish_reason == "stop" and w.stop_reason == stop
        assert (g.text, g.finish_reason, g.stop_reason) == (text, "stop", stop)
    assert_same_tokens(got, want)
    assert_freed(la)


def test_eos(la, va, smollm2_path):
    """Chat answers that end with EOS well before max_tokens: same tokens
    (EOS included), finish_reason "stop" with no stop string."""
    from transformers import AutoTokenizer

    from vllm_lookahead.tools import chat_prompts

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    prompts = [
        tok(t, add_special_tokens=False)["input_ids"] for t in chat_prompts(tok, EOS_QUESTIONS)
    ]
    params = greedy(max_tokens=96)
    want = run(va, prompts, params)
    for w in want:  # precondition: vanilla ends with EOS
        assert w.finish_reason == "stop" and w.stop_reason is None, w
        assert w.token_ids[-1] == tok.eos_token_id and len(w.token_ids) < 96, w
    got = run(la, prompts, params)
    assert_same_tokens(got, want)
    assert all(g.finish_reason == "stop" and g.stop_reason is None for g in got)
    assert_freed(la)


def test_more_requests_than_max_num_seqs(la, va, prompt_ids):
    """10 prompts through 3 slots: requests wait, start as others finish."""
    prompts = prompt_ids[:5] + prompt_ids[6:11]
    params = greedy(max_tokens=24)
    want = run(va, prompts, params)
    got = run(la, prompts, params)
    assert_same_tokens(got, want)
    assert_freed(la)


def test_abort_mid_generation(la, va, prompt_ids):
    """LLMEngine API: abort a running request after a few steps (its state
    is freed on the next step) and a waiting one; the others finish with
    vanilla's output."""
    prompts = [prompt_ids[0], prompt_ids[6], prompt_ids[1], prompt_ids[7]]
    params = greedy(max_tokens=32)
    want = run(va, prompts, params)
    eng = la.llm_engine
    drafter = proposer(la)
    names = [f"abort-test-{i}" for i in range(len(prompts))]
    internal = {
        n: eng.add_request(n, tp, params) for n, tp in zip(names, token_prompts(prompts))
    }
    done = {}

    def step():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out

    for _ in range(4):
        step()
    running, waiting = names[1], names[3]  # 3 slots: the 4th request waits
    assert internal[running] in drafter.states
    assert internal[waiting] not in drafter.states
    eng.abort_request([running, waiting])
    step()
    assert internal[running] not in drafter.states
    while eng.has_unfinished_requests():
        step()
    for i in (0, 2):
        assert list(done[names[i]].outputs[0].token_ids) == list(want[i].token_ids), i
    assert_freed(la)


@pytest.fixture(scope="module")
def small_kv(smollm2_path):
    """Lookahead engine with a KV cache of 3 blocks (384 tokens).

    Module-scoped on purpose: shutting an in-process engine down tears down
    vLLM's global parallel state ("pipeline model parallel group is not
    initialized" in every engine still alive), so no engine may be closed
    while ``la`` / ``va`` are still in use.
    """
    with engine(
        smollm2_path,
        LOOKAHEAD,
        max_num_seqs=3,
        max_model_len=256,
        kv_cache_memory_bytes=3 * KV_BLOCK_BYTES,
    ) as llm:
        yield llm


def test_preemption(small_kv, va, prompt_ids):
    """3 requests that each need 2 of the 3 KV blocks: vLLM preempts and
    later resumes them (recomputing their KV); output still equals
    vanilla."""
    prompts = [p for p in prompt_ids if 100 <= len(p) <= 126][:3]
    assert len(prompts) == 3
    params = greedy(max_tokens=40)
    want = run(va, prompts, params)
    sched = small_kv.llm_engine.engine_core.engine_core.scheduler
    preempted = []
    inner = sched._preempt_request

    def counting(request, *args, **kwargs):
        preempted.append(request.request_id)
        return inner(request, *args, **kwargs)

    sched._preempt_request = counting
    try:
        got = run(small_kv, prompts, params)
    finally:
        del sched._preempt_request  # back to the class method
    assert preempted, "vLLM did not preempt: the test proves nothing"
    assert_same_tokens(got, want)
    assert_freed(small_kv)
