"""Unit tests of per-request drafting (vllm_lookahead.algo.drafting), the one tree
builder (vllm_lookahead.algo.trees) and one step's drafts (vllm_lookahead.planner.step),
without an engine."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_lookahead.planner.acceptance import AcceptancePrior, pool_kind
from vllm_lookahead.attn_mask import build_tree, fill_tree_tokens, tree_size
from vllm_lookahead.config import LookaheadConfig, RequestSettings
from vllm_lookahead.algo.drafting import (
    Live,
    account,
    best_confirmed,
    candidates,
    harvest,
    jacobi_step,
    lookup,
    new_state,
    unchecked_draft,
)
from vllm_lookahead.algo.state import (
    SOURCE_MEMORY,
    SOURCE_MODEL,
    SOURCE_PROMPT,
    SOURCE_WINDOW,
    JacobiWindow,
)
from vllm_lookahead.stats import LookaheadStats
from vllm_lookahead.planner.siblings import drain_value, end_value
from vllm_lookahead.planner.step import StepDrafter
from vllm_lookahead.algo.trees import PlannedTree, TreeAsk, plan_trees


def _state(n=4, w=3, g=3, prompt=(1, 2, 3, 4, 5), max_tokens=None):
    tokens = np.asarray(prompt, dtype=np.int32)
    return new_state(RequestSettings(ngram_size=n, window_size=w, guess_set_size=g), tokens,
                     len(tokens), len(tokens), max_tokens, False, 0, AcceptancePrior(max_cands=g))


# -- new_state -----------------------------------------------------------------


def test_new_state_window_from_prompt_deterministic():
    a = _state(prompt=(11, 12, 13, 14))
    b = _state(prompt=(11, 12, 13, 14))
    assert a.window.levels.shape == (3, 3)
    assert set(a.window.levels.ravel().tolist()) <= {11, 12, 13, 14}
    np.testing.assert_array_equal(a.window.levels, b.window.levels)
    assert a.pool.cap == 3 and a.num_prompt_tokens == 4 and a.acc is not None


def test_new_state_window_uses_prompt_only():
    tokens = np.array([5, 5, 5, 9, 9, 9], dtype=np.int32)
    s = new_state(RequestSettings(ngram_size=3, window_size=4, guess_set_size=2), tokens, 6, 3,
                  None, True, 1, AcceptancePrior(max_cands=2))
    assert set(s.window.levels.ravel().tolist()) == {5}
    assert s.seeded and s.num_prompt_tokens == 3


# -- lookup --------------------------------------------------------------------


def test_lookup_takes_the_longest_earlier_suffix():
    s = _state()
    # the 3-token suffix (7, 8, 9) was followed by 50, 51; the 2-token suffix
    # (8, 9) more recently by 60, 61
    toks = np.array([7, 8, 9, 50, 51, 52, 8, 9, 60, 61, 1, 7, 8, 9], dtype=np.int32)
    draft = lookup(s, toks, len(toks), room=2, prompt_pool=True)
    assert draft == [50, 51]
    assert s.lookup_kind == "suffix3"
    assert s.lookup_sources == [SOURCE_PROMPT] * 2


def test_lookup_falls_back_to_the_pool_most_seen_then_newest():
    s = _state()
    s.pool.add(9, (1, 2, 3), SOURCE_WINDOW)
    s.pool.add(9, (4, 5, 6), SOURCE_PROMPT)
    s.pool.add(9, (1, 2, 3), SOURCE_WINDOW)  # seen twice
    s.pool.add(9, (7, 7, 7), SOURCE_PROMPT)  # newest, seen once
    toks = np.array([40, 41, 42, 9], dtype=np.int32)  # no earlier suffix
    assert lookup(s, toks, 4, room=2, prompt_pool=True) == [1, 2]
    # 2 of the token's 4 counts: no majority, a kind of its own
    assert s.lookup_kind == "poolsplit" and s.lookup_sources == [SOURCE_WINDOW] * 2
    s.pool.add(9, (1, 2, 3), SOURCE_WINDOW)  # 3 of 5
    assert lookup(s, toks, 4, room=2, prompt_pool=True) == [1, 2]
    assert s.lookup_kind == "pool"
    # prompt pool off: the pool even where a suffix matches
    toks = np.array([8, 9, 30, 8, 9], dtype=np.int32)
    assert lookup(s, toks, 5, room=5, prompt_pool=False) == [1, 2, 3]
    assert s.lookup_kind == "pool"


def test_pool_kind_splits_the_guesses_by_their_share_of_the_counts():
    assert pool_kind([1], 0) == "pool"  # the only continuation
    assert pool_kind([3], 0) == "pool"
    assert pool_kind([2, 1], 0) == "pool"  # most of the counts
    assert pool_kind([1, 1], 0) == "poolsplit"  # the newest of two seen once
    assert pool_kind([2, 1, 1], 0) == "poolsplit"  # half is not most
    assert pool_kind([1, 3, 1], 1) == "pool"
    # learnt apart, each from its own prior
    s = _state()
    assert s.acc.unchecked_p("poolsplit") < s.acc.unchecked_p("pool")
    for _ in range(6):
        s.acc.observe_unchecked([5], [5], "poolsplit")  # every guess right
    assert s.acc.unchecked_p("poolsplit") > s.acc.unchecked_p("pool")


def test_lookup_without_room_looks_up_n_tokens_and_empty_without_match():
    s = _state(n=3)
    toks = np.array([1, 2, 3, 4, 5, 6, 1, 2], dtype=np.int32)
    assert lookup(s, toks, len(toks), room=0, prompt_pool=True) == [3, 4, 5]
    assert lookup(s, np.array([1, 2, 3], dtype=np.int32), 3, room=2, prompt_pool=True) == []
    assert s.lookup_sources == [] and s.lookup_kind == "pool"


def test_unchecked_draft_takes_k_tokens_of_the_lookup():
    s, st = _state(), LookaheadStats()
    s.lookup, s.lookup_sources, s.draft_checked = [4, 5, 6], [SOURCE_PROMPT] * 3, True
    assert unchecked_draft(s, 2, st) == [4, 5]
    assert s.draft_sources == [SOURCE_PROMPT] * 2 and not s.draft_checked
    assert st.unchecked_drafts == 1
    s.lookup = []
    assert unchecked_draft(s, 2, st) == [] and st.unchecked_drafts == 1


# -- candidates ----------------------------------------------------------------


def test_candidates_led_by_a_new_suffix_continuation():
    s = _state(n=3, g=2)
    s.pool.add(9, (1, 1), SOURCE_WINDOW)
    s.pool.add(9, (2, 2), SOURCE_WINDOW)
    text = np.array([5, 9, 70, 71, 3, 5, 9], dtype=np.int32)
    got = candidates(s, text, prompt_pool=True)
    assert got == [((70, 71), 1, SOURCE_PROMPT), ((2, 2), 1, SOURCE_WINDOW)]
    assert candidates(s, text, prompt_pool=False) == [((2, 2), 1, SOURCE_WINDOW),
                                                      ((1, 1), 1, SOURCE_WINDOW)]
    s.pool.add(9, (70, 71), SOURCE_PROMPT)  # known already: not repeated
    assert [c for c, _, _ in candidates(s, text, prompt_pool=True)] == [(70, 71), (2, 2)]


# -- trees ---------------------------------------------------------------------


def _ask(n=4, w=3, g=2, root=7, root_pos=20, expect=()):
    levels = np.arange(100, 100 + (n - 1) * max(w, 1), dtype=np.int32).reshape(n - 1, -1)
    cands = [(tuple(range(10 * c + 1, 10 * c + n)), 1, SOURCE_PROMPT) for c in range(g)]
    return TreeAsk(ngram_size=n, window=w, cands=cands, root=root, root_pos=root_pos,
                   levels=levels, expect=list(expect))


@pytest.mark.parametrize("fused", [False, True])
def test_plan_trees_builds_layout_tokens_positions(fused):
    expect = [3, 4, 7] if fused else []
    ask = _ask(expect=expect)
    (tree,), use_window = plan_trees([ask], 0, 1000)
    assert use_window
    assert isinstance(tree, PlannedTree)
    layout = build_tree(4, 3, 2)
    np.testing.assert_array_equal(tree.layout.mask, layout.mask)
    cands = np.array([c for c, _, _ in ask.cands], dtype=np.int32)
    np.testing.assert_array_equal(tree.tokens, fill_tree_tokens(layout, 7, ask.levels, cands))
    assert tree.tokens[0] == tree.root == 7
    np.testing.assert_array_equal(tree.positions, 20 + layout.depth)
    assert tree.positions.dtype == np.int64 and tree.tokens.dtype == np.int32
    assert tree.root_pos == 20 and tree.window and tree.cands == ask.cands
    assert tree.expect == expect and tree.num_scheduled == len(expect)


def test_plan_trees_fits_the_budget_windows_first_then_candidates():
    asks = [_ask(g=3), _ask(g=3)]
    full = tree_size(4, 3, 3)
    trees, use_window = plan_trees(asks, 2 * full, 1000)
    assert use_window and all(t.layout.window_size == 3 and len(t.cands) == 3 for t in trees)
    trees, use_window = plan_trees(asks, 20, 1000)  # no windows, 2 x (1 + 3 * 3) = 20
    assert not use_window
    assert all(not t.window and t.layout.window_size == 0 and len(t.cands) == 3 for t in trees)
    trees, use_window = plan_trees(asks, 10, 1000)  # 2 x (1 + 3 * 1) = 8
    assert not use_window and [len(t.cands) for t in trees] == [1, 1]
    assert trees[0].cands == asks[0].cands[:1]
    trees, use_window = plan_trees(asks, 7, 1000)  # not even one candidate each
    assert not use_window and trees == [None, None]


def test_plan_trees_no_tree_without_window_or_candidates():
    (tree,), use_window = plan_trees([_ask(w=0, g=0)], 0, 1000)
    assert tree is None and use_window
    trees, _ = plan_trees([_ask(w=3, g=0), _ask(w=0, g=1)], 0, 1000)
    assert trees[0].window and not trees[0].cands
    assert not trees[1].window and trees[1].layout.num_nodes == 1 + 3


def test_plan_trees_leaves_out_a_tree_reaching_max_model_len():
    depth = int(build_tree(4, 3, 2).depth.max())  # window: the deepest column
    assert depth == 2 + 2
    (tree,), _ = plan_trees([_ask(root_pos=50 - depth)], 0, 50)
    assert tree is None
    (tree,), _ = plan_trees([_ask(root_pos=49 - depth)], 0, 50)
    assert tree is not None and tree.positions.max() == 49
    # the cut is per request, after the step's budget
    trees, _ = plan_trees([_ask(root_pos=10), _ask(root_pos=50 - depth)], 0, 50)
    assert trees[0] is not None and trees[1] is None


# -- reading a tree ------------------------------------------------------------


def _cand_tree(cands):
    s = _state(n=3, w=0, g=len(cands))
    layout = build_tree(3, 0, len(cands))
    return s, layout, [(tuple(c), cnt, src) for c, cnt, src in cands]


def test_best_confirmed_takes_the_longest_confirmed_candidate():
    s, layout, cands = _cand_tree([((5, 6), 1, SOURCE_WINDOW), ((5, 8), 1, SOURCE_PROMPT)])
    pred = np.zeros(layout.num_nodes, dtype=np.int64)
    pred[0] = 5  # after the root: 5 (both candidates' first token)
    pred[layout.cand_index[0][0]] = 9  # after (5): 9, candidate 0's 6 is wrong
    pred[layout.cand_index[1][0]] = 8  # candidate 1's 8 is right
    pred[layout.cand_index[1][1]] = 42  # the model's token after (5, 8)
    assert best_confirmed(s, layout, cands, pred) == [5, 8, 42]
    assert s.draft_sources == [SOURCE_PROMPT, SOURCE_PROMPT, SOURCE_MODEL]


def test_best_confirmed_ties_most_seen_then_newest_and_none_confirmed():
    s, layout, cands = _cand_tree([((5, 6), 1, SOURCE_WINDOW), ((5, 7), 3, SOURCE_PROMPT),
                                   ((5, 1), 3, SOURCE_WINDOW)])
    pred = np.full(layout.num_nodes, 99, dtype=np.int64)
    pred[0] = 5
    pred[layout.cand_index[1][0]] = 31
    pred[layout.cand_index[2][0]] = 32
    # all confirm one token; candidates 1 and 2 seen 3 times; 1 is newer
    assert best_confirmed(s, layout, cands, pred) == [5, 31]
    assert s.draft_sources == [SOURCE_PROMPT, SOURCE_MODEL]
    pred[0] = 4  # nothing confirmed: the model's own next token
    assert best_confirmed(s, layout, cands, pred) == [4]
    assert s.draft_sources == [SOURCE_MODEL]


def test_jacobi_step_harvests_only_when_warm_and_shifts():
    s = _state(n=3, w=2)
    s.window = JacobiWindow(3, 2, np.array([1, 2, 3, 4], dtype=np.int32))
    layout = build_tree(3, 2, 0)
    pred = np.zeros(layout.num_nodes, dtype=np.int64)
    pred[layout.newest_level] = [8, 9]
    jacobi_step(s, layout, 7, pred)  # cold (random levels): no harvest
    assert len(s.pool) == 0
    assert s.window.steps == 1 and s.window.levels.tolist() == [[4, 2], [8, 9]]
    pred[layout.newest_level] = [10, 11]
    jacobi_step(s, layout, 7, pred)  # N=3: warm after one step
    # columns (B0[j], B1[j], new[j]) with B0 = (root, L0[0])
    assert s.pool.get(7) == [((8, 10), 1, SOURCE_WINDOW)]
    assert s.pool.get(4) == [((9, 11), 1, SOURCE_WINDOW)]
    assert s.window.steps == 2 and s.window.levels[-1].tolist() == [10, 11]


def test_harvest_only_where_vllm_sampled_the_expected_text():
    s = _state(n=3, w=2, g=1)
    ask = TreeAsk(ngram_size=3, window=2, cands=[((5, 6), 1, SOURCE_PROMPT)], root=7,
                  root_pos=30, levels=s.window.levels, expect=[3, 7])
    (plan,), _ = plan_trees([ask], 0, 1000)
    pred = np.zeros(plan.layout.num_nodes, dtype=np.int64)
    pred[0] = 5
    pred[plan.layout.cand_index[0]] = [6, 11]
    levels = s.window.levels.copy()
    assert harvest(s, plan, pred, [3, 8]) == []
    np.testing.assert_array_equal(s.window.levels, levels)  # untouched
    assert harvest(s, plan, pred, [3, 7]) == [5, 6, 11]
    assert s.window.steps == 1


# -- accounting ----------------------------------------------------------------


def test_account_counts_accepted_by_source_and_caps_at_max_tokens():
    st = LookaheadStats()
    s = _state(prompt=(1, 2, 3, 4, 5), max_tokens=4)
    s.draft_sources = [SOURCE_WINDOW, SOURCE_PROMPT, SOURCE_MODEL]
    s.draft_checked = True
    s.lookup, s.lookup_kind = [9, 9], "pool"
    # 3 sampled: 2 draft tokens accepted; the request had 2 output tokens
    # before, so only 2 of the 3 count (max_tokens 4)
    account(s, st, [10, 11, 12], num_tokens=5 + 2 + 3)
    assert st.decode_steps == 1 and st.generated_tokens == 2 and st.accepted_tokens == 2
    assert st.accepted_by_source == {SOURCE_WINDOW: 1, SOURCE_PROMPT: 1, SOURCE_MEMORY: 0,
                                     SOURCE_MODEL: 0}
    assert s.draft_sources == [] and s.lookup == [] and not s.draft_checked
    # no cap: every sampled token counts; nothing drafted, nothing accepted
    s.max_tokens = None
    account(s, st, [13, 14], num_tokens=12)
    assert st.generated_tokens == 4 and st.accepted_tokens == 2 and st.decode_steps == 2
    # past max_tokens: nothing counts as generated
    s.max_tokens = 1
    account(s, st, [15], num_tokens=13)
    assert st.generated_tokens == 4


def test_account_books_accepted_tokens_by_the_drafts_kind():
    st = LookaheadStats()
    s = _state(prompt=(1, 2, 3, 4, 5))
    st.drafts_by_kind["suffix3+"] = [1, 3, 0]  # as the step booked the draft
    s.draft_sources, s.draft_kind = [SOURCE_PROMPT] * 3, "suffix3+"
    account(s, st, [10, 11, 12], num_tokens=8)  # 2 of 3 draft tokens accepted
    assert st.drafts_by_kind == {"suffix3+": [1, 3, 2]}
    account(s, st, [13], num_tokens=9)  # no draft: nothing booked
    assert st.drafts_by_kind == {"suffix3+": [1, 3, 2]}


def test_account_learns_checked_acceptance_only_for_checked_drafts():
    s = _state()
    before = (s.acc.checked.hits, s.acc.checked.misses)
    s.draft_sources, s.draft_checked = [SOURCE_PROMPT] * 2, False
    account(s, LookaheadStats(), [1, 2, 3], num_tokens=8)
    assert (s.acc.checked.hits, s.acc.checked.misses) == before
    s.draft_sources, s.draft_checked = [SOURCE_PROMPT] * 2, True
    account(s, LookaheadStats(), [1, 2], num_tokens=10)  # 1 of 2 accepted
    assert s.acc.checked.misses > before[1] * 0.9


def test_account_compares_planned_gain_with_what_was_accepted():
    st = LookaheadStats()
    s = _state()
    s.draft_sources, s.draft_expect = [SOURCE_PROMPT] * 3, 1.5
    account(s, st, [1, 2], num_tokens=8)  # 1 of 3 draft tokens accepted
    assert st.planned_gain == 1.5 and st.planned_gain_seen == 1
    assert s.draft_expect is None
    # a draft not planned so (checked chain, seeded) is left out
    s.draft_sources = [SOURCE_PROMPT] * 2
    account(s, st, [1, 2, 3], num_tokens=11)
    assert st.planned_gain == 1.5 and st.planned_gain_seen == 1


# -- one step ------------------------------------------------------------------


def _step(mode, **cfg):
    cfg = LookaheadConfig(ngram_size=3, window_size=2, guess_set_size=2, mode=mode,
                          adaptive=False, **cfg)
    stats = LookaheadStats()
    return StepDrafter(cfg, mode == "fused", 1000, stats, AcceptancePrior(max_cands=2)), stats


def _live_request(text, n=3, w=2, g=2):
    tokens = np.zeros((1, 64), dtype=np.int32)
    tokens[0, : len(text)] = text
    s = new_state(RequestSettings(ngram_size=n, window_size=w, guess_set_size=g), tokens[0],
                  len(text), len(text), None, False, 0, AcceptancePrior(max_cands=g))
    return s, tokens


def test_separate_step_runs_one_pass_and_drafts_the_checked_chain():
    step, stats = _step("separate")
    text = [4, 5, 6, 9, 4, 5]
    s, tokens = _live_request(text)
    calls = []

    def run_trees(rows):
        calls.append(rows)
        (i, tree), = rows
        assert i == 0 and tree.root == 5 and tree.root_pos == len(text) - 1
        pred = np.full(tree.layout.num_nodes, 1, dtype=np.int64)
        pred[0] = 6  # the prompt's continuation (6, 9) of (4, 5): confirmed
        c = next(c for c, (cont, _, _) in enumerate(tree.cands) if cont == (6, 9))
        pred[tree.layout.cand_index[c]] = [9, 77]
        return [pred]

    drafts, planned = step.run([Live(0, s, len(text), 3, [])], 1, 1, 3, True, tokens, run_trees)
    assert len(calls) == 1 and planned is None
    assert drafts == [[6, 9, 77]]
    assert s.draft_checked and s.draft_sources == [SOURCE_PROMPT, SOURCE_PROMPT, SOURCE_MODEL]
    assert stats.lookahead_passes == 1 and stats.pass_requests == 1
    assert stats.drafts == 1 and stats.draft_tokens == 3 and stats.arm_steps["tree"] == 1
    assert stats.drafts_by_kind == {"checked": [1, 3, 0]} and s.draft_kind == "checked"


def test_fused_step_catches_up_in_the_step_itself():
    """A request without a checked chain gets no extra forward: its draft
    is the unchecked lookup and a catch-up tree rooted at its newest token
    rides in the step; what vLLM samples along the tree's chain is cut off
    the chain, the rest is the next step's chain."""
    step, stats = _step("fused")
    text = [4, 5, 6, 9, 4, 5]
    s, tokens = _live_request(text)

    def run_trees(rows):  # pragma: no cover - no separate pass in fused mode
        raise AssertionError(rows)

    drafts, _ = step.run([Live(0, s, len(text), 3, [])], 1, 1, 3, True, tokens, run_trees)
    assert stats.catch_up_requests == 1 and stats.lookahead_passes == 0
    # the lookup (6, 9, 4), unchecked, as far as its acceptance (the prior's
    # 0.4 per token for a 2-token suffix match) keeps p^k >= 1/4: one token
    assert s.lookup == [6, 9, 4] and s.lookup_kind == "suffix2"
    assert drafts == [[6]] and not s.draft_checked
    plan = s.plan
    assert plan.catch_up and plan.expect == [] and plan.num_scheduled is None
    assert plan.root == 5 and plan.root_pos == len(text) - 1
    assert plan.tokens[0] == 5 and plan.positions[0] == plan.root_pos

    def pred_confirming(plan):
        pred = np.full(plan.layout.num_nodes, 1, dtype=np.int64)
        pred[0] = 6  # the argmax after 5
        c = next(c for c, (cont, _, _) in enumerate(plan.cands) if cont == (6, 9))
        pred[plan.layout.cand_index[c]] = [9, 77]
        return pred

    # vLLM sampled one token, along the chain (6, 9, 77): (9, 77) is left
    assert harvest(s, plan, pred_confirming(plan), [6]) == [9, 77]
    assert s.draft_sources == [SOURCE_PROMPT, SOURCE_MODEL]
    # it sampled the whole chain (the lookup's draft was accepted): nothing left
    s2, _ = _live_request(text)
    assert harvest(s2, plan, pred_confirming(plan), [6, 9, 77]) == []
    # it sampled off the chain: nothing
    s3, _ = _live_request(text)
    assert harvest(s3, plan, pred_confirming(plan), [7]) == []


def test_fused_step_with_a_chain_plans_the_next_tree_after_the_draft():
    step, stats = _step("fused")
    text = [4, 5, 6, 9, 4, 5]
    s, tokens = _live_request(text)
    drafts, _ = step.run([Live(0, s, len(text), 3, [6, 9, 77])], 1, 1, 3, True, tokens, None)
    assert stats.catch_up_requests == 0 and drafts == [[6, 9]]
    plan = s.plan
    assert not plan.catch_up and plan.expect == [6, 9, 77] and plan.num_scheduled == 3
    assert plan.root == 77 and plan.root_pos == len(text) + 2
    assert plan.tokens[0] == 77 and plan.positions[0] == plan.root_pos


def test_step_budget_too_small_falls_back_to_the_unchecked_lookup():
    step, stats = _step("separate", max_tree_tokens=1)
    text = [4, 5, 6, 9, 4, 5]
    s, tokens = _live_request(text)

    def run_trees(rows):  # pragma: no cover - must not run
        raise AssertionError(rows)

    drafts, _ = step.run([Live(0, s, len(text), 3, [])], 1, 1, 3, True, tokens, run_trees)
    assert drafts == [[6, 9, 4]] and not s.draft_checked
    assert stats.unchecked_drafts == 1 and stats.steps_window_off == 1
    # booked under the lookup's kind: "4 5" seen once before (one place)
    assert stats.drafts_by_kind == {"suffix2": [1, 3, 0]} == {s.lookup_kind: [1, 3, 0]}


def test_a_step_whose_budget_cuts_windows_twice_counts_once():
    """Fused mode, a budget (6 tokens) under two windowed trees (6 each with
    one candidate) but over two without window (3 each): the catch-up tree
    of the request without a checked chain and the next tree of the request
    with one both leave the window out -- one step with the window off."""
    step, stats = _step("fused", max_tree_tokens=6)
    text = [4, 5, 6, 9, 4, 5]
    s0, tokens = _live_request(text)
    s1, _ = _live_request(text)
    tokens = np.concatenate([tokens, tokens])
    live = [Live(0, s0, len(text), 3, []), Live(1, s1, len(text), 3, [6, 9, 4])]
    step.run(live, 2, 2, 3, True, tokens, None)
    assert stats.catch_up_requests == 1
    assert s0.plan is not None and s0.plan.catch_up and s0.plan.window is False
    assert s1.plan is not None and s1.plan.window is False
    assert stats.steps_window_off == 1


def test_a_step_where_nothing_pays_leaves_every_request_off_unsearched():
    """A machine where nothing can pay: every request is looked up (its
    lookup is scored either way) and left off without the planner's search
    (``requests_unpaid``); the step is timed as planned, all off."""
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel
    from vllm_lookahead.planner.planner import Planner

    cfg = LookaheadConfig(ngram_size=3, window_size=2, guess_set_size=2, mode="fused")
    stats = LookaheadStats()
    prior = AcceptancePrior(max_cands=2, p_unchecked=0.1)
    step = StepDrafter(cfg, True, 1000, stats, prior)
    # every extra query token costs two steps: nothing ever pays
    step.planner = Planner(CostModel(CostCurve.flat(0.05, 2.0)))
    text = [4, 5, 6, 9, 4, 5]
    tokens = np.zeros((2, 64), dtype=np.int32)
    tokens[:, : len(text)] = text
    states = [new_state(RequestSettings(ngram_size=3, window_size=2, guess_set_size=2),
                        tokens[i], len(text), len(text), None, False, 0, prior)
              for i in range(2)]
    live = [Live(i, s, len(text), 3, []) for i, s in enumerate(states)]

    def no_trees(rows):  # pragma: no cover - must not run
        raise AssertionError(rows)

    for joined in (True, False):
        drafts, planned = step.run(live, 2, 2, 3, joined, tokens, no_trees)
        assert all(s.lookup for s in states)
        assert drafts == [[], []] and planned == (2, 1.0, False, 0, 0.0, None)
    assert stats.requests_unpaid == 4 and stats.shape_steps["off"] == 4


def _planned_step(p_unchecked: float, per_token: float, rows: int, **cfg):
    """A fused N=3, W=2, G=2 drafter with a planner on a flat curve (an
    extra query token costs ``per_token`` of a step), a prior that has seen
    no tree, and ``rows`` rows of a repeating text (tokens [rows, 64])."""
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel
    from vllm_lookahead.planner.planner import Planner

    stats = LookaheadStats()
    prior = AcceptancePrior(max_cands=2, p_unchecked=p_unchecked, tree_cands=[0.0, 0.0],
                            tree_window=0.0)
    step = StepDrafter(LookaheadConfig(ngram_size=3, window_size=2, guess_set_size=2,
                                       mode="fused", **cfg), True, 1000, stats, prior)
    step.planner = Planner(CostModel(CostCurve.flat(0.05, per_token)))
    text = [4, 5, 6, 9, 4, 5, 6, 9, 4, 5]
    tokens = np.zeros((rows, 64), dtype=np.int32)
    tokens[:, : len(text)] = text
    return step, stats, prior, text, tokens


def test_a_request_that_cannot_pay_is_left_off_unsearched():
    """A request whose lookup's drafts and trees could not pay with the
    others off is off without the planner's search (``requests_unpaid``);
    the one that may pay drafts."""
    from vllm_lookahead.planner.acceptance import LOOKUP_KINDS

    step, stats, prior, text, tokens = _planned_step(0.1, 0.3, rows=2)
    strong, weak = (new_state(RequestSettings(ngram_size=3, window_size=2, guess_set_size=2),
                              tokens[i], len(text), len(text), None, False, 0, prior)
                    for i in range(2))
    for st, p in ((strong, 0.95), (weak, 0.01)):
        for kind in LOOKUP_KINDS:
            st.acc.unchecked[kind].hits, st.acc.unchecked[kind].misses = 100 * p, 100 * (1 - p)
    live = [Live(0, strong, len(text), 3, []), Live(1, weak, len(text), 3, [])]

    def no_trees(rows):  # pragma: no cover - must not run
        raise AssertionError(rows)

    for joined in (True, False):
        drafts, _ = step.run(live, 2, 2, 3, joined, tokens, no_trees)
        assert weak.lookup and strong.lookup
        assert drafts[0] == [6, 9, 4] and drafts[1] == []
    assert stats.requests_unpaid == 2


def test_requests_left_off_after_their_lookup_are_off_in_the_full_plan(monkeypatch):
    """A request whose lookup cannot pay with the others off is left
    off without the planner's search (``requests_unpaid``), and the step's
    drafts are the ones the planner gives with every request searched:
    random batches of requests of random acceptance, room and weight."""
    import copy
    import random

    from vllm_lookahead.planner.acceptance import LOOKUP_KINDS
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel
    from vllm_lookahead.planner.planner import Planner

    rng = random.Random(5)
    left_off = 0
    for _ in range(60):
        rows = rng.randint(2, 12)
        step, stats, prior, text, tokens = _planned_step(0.3, rng.choice([0.001, 0.01, 0.05]),
                                                         rows=rows)
        step.trees = False
        # the planner's unchecked gains scaled by the engine's calibration
        prior.calibration = rng.choice([1.0, rng.uniform(0.3, 1.5)])
        # a verifier whose step pays a switch once where any request drafts
        flat = CostCurve.flat(0.05, rng.choice([0.001, 0.01, 0.05]))
        row = (rng.uniform(0, 0.004), rng.uniform(0, 0.002), 0.0, rng.uniform(0, 0.02))
        step.planner = Planner(CostModel(CostCurve(flat.points, {"sampled": {1: row},
                                                                "greedy": {1: row}})))
        live = []
        for i in range(rows):
            st = new_state(RequestSettings(ngram_size=3, window_size=2, guess_set_size=2),
                           tokens[i], len(text), len(text), None, False, 0, prior)
            p = rng.random()
            for kind in LOOKUP_KINDS:
                st.acc.unchecked[kind].hits, st.acc.unchecked[kind].misses = 100 * p, 100 * (1 - p)
            live.append(Live(i, st, len(text), rng.randint(0, 3), []))
        weights = [rng.uniform(0.0, 2.0) for _ in live]
        full_live = copy.deepcopy(live)
        drafts = [[] for _ in range(rows)]
        step._plan(live, drafts, tokens, weights=weights)
        left_off += stats.requests_unpaid
        full = [[] for _ in range(rows)]
        with monkeypatch.context() as m:
            m.setattr(Planner, "_prune", lambda self, views, options, *a: options)
            before = stats.requests_unpaid
            step._plan(full_live, full, tokens, weights=weights)
            assert stats.requests_unpaid == before
        assert drafts == full
    assert left_off > 100  # most of the weak or unweighted ones


def test_trees_left_off_after_their_lookup_are_off_in_the_full_plan(monkeypatch):
    """With trees: a request none of whose drafts and trees this step could
    pay with the others off is left off without the planner's search, and
    the step's drafts and trees are the ones the planner gives with every
    shape of every request searched (random batches, acceptance, tree
    estimates, room and weights; the two plans from copies of one planner,
    no exploration credit)."""
    import copy
    import random

    from vllm_lookahead.planner.acceptance import LOOKUP_KINDS
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel
    from vllm_lookahead.planner.planner import Planner

    rng = random.Random(11)
    left_off = trees_planned = 0
    for _ in range(80):
        rows = rng.randint(2, 10)
        step, stats, prior, text, tokens = _planned_step(0.3, rng.choice([0.001, 0.01, 0.05]),
                                                         rows=rows)
        prior.calibration = rng.choice([1.0, rng.uniform(0.3, 1.5)])
        flat = CostCurve.flat(0.05, rng.choice([0.001, 0.01, 0.05]))
        row = (rng.uniform(0, 0.004), rng.uniform(0, 0.002), 0.0, rng.uniform(0, 0.02))
        step.planner = Planner(CostModel(CostCurve(flat.points, {"sampled": {1: row},
                                                                "greedy": {1: row}})))
        step.planner.planned_s = 0.0  # no exploration credit
        live = []
        for i in range(rows):
            st = new_state(RequestSettings(ngram_size=3, window_size=2, guess_set_size=2),
                           tokens[i], len(text), len(text), None, False, 0, prior)
            st.acc.tree_runs = rng.choice([0, 1])
            p = rng.random()
            for kind in LOOKUP_KINDS:
                st.acc.unchecked[kind].hits, st.acc.unchecked[kind].misses = 100 * p, 100 * (1 - p)
            good = rng.choice([0.0, 0.3, 1.5])
            st.acc.tree_cands = [good * rng.random(), good * rng.random()]
            st.acc.tree_window = good * rng.random()
            live.append(Live(i, st, len(text), rng.randint(0, 3), []))
        weights = [rng.uniform(0.0, 2.0) for _ in live]
        full_step, full_live = copy.deepcopy((step, live))
        drafts = [[] for _ in range(rows)]
        trees, _ = step._plan(live, drafts, tokens, weights=weights)
        left_off += stats.requests_unpaid
        full = [[] for _ in range(rows)]
        with monkeypatch.context() as m:
            m.setattr(Planner, "_prune", lambda self, views, options, *a: options)
            full_trees, _ = full_step._plan(full_live, full, tokens, weights=weights)
            assert full_step.stats.requests_unpaid == 0
        assert drafts == full
        assert [(t[0].i, t[1], t[2]) for t in trees] == [(t[0].i, t[1], t[2])
                                                          for t in full_trees]
        trees_planned += len(trees)
    assert left_off > 100 and trees_planned > 20


def test_planner_counts_requests_left_out_as_off():
    from vllm_lookahead.planner.acceptance import RequestAcceptance
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel
    from vllm_lookahead.planner.planner import Planner, RequestView

    # each extra query token costs 10% of a step at any batch size
    curve = CostCurve({b: [(t, 0.05 * (1 + 0.1 * (b * t - 1))) for t in (1, 8, 64)]
                       for b in (1, 2, 4, 8, 16)})
    planner = Planner(CostModel(curve))
    prior = AcceptancePrior(max_cands=2, p_unchecked=0.6)

    def view(room=3):
        return RequestView(acc=RequestAcceptance(prior), ngram_size=3, window_size=2,
                           guess_set_size=2, room=room, unchecked=3)

    v = view()
    together = planner.plan([v] + [view(room=0) for _ in range(15)])
    assert all(s.kind == "off" for s in together[1:])
    assert together[:1] != planner.plan([v])  # the batch's size changes the answer


def test_planned_unchecked_draft_carries_its_expected_gain():
    """The planner's unchecked draft records what the planner expected the
    verifier to accept of it (``shape.tokens - 1``); a step left off does
    not."""
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel
    from vllm_lookahead.planner.planner import Planner

    cfg = LookaheadConfig(ngram_size=3, window_size=2, guess_set_size=2, mode="fused")
    stats = LookaheadStats()
    # trees confirm nothing: a draft or nothing
    prior = AcceptancePrior(max_cands=2, p_unchecked=0.9, tree_cands=[0.0, 0.0],
                            tree_window=0.0)
    step = StepDrafter(cfg, True, 1000, stats, prior)
    text = [4, 5, 6, 9, 4, 5]
    tokens = np.zeros((1, 64), dtype=np.int32)
    tokens[0, : len(text)] = text
    s = new_state(RequestSettings(ngram_size=3, window_size=2, guess_set_size=2), tokens[0],
                  len(text), len(text), None, False, 0, prior)
    live = [Live(0, s, len(text), 3, [])]

    def no_trees(rows):  # pragma: no cover - must not run
        raise AssertionError(rows)

    # extra tokens nearly free: the lookup (after the suffix [4, 5]) is drafted
    step.planner = Planner(CostModel(CostCurve.flat(0.05, 0.001)))
    drafts, _ = step.run(live, 1, 1, 3, True, tokens, no_trees)
    assert drafts == [[6, 9, 4]]
    expected = s.draft_expect
    assert expected is not None and 0.9 < expected < 2.0
    account(s, stats, [6, 9, 7], num_tokens=len(text) + 3)  # 2 of 3 accepted
    assert stats.planned_gain == expected and stats.planned_gain_seen == 2
    # every extra token costs 2 steps: off, nothing expected
    step = StepDrafter(cfg, True, 1000, stats, prior)
    step.planner = Planner(CostModel(CostCurve.flat(0.05, 2.0)))
    drafts, _ = step.run(live, 1, 1, 3, True, tokens, no_trees)
    assert drafts == [[]] and s.draft_expect is None


def _capped_states(prior, tokens, text, generated, groups):
    """N=3, W=2, G=2 request states of row i of ``tokens`` (the whole
    ``text``), ``generated[i]`` tokens of 16 generated, in parent
    ``groups[i]`` (None: no siblings)."""
    states = []
    for i, (done, group) in enumerate(zip(generated, groups)):
        s = new_state(RequestSettings(ngram_size=3, window_size=2, guess_set_size=2),
                      tokens[i], len(text), len(text) - done, 16, False, 0, prior)
        s.group = group
        states.append(s)
    return states


def test_samples_of_one_parent_are_planned_by_who_ends_last():
    """The n samples of a request (vLLM's ids ``"{index}_{parent}"``): the one
    with the most tokens left, far behind its sibling, is planned with the
    parent's last step (2 tokens here), the one ahead at about the worth of
    a batch slot (``sibling_ahead_steps``): where a draft token
    costs little but a request's slot too, the sample ahead is left off and
    the others draft their lookups."""
    from vllm_lookahead.algo.state import sibling_group

    assert sibling_group("3_cmpl-abc_1") == "cmpl-abc_1"
    assert sibling_group("cmpl-abc") is None and sibling_group("x_1") is None
    assert sibling_group("12_") is None

    step, stats, prior, text, tokens = _planned_step(0.9, 0.001, rows=3, parent_latency=True)
    live = [Live(i, s, len(text), 3, [])
            for i, s in enumerate(_capped_states(prior, tokens, text, (1, 9, 2), ("p", "p", None)))]
    w = step._weights(live, 3)
    slot = drain_value(step.planner.cost, 3, 2)
    # 15 left against its sibling's 7: it ends the parent (worth the
    # parent's last step, 2 tokens here), its sibling only frees a slot
    assert 1.6 < w[0] <= 2.0
    assert slot <= w[1] < 0.02 * 2.0 + slot
    assert w[2] == 1.0  # no siblings
    assert (stats.sibling_steps, stats.sibling_ahead_steps) == (2, 1)  # counted
    drafts, _ = step.run(live, 3, 3, 3, True, tokens, lambda rows: [])
    # a slot is worth 3 * 0.001 / 0.052 tokens: the one ahead would gain
    # under 0.1 * 2.4 tokens for 3 draft tokens worth 0.17
    assert drafts == [[6, 9, 4], [], [6, 9, 4]]
    assert stats.sibling_ahead_steps == 2  # the one ahead, in the step
    assert stats.sibling_steps == 4  # the two samples
    # seeded samples only: their drafts never read a weight, none is taken
    for r in live:
        r.state.seeded = True
    assert step._weights(live, 3) is None
    live[2].state.seeded = False  # an unseeded request beside them: taken
    assert step._weights(live, 3) is not None


def test_a_step_prices_the_bonus_rows_only_where_every_request_allows_them():
    """A sampled request's poor guess is drafted where a rejected draft
    saves its bonus row (patch 15's lazy_bonus), and only when every
    request of the step lets vLLM's rows be cut (``state.lazy_bonus``): one
    request with, say, penalties keeps the whole batch on vLLM's path, and
    nothing is saved."""
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel
    from vllm_lookahead.planner.planner import Planner

    cfg = LookaheadConfig(ngram_size=3, window_size=2, guess_set_size=2, mode="fused")
    prior = AcceptancePrior(max_cands=2, p_unchecked=0.05, tree_cands=[0.0, 0.0],
                            tree_window=0.0)
    text = [4, 5, 6, 9, 4, 5]
    tokens = np.zeros((2, 64), dtype=np.int32)
    tokens[:, : len(text)] = text

    def no_trees(rows):  # pragma: no cover - must not run
        raise AssertionError(rows)

    def run(allow):
        stats = LookaheadStats()
        step = StepDrafter(cfg, True, 1000, stats, prior)
        # a draft token's forward: 1 ms; the bonus row a rejection saves: 4 ms
        curve = CostCurve.flat(0.05, 0.02)
        curve = CostCurve(curve.points, {"sampled": {1: (0.0005, 0.0003, 0.004)}})
        step.planner = Planner(CostModel(curve))
        step.planner.lazy_verify = True
        live = []
        for i, ok in enumerate(allow):
            s = new_state(RequestSettings(ngram_size=3, window_size=2, guess_set_size=2),
                          tokens[i], len(text), len(text), None, False, 0, prior)
            s.sampled, s.lazy_bonus = True, ok
            live.append(Live(i, s, len(text), 3, []))
        return step.run(live, 2, 2, 3, True, tokens, no_trees)

    drafts, planned = run([True, True])
    assert all(drafts)
    # the step is booked less the verification it was priced with: the
    # rows expected less the bonus rows expected saved, below 0 here
    assert planned[4] < 0
    assert run([True, False])[0] == [[], []]


def test_match_kind_buckets_long_own_matches():
    """Own-text matches past 4 tokens are learnt in three length buckets;
    the memory's key lengths are kinds as they are; every kind is one the
    acceptance model keeps a rate for."""
    from vllm_lookahead.planner.acceptance import LOOKUP_KINDS, AcceptancePrior, match_kind

    got = {m: match_kind("suffix", m) for m in (2, 3, 4, 5, 8, 9, 16, 17, 24, 30)}
    assert got == {2: "suffix2", 3: "suffix3", 4: "suffix4", 5: "suffix8", 8: "suffix8",
                   9: "suffix16", 16: "suffix16", 17: "suffix24", 24: "suffix24",
                   30: "suffix24"}
    assert [match_kind("memory", m) for m in (2, 3, 6, 12)] == ["memory2", "memory3", "memory6",
                                                                "memory12"]
    prior = AcceptancePrior(max_cands=3)
    assert set(got.values()) <= set(LOOKUP_KINDS) == set(prior.p_unchecked)
