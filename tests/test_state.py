"""Unit tests of the per-request lookahead state (vllm_lookahead.algo.state)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_lookahead.attn_mask import build_tree, fill_tree_tokens
from vllm_lookahead.algo.state import (
    SOURCE_PROMPT,
    SOURCE_WINDOW,
    JacobiWindow,
    NGramPool,
    RequestState,
    choose_candidate,
    request_seed,
)

# --------------------------------------------------------------------------
# NGramPool
# --------------------------------------------------------------------------


def test_pool_get_newest_first_and_unknown_key():
    pool = NGramPool(cap=4)
    assert pool.get(1) == []
    pool.add(1, (2, 3), SOURCE_PROMPT)
    pool.add(1, (4, 5), SOURCE_WINDOW)
    pool.add(1, (6, 7), SOURCE_PROMPT)
    assert pool.get(1) == [
        ((6, 7), 1, SOURCE_PROMPT),
        ((4, 5), 1, SOURCE_WINDOW),
        ((2, 3), 1, SOURCE_PROMPT),
    ]
    assert pool.get(2) == []
    assert pool.get(6) == []  # continuation tokens are not keys


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_pool_cap_drops_oldest(cap):
    pool = NGramPool(cap=cap)
    conts = [(10 + i,) for i in range(cap + 2)]
    for c in conts:
        pool.add(7, c, SOURCE_WINDOW)
    got = [c for c, _, _ in pool.get(7)]
    assert got == list(reversed(conts))[:cap]
    assert len(pool) == cap


def test_pool_readd_moves_to_newest_and_bumps_count_keeps_first_source():
    pool = NGramPool(cap=3)
    pool.add(1, (2,), SOURCE_PROMPT)
    pool.add(1, (3,), SOURCE_WINDOW)
    pool.add(1, (4,), SOURCE_WINDOW)
    pool.add(1, (2,), SOURCE_WINDOW)  # re-add the oldest: it becomes newest
    assert pool.get(1) == [
        ((2,), 2, SOURCE_PROMPT),
        ((4,), 1, SOURCE_WINDOW),
        ((3,), 1, SOURCE_WINDOW),
    ]
    # a new continuation now evicts (3,), the oldest, not the re-added (2,)
    pool.add(1, (5,), SOURCE_PROMPT)
    assert [c for c, _, _ in pool.get(1)] == [(5,), (2,), (4,)]
    pool.add(1, (2,), SOURCE_PROMPT)
    assert pool.get(1)[0] == ((2,), 3, SOURCE_PROMPT)
    assert len(pool) == 3


def test_pool_len_and_count():
    pool = NGramPool(cap=2)
    assert len(pool) == 0 and pool.count(1) == 0
    pool.add(1, (2, 3), SOURCE_PROMPT)
    pool.add(1, (2, 3), SOURCE_PROMPT)  # duplicate: no new entry
    assert len(pool) == 1 and pool.count(1) == 1
    pool.add(1, (2, 4), SOURCE_PROMPT)
    pool.add(5, (2, 3), SOURCE_PROMPT)  # same continuation, other key
    assert len(pool) == 3 and pool.count(1) == 2 and pool.count(5) == 1
    pool.add(1, (9, 9), SOURCE_PROMPT)  # over cap for key 1
    assert len(pool) == 3 and pool.count(1) == 2


@pytest.mark.parametrize("cap", [0, -1])
def test_pool_rejects_bad_cap(cap):
    with pytest.raises(ValueError):
        NGramPool(cap)


@pytest.mark.parametrize("cap,seed", [(1, 0), (2, 1), (3, 2), (5, 3)])
def test_pool_matches_reference_lru(cap, seed):
    """Random adds against a straightforward list-based LRU model."""
    rng = np.random.default_rng(seed)
    pool = NGramPool(cap)
    ref: dict[int, list[list]] = {}  # key -> [[cont, count, source]], newest first
    for _ in range(400):
        key = int(rng.integers(0, 4))
        cont = tuple(int(x) for x in rng.integers(0, 3, size=2))
        src = SOURCE_PROMPT if rng.random() < 0.5 else SOURCE_WINDOW
        pool.add(key, cont, src)
        lst = ref.setdefault(key, [])
        for i, e in enumerate(lst):
            if e[0] == cont:
                e[1] += 1
                lst.insert(0, lst.pop(i))
                break
        else:
            lst.insert(0, [cont, 1, src])
            del lst[cap:]
        for k, entries in ref.items():
            assert pool.get(k) == [tuple(e) for e in entries]
    assert len(pool) == sum(len(v) for v in ref.values())
    assert all(pool.count(k) == len(v) for k, v in ref.items())


# --------------------------------------------------------------------------
# JacobiWindow
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n,w", [(2, 1), (2, 5), (4, 5), (5, 15), (3, 1)])
def test_random_init_deterministic_and_from_context(n, w):
    context = np.array([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], dtype=np.int32)
    a = JacobiWindow.random_init(n, w, context, seed=123)
    b = JacobiWindow.random_init(n, w, context, seed=123)
    assert a.levels.shape == (n - 1, w)
    assert a.levels.dtype == np.int32
    np.testing.assert_array_equal(a.levels, b.levels)
    assert set(a.levels.ravel().tolist()) <= set(context.tolist())
    assert a.steps == 0
    assert a.warm == (n == 2)
    # the levels are a copy: mutating them does not alias another window
    a.levels[...] = -1
    assert (b.levels != -1).all()


def test_random_init_seed_matters_and_covers_context():
    context = np.arange(1000, 1050, dtype=np.int32)
    a = JacobiWindow.random_init(5, 15, context, seed=1).levels
    b = JacobiWindow.random_init(5, 15, context, seed=2).levels
    assert not np.array_equal(a, b)
    # 60 draws out of 50 tokens: not all the same token (it really samples)
    assert len(set(a.ravel().tolist())) > 10


def test_random_init_single_token_and_empty_context():
    w1 = JacobiWindow.random_init(4, 3, np.array([42]), seed=0)
    assert (w1.levels == 42).all()
    w0 = JacobiWindow.random_init(4, 3, np.array([], dtype=np.int32), seed=0)
    assert w0.levels.shape == (3, 3)
    assert (w0.levels == 0).all()


def _coded_window(n, w):
    """levels[l, j] = 1000 * (l + 1) + j: every cell distinguishable."""
    lv = np.array([[1000 * (lvl + 1) + j for j in range(w)] for lvl in range(n - 1)])
    return JacobiWindow(n, w, lv.ravel())


WINDOW_SIZES = [(2, 1), (2, 4), (3, 1), (3, 3), (4, 5), (5, 2), (6, 4)]


@pytest.mark.parametrize("n,w", WINDOW_SIZES)
def test_columns(n, w):
    win = _coded_window(n, w)
    lv = win.levels.copy()
    root = 7
    new = np.array([90_000 + j for j in range(w)])
    cols = win.columns(root, new)
    trunk = [root] + [int(lv[0, j]) for j in range(w - 1)]  # B0
    assert len(cols) == w
    for j, (key, cont) in enumerate(cols):
        assert key == trunk[j]
        expect = tuple(int(lv[lvl, j]) for lvl in range(1, n - 1)) + (90_000 + j,)
        assert cont == expect
        assert len(cont) == n - 1
        assert isinstance(key, int) and all(isinstance(t, int) for t in cont)
    np.testing.assert_array_equal(win.levels, lv)  # columns() does not mutate
    assert win.steps == 0


@pytest.mark.parametrize("n,w", WINDOW_SIZES)
def test_shift(n, w):
    win = _coded_window(n, w)
    old = win.levels.copy()
    new = np.array([90_000 + j for j in range(w)])
    win.shift(new)
    lv = win.levels
    if n == 2:
        # the only level is L0 = newest: L0 <- new[1:]
        np.testing.assert_array_equal(lv[0, : w - 1], new[1:])
    else:
        np.testing.assert_array_equal(lv[0, : w - 1], old[1, 1:])  # L0 <- L1[1:]
        for lvl in range(1, n - 2):
            np.testing.assert_array_equal(lv[lvl], old[lvl + 1])  # L_l <- L_{l+1}
        np.testing.assert_array_equal(lv[n - 2], new)  # newest <- new
    assert win.steps == 1


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_warm_after_n_minus_2_steps(n):
    win = _coded_window(n, 3)
    for s in range(n + 2):
        assert win.steps == s
        assert win.warm == (s >= n - 2)
        win.shift(np.array([1, 2, 3]))


@pytest.mark.parametrize("n,w", [(2, 1), (2, 4), (3, 1), (3, 5), (4, 5), (5, 7), (6, 3)])
def test_jacobi_fixed_point_harvests_true_ngrams(n, w):
    """Simulate the proposer's loop with a deterministic position-only model.

    The "model" predicts, at every tree node, the token of a known sequence S
    at (node position + 1): whatever a node's prefix, the next token is
    S[len(prefix)]. Each step accepts exactly one token (the root advances by
    one position). Once the window has gone through N-1 Jacobi steps, every
    column n-gram (B0[j], B_1[j], ..., B_{N-2}[j], new[j]) must be a true
    n-gram S[q : q+N] of the sequence.
    """
    rng = np.random.default_rng(n * 100 + w)
    seq = rng.integers(0, 50_000, size=400).astype(np.int64)
    p0 = 20
    prompt = seq[: p0 + 1]
    win = JacobiWindow.random_init(n, w, prompt, seed=5)
    pool = NGramPool(cap=1000)
    g = 0
    lay = build_tree(n, w, g)
    cands = np.zeros((0, n - 1), dtype=np.int32)
    harvested_true = set()
    steps = 3 * n + 10
    for step in range(steps):
        p = p0 + step
        x = int(seq[p])
        toks = fill_tree_tokens(lay, x, win.levels, cands)
        positions = p + lay.depth
        assert toks[0] == x
        pred = seq[positions + 1]  # the model's argmax at every node
        new = pred[lay.newest_level]
        cols = win.columns(x, new)
        if step >= n - 1:
            # The tree tokens themselves sit at their true positions...
            np.testing.assert_array_equal(toks, seq[positions])
            # ... and every column is a true n-gram at positions p+j .. p+j+N-1.
            for j, (key, cont) in enumerate(cols):
                assert (key, *cont) == tuple(int(t) for t in seq[p + j : p + j + n])
                harvested_true.add((key, cont))
        if win.warm:
            for key, cont in cols:
                pool.add(key, cont, SOURCE_WINDOW)
        win.shift(new)
    # every true n-gram starting in the window's span over the converged steps
    # is in the pool
    for q in range(p0 + n - 1, p0 + steps):
        key, cont = int(seq[q]), tuple(int(t) for t in seq[q + 1 : q + n])
        assert any(c == cont for c, _, _ in pool.get(key)), q
    assert len(harvested_true) >= steps - n


# --------------------------------------------------------------------------
# RequestState.add_context_ngrams
# --------------------------------------------------------------------------


def _pool_snapshot(pool: NGramPool, keys):
    return {k: pool.get(k) for k in keys}


def _new_state(n, cap=1000):
    return RequestState(
        window=JacobiWindow(n, 2, np.zeros((n - 1) * 2, dtype=np.int32)),
        pool=NGramPool(cap),
    )


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize(
    "uptos",
    [[5, 9, 9, 20], [20], [1, 2, 3, 20], list(range(0, 21)), [3, 4, 11, 12, 20, 20]],
)
def test_add_context_ngrams_incremental_equals_one_call(n, uptos):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=32).astype(np.int32)  # small vocab: repeats
    once = _new_state(n)
    once.add_context_ngrams(tokens, n, 20)
    inc = _new_state(n)
    for u in uptos:
        inc.add_context_ngrams(tokens, n, u)
    keys = range(4)
    assert _pool_snapshot(inc.pool, keys) == _pool_snapshot(once.pool, keys)
    assert inc.pooled_upto == once.pooled_upto == 20

    # each n-gram of tokens[:20] added exactly once: its count equals the
    # number of its occurrences, and nothing from tokens[20:] leaked in
    occ: dict[tuple, int] = {}
    t = tokens[:20].tolist()
    for i in range(len(t) - n + 1):
        ng = tuple(t[i : i + n])
        occ[ng] = occ.get(ng, 0) + 1
    got = {}
    for k in keys:
        for cont, count, src in once.pool.get(k):
            assert src == SOURCE_PROMPT
            got[(k, *cont)] = count
    assert got == occ


def test_add_context_ngrams_exact_entries():
    st = _new_state(3)
    toks = np.array([1, 2, 3, 1, 2, 4, 9], dtype=np.int32)
    st.add_context_ngrams(toks, 3, 2)  # fewer than n tokens: nothing yet
    assert len(st.pool) == 0
    st.add_context_ngrams(toks, 3, 4)
    assert st.pool.get(1) == [((2, 3), 1, SOURCE_PROMPT)]
    assert st.pool.get(2) == [((3, 1), 1, SOURCE_PROMPT)]
    assert len(st.pool) == 2
    st.add_context_ngrams(toks, 3, 6)
    assert st.pool.get(1) == [((2, 4), 1, SOURCE_PROMPT), ((2, 3), 1, SOURCE_PROMPT)]
    assert st.pool.get(3) == [((1, 2), 1, SOURCE_PROMPT)]
    assert len(st.pool) == 4
    # a smaller upto later never re-adds nor rewinds
    st.add_context_ngrams(toks, 3, 3)
    assert len(st.pool) == 4 and st.pooled_upto == 6
    assert st.pool.get(1)[0][1] == 1


# --------------------------------------------------------------------------
# request_seed
# --------------------------------------------------------------------------


def test_request_seed_depends_on_prompt_and_base_seed():
    prompt = np.array([5, 6, 7, 8, 9], dtype=np.int32)
    s = request_seed(0, prompt)
    assert isinstance(s, int) and 0 <= s < 2**32
    assert request_seed(0, prompt.copy()) == s
    assert request_seed(0, [5, 6, 7, 8, 9]) == s
    assert request_seed(0, prompt.astype(np.int64)) == s  # same tokens, other dtype
    assert request_seed(1, prompt) != s
    assert request_seed(12345, prompt) != request_seed(12346, prompt)
    assert request_seed(0, np.array([5, 6, 7, 8, 10])) != s
    assert request_seed(0, np.array([5, 6, 7, 8])) != s
    assert request_seed(0, np.array([6, 5, 7, 8, 9])) != s
    # many prompts give many different seeds
    seeds = {request_seed(3, np.array([i, i + 1])) for i in range(200)}
    assert len(seeds) == 200


_SEED_SNIPPET = (
    "import numpy as np; from vllm_lookahead.algo.state import request_seed; "
    "print(request_seed(7, np.array([3, 1, 4, 1, 5, 9, 2, 6])))"
)


def test_request_seed_stable_across_processes():
    """Every TP rank (a separate process) must derive the same seed."""
    here = request_seed(7, np.array([3, 1, 4, 1, 5, 9, 2, 6]))
    outs = set()
    for hashseed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        r = subprocess.run(
            [sys.executable, "-c", _SEED_SNIPPET],
            capture_output=True, text=True, env=env, check=True, timeout=60,
        )
        outs.add(int(r.stdout.strip().splitlines()[-1]))
    assert outs == {here}


# --------------------------------------------------------------------------
# choose_candidate
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "matches,counts,expect",
    [
        ([], [], -1),
        ([0], [1], 0),
        ([1, 3, 2], [9, 1, 9], 1),  # longest match wins over count
        ([2, 2, 1], [1, 5, 9], 1),  # tie on match: most often seen
        ([2, 2, 2], [4, 4, 4], 0),  # full tie: lowest index (newest)
        ([0, 2, 2], [9, 3, 3], 1),  # tie after the leader: first of them
        ([0, 0, 0], [1, 3, 2], 1),  # no match anywhere: still by count
        ([1, 3, 3, 3], [1, 2, 7, 7], 2),
    ],
)
def test_choose_candidate(matches, counts, expect):
    assert choose_candidate(matches, counts) == expect


def test_choose_candidate_random_against_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(1, 8))
        m = rng.integers(0, 4, size=k).tolist()
        c = rng.integers(1, 4, size=k).tolist()
        best = max(range(k), key=lambda i: (m[i], c[i], -i))
        assert choose_candidate(m, c) == best


def _suffix_match_reference(toks, n, k, max_len=4):
    """Brute force: longest suffix first, most recent earlier start;
    (continuation, matched length)."""
    t = list(toks[:n])
    for m in range(min(max_len, n - 1), 1, -1):
        for s in range(n - m - 1, -1, -1):
            if t[s : s + m] == t[n - m :]:
                return t[s + m : s + m + k], m
    return [], 0


@pytest.mark.parametrize("seed", range(40))
def test_suffix_lookup_matches_brute_force(seed):
    from vllm_lookahead.algo.state import suffix_lookup

    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))
    toks = rng.integers(0, vocab, size=int(rng.integers(1, 60))).astype(np.int32)
    padded = np.concatenate([toks, np.full(7, 99, np.int32)])  # junk past n
    hi = 2 + seed % 5  # key lengths 2-2 up to 2-6
    for n in range(1, len(toks) + 1):
        for k in (1, 3, 4):
            assert suffix_lookup(padded, n, k) == _suffix_match_reference(toks, n, k)[0], (n, k)
            assert suffix_lookup(padded, n, k, hi) == \
                _suffix_match_reference(toks, n, k, hi)[0], (n, k, hi)


def test_suffix_lookup_prefers_the_longest_suffix():
    from vllm_lookahead.algo.state import suffix_lookup

    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 1, 2, 7, 3, 1, 2, 8, 9, 1, 2]
    # suffix (1, 2) last seen at 5..6 -> 8, 9
    assert suffix_lookup(np.array(toks), len(toks), 2) == [8, 9]
    toks = [4, 1, 2, 7, 7, 0, 1, 2, 8, 4, 1, 2]
    # suffix (4, 1, 2) seen at 0..2 beats the later (1, 2) at 6..7
    assert suffix_lookup(np.array(toks), len(toks), 3) == [7, 7, 0]
    assert suffix_lookup(np.array([1, 2, 3]), 3, 4) == []  # nothing repeats
    assert suffix_lookup(np.array([1, 2, 1, 2]), 4, 0) == []


def test_a_tree_with_part_of_the_window_moves_its_columns_only():
    from vllm_lookahead.algo.state import JacobiWindow

    n, w = 4, 3
    levels = np.arange(1, 1 + (n - 1) * w, dtype=np.int32)  # [[1 2 3] [4 5 6] [7 8 9]]
    win = JacobiWindow(n, w, levels)
    tree = build_tree(n, 2, 0)  # 2 of the 3 columns
    toks = fill_tree_tokens(tree, 99, win.levels, np.zeros((0, n - 1), dtype=np.int32))
    assert toks.tolist() == [99, 1, 4, 5, 7, 8]  # trunk (99, L0[0]), then L1[:2], L2[:2]
    assert win.columns(99, np.array([20, 21])) == [(99, (4, 7, 20)), (1, (5, 8, 21))]
    win.shift(np.array([20, 21]))
    # L0[:1] <- L1[1:2]; L1[:2] <- L2[:2]; L2[:2] <- new; column 2 untouched
    assert win.levels.tolist() == [[5, 2, 3], [7, 8, 6], [20, 21, 9]]


def test_vote_draft_follows_the_places_that_agree():
    from vllm_lookahead.algo.state import vote_draft

    # newest first: the mode wins over the newest place, token by token
    assert vote_draft([[9, 9], [7, 8], [7, 8]], 2, 0.1) == [7, 8]
    # among equals the newest place's token
    assert vote_draft([[9, 1], [7, 2]], 2, 0.1) == [9, 1]
    # only the places that agreed so far vote on the next token
    assert vote_draft([[5, 1], [5, 2], [5, 2], [6, 1], [6, 1]], 2, 0.1) == [5, 2]
    # the draft stops where too few places agree all the way (2 of 5 < 0.5)
    assert vote_draft([[5, 1], [5, 2], [5, 2], [6, 1], [6, 1]], 2, 0.5) == [5]
    assert vote_draft([[1], [2], [3]], 1, 0.5) == []
    # one place: its continuation, whatever min_prob; at most k tokens
    assert vote_draft([[4, 5, 6]], 2, 0.9) == [4, 5]
    assert vote_draft([], 3, 0.1) == []
    # short continuations stop voting where they end
    assert vote_draft([[3], [3, 4]], 3, 0.1) == [3, 4]


def _vote_reference(tokens, n, k, max_len=4):
    """The reference of TextIndex.vote: the longest suffix (2..max_len
    tokens) of tokens[:n] seen earlier, by brute force, and the draft its
    newest MAX_PLACES places vote for; (draft, length, agreement)."""
    from vllm_lookahead.algo.state import MAX_PLACES, agreement, vote_draft

    t = [int(x) for x in tokens[:n]]
    if k <= 0 or n < 3:
        return [], 0, ""
    top = min(max_len, n - 1)
    lengths = {}
    for e in range(n - 1):  # an earlier place ending at e
        m = 0
        while m < top and e - m >= 0 and t[e - m] == t[n - 1 - m]:
            m += 1
        lengths[e] = m
    m = max(lengths.values())
    if m < 2:
        return [], 0, ""
    ends = [e for e in sorted(lengths) if lengths[e] >= m]
    conts = [t[e + 1 : e + 1 + k] for e in reversed(ends[-MAX_PLACES:])]
    draft = vote_draft(conts, k)
    return draft, m, agreement(conts, draft)


def test_text_index_votes_with_the_places_of_the_longest_suffix():
    from vllm_lookahead.algo.state import TextIndex, suffix_lookup

    def vote(toks, max_len=4, k=2):
        return TextIndex().vote(toks, len(toks), k, max_len=max_len)

    # "1 2" is followed by 7 8 twice, then by 9 9 (newest); the text ends in "1 2"
    toks = np.array([1, 2, 7, 8, 0, 1, 2, 7, 8, 0, 1, 2, 9, 9, 0, 1, 2], np.int32)
    assert suffix_lookup(toks, len(toks), 2, max_len=2) == [9, 9]  # the newest place
    assert vote(toks, max_len=2) == ([7, 8], 2, "-")  # voted: 7 8, the places split
    # the longest key's places vote alone: "0 1 2" came before 7 8 once
    # and 9 9 once (a tie: the newest), split
    assert vote(toks, max_len=3) == ([9, 9], 3, "-")
    same = np.array([1, 2, 7, 8, 0, 1, 2, 7, 5, 0, 1, 2], np.int32)
    # both places go on with 7 (unanimous), then part (a tie: the newest)
    assert vote(same, max_len=2) == ([7, 5], 2, "+")
    once = np.array([1, 2, 7, 8, 0, 1, 2], np.int32)
    assert vote(once, max_len=2) == ([7, 8], 2, "")
    assert vote(once, k=0) == ([], 0, "")
    for t in (toks, same, once):
        for max_len in (2, 3, 4):
            assert vote(t, max_len) == _vote_reference(t, len(t), 2, max_len)


def test_agreement_of_the_places_on_the_first_token():
    from vllm_lookahead.algo.state import agreement

    assert agreement([[4, 5]], [4, 5]) == ""  # one place: nothing to agree
    assert agreement([[4, 5], [4, 6]], [4, 5]) == "+"  # the first token unanimous
    assert agreement([[4, 5], [4, 5], [3, 5]], [4, 5]) == "-"  # a place continues otherwise
    assert agreement([[4], [3]], []) == ""  # no draft


@pytest.mark.parametrize("max_len", [3, 4, 24])
def test_text_index_finds_the_longest_match_and_its_places(max_len):
    """On texts with long repeats (small vocabularies, half of them a text
    followed by its own start), a fresh index finds what the brute force does."""
    from vllm_lookahead.algo.state import TextIndex

    rng = np.random.default_rng(max_len)
    for trial in range(400):
        vocab = int(rng.integers(2, 6))
        base = rng.integers(0, vocab, size=int(rng.integers(3, 40)))
        text = np.concatenate([base, base[: int(rng.integers(0, len(base)))]]) \
            if trial % 2 else base
        n = len(text)
        got = TextIndex().vote(text, n, 8, max_len=max_len)
        assert got == _vote_reference(text, n, 8, max_len), (text.tolist(), max_len)


def test_text_index_answers_as_the_brute_force_as_the_text_grows() -> None:
    """The request's indexed text (fed as it grows, a few tokens a call)
    answers every lookup as the brute force over the whole text does: small
    vocabularies (long, many-place matches), both key caps, k from 0 up."""
    from vllm_lookahead.algo.state import TextIndex

    checked = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        vocab = (3, 6, 20, 100)[seed % 4]
        size = int(rng.integers(3, 300))
        toks = rng.integers(0, vocab, size + 10).astype(np.int32)
        index = TextIndex()
        n = int(rng.integers(1, 5))
        while n <= size:
            for max_len in (4, 24):
                k = int(rng.integers(0, 8))
                want = _vote_reference(toks, n, k, max_len)
                assert index.vote(toks, n, k, max_len=max_len) == want, (seed, n, k, max_len)
                checked += bool(want[0])
            n += int(rng.integers(1, 4))
    assert checked > 500  # most lookups found something to compare


def test_text_index_starts_again_on_other_text() -> None:
    """A text that does not extend the indexed one (shorter, or another
    token where the indexed text ended) is indexed afresh, not mixed in."""
    from vllm_lookahead.algo.state import TextIndex

    index = TextIndex()
    a = np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32)
    assert index.vote(a, 8, 2) == _vote_reference(a, 8, 2) == ([3, 1], 4, "")
    b = np.array([5, 2, 7, 1, 2, 9, 1, 3, 1, 2], dtype=np.int32)  # b[7] != a[7]
    assert index.vote(b, 10, 2) == _vote_reference(b, 10, 2) == ([9, 1], 2, "")
    assert index.vote(a, 5, 2) == _vote_reference(a, 5, 2)
