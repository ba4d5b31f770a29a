"""The per-step planner, the acceptance model and the cost model, without an
engine: synthetic cost curves of the machine kinds we meet (AMX Xeon:
bf16 flat up to 16 tokens; AVX2 EPYC bf16: steep from 2 tokens; a GPU: flat
up to 128), with high and zero acceptance."""

from __future__ import annotations

import json
import math
import logging
import random

import numpy as np
import pytest

from vllm_lookahead.planner.acceptance import (
    LOOKUP_KINDS,
    AcceptancePrior,
    RequestAcceptance,
    geometric_gain,
    window_root,
)
from vllm_lookahead.planner.cost_cache import CostCache, cache_key, load_curve
from vllm_lookahead.planner.cost_model import CostCurve, CostModel, bucket_of, measure_curve
from vllm_lookahead.planner.planner import OFF, Planner, RequestView, Shape
from vllm_lookahead.planner.siblings import drain_value, end_shares_many, end_value

# -- synthetic machines ----------------------------------------------------------
STEP = 0.05  # seconds of a 1-token step


def curve_from(fn, batches=(1, 2, 4, 8, 16), tokens=(1, 2, 4, 8, 16, 24, 32, 48, 64, 128)):
    """A measured-looking curve from ``fn(total_tokens) -> relative cost``."""
    return CostCurve({b: [(t, STEP * fn(b * t)) for t in tokens] for b in batches})


def amx(total):  # bf16 with AMX: nearly free up to 16 tokens, then rising
    return 1.0 if total <= 16 else 1.0 + 0.04 * (total - 16)


def avx2_bf16(total):  # every extra token costs a quarter step
    return 1.0 + 0.25 * (total - 1)


def gpu(total):  # flat up to 128 tokens
    return 1.0 if total <= 128 else total / 128


def model(fn):
    return CostModel(curve_from(fn))


def acceptance(p_unchecked, tree_by_g, window_extra, p_checked=1.0, g_max=8):
    """A request whose estimates were learnt from many observations."""
    prior = AcceptancePrior(max_cands=g_max, p_unchecked=p_unchecked, p_checked=p_checked,
                            tree_cands=list(tree_by_g), tree_window=window_extra)
    return RequestAcceptance(prior)


HIGH = dict(p_unchecked=0.8, tree_by_g=[1.6, 2.0, 2.2, 2.3, 2.4, 2.4, 2.4, 2.4],
            window_extra=0.5)
ZERO = dict(p_unchecked=0.0, tree_by_g=[0.0] * 8, window_extra=0.0)


def rate(planner, shapes):
    """Expected tokens per second of a step run with ``shapes``."""
    q = sum(s.query for s in shapes)
    sec = planner.cost.predict(len(shapes), q / len(shapes), tree=any(s.kind == "tree" for s in shapes),
                               drafting=sum(s.query > 1 for s in shapes))
    return sum(s.tokens for s in shapes) / (sec + sum(s.extra_s for s in shapes))


def unpruned(monkeypatch):
    """Plans of every planner weigh every shape of every request."""
    monkeypatch.setattr(Planner, "_prune", lambda self, views, options, *a: options)


def tree_gain(acc, g, window):
    """Tokens confirmed by a tree of ``g`` candidates and ``window`` of the columns."""
    return acc.tree_gains(((g, window_root(window)),))[0]


def view(acc, chain=0, unchecked=4, n=5, w=7, g=8, room=5, **kw):
    return RequestView(acc=acc, ngram_size=n, window_size=w, guess_set_size=g, room=room,
                       chain=chain, unchecked=unchecked, **kw)


# -- planner ----------------------------------------------------------------------
@pytest.mark.parametrize("fn", [amx, avx2_bf16, gpu])
def test_nothing_pays_with_zero_acceptance(fn):
    plan = Planner(model(fn)).plan([view(acceptance(**ZERO), chain=0)])
    assert plan == [OFF]


def test_tokens_free_means_large_trees():
    planner = Planner(model(gpu))
    plan = planner.plan([view(acceptance(**HIGH), chain=3)])
    assert plan[0].kind == "tree"
    assert plan[0].window == 7 and plan[0].cands == 8  # the whole tree: it costs nothing


def test_amx_like_tree_fits_the_free_size():
    planner = Planner(model(amx))
    (shape,) = planner.plan([view(acceptance(**HIGH), chain=3)])
    assert shape.kind == "tree"
    assert shape.query <= 24  # about the free size, not the full (N-1)(W+G) = 60
    assert rate(planner, [shape]) > rate(planner, [OFF]) * 1.5


def test_avx2_bf16_like_no_tree_but_a_draft():
    planner = Planner(model(avx2_bf16))
    (shape,) = planner.plan([view(acceptance(**HIGH), chain=0, unchecked=4)])
    assert shape.kind == "draft"
    # every token costs a quarter step: long drafts of 80% tokens still pay
    assert 1 <= shape.draft <= 4


def test_avx2_bf16_like_low_acceptance_goes_off():
    acc = acceptance(p_unchecked=0.15, tree_by_g=[0.2] * 8, window_extra=0.1)
    (shape,) = Planner(model(avx2_bf16)).plan([view(acc)])
    assert shape == OFF


def test_never_explores_a_tree_costing_several_steps_for_a_small_gain():
    # The prior of a fresh engine (LADE-like: under one confirmed token per
    # step) on a machine where a tree costs several plain steps: no tree,
    # not even once to see.
    prior = AcceptancePrior(max_cands=8)
    planner = Planner(model(avx2_bf16))
    for chain in (0, 2):
        (shape,) = planner.plan([view(RequestAcceptance(prior), chain=chain)])
        assert shape.kind != "tree"
        tree = [s for s in planner.shapes(view(RequestAcceptance(prior), chain=chain), 1)
                if s.kind == "tree"]
        assert min(rate(planner, [t]) for t in tree) < rate(planner, [OFF])


def test_batch_shares_the_cost():
    # AMX-like: 16 tokens are free in total, not per request, so a batch of
    # 8 cannot give each request a big tree.
    planner = Planner(model(amx))
    views = [view(acceptance(**HIGH), chain=3) for _ in range(8)]
    plan = planner.plan(views)
    assert sum(s.query for s in plan) <= 8 * 8
    assert rate(planner, plan) >= rate(planner, [OFF] * 8)
    # and it beats every uniform plan of one shape
    for s in planner.shapes(views[0], 8):
        assert rate(planner, plan) >= rate(planner, [s] * 8) * 0.999


def test_fixed_and_no_tree_views():
    planner = Planner(model(gpu))
    fixed = Shape("draft", draft=2, tokens=1.5)
    acc = acceptance(**HIGH)
    plan = planner.plan([view(acc, fixed=fixed), view(acc, chain=2, trees=False)])
    assert plan[0] is fixed
    assert plan[1].kind == "draft" and plan[1].draft == 2  # its chain, no tree


def test_no_room_means_off():
    assert Planner(model(gpu)).plan([view(acceptance(**HIGH), room=0)]) == [OFF]


def test_tree_token_budget():
    planner = Planner(model(gpu))
    plan = planner.plan([view(acceptance(**HIGH), chain=3) for _ in range(4)], max_tree_tokens=40)
    assert sum(s.nodes for s in plan) <= 40
    assert any(s.kind == "tree" for s in plan)


def test_catch_up_is_priced():
    # Without a checked chain, a fused tree confirms nothing in its first
    # step (its catch-up): worth less than the same tree after a chain,
    # at the same cost (no extra forward).
    planner = Planner(model(amx))
    acc = acceptance(**HIGH)
    with_chain = [s for s in planner.shapes(view(acc, chain=2), 1) if s.kind == "tree"]
    without = [s for s in planner.shapes(view(acc, chain=0), 1) if s.kind == "tree"]
    assert all(s.extra_s == 0 for s in with_chain + without)
    assert all(a.tokens < b.tokens for a, b in zip(without, with_chain))
    planner.horizon = 100.0  # long runs: the lost step hardly counts
    long_run = [s for s in planner.shapes(view(acc, chain=0), 1) if s.kind == "tree"]
    assert all(a.tokens < b.tokens for a, b in zip(without, long_run))


# -- what pays, and the search's shortcut -------------------------------------------
@pytest.mark.parametrize("fn,batch,acc,pays", [
    (gpu, 16, HIGH, True),  # tokens free: drafts pay
    (amx, 1, HIGH, True),
    (avx2_bf16, 16, ZERO, False),  # nothing is ever accepted
    (avx2_bf16, 16, dict(p_unchecked=0.2, tree_by_g=[0.2] * 8, window_extra=0.0), False),
    (gpu, 16, ZERO, False),
    # no draft is ever accepted, but trees confirm tokens: a tree pays
    (gpu, 16, dict(p_unchecked=0.0, tree_by_g=HIGH["tree_by_g"], window_extra=0.5), True),
])
def test_drafts_and_trees_pay_on_the_machine_kinds(fn, batch, acc, pays):
    views = [view(acceptance(**acc)) for _ in range(batch)]
    planner = Planner(model(fn))
    plan = planner.plan(views)
    assert (plan != [OFF] * batch) is pays


def test_shapes_left_out_of_the_search_could_never_pay(monkeypatch):
    """``Planner._paying`` is safe: on random batches (machines, verifiers,
    switches, calibration, weights, fused or not) the plan is the one of a
    search that weighs every shape of every request, and a request alone
    among the others off too."""
    rng = random.Random(0)
    left_off = 0
    for trial in range(300):
        fn = rng.choice([amx, avx2_bf16, gpu, lambda t: 1 + 0.06 * (t - 1),
                         lambda t: 1 + 0.02 * (t - 1)])
        verify = {} if rng.random() < 0.3 else {
            kind: {b: (rng.uniform(0, 0.3) * STEP, rng.uniform(0, 0.1) * STEP,
                       rng.choice([0.0, rng.uniform(0, 0.3) * STEP]),
                       rng.choice([0.0, rng.uniform(0, 0.3) * STEP]))
                   for b in (1, 4, 16)} for kind in ("sampled", "greedy")}
        cost = CostModel(CostCurve(curve_from(fn).points, verify))
        fused, lazy = rng.random() < 0.7, rng.random() < 0.5
        prior = AcceptancePrior(max_cands=8, p_unchecked=rng.uniform(0, 0.6),
                                p_checked=rng.uniform(0.5, 1.0))
        prior.calibration = rng.choice([1.0, rng.uniform(0.3, 1.5)])
        batch = rng.choice([1, 2, 4, 8, 16])
        views = []
        for _ in range(batch):
            sampled = rng.random() < 0.5
            acc = RequestAcceptance(prior)
            for kind in acc.unchecked:
                acc.unchecked[kind].hits = rng.uniform(0, 4)
                acc.unchecked[kind].misses = rng.uniform(0.1, 9)
            acc.tree_cands = sorted(rng.uniform(0, 1.5) for _ in acc.tree_cands)
            kind = rng.choice(LOOKUP_KINDS)
            kind += rng.choice(["", "+", "-"]) if kind not in ("pool", "poolsplit", "memory1") else ""
            views.append(view(acc, chain=rng.choice([0, 0, 2]), unchecked=rng.randint(0, 5),
                              n=rng.randint(2, 6), w=rng.randint(0, 7), g=rng.randint(1, 8),
                              room=rng.randint(0, 5), lookup_kind=kind,
                              trees=rng.random() < 0.8, weight=rng.choice([1.0, rng.uniform(0, 2)]),
                              verify=cost.verify(batch, sampled), lazy=lazy and sampled,
                              bonus=cost.bonus(batch, True) if lazy else 0.0,
                              switch=cost.switch(batch, sampled)))

        idle = view(RequestAcceptance(prior), unchecked=0, room=0, trees=False)

        def plans(planner):
            return planner.plan(views), [planner.plan([v] + [idle] * (batch - 1)) for v in views]

        pruned = Planner(cost, fused=fused)
        got = plans(pruned)
        left_off += pruned.left_off
        with monkeypatch.context() as m:
            unpruned(m)
            assert got == plans(Planner(cost, fused=fused)), trial
    assert left_off >= 500  # the cases are exercised


def test_a_step_pays_the_verifiers_switch_once():
    """Where the step already drafts (one request's draft pays even with
    the verifier's switch), a second request drafts what pays beside it
    without the switch; priced per request, the switch would keep it off.
    A request's own bound leaves the switch out (it may draft beside
    another), the step's alone puts it in."""
    curve = CostCurve.flat(STEP, 0.02)
    row = (0.02 * STEP, 0.01 * STEP, 0.0, 0.3 * STEP)
    shared = Planner(CostModel(CostCurve(curve.points, {"sampled": {1: row}, "greedy": {1: row}})))
    each = Planner(CostModel(CostCurve(curve.points, {
        "sampled": {1: (row[0] + row[3], row[1])}, "greedy": {1: (row[0] + row[3], row[1])}})))
    prior = AcceptancePrior(max_cands=2, p_unchecked=0.5)

    def req(p, switch):
        acc = RequestAcceptance(prior)
        acc.unchecked["suffix4"] = type(acc.unchecked["suffix4"])(100 * p, 100 * (1 - p))
        return view(acc, unchecked=4, room=4, trees=False, switch=switch,
                    verify=(row[0], row[1]) if switch else (row[0] + row[3], row[1]))

    strong, weak = 0.95, 0.25
    plan = shared.plan([req(strong, row[3]), req(weak, row[3])])
    assert plan[0].draft > 0 and plan[1].draft > 0
    plan = each.plan([req(strong, 0.0), req(weak, 0.0)])
    assert plan[0].draft > 0 and plan[1] == OFF
    # the weak one alone does not pay the switch
    assert shared.plan([req(weak, row[3])]) == [OFF]


def test_drafts_that_pay_only_together_are_planned_together():
    """The verifier's switch is paid once where any request drafts. Weak
    drafts that each pay beside another drafting request, but none as the
    step's only one, pay together where there are enough of them to share
    the switch (16 sampled sequences on the CPU, where a rejected draft
    saves its sorted bonus row): the plan drafts them all, where a search
    that moves one request at a time from every request off never would.
    Too few of them to share it: all off."""
    curve = CostCurve.flat(STEP, 0.02)
    row = (0.02 * STEP, 0.01 * STEP, 0.0, 0.05 * STEP)
    planner = Planner(CostModel(CostCurve(curve.points, {"sampled": {1: row}, "greedy": {1: row}})))
    prior = AcceptancePrior(max_cands=2, p_unchecked=0.35)

    def weak():
        acc = RequestAcceptance(prior)
        acc.unchecked["suffix4"] = type(acc.unchecked["suffix4"])(35.0, 65.0)
        return view(acc, unchecked=4, room=4, trees=False, switch=row[3],
                    verify=(row[0], row[1]))

    # the step's only drafting one of 8 does not pay the switch; two cannot
    # share it enough
    idle = view(RequestAcceptance(prior), unchecked=0, room=0, trees=False)
    assert planner.plan([weak()] + [idle] * 7) == [OFF] * 8
    assert planner.plan([weak(), weak()] + [idle] * 6) == [OFF] * 8
    plan = planner.plan([weak() for _ in range(8)])
    assert all(s.draft > 0 for s in plan), plan
    # and the plan found is worth more than every request off
    rate = sum(s.tokens for s in plan) / (
        planner.cost.predict(8, sum(s.query for s in plan) / 8, tree=False, drafting=8)
        + sum(s.extra_s for s in plan) + row[3])
    assert rate > 8 / planner.cost.predict(8, 1.0, tree=False)


def test_geometric_gain():
    assert geometric_gain(1.0, 4) == 4
    assert geometric_gain(0.0, 4) == 0
    assert geometric_gain(0.5, 2) == pytest.approx(0.75)


def test_unchecked_rate_learns_from_text():
    acc = RequestAcceptance(AcceptancePrior(max_cands=4))
    for _ in range(50):
        acc.observe_unchecked([1, 2, 3], [1, 2, 3, 4])  # always right
    assert acc.unchecked["suffix4"].p > 0.95
    for _ in range(50):
        acc.observe_unchecked([9, 2, 3], [1, 2])  # always wrong
    assert acc.unchecked["suffix4"].p < 0.1
    before = acc.unchecked["suffix4"].p
    acc.observe_unchecked([], [1])  # no draft: nothing learnt
    assert acc.unchecked["suffix4"].p == before


def test_a_lookup_not_drafted_is_scored_on_all_its_tokens():
    """A step without a draft produces one token; the lookup made before
    it is scored on the tokens of the next steps too, until its first
    mismatch or its end, and one at a time (lookups made meanwhile are
    not scored)."""
    acc = RequestAcceptance(AcceptancePrior(max_cands=4))
    r = acc.unchecked["suffix4"]
    h0, m0 = r.hits, r.misses
    acc.observe_unchecked([5, 6, 7], [5])  # open: 1 of 3 so far
    acc.observe_unchecked([6, 7, 8], [6])  # scored on the open one
    assert (r.hits, r.misses) == (h0, m0) and acc.seen == 0
    acc.observe_unchecked([7, 8, 9], [7])  # all 3 right: closed
    assert acc.seen == 1
    assert r.hits == pytest.approx(h0 * acc.keep + 3) and r.misses == pytest.approx(m0 * acc.keep)
    acc.observe_unchecked([1, 2, 3], [1])
    acc.observe_unchecked([], [9])  # second token wrong: 1 hit, a miss
    assert acc.seen == 2
    assert r.hits == pytest.approx((h0 * acc.keep + 3) * acc.keep + 1)
    # a first token right half the time and the next ones always (a copy
    # of earlier text): judged on first tokens alone, p would be 0.5
    acc = RequestAcceptance(AcceptancePrior(max_cands=4))
    for i in range(200):
        first = 1 if i % 2 else 0
        acc.observe_unchecked([1, 2, 3, 4], [first])
        if first:
            for t in (2, 3, 4):
                acc.observe_unchecked([], [t])
    assert acc.unchecked["suffix4"].p > 0.7


def test_lookup_kinds_are_learnt_apart():
    # a 4-token suffix match is right, the pool's one-token guess is not
    acc = RequestAcceptance(AcceptancePrior(max_cands=4))
    for _ in range(50):
        acc.observe_unchecked([1, 2, 3], [1, 2, 3, 4], "suffix4")
        acc.observe_unchecked([7, 8], [1, 2], "pool")
    assert acc.unchecked_gain(3, "suffix4") > 2.5
    assert acc.unchecked_gain(3, "pool") < 0.2
    planner = Planner(model(avx2_bf16))
    good = planner.plan([view(acc, unchecked=3, lookup_kind="suffix4")])[0]
    bad = planner.plan([view(acc, unchecked=3, lookup_kind="pool")])[0]
    assert good.kind == "draft" and bad == OFF


def test_tree_counterfactuals_and_relaxing():
    prior = AcceptancePrior(max_cands=4, tree_cands=[1.0] * 4, tree_window=0.5)
    acc = RequestAcceptance(prior)
    for _ in range(60):
        # candidate 2 (a window n-gram) confirms 3 tokens, text candidates 0/1
        acc.observe_tree([0, 1, 3], [False, False, True], window_on=True)
    assert tree_gain(acc, 1, False) == pytest.approx(0.0, abs=0.05)
    assert tree_gain(acc, 2, False) == pytest.approx(1.0, abs=0.05)
    assert tree_gain(acc, 2, True) == pytest.approx(3.0, abs=0.1)
    # without trees, the estimates drift back towards the engine's prior
    # (which other requests have since found better)
    prior.tree_cands = [1.0] * 4
    low = tree_gain(acc, 1, False)
    for _ in range(200):
        acc.relax()
    assert tree_gain(acc, 1, False) > low + 0.3
    assert abs(tree_gain(acc, 1, False) - prior.tree_cands[0]) < 0.05


def test_new_requests_start_from_the_engines_experience():
    prior = AcceptancePrior(max_cands=4)
    start = prior.p_unchecked["suffix4"]
    a = RequestAcceptance(prior)
    for _ in range(300):
        a.observe_unchecked([5, 6], [5, 6])
    assert prior.p_unchecked["suffix4"] > start + 0.3
    assert RequestAcceptance(prior).unchecked["suffix4"].p > start + 0.3


# -- cost model ------------------------------------------------------------------------
# -- trees that can be discovered ---------------------------------------------------
def test_nothing_is_pulled_towards_a_prior_never_measured():
    prior = AcceptancePrior(max_cands=4)
    acc = RequestAcceptance(prior)
    for _ in range(20):
        acc.observe_tree([2, 2], [False, False], window_on=0.0)
    prior.trees_seen = 0  # as if other requests had never run a tree
    before = tree_gain(acc, 2, 0.0)
    for _ in range(200):
        acc.relax()
    assert tree_gain(acc, 2, 0.0) == before


def test_the_prior_forgets_its_assumed_start_fast():
    prior = AcceptancePrior(max_cands=2)
    assumed = prior.tree_cands[0]
    acc = RequestAcceptance(prior)
    for _ in range(5):
        acc.observe_tree([0, 0], [False, False], window_on=0.0)
    assert prior.trees_seen == 5
    assert prior.tree_cands[0] < 0.25 * assumed  # a running mean, not a 2% EMA


def test_tree_gains_in_one_pass_are_each_trees_exactly():
    """The planner prices its trees with ``tree_gains`` (one pass): the very
    floats each tree alone gives, for every shape of an N, W, G (``_tree_table``),
    however the estimates moved."""
    from vllm_lookahead.attn_mask import tree_size
    from vllm_lookahead.planner.shapes import _tree_table

    rng = np.random.default_rng(3)
    prior = AcceptancePrior(max_cands=4)
    acc = RequestAcceptance(prior)
    for _ in range(30):
        acc.observe_tree(list(rng.integers(0, 3, 3)), list(rng.random(3) < 0.3),
                         window_on=float(rng.choice([0.0, 0.25, 0.5, 1.0])))
        acc.relax()
        for n, w, g in ((3, 2, 2), (5, 4, 4), (4, 7, 3), (2, 0, 4), (4, 4, 6)):
            options, roots = _tree_table(n, w, g)
            assert all(nodes == tree_size(n, ww, gg) and (ww or gg) and ww <= w and gg <= g
                       for ww, gg, nodes in options)
            assert (w, g) in {(ww, gg) for ww, gg, _ in options} or w == g == 0
            cols = max(w, 1)
            assert roots == tuple((gg, window_root(ww / cols)) for ww, gg, _ in options)
            assert acc.tree_gains(roots) == [tree_gain(acc, gg, ww / cols)
                                             for ww, gg, _ in options]


def test_window_gain_by_columns_and_harvest_credit():
    prior = AcceptancePrior(max_cands=2, tree_cands=[0.0, 0.0], tree_window=1.0)
    acc = RequestAcceptance(prior)
    assert tree_gain(acc, 0, 1.0) == pytest.approx(1.0)
    assert tree_gain(acc, 0, 0.25) == pytest.approx(0.5)  # sqrt of the share
    assert tree_gain(acc, 0, 0.0) == 0.0 and tree_gain(acc, 0, True) == pytest.approx(1.0)
    # a quarter of the window confirmed 1 token beyond the text: 2 for all W
    for _ in range(80):
        acc.observe_tree([0, 1], [False, True], window_on=0.25)
    assert acc.tree_window == pytest.approx(2.0, abs=0.05)
    # no window in the tree, but a candidate an earlier window harvested
    # beats the text's: credited to the window
    acc.tree_window = 0.0
    acc.observe_tree([0, 2], [False, True], window_on=0.0)
    assert acc.tree_window > 0.1
    # ... and a tree without it tells nothing against it
    w = acc.tree_window
    acc.observe_tree([1, 0], [False, False], window_on=0.0)
    assert acc.tree_window == w


def test_planner_offers_part_of_the_window():
    planner = Planner(model(amx))
    shapes = planner.shapes(view(acceptance(**HIGH), chain=2, w=7, g=2), 1)
    cols = sorted({s.window for s in shapes if s.kind == "tree"})
    assert cols == [0, 1, 2, 4, 7]
    nodes = {s.window: s.nodes for s in shapes if s.kind == "tree" and s.cands == 0}
    assert nodes[1] < nodes[2] < nodes[4] < nodes[7]


def test_exploration_is_bounded_priced_and_stops_once_learnt():
    """Zero predicted tree gain: the plan never picks a tree by value, but
    a request that has run none is given one within 3% of the planned time,
    never one predicted to make the step more than 1.5x the plan's; once
    its trees are measured (and while fresh), no more."""
    planner = Planner(model(amx))
    acc = acceptance(**ZERO)
    v = view(acc, chain=0, unchecked=0)
    plans = [planner.plan([v], explore=True)[0] for _ in range(400)]
    trees = [s for s in plans if s.kind == "tree"]
    assert 0 < len(trees) < 40 and planner.explored == len(trees)
    # no tree of it could pay: left out of the search, explored all the same
    assert planner.left_off == 400
    assert planner.explore_s <= Planner.EXPLORE_SHARE * planner.planned_s + 1e-12
    off = planner.cost.predict(1, 1.0)
    assert all(planner.cost.predict(1, s.query, tree=True) <= 1.5 * off + 1e-12 for s in trees)
    # without exploring, the same plan is all off
    assert planner.plan([v])[0] == OFF
    # the request's trees measured: not explored again while that is fresh
    acc.observe_tree([0], [False], window_on=0.0)
    before = planner.explored
    assert all(planner.plan([v], explore=True)[0] == OFF for _ in range(400))
    assert planner.explored == before


def test_a_new_request_is_not_explored_once_the_engine_knows_trees():
    """Once the engine's prior has learnt from ``EXPLORE_KNOWN`` trees, a
    request that has run none starts from it: no exploration tree until
    ``EXPLORE_AFTER`` steps into its life; before that, a new request is
    explored at once (as is one of a prior that knows fewer trees)."""
    def fresh(trees_seen):
        acc = acceptance(**ZERO)
        acc.prior.trees_seen = trees_seen
        return acc

    def first_tree(acc):
        planner = Planner(model(amx))
        v = view(acc, chain=0, unchecked=0)
        for step in range(400):
            if planner.plan([v], explore=True)[0].kind == "tree":
                return step
            acc.relax()  # a step without a tree, as StepDrafter books it
        return None

    early = first_tree(fresh(Planner.EXPLORE_KNOWN - 1))
    assert early is not None and early < Planner.EXPLORE_AFTER
    known = fresh(Planner.EXPLORE_KNOWN)
    assert not Planner(model(amx)).explore_due(known)
    late = first_tree(known)
    assert late is not None and late >= Planner.EXPLORE_AFTER
    known.since_tree = Planner.EXPLORE_AFTER
    assert Planner(model(amx)).explore_due(known)


# -- samples of one parent ----------------------------------------------------------
def end_shares(remaining, draws):
    """One parent's end shares."""
    return end_shares_many([(remaining, draws)])[0]


def accepted_pmf(p, k):
    """P(A = a), a = 0..k, of a k-token draft accepted at ``p`` a token."""
    a = np.arange(k + 1)
    pmf = p ** a * (1.0 - p)
    pmf[k] = p ** k
    return pmf


def test_sibling_weights_value_the_share_that_ends_the_parent():
    from vllm_lookahead.planner.siblings import sibling_weights

    def end(k):
        return 0.5 * k

    # parent "a": 20 left carries it (12 and 4 are far ahead, a slot each);
    # "b": two tied at 30 with drafts that rarely hit: a token of one ends
    # the parent only where it would have ended last; a lone request and an
    # uncapped sample count in full
    groups = ["a", "a", "a", "b", "b", None, "c", "c"]
    remaining = [20, 12, 4, 30, 30, 5, None, 3]
    draws = [(0.5, 3)] * 8
    w = sibling_weights(groups, remaining, lambda k: 0.3, end, draws)
    # end(3) = 1.5 where its every token ends the parent (12 left may
    # still, rarely, end after it)
    assert 1.35 < w[0] <= 1.5
    assert w[1] == pytest.approx(0.3, abs=0.05) and w[2] == pytest.approx(0.3, abs=1e-6)
    assert 0.3 < w[3] == w[4] < 1.0
    assert w[5:] == [1.0, 1.0, 1.0]
    # a parent with one live sample left: that sample counts in full
    assert sibling_weights(["a"], [7], lambda k: 0.3, end, [(0.5, 3)]) == [1.0]


def test_end_shares_of_sixteen_tied_samples_sum_to_less_than_one():
    """Sixteen samples at a parent's start, each drafting now and then:
    each is the last with probability about 1/16, and a random gain moves
    the max less than its mean (ties, and the spread it adds)."""

    shares = end_shares([64] * 16, [(0.5, 3)] * 16)
    assert len(set(shares)) == 1
    assert 0.5 / 16 < shares[0] < 1 / 16
    # alone, every token ends the parent sooner; far ahead, none does
    assert end_shares([9], [(0.5, 3)]) == [1.0]
    assert end_shares([30, 5, 5], [(0.5, 3)] * 3) == pytest.approx([1.0, 0.0, 0.0], abs=1e-3)
    # further behind, more of its gain ends the parent
    s = end_shares([40, 38, 36, 30], [(0.4, 3)] * 4)
    assert s[0] > s[1] > s[2] > s[3] >= 0.0 and sum(s) <= 1.0 + 1e-9
    # a sample that drafts better ends sooner: its tie-mate is the laggard
    s = end_shares([40, 40], [(0.8, 3), (0.1, 3)])
    assert s[1] > s[0]


def test_end_shares_of_many_parents_in_one_pass_are_each_parents_own():
    """end_shares_many pads the parents' arrays to the largest: a parent's
    shares must not depend on which others share its pass (grids of
    different widths, 0/1/16 samples, drafts that never or always hit)."""
    from vllm_lookahead.planner.siblings import end_shares_many

    rng = np.random.default_rng(7)
    for _ in range(200):
        parents = []
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(0, 17))
            rem = [int(x) for x in rng.integers(0, 80, size=n)]
            if n and rng.random() < 0.3:
                rem = [rem[0]] * n  # tied samples: the narrowest grid
            draws = [(float(rng.choice([0.0, 1.0, rng.uniform(0, 1)])), int(rng.integers(0, 6)))
                     for _ in range(n)]
            parents.append((rem, draws))
        together = end_shares_many(parents)
        for parent, shares in zip(parents, together):
            alone = end_shares_many([parent])[0]
            assert len(shares) == len(parent[0])
            assert shares == pytest.approx(alone, abs=1e-12)
            assert all(0.0 <= s <= 1.0 for s in shares)


def test_end_shares_agree_with_a_fine_integral():
    """The shares (their own grid, a third of the narrowest spread; the
    acceptance to two decimals) against the model's integral on a fine
    fixed grid, sample by sample:
    ``E[max S] - E[max S']`` with sample j moved ``a / (1 + mu_j)`` steps
    sooner, averaged over its gain, over its expected gain."""
    from math import erf

    from vllm_lookahead.planner.siblings import SPREAD_FLOOR, end_shares_many

    cdf = np.vectorize(lambda z: 0.5 * (1.0 + erf(z / np.sqrt(2.0))))
    rng = np.random.default_rng(11)
    parents = []
    for _ in range(12):
        n = int(rng.integers(2, 7))
        rem = [int(x) for x in rng.integers(1, 70, size=n)]
        draws = [(round(float(rng.uniform(0.05, 0.9)), 2), int(rng.integers(1, 5)))
                 for _ in range(n)]
        parents.append((rem, draws))
    for (rem, draws), shares in zip(parents, end_shares_many(parents)):
        pmfs = [accepted_pmf(p, k) for p, k in draws]
        mu = np.array([np.arange(len(f)) @ f for f in pmfs])
        var = np.array([(np.arange(len(f)) ** 2) @ f for f in pmfs]) - mu ** 2
        mean = np.array(rem, dtype=float) / (1 + mu)
        sd = np.sqrt(np.array(rem) * var / (1 + mu) ** 3 + SPREAD_FLOOR ** 2)
        x = np.linspace((mean - 8 * sd).min(), (mean + 8 * sd).max() + 5, 20001)
        f = cdf((x[None, :] - mean[:, None]) / sd[:, None])
        for j in range(len(rem)):
            moved_end = 0.0
            for a in range(1, len(pmfs[j])):
                g = f.copy()
                g[j] = cdf((x + a / (1 + mu[j]) - mean[j]) / sd[j])
                moved_end += pmfs[j][a] * np.trapezoid(g.prod(axis=0) - f.prod(axis=0), x)
            want = min(max(moved_end * (1 + mu[j]) / mu[j], 0.0), 1.0)
            assert shares[j] == pytest.approx(want, abs=3e-3)


def test_end_shares_agree_with_a_monte_carlo_of_the_model():
    """The grid integral against sampled ends: S_i normal with the module's
    mean and spread, the sample's gain A drawn from its pmf."""
    from vllm_lookahead.planner.siblings import SPREAD_FLOOR

    rng = np.random.default_rng(0)
    remaining = [24, 22, 22, 15]
    draws = [(0.6, 3), (0.3, 2), (0.5, 4), (0.5, 3)]
    shares = end_shares(remaining, draws)
    pmfs = [accepted_pmf(p, k) for p, k in draws]
    mu = np.array([np.arange(len(f)) @ f for f in pmfs])
    var = np.array([(np.arange(len(f)) ** 2) @ f for f in pmfs]) - mu ** 2
    r = np.array(remaining, dtype=float)
    mean = r / (1 + mu)
    sd = np.sqrt(r * var / (1 + mu) ** 3 + SPREAD_FLOOR ** 2)
    n = 400_000
    ends = rng.normal(mean, sd, size=(n, len(r)))
    base = ends.max(axis=1)
    for j in range(len(r)):
        a = rng.choice(len(pmfs[j]), size=n, p=pmfs[j])
        moved = ends.copy()
        moved[:, j] -= a / (1 + mu[j])
        mc = float(np.mean(base - moved.max(axis=1))) * (1 + mu[j]) / mu[j]
        assert shares[j] == pytest.approx(mc, abs=0.01)


def test_end_value_is_the_parents_last_step_at_the_plain_rate():
    def fn(total):  # a step of b requests costs 1 + 0.1 (b - 1) plain steps
        return 1.0 + 0.1 * (total - 1)

    planner = Planner(CostModel(curve_from(fn, tokens=(1, 2, 4))))
    # 4 samples alone: the last runs alone, c(1) = 1 against c(4) = 1.3
    assert end_value(planner.cost, 4, 4) == pytest.approx(4 * 1.0 / 1.3, rel=1e-3)
    # 2 samples among 4: the last step keeps the 2 others, c(3) = 1.2, whose
    # 2 tokens it gains too and they gain anyway: 4 * 1.2 / 1.3 - 2
    assert end_value(planner.cost, 4, 2) == pytest.approx(4 * 1.2 / 1.3 - 2, rel=1e-3)
    assert end_value(planner.cost, 8, 8) == pytest.approx(8 * 1.0 / 1.7, rel=1e-2)
    assert end_value(planner.cost, 1, 1) == 1.0
    # 4 samples among 16 on a step a + m b (a = 0.9, m = 0.1): 1 + 3 a / c(16)
    assert end_value(planner.cost, 16, 4) == pytest.approx(1 + 3 * 0.9 / 2.5, rel=1e-2)
    # a flat machine: the parent's slots, its k samples' tokens
    assert end_value(model(gpu), 16, 4) == pytest.approx(4.0, rel=1e-6)


def test_one_slots_value_is_the_marginal_request_at_the_plain_rate():
    def fn(total):  # a step of b requests costs 1 + 0.1 (b - 1) plain steps
        return 1.0 + 0.1 * (total - 1)

    planner = Planner(CostModel(curve_from(fn, tokens=(1, 2, 4))))
    assert drain_value(planner.cost, 1, 1) == 1.0
    # b (c(b) - c(b-1)) / c(b) = 4 * 0.1 / 1.3
    assert drain_value(planner.cost, 4, 1) == pytest.approx(4 * 0.1 / 1.3, rel=1e-3)
    # a flat machine: a sample ahead frees nothing
    assert drain_value(model(gpu), 4, 1) == pytest.approx(0.0, abs=1e-9)


def test_drain_value_is_the_mean_slot_over_the_parents_drain():
    """A sample's freed slot is freed near its parent's end, as the
    samples leave the step: on a machine whose cost rises slower with the
    batch (sqrt), the mean over that drain is worth more than the slot at
    the full batch."""
    planner = Planner(CostModel(curve_from(math.sqrt, batches=(1, 2, 3, 4), tokens=(1, 2, 4))))
    # c(b) = sqrt(b): the last slot at 4 is 4 (2 - sqrt 3) / 2
    assert drain_value(planner.cost, 4, 1) == pytest.approx(2 * (2 - math.sqrt(3)), rel=1e-3)
    # the 4 samples drain from 4 to 1: 4 (2 - 1) / (3 * 2)
    assert drain_value(planner.cost, 4, 4) == pytest.approx(4 / 6, rel=1e-3)
    assert drain_value(planner.cost, 4, 2) == drain_value(planner.cost, 4, 1)  # one slot


def test_a_sample_ahead_of_its_siblings_drafts_only_where_a_slot_pays():
    """Two samples of one parent at batch 2 on a machine where a draft token
    costs a fifth of a step: the one with the most tokens left drafts, the one
    ahead (its gain only frees its slot early) does not."""
    def fn(total):
        return 1.0 + 0.2 * (total - 2) if total > 2 else 1.0 + 0.1 * (total - 1)

    planner = Planner(CostModel(curve_from(fn, batches=(1, 2, 4), tokens=(1, 2, 4, 8))))
    acc = acceptance(p_unchecked=0.6, tree_by_g=[0.0] * 8, window_extra=0.0)
    full = planner.plan([view(acc, unchecked=4, g=0, trees=False),
                         view(acc, unchecked=4, g=0, trees=False)])
    assert [s.kind for s in full] == ["draft", "draft"]
    w = drain_value(planner.cost, 2, 1)
    assert 0.0 < w < 0.5
    lag, ahead = planner.plan([view(acc, unchecked=4, g=0, trees=False, weight=1.0),
                               view(acc, unchecked=4, g=0, trees=False, weight=w)])
    assert lag.kind == "draft" and ahead == OFF


# -- vLLM's verification cost (CostCurve.verify) ------------------------------------
def test_a_draft_that_pays_on_the_forward_alone_waits_for_its_verification():
    # bf16 AVX-512-like: a draft token adds 2% of a step to the forward
    planner = Planner(CostModel(CostCurve.flat(0.03, 0.02)))
    acc = acceptance(p_unchecked=0.15, tree_by_g=[0.0] * 8, window_extra=0.0)
    free = planner.plan([view(acc, unchecked=4, trees=False)])
    assert free[0].kind == "draft"
    # a sampled request's verification: 20% of a step for its first token
    costly = planner.plan([view(acc, unchecked=4, trees=False, verify=(0.006, 0.001))])
    assert costly == [OFF]
    # with high acceptance the draft pays anyway, its verification in its cost
    sure = acceptance(p_unchecked=0.9, tree_by_g=[0.0] * 8, window_extra=0.0)
    plan = planner.plan([view(sure, unchecked=4, trees=False, verify=(0.006, 0.001))])
    assert plan[0].kind == "draft"
    assert plan[0].extra_s == pytest.approx(0.006 + 0.001 * (plan[0].draft - 1))


def test_a_lazy_verifier_prices_the_rows_it_computes():
    """Where the verifier computes a sampled draft's rows only up to its
    first rejection (patch 15 on the CPU), a draft's verification is priced
    by the rows expected, ``1 + p + ... + p^(k-1)``: a long draft of a
    likely lookup costs about what its accepted part does, and the planner
    drafts longer than where every row is computed."""
    from vllm_lookahead.planner.shapes import verified_rows

    assert verified_rows(0, 0.5) == 0.0
    assert verified_rows(1, 0.5) == 1.0
    assert verified_rows(4, 0.5) == pytest.approx(1.875)
    assert verified_rows(16, 0.0) == 1.0 and verified_rows(16, 1.0) == 16.0
    planner = Planner(CostModel(CostCurve.flat(0.03, 0.002)))
    acc = acceptance(p_unchecked=0.6, tree_by_g=[0.0] * 8, window_extra=0.0)
    verify = (0.004, 0.002)  # a row costs 7% of a step
    every = planner.plan([view(acc, unchecked=16, room=16, trees=False, verify=verify)])
    lazy = planner.plan([view(acc, unchecked=16, room=16, trees=False, verify=verify,
                              lazy=True)])
    assert every[0].kind == lazy[0].kind == "draft"
    assert lazy[0].draft > every[0].draft
    k, p = lazy[0].draft, acc.unchecked_p("suffix4") * acc.prior.calibration
    assert lazy[0].extra_s == pytest.approx(0.004 + 0.002 * (verified_rows(k, p) - 1))
    assert every[0].extra_s == pytest.approx(0.004 + 0.002 * (every[0].draft - 1))


def test_a_draft_rejected_anywhere_saves_its_lazy_bonus_row():
    """Where the verifier samples a request's bonus row only after its
    whole draft is accepted (patch 15's lazy_bonus), a draft's price counts
    the row it is expected to save, ``bonus * (1 - p^k)``: on a machine
    where that row costs more than a draft token's forward (the CPU's
    full-vocabulary top-p sort), a draft of a poor guess pays, where it does
    not without the saving or where the bonus row is not lazy."""
    from vllm_lookahead.planner.shapes import bonus_saving, verified_rows

    assert bonus_saving(0.002, 0, 0.3) == 0.0
    assert bonus_saving(0.0, 3, 0.3) == 0.0
    assert bonus_saving(0.002, 1, 0.25) == pytest.approx(0.0015)
    assert bonus_saving(0.002, 3, 1.0) == 0.0  # always accepted: never saved
    assert bonus_saving(0.002, 3, 0.0) == pytest.approx(0.002)
    planner = Planner(CostModel(CostCurve.flat(0.03, 0.02)))  # a token: 0.6 ms
    poor = acceptance(p_unchecked=0.01, tree_by_g=[0.0] * 8, window_extra=0.0)
    verify = (0.0005, 0.0003)
    assert planner.plan([view(poor, unchecked=4, trees=False, verify=verify,
                              lazy=True)]) == [OFF]
    assert planner.plan([view(poor, unchecked=4, trees=False, verify=verify,
                              bonus=0.002)]) == [OFF]  # not lazy: nothing skipped
    plan = planner.plan([view(poor, unchecked=4, trees=False, verify=verify, lazy=True,
                              bonus=0.002)])
    assert plan[0].kind == "draft"
    k, p = plan[0].draft, poor.unchecked_p("suffix4") * poor.prior.calibration
    assert plan[0].extra_s == pytest.approx(
        0.0005 + 0.0003 * (verified_rows(k, p) - 1) - 0.002 * (1 - p ** k))
    assert plan[0].extra_s < 0


def test_a_tree_chain_is_priced_as_the_draft_it_hands_the_verifier():
    """A tree's steady state drafts its confirmed chain next step: a lazy
    sampled request's chain is priced by the rows expected at the checked
    chain's acceptance, less the bonus row it is expected to save."""
    from vllm_lookahead.planner.shapes import bonus_saving, verified_rows

    planner = Planner(CostModel(CostCurve.flat(0.03, 0.002)))
    acc = acceptance(**{**HIGH, "p_checked": 0.5})
    verify = (0.004, 0.002)
    plain = view(acc, unchecked=0, verify=verify)
    lazy = view(acc, unchecked=0, verify=verify, lazy=True, bonus=0.003)
    trees = [(a, b) for a, b in zip(planner.shapes(plain, 1), planner.shapes(lazy, 1))
             if a.kind == "tree" and a.draft > 1]
    assert trees
    p = acc.checked.p
    for every, cut in trees:
        k = every.draft
        assert every.extra_s == pytest.approx(0.004 + 0.002 * (k - 1))
        assert cut.extra_s == pytest.approx(0.004 + 0.002 * (verified_rows(k, p) - 1)
                                            - bonus_saving(0.003, k, p))
        assert cut.extra_s < every.extra_s


def test_a_seeded_draft_is_priced_with_the_verification_measured_at_start():
    acc = acceptance(p_unchecked=0.5, tree_by_g=[0.0] * 8, window_extra=0.0)
    pts = {1: [(1, 0.03), (64, 0.03 * 1.63)]}
    cheap = Planner(CostModel(CostCurve(pts, {"sampled": {1: (0.0003, 0.0001)}})))
    dear = Planner(CostModel(CostCurve(pts, {"sampled": {1: (0.03, 0.0)}})))
    assert cheap.steady_draft(acc, "suffix4", 4) > 0
    assert dear.steady_draft(acc, "suffix4", 4) == 0  # verifying costs a whole step
    # without a measurement: the fixed shares of a step (SEEDED_FIRST, _NEXT)
    bare = Planner(CostModel(CostCurve(pts)))
    assert bare.steady_draft(acc, "suffix4", 4) == Planner(CostModel(CostCurve(
        pts, {"sampled": {1: (0.03 * Planner.SEEDED_FIRST, 0.03 * Planner.SEEDED_NEXT)}}))
    ).steady_draft(acc, "suffix4", 4)


def test_a_seeded_draft_is_priced_with_the_seeded_verification_where_measured():
    """vLLM's samplers draw a seeded request's noise from its own generator,
    request by request (on the AMX Xeon, bfloat16, 4 seeded samples: 1.4-1.7
    ms a draft token against 0.55-0.77 unseeded, stop 61): a seeded draft is
    priced with the seeded verification where the curve has one, the
    sampled one's where not (a curve cached before it was timed apart)."""
    acc = acceptance(p_unchecked=0.5, tree_by_g=[0.0] * 8, window_extra=0.0)
    pts = {1: [(1, 0.03), (64, 0.03 * 1.63)]}
    cheap = {1: (0.0003, 0.0001, 0.0, 0.0)}
    dear = {1: (0.03, 0.0, 0.0, 0.0)}
    curve = CostCurve(pts, {"sampled": cheap, "seeded": dear})
    assert curve.verify_row(1, True, seeded=True)[:2] == (0.03, 0.0)
    assert curve.verify_row(1, True)[:2] == (0.0003, 0.0001)
    assert curve.verify_row(1, False, seeded=True)[:2] == (0.0, 0.0)  # greedy: no generator drawn
    unseeded = CostCurve(pts, {"sampled": cheap})
    assert unseeded.verify_row(1, True, seeded=True)[:2] == (0.0003, 0.0001)
    assert Planner(CostModel(curve)).steady_draft(acc, "suffix4", 4) == 0
    assert Planner(CostModel(CostCurve(pts, {"sampled": cheap}))).steady_draft(acc, "suffix4", 4) > 0
    assert Planner(CostModel(CostCurve(pts, {"sampled": dear, "seeded": cheap}))).steady_draft(
        acc, "suffix4", 4) > 0
    # and the switch, what the step pays once, is the seeded one's
    sw = CostCurve({1: pts[1], 4: [(1, 0.04), (64, 0.06)]},
                   {"sampled": {4: (0.0, 0.0, 0.0, 0.001)}, "seeded": {4: (0.0, 0.0, 0.0, 0.004)}})
    assert CostModel(sw).switch(4, True, seeded=True) == 0.004
    assert CostModel(sw).switch(4, True) == 0.001
    # the kind round-trips through the cache's JSON
    again = CostCurve.from_dict(curve.to_dict(), curve.verify_dict())
    assert again.verify_row(1, True, seeded=True)[:2] == (0.03, 0.0)


def test_a_tree_that_gains_nothing_is_not_planned_where_drafts_look_cheap():
    """Steps that undid part of the verification hold the draft slope at 0
    (never below): a step with more query tokens never looks cheaper than
    a plain one, and a tree predicted to confirm nothing is never planned."""
    from vllm_lookahead.proposer import StepTimer

    pts = {1: [(1, 0.0329), (4, 0.0329), (8, 0.0461), (16, 0.0571)]}
    cm = CostModel(CostCurve(pts, {"sampled": {1: (0.00134, 0.00059)},
                                   "greedy": {1: (0.0003, 0.00002)}}))
    planner = Planner(cm)
    timer = StepTimer(None)
    now = 0.0
    for i in range(300):  # drafting steps no dearer than plain ones
        k = i % 4
        timer.planned((1, 1.0 + k, False, int(k > 0), 0.0003 + 0.00002 * (k - 1) if k else 0.0,
                       (0.0003, 0.00002) if k else None), now)
        now += 0.023
        timer.book(planner, now, True, 1)
        if i % 10 == 0:  # and a few tree steps, which took a plain step's time
            timer.planned((1, 4.0, True, 1, 0.0, None), now)
            now += 0.0225
            timer.book(planner, now, True, 1)
    cm.agreed(cm.local_factors())
    assert cm.factors[(1, False)][3] == 0  # held at 0, not below
    acc = acceptance(p_unchecked=0.5, tree_by_g=[0.0] * 8, window_extra=0.0)
    v = RequestView(acc=acc, ngram_size=4, window_size=1, guess_set_size=0, room=4,
                    trees=True, verify=planner.cost.verify_seen(1, False))
    assert planner.plan([v])[0].kind == "off"


def test_free_draft_tokens_draft_the_whole_lookup():
    """On a machine where draft tokens cost nothing (the GPU curve) the
    planner drafts the whole lookup at p 0.5; a seeded request's draft
    (from the start-up curve alone) is 2 tokens of 8 there."""
    acc = acceptance(p_unchecked=0.5, tree_by_g=[0.0] * 8, window_extra=0.0)
    planner = Planner(model(gpu))
    free = planner.plan([view(acc, unchecked=8, room=8, trees=False)])
    assert free[0].kind == "draft" and free[0].draft == 8
    assert planner.steady_draft(acc, "suffix4", 8) == 2


def test_a_seeded_draft_is_priced_in_the_batch_fixed_at_its_start():
    """In a b-request step a draft pays only where its gain beats b x its
    seconds / the step's: a draft that pays alone (batch 1, the default,
    as before) does not in a step of 4 whose time is 1.25x one request's
    (the AVX2 EPYC's shape, stop 59), a surer one still does, and the
    verification and switch measured at that batch are what it pays."""
    pts = {1: [(1, 0.040), (2, 0.040), (4, 0.045), (16, 0.070)],
           4: [(1, 0.050), (2, 0.056), (4, 0.070)]}
    verify = {"sampled": {1: (0.0012, 0.0007, 0.0, 0.0), 4: (0.0003, 0.0007, 0.0, 0.0012)}}
    planner = Planner(CostModel(CostCurve(pts, verify)))
    weak = acceptance(p_unchecked=0.2, tree_by_g=[0.0] * 8, window_extra=0.0)
    sure = acceptance(p_unchecked=0.7, tree_by_g=[0.0] * 8, window_extra=0.0)
    assert planner.steady_draft(weak, "suffix4", 4) == planner.steady_draft(weak, "suffix4", 4, 1) > 0
    assert planner.steady_draft(weak, "suffix4", 4, 4) == 0
    assert planner.steady_draft(sure, "suffix4", 4, 4) > 0
    # its draft at 4: the k with the best rate of the 4-request step, by hand
    cm = planner.cost
    first, nxt = cm.verify(4, True)
    first += cm.switch(4, True)
    rates = {0: 4 / cm.plain(4, 1)}
    for k in range(1, 5):
        rates[k] = (4 + sure.unchecked_gain(k, "suffix4")) / (
            cm.plain(4, 1 + k / 4) + first + nxt * (k - 1))
    assert planner.steady_draft(sure, "suffix4", 4, 4) == max(rates, key=rates.get)


def test_a_seeded_requests_batch_is_its_parents_n_or_the_setting():
    """``seeded_batch``: the parent's n the frontend wrote (patch 13), the
    engine's ``seeded_batch`` where larger, at most ``max_num_seqs``; a
    request without the key (an EngineCoreRequest made by hand) counts 1."""
    from types import SimpleNamespace

    from vllm_lookahead.proposer import seeded_batch
    from vllm_lookahead.algo.state import SAMPLES_KEY

    def params(extra):
        return SimpleNamespace(extra_args=extra)

    assert seeded_batch(params({SAMPLES_KEY: 4}), 0, 256) == 4
    assert seeded_batch(params({SAMPLES_KEY: 4}), 8, 256) == 8
    assert seeded_batch(params({SAMPLES_KEY: 16}), 0, 8) == 8
    assert seeded_batch(params(None), 0, 256) == 1
    assert seeded_batch(params({SAMPLES_KEY: "x"}), 0, 256) == 1
    assert seeded_batch(params({}), 2, 256) == 2


def test_the_engine_learns_a_kind_that_never_pays_from_few_probes():
    """A kind whose tokens are right 5% of the time, probed 3 times a
    request: the engine's rate is the probes pooled, not a slow mean of
    the requests' own (which start at the prior): near the truth after
    24 requests (a running mean of requests' rates read 0.19 there)."""
    import random
    ends = []
    for seed in range(20):
        rng = random.Random(seed)
        prior = AcceptancePrior(max_cands=3)
        assert prior.p_unchecked["memory1"] == pytest.approx(0.3)
        for _ in range(24):
            acc = RequestAcceptance(prior)
            for _ in range(3):
                acc.observe_unchecked([1, 2, 3, 4],
                                      [t if rng.random() < 0.05 else 99 for t in (1, 2, 3, 4)],
                                      "memory1")
        ends.append(prior.p_unchecked["memory1"])
    assert sum(ends) / len(ends) < 0.1
    # and a kind that pays is learnt up as fast
    prior = AcceptancePrior(max_cands=3)
    for _ in range(8):
        acc = RequestAcceptance(prior)
        for _ in range(3):
            acc.observe_unchecked([1, 2, 3, 4], [1, 2, 3, 4], "memory1")
    assert prior.p_unchecked["memory1"] > 0.85


def test_requests_running_together_learn_a_kind_together():
    """A request reads the engine's current rate of a kind it has not
    probed itself (the n samples of one prompt start together), and its
    own probes outweigh the engine's as they come."""
    prior = AcceptancePrior(max_cands=3)
    a, b = RequestAcceptance(prior), RequestAcceptance(prior)
    start = b.unchecked_p("memory1")
    assert start == pytest.approx(prior.p_unchecked["memory1"])
    for _ in range(12):
        a.observe_unchecked([1, 2, 3], [9], "memory1")  # never right
    assert prior.p_unchecked["memory1"] < start / 2
    assert b.unchecked_p("memory1") == pytest.approx(prior.p_unchecked["memory1"])
    # b's own probes, all right, outweigh the engine's rate
    for _ in range(12):
        b.observe_unchecked([1, 2, 3], [1, 2, 3], "memory1")
    assert b.unchecked_p("memory1") > 0.8
    assert a.unchecked_p("memory1") < 0.5
