"""The shared memory (vllm_lookahead.algo.memory) and its use in lookups: pure
logic, no engine."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_lookahead.planner.acceptance import LOOKUP_KINDS, AcceptancePrior
from vllm_lookahead.config import LookaheadConfig, request_settings
from vllm_lookahead.algo.drafting import candidates, lookup, new_state
from vllm_lookahead.algo.memory import KEY_LENS, PROMPT_TAIL, SharedMemory, scope_of
from vllm_lookahead.planner.planner import Planner
from vllm_lookahead.algo.state import SOURCE_MEMORY


def _toks(*xs):
    return np.asarray(xs, dtype=np.int32)


def _text(rng, n, vocab=5000):
    return rng.integers(100, vocab, size=n).astype(np.int32)


def test_finds_other_documents_text_after_a_long_key():
    rng = np.random.default_rng(0)
    mem = SharedMemory(4096, delay=4)
    prompt, answer = _text(rng, 40), _text(rng, 30)
    a = mem.open(0, prompt)
    mem.extend(a, answer)
    # Another request with the same prompt asks at the prompt's end.
    b = mem.open(0, prompt)
    cont, m, _ = mem.lookup(0, b, prompt, len(prompt), 4)
    assert m == KEY_LENS[0]
    assert cont == answer[:4].tolist()
    # Its own document is never the answer.
    cont, m, _ = mem.lookup(0, a, prompt, len(prompt), 4)
    assert cont == [] and m == 0


def test_running_text_is_indexed_delay_tokens_late_and_all_at_close():
    rng = np.random.default_rng(1)
    mem = SharedMemory(4096, delay=4)
    prompt = _text(rng, 30)
    answer = _text(rng, 10)
    a = mem.open(0, prompt)
    mem.extend(a, answer)
    text = np.concatenate([prompt, answer])
    # The key ending 2 tokens before the end has only 2 tokens after it:
    # not indexed yet (a match must have `delay` tokens to draft).
    asker = np.concatenate([_text(rng, 5), text[-14:-2]])
    assert mem.lookup(0, None, asker, len(asker), 4)[:2] == ([], 0)
    mem.close(a)
    cont, m, _ = mem.lookup(0, None, asker, len(asker), 4)
    assert cont == text[-2:].tolist() and m == 12


def test_scopes_never_see_each_other():
    rng = np.random.default_rng(2)
    mem = SharedMemory(4096)
    prompt, answer = _text(rng, 30), _text(rng, 20)
    s1, s2 = scope_of("tenant-1"), scope_of("tenant-2")
    assert s1 != s2 and scope_of(None) == 0 and scope_of("tenant-1") == s1
    a = mem.open(s1, prompt)
    mem.extend(a, answer)
    mem.close(a)
    assert mem.lookup(s2, None, prompt, len(prompt), 4)[:2] == ([], 0)
    assert mem.lookup(0, None, prompt, len(prompt), 4)[:2] == ([], 0)
    assert mem.lookup(s1, None, prompt, len(prompt), 4)[0] == answer[:4].tolist()


def test_bounded_oldest_evicted_first_and_no_growth():
    rng = np.random.default_rng(3)
    cap = 2048
    mem = SharedMemory(cap, delay=4)
    first = None
    sizes = []
    for r in range(1000):
        doc = mem.open(0, _text(rng, 50))
        for _ in range(8):
            mem.extend(doc, _text(rng, 8))
        mem.close(doc)
        first = doc if first is None else first
        assert mem.tokens <= cap
        sizes.append(mem.nbytes())
    assert mem.evicted > 900
    # the first document is gone; the newest is there
    assert first not in mem._docs and doc in mem._docs
    assert max(sizes[100:]) <= max(sizes[:100]) * 1.05
    # documents are bounded too (tiny documents)
    mem2 = SharedMemory(256)
    for _ in range(500):
        mem2.open(0, _text(rng, 1))
    assert len(mem2) <= 256 // 16


def test_default_capacity_is_a_few_megabytes():
    mem = SharedMemory(LookaheadConfig().memory_tokens, delay=4)
    rng = np.random.default_rng(4)
    while mem.tokens < mem.capacity - 2000:
        doc = mem.open(0, _text(rng, 100))
        mem.extend(doc, _text(rng, 900))
    # 4 key tables of 2^17 slots (8 bytes each) and 4 chains of 8 bytes a
    # held token: 8 MiB, plus the documents and the n-gram tables
    assert mem.nbytes() < 10 * 2**20


def test_clear_forgets_everything():
    rng = np.random.default_rng(5)
    mem = SharedMemory(1024)
    prompt = _text(rng, 20)
    a = mem.open(0, prompt)
    mem.extend(a, _text(rng, 20))
    mem.close(a)
    mem.clear()
    assert len(mem) == 0 and mem.tokens == 0
    assert mem.lookup(0, None, prompt, len(prompt), 4)[:2] == ([], 0)
    mem.extend(a, _text(rng, 4))  # a cleared document takes nothing
    assert mem.tokens == 0


def test_prompt_tail_only():
    rng = np.random.default_rng(6)
    mem = SharedMemory(1024)
    mem.open(0, _text(rng, 500))
    assert mem.tokens == PROMPT_TAIL


def _state(prior, seeded=False, reads=True, doc=None, scope=0):
    s = new_state(request_settings(None, LookaheadConfig()), _toks(1, 2, 3), 3, 3, None,
                  seeded, 0, prior)
    s.memory_reads, s.memory_doc, s.memory_scope = reads, doc, scope
    return s


def _answered(seed):
    """A memory holding one finished request (prompt, answer)."""
    rng = np.random.default_rng(seed)
    mem = SharedMemory(4096, delay=4)
    prompt, answer = _text(rng, 30), _text(rng, 12)
    a = mem.open(0, prompt)
    mem.extend(a, answer)
    mem.close(a)
    return rng, mem, prompt, answer


def test_lookup_prefers_own_text_on_ties_and_memory_when_longer():
    rng, mem, prompt, answer = _answered(7)
    prior = AcceptancePrior(max_cands=3)
    state = _state(prior)
    draft = lookup(state, prompt, len(prompt), 4, True, mem)
    assert draft == answer[:4].tolist()
    assert state.lookup_kind == "memory12"
    assert state.lookup_sources == [SOURCE_MEMORY] * 4
    # without the memory, or a request that does not read it: nothing
    assert lookup(state, prompt, len(prompt), 4, True, None) == []
    off = _state(prior, reads=False)
    assert lookup(off, prompt, len(prompt), 4, True, mem) == []
    # own text with a 4-token match beats a 3-token memory match
    text = np.concatenate([_toks(7, 8, 9, 10, 11, 12), _text(rng, 5), _toks(8, 9, 10, 11)])
    b = mem.open(0, _toks(40, 41, 9, 10, 11, 50, 51, 52, 53))
    mem.close(b)
    state2 = _state(prior)
    assert lookup(state2, text, len(text), 4, True, mem)[0] == 12
    assert state2.lookup_kind == "suffix4"
    assert "memory12" in LOOKUP_KINDS and "memory3" in prior.p_unchecked


def test_two_token_key_answers_where_own_text_has_no_match():
    """The memory's shortest key (2 tokens) drafts where the request's own
    text has no earlier match (kind ``memory2``) and the pool has nothing,
    before ``memory1``'s single-token guess; a 2-token match in the
    request's own text wins the tie."""
    assert KEY_LENS[-1] == 2
    rng = np.random.default_rng(11)
    mem = SharedMemory(4096, delay=4)
    other = mem.open(0, _toks(500, 501, 77, 78, 600, 601, 602, 603, 604))
    mem.close(other)
    prior = AcceptancePrior(max_cands=3)
    # own text ends in (77, 78), never seen before in it; the other
    # request's text has (77, 78) followed by 600..603
    text = np.concatenate([_text(rng, 12, vocab=400), _toks(77, 78)])
    state = _state(prior)
    assert lookup(state, text, len(text), 4, True, mem) == [600, 601, 602, 603]
    assert state.lookup_kind == "memory2"
    assert "memory2" in prior.p_unchecked
    # the same 2 tokens earlier in its own text: the own match wins the tie
    own = np.concatenate([_toks(77, 78, 900, 901, 902, 903), _text(rng, 6, vocab=400),
                          _toks(77, 78)])
    state2 = _state(prior)
    assert lookup(state2, own, len(own), 4, True, mem)[:2] == [900, 901]
    assert state2.lookup_kind.startswith("suffix2")


def test_memory_candidate_leads_a_tree():
    _, mem, prompt, answer = _answered(8)
    state = _state(AcceptancePrior(max_cands=3))
    cands = candidates(state, prompt, True, mem)
    assert cands[0] == (tuple(answer[:3].tolist()), 1, SOURCE_MEMORY)


def test_seeded_requests_learn_from_a_prior_of_their_own():
    prior = AcceptancePrior(max_cands=3)
    s = _state(prior, seeded=True)
    assert s.acc.prior is not prior
    assert _state(prior).acc.prior is prior


class _Curve:
    """seconds = fixed + per_token * tokens (a plain step)."""

    def __init__(self, fixed, per_token):
        self.fixed, self.per_token = fixed, per_token

    def plain(self, batch, tokens):
        return self.fixed + self.per_token * tokens

    def predict(self, batch, tokens, tree=True, drafting=None):
        raise AssertionError("a seeded draft must not read corrected predictions")

    def verify(self, batch, sampled, seeded=False):
        return 0.0, 0.0  # not measured

    def switch(self, batch, sampled, seeded=False):
        return 0.0


@pytest.mark.parametrize("p,per_token,expect", [
    (0.9, 0.01, 4),   # cheap tokens, good guesses: the whole draft
    (0.2, 0.5, 0),    # dear tokens, poor guesses: none
    # a curve that says drafts are nearly free (it times the forward only):
    # vLLM's verification of a draft row still has to be paid
    (0.2, 0.01, 0),
])
def test_steady_draft_prices_a_seeded_draft_on_the_start_curve(p, per_token, expect):
    prior = AcceptancePrior(max_cands=3)
    s = _state(prior, seeded=True)
    s.acc.unchecked["suffix4"].hits, s.acc.unchecked["suffix4"].misses = p * 100, (1 - p) * 100
    planner = Planner(_Curve(1.0, per_token))
    assert planner.steady_draft(s.acc, "suffix4", 4) == expect


def test_calibration_scales_unchecked_gains_to_what_was_accepted():
    from vllm_lookahead.planner.acceptance import RequestAcceptance

    prior = AcceptancePrior(max_cands=3)
    acc = RequestAcceptance(prior)
    raw = acc.unchecked_gain(4, "suffix4")
    assert prior.calibration == 1.0
    for _ in range(200):  # the planner expected twice what was accepted
        prior.calibrate(acc.unchecked_gain(4, "suffix4"), 0)
        prior.calibrate(acc.unchecked_gain(4, "suffix4"), round(raw))
    assert 0.3 <= prior.calibration < 0.8
    assert acc.unchecked_gain(4, "suffix4") == pytest.approx(raw * prior.calibration)
    for _ in range(2000):  # then the estimates were right: back to 1
        prior.calibrate(acc.unchecked_gain(4, "suffix4"), raw)
    assert prior.calibration == pytest.approx(1.0, abs=0.01)
    for _ in range(2000):  # then more than expected: above 1, to the ceiling
        prior.calibrate(acc.unchecked_gain(4, "suffix4"), raw * 1.2)
    assert 1.15 < prior.calibration < 1.25
    assert acc.unchecked_gain(4, "suffix4") == pytest.approx(raw * prior.calibration)
    for _ in range(2000):
        prior.calibrate(acc.unchecked_gain(4, "suffix4"), raw * 4)
    assert prior.calibration == prior.CALIBRATION_MAX


# -- drafts longer than N (lookup_len) ---------------------------------------
def _long_answered(seed, n_answer=40):
    rng = np.random.default_rng(seed)
    mem = SharedMemory(4096, delay=4)
    prompt, answer = _text(rng, 30), _text(rng, n_answer)
    a = mem.open(0, prompt)
    mem.extend(a, answer)
    mem.close(a)
    return rng, mem, prompt, answer


@pytest.mark.parametrize("look, room, k", [(16, 16, 16), (16, 24, 16), (16, 9, 9),
                                           (0, 16, 4), (3, 16, 4), (24, 24, 24)])
def test_lookups_draft_up_to_lookup_len_from_memory_and_own_text(look, room, k):
    """A lookup drafts up to k = max(N, lookup_len) tokens (and the room
    vLLM leaves): the memory's continuation of a repeated question, and the
    request's own text where it repeats itself. Past N a match's
    continuation runs no further than the match is long (N at least), and
    the request's own text is matched up to LONG_MATCH tokens, learnt by
    length (``suffix8``, ``suffix16``, ``suffix24``)."""
    _, mem, prompt, answer = _long_answered(9)
    cfg = LookaheadConfig(lookup_len=look)
    state = new_state(request_settings(None, cfg), _toks(1, 2, 3), 3, 3, None, False, 0,
                      AcceptancePrior(max_cands=3))
    state.memory_reads, state.memory_doc, state.memory_scope = True, None, 0
    draft = lookup(state, prompt, len(prompt), room, True, mem)
    expect = min(k, 12) if k > 4 else k  # a 12-token key
    assert draft == answer[:expect].tolist() and state.lookup_kind == "memory12"
    assert state.lookup_sources == [SOURCE_MEMORY] * expect
    # own text: a 40-token passage seen before, its first m tokens again
    state.memory_reads = False
    for m, kind in ((4, "suffix4"), (7, "suffix8"), (16, "suffix16"), (20, "suffix24")):
        own = np.concatenate([answer, _toks(7, 7, 7), answer[:m]])
        expect = min(k, m) if k > 4 else k
        assert lookup(state, own, len(own), room, True, mem) == answer[m: m + expect].tolist()
        assert state.lookup_kind == (kind if k > 4 else "suffix4")
    # a request may lower lookup_len (never raise it)
    low = request_settings({"lookahead": {"lookup_len": 0}}, cfg)
    assert low.lookup_len == 0
    with pytest.raises(ValueError, match="lookup_len"):
        request_settings({"lookahead": {"lookup_len": look + 1}}, cfg)


def test_draft_lengths_weigh_every_short_length_then_a_ladder():
    from vllm_lookahead.planner.shapes import draft_lengths

    assert draft_lengths(0) == ()
    assert draft_lengths(3) == (1, 2, 3)
    assert draft_lengths(8) == tuple(range(1, 9))
    assert draft_lengths(16) == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
    assert draft_lengths(20) == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20)
    assert draft_lengths(64)[-4:] == (24, 32, 48, 64)


@pytest.mark.parametrize("p, per_token, lo, hi", [
    (0.97, 0.002, 16, 16),  # a memory match that runs on, tokens cheap: all of it
    (0.97, 0.04, 5, 16),    # dearer tokens: shorter, still past N
    (0.5, 0.04, 1, 3),      # coin flips: a short draft
])
def test_planner_prices_a_long_lookup(p, per_token, lo, hi):
    from vllm_lookahead.planner.acceptance import RequestAcceptance
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel
    from vllm_lookahead.planner.planner import RequestView

    prior = AcceptancePrior(max_cands=3)
    acc = RequestAcceptance(prior)
    acc.unchecked["memory12"].hits, acc.unchecked["memory12"].misses = p * 1000, (1 - p) * 1000
    curve = CostCurve({1: [(t, 0.05 * (1 + per_token * (t - 1))) for t in (1, 2, 4, 8, 16, 32)]})
    planner = Planner(CostModel(curve))
    v = RequestView(acc=acc, ngram_size=4, window_size=3, guess_set_size=0, room=16,
                    unchecked=16, lookup_kind="memory12", trees=False)
    (shape,) = planner.plan([v])
    assert shape.kind == "draft" and lo <= shape.draft <= hi, shape


def test_planner_drafts_a_unanimous_lookup_and_skips_a_split_one_of_the_same_key():
    """A key kind's rate is learnt per request over every agreement class;
    the engine's class factors (learnt from every request's matches) part
    a unanimous match from a split one of the same kind."""
    from vllm_lookahead.planner.acceptance import RequestAcceptance
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel
    from vllm_lookahead.planner.planner import RequestView

    prior = AcceptancePrior(max_cands=3)
    for _ in range(1000):  # unanimous matches run on, split ones miss at once
        prior.observe_agreement("+", True)
        prior.observe_agreement("+", True)
        prior.observe_agreement("-", False)
        prior.observe_agreement("", True)
        prior.observe_agreement("", False)
    # by first tokens: "+" 2 of 2, "" 1 of 2, "-" 0 of 1; pooled 3 of 5.
    # (Counted by tokens, "+" matches running 8 tokens would pool at 0.85
    # and push "" to 0.59.)
    assert prior.agreement_factor("+") == pytest.approx(1 / 0.6, rel=0.03)
    assert prior.agreement_factor("") == pytest.approx(0.5 / 0.6, rel=0.03)
    assert prior.agreement_factor("-") < 0.05
    acc = RequestAcceptance(prior)
    acc.unchecked["suffix3"].hits, acc.unchecked["suffix3"].misses = 500, 500
    assert acc.unchecked_p("suffix3+") == pytest.approx(0.5 / 0.6, rel=0.03)
    assert acc.unchecked_p("suffix3-") < 0.05
    acc.unchecked["suffix3"].hits = 10_000
    assert acc.unchecked_p("suffix3+") == pytest.approx(0.98)  # lifted at most to P_MAX
    assert acc.unchecked_p("pool") == acc.unchecked["pool"].p  # no class
    # a draft token costs a tenth of a step: worth it at 0.98, not at 0.05
    curve = CostCurve({1: [(t, 0.05 * (1 + 0.1 * (t - 1))) for t in (1, 2, 4, 8)]})
    planner = Planner(CostModel(curve))
    shapes = {}
    for kind in ("suffix3+", "suffix3-"):
        v = RequestView(acc=acc, ngram_size=4, window_size=3, guess_set_size=0, room=4,
                        unchecked=4, lookup_kind=kind, trees=False)
        (shapes[kind],) = planner.plan([v])
    assert shapes["suffix3+"].kind == "draft" and shapes["suffix3+"].draft >= 2
    assert shapes["suffix3-"].kind == "off"


def test_a_probe_teaches_its_key_kind_and_its_class():
    from vllm_lookahead.planner.acceptance import AGREEMENT_PRIOR, RequestAcceptance

    prior = AcceptancePrior(max_cands=3)
    assert {a: prior.agreement_factor(a) for a in prior.agreement} == \
        pytest.approx(AGREEMENT_PRIOR)  # as assumed before any match
    acc = RequestAcceptance(prior)
    before = acc.unchecked["memory6"].hits, prior.agreement["+"].hits
    acc.observe_unchecked([1, 2, 3], [1, 2], "memory6+")
    acc.observe_unchecked([], [3], "memory6+")  # the probe's end: all 3 matched
    assert acc.unchecked["memory6"].hits > before[0]
    assert prior.agreement["+"].hits > before[1]
    assert "memory6+" not in acc.unchecked
    # the pool's guesses teach no class
    total = sum(r.hits + r.misses for r in prior.agreement.values())
    acc.observe_unchecked([5], [6], "pool")
    assert sum(r.hits + r.misses for r in prior.agreement.values()) == pytest.approx(total)
    assert "agreement_factors" in prior.snapshot()


# -- the windows' harvest ----------------------------------------------------
def test_harvest_table_newest_first_bounded_scoped_and_cleared():
    mem = SharedMemory(1024, delay=4)
    before = mem.nbytes()
    mem.add_ngram(0, 5, (1, 2, 3))
    mem.add_ngram(0, 5, (4, 5, 6))
    mem.add_ngram(0, 5, (1, 2, 3))  # seen again: newest again, not twice
    assert mem.ngrams(0, 5) == [(1, 2, 3), (4, 5, 6)]
    assert mem.ngrams(0, 6) == [] and mem.ngrams(scope_of("a"), 5) == []
    mem.add_ngram(0, 5, (9, 9))  # not N-1 tokens: ignored
    for i in range(10):
        mem.add_ngram(0, 5, (100 + i, 0, 0))
    got = mem.ngrams(0, 5)
    assert len(got) == 4 and got[0] == (109, 0, 0) and got[-1] == (106, 0, 0)
    # many keys: the table's size never changes (fixed sets, the oldest out)
    for key in range(20000):
        mem.add_ngram(key % 3, key, (key, key, key))
    assert mem.nbytes() == before and mem.harvested == 20013
    assert mem.ngrams(19999 % 3, 19999) == [(19999,) * 3]
    mem.clear()
    assert mem.ngrams(19999 % 3, 19999) == [] and mem.harvested == 0


def test_other_requests_window_ngrams_fill_a_trees_candidates():
    mem = SharedMemory(4096, delay=4)
    other = scope_of("other")
    mem.add_ngram(0, 3, (40, 41, 42))
    mem.add_ngram(other, 3, (50, 51, 52))
    state = _state(AcceptancePrior(max_cands=3))
    text = _toks(9, 8, 7, 3)
    cands = candidates(state, text, False, mem)
    assert (( 40, 41, 42), 1, SOURCE_MEMORY) in cands
    assert all(c[0] != (50, 51, 52) for c in cands)  # another scope's: never
    # an unchecked lookup with no n-gram of its own drafts the newest
    assert lookup(state, text, len(text), 4, False, mem) == [40, 41, 42]
    assert state.lookup_sources == [SOURCE_MEMORY] * 3
    # a request that does not read the memory: nothing
    assert candidates(_state(AcceptancePrior(max_cands=3), reads=False), text, False, mem) == []


def test_followers_table_fed_with_the_text_newest_first_scoped_bounded_cleared():
    mem = SharedMemory(1024, delay=4)
    before = mem.nbytes()
    a = mem.open(0, _toks(1, 2, 3))
    mem.extend(a, _toks(5, 10, 11, 12, 13, 5, 20, 21))
    # a place is indexed once ``delay`` tokens follow it: 5 -> (10, 11, 12)
    # is in, the second 5's continuation (20, 21, ...) not yet complete
    assert mem.followers(0, 5) == [(10, 11, 12)]
    mem.extend(a, _toks(22, 23))
    assert mem.followers(0, 5) == [(20, 21, 22), (10, 11, 12)]
    # another scope's text: never
    b = mem.open(scope_of("t"), _toks(9))
    mem.extend(b, _toks(5, 30, 31, 32, 33, 34))
    assert mem.followers(0, 5)[0] == (20, 21, 22)
    assert mem.followers(scope_of("t"), 5) == [(30, 31, 32)]
    # a place near the end of a closed document: only full continuations
    mem.close(a)
    assert all(len(c) == 3 for c in mem.followers(0, 23) + mem.followers(0, 22))
    # fixed size, whatever it holds; gone with clear
    rng = np.random.default_rng(9)
    for _ in range(50):
        d = mem.open(0, _text(rng, 20))
        mem.extend(d, _text(rng, 40))
        mem.close(d)
    assert mem.nbytes() <= before + 2 * 2**10 * 64  # the documents' arrays only
    mem.clear()
    assert mem.followers(0, 5) == [] and mem.followers(scope_of("t"), 5) == []


def test_lookup_without_own_ngram_drafts_what_followed_the_token_elsewhere():
    mem = SharedMemory(4096, delay=4)
    other = mem.open(0, _toks(60, 61))
    mem.extend(other, _toks(3, 70, 71, 72, 73, 74))
    mem.add_ngram(0, 3, (40, 41, 42))  # a window's n-gram: the text wins
    state = _state(AcceptancePrior(max_cands=3))
    text = _toks(9, 8, 7, 3)
    assert lookup(state, text, len(text), 4, False, mem) == [70, 71, 72]
    assert state.lookup_kind == "memory1"
    assert state.lookup_sources == [SOURCE_MEMORY] * 3
    # its own pool's n-gram for the token comes first (kind pool)
    own = _state(AcceptancePrior(max_cands=3))
    own.pool.add(3, (80, 81, 82), "prompt")
    assert lookup(own, text, len(text), 4, False, mem) == [80, 81, 82]
    assert own.lookup_kind == "pool"
    # a request that does not read the memory: nothing
    assert lookup(_state(AcceptancePrior(max_cands=3), reads=False), text, len(text), 4,
                  False, mem) == []
    # learnt as a guess: no agreement class moves
    prior = AcceptancePrior(max_cands=3)
    acc = _state(prior).acc
    total = sum(r.hits + r.misses for r in prior.agreement.values())
    acc.observe_unchecked([70, 71], [70, 71], "memory1")
    assert acc.unchecked["memory1"].hits > 0
    assert sum(r.hits + r.misses for r in prior.agreement.values()) == pytest.approx(total)


def test_jacobi_step_feeds_the_memory_only_for_requests_that_feed_it():
    from vllm_lookahead.algo.drafting import jacobi_step

    class _Window:
        warm = True

        def columns(self, root, new):
            return [(root, (1, 2, 3)), (7, (4, 5, 6))]

        def shift(self, new):
            self.shifted = new

    class _Layout:
        newest_level = [0]

    mem = SharedMemory(1024, delay=4)
    for doc, expect in ((None, []), (0, [(1, 2, 3)])):
        state = _state(AcceptancePrior(max_cands=3), doc=doc)
        state.window = _Window()
        jacobi_step(state, _Layout(), 11, np.asarray([5]), mem)
        assert mem.ngrams(0, 11) == expect
        assert state.pool.get(11)[0][0] == (1, 2, 3)


def _after(mem, key, conts, scope=0):
    """Documents (oldest first) in which ``key`` is followed by each of
    ``conts``; returns their ids."""
    ids = []
    for c in conts:
        d = mem.open(scope, _toks(*([1] * 30)))
        mem.extend(d, np.concatenate([key, _toks(*c)]))
        mem.close(d)
        ids.append(d)
    return ids


def test_the_places_of_a_key_vote():
    """The newest MAX_PLACES places of a key vote token by token (the most
    common continuation, not the newest); the draft stops where fewer than
    min_prob of them agree with it all the way."""
    key = _toks(*range(500, 512))  # 12 tokens: the longest key
    mem = SharedMemory(4096, delay=2)
    _after(mem, key, [(7, 8), (7, 8), (9, 9)])
    assert mem.lookup(0, None, key, len(key), 2)[:2] == ([7, 8], 12)
    mem.min_prob = 0.9  # 2 of 3 agree: too few at every key length
    assert mem.lookup(0, None, key, len(key), 2)[:2] == ([], 0)
    # a tie (one place each): the newest place's continuation, as before the vote
    one = SharedMemory(4096, delay=2, min_prob=0.0)
    _after(one, key, [(9, 9), (7, 8)])
    assert one.lookup(0, None, key, len(key), 2)[:2] == ([7, 8], 12)


def test_votes_leave_out_the_asking_document_and_evicted_ones():
    key = _toks(*range(500, 512))
    mem = SharedMemory(4096, delay=2)
    a, b, c = _after(mem, key, [(7, 8), (7, 8), (9, 9)])
    # the asking request's own place does not vote (the chain goes on past
    # it): as a, b and c tie and the newest (c) wins; as c, 7 8 twice
    assert mem.lookup(0, a, key, len(key), 2)[:2] == ([9, 9], 12)
    assert mem.lookup(0, c, key, len(key), 2)[:2] == ([7, 8], 12)
    # the two oldest evicted: only c's place is left
    mem._docs.pop(a)
    mem._docs.pop(b)
    assert mem.lookup(0, None, key, len(key), 2)[:2] == ([9, 9], 12)


def test_votes_skip_places_of_other_keys_on_a_shared_slot(monkeypatch):
    """Every key hashes to one slot: the chain mixes keys, and only the
    places whose tokens are the asked key vote."""
    import builtins

    import vllm_lookahead.algo.memory as memory

    monkeypatch.setattr(memory, "hash", lambda _x: 0, raising=False)
    assert builtins.hash((1, 2)) != 0  # (the module's own name, not Python's)
    key, other = _toks(*range(500, 512)), _toks(*range(600, 612))
    mem = SharedMemory(4096, delay=2)
    _after(mem, key, [(7, 8)])
    _after(mem, other, [(9, 9), (9, 9)])
    assert mem.lookup(0, None, key, len(key), 2)[:2] == ([7, 8], 12)


def test_a_lookup_asked_for_longer_keys_skips_the_shorter_ones():
    """``longer_than``: the keys no longer than the caller's own match are
    not looked up (the request's own text wins those)."""
    key = _toks(*range(500, 512))
    mem = SharedMemory(4096, delay=2)
    _after(mem, key, [(7, 8)])
    _after(mem, _toks(900, 901, 510, 511), [(3, 4)])  # a shorter key elsewhere
    assert mem.lookup(0, None, key, len(key), 2, longer_than=6) == ([7, 8], 12, "")
    assert mem.lookup(0, None, key, len(key), 2, longer_than=12) == ([], 0, "")
    tail = _toks(1, 2, 510, 511)
    assert mem.lookup(0, None, tail, 4, 2)[1] == 2
    assert mem.lookup(0, None, tail, 4, 2, longer_than=2) == ([], 0, "")


def test_a_lookup_says_how_the_places_agreed_and_its_kind_carries_it():
    key = _toks(*range(500, 512))
    mem = SharedMemory(4096, delay=2)
    _after(mem, key, [(7, 8), (7, 9)])
    assert mem.lookup(0, None, key, len(key), 2) == ([7, 9], 12, "+")
    _after(mem, key, [(5, 5)])
    assert mem.lookup(0, None, key, len(key), 2)[2] == "-"
    one = SharedMemory(4096, delay=2)
    _after(one, key, [(7, 8)])
    assert one.lookup(0, None, key, len(key), 2) == ([7, 8], 12, "")
    assert one.lookup(0, None, _toks(1, 2, 3), 3, 2) == ([], 0, "")
    # the request's lookup kind: source, key length, agreement
    prior = AcceptancePrior(max_cands=3)
    state = _state(prior)
    assert lookup(state, key, len(key), 2, True, mem) and state.lookup_kind == "memory12-"
    state = _state(prior)
    assert lookup(state, key, len(key), 2, True, one) and state.lookup_kind == "memory12"
