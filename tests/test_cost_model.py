"""The cost model without an engine: the curve, its start-up measurement
ladder, its cache on disk, the corrections from the steps seen
(:mod:`vllm_lookahead.planner.cost_model`, :mod:`.fit`, :mod:`.cost_cache`,
:mod:`.machine`)."""

from __future__ import annotations

import json
import logging
import random

import pytest

from vllm_lookahead.planner.acceptance import AcceptancePrior, RequestAcceptance
from vllm_lookahead.planner.cost_cache import CostCache, cache_key, load_curve
from vllm_lookahead.planner.cost_model import CostCurve, CostModel, bucket_of, measure_curve
from vllm_lookahead.planner.planner import Planner, RequestView

STEP = 0.05  # seconds of a 1-token step


def curve_from(fn, batches=(1, 2, 4, 8, 16), tokens=(1, 2, 4, 8, 16, 24, 32, 48, 64, 128)):
    """A measured-looking curve from ``fn(total_tokens) -> relative cost``."""
    return CostCurve({b: [(t, STEP * fn(b * t)) for t in tokens] for b in batches})


def avx2_bf16(total):  # every extra token costs a quarter step
    return 1.0 + 0.25 * (total - 1)


def acceptance(p_unchecked, tree_by_g, window_extra, p_checked=1.0, g_max=8):
    prior = AcceptancePrior(max_cands=g_max, p_unchecked=p_unchecked, p_checked=p_checked,
                            tree_cands=list(tree_by_g), tree_window=window_extra)
    return RequestAcceptance(prior)


HIGH = dict(p_unchecked=0.8, tree_by_g=[1.6, 2.0, 2.2, 2.3, 2.4, 2.4, 2.4, 2.4],
            window_extra=0.5)


def view(acc, chain=0, unchecked=4, n=5, w=7, g=8, room=5, **kw):
    return RequestView(acc=acc, ngram_size=n, window_size=w, guess_set_size=g, room=room,
                       chain=chain, unchecked=unchecked, **kw)


def test_curve_interpolates_and_extrapolates():
    c = CostCurve({1: [(1, 1.0), (9, 2.0)], 4: [(1, 2.0), (9, 6.0)]})
    assert c.predict(1, 5) == pytest.approx(1.5)
    assert c.predict(1, 17) == pytest.approx(3.0)  # past the last point
    assert c.predict(2, 1) == pytest.approx(1.0 + (2.0 - 1.0) / 3)  # between batches
    assert c.predict(8, 1) == pytest.approx(c.predict(4, 2))  # same total tokens
    with pytest.raises(ValueError):
        CostCurve({1: [(1, -1.0)]})


def test_a_curve_level_at_its_end_still_prices_tokens_past_it():
    """Measured under load, a curve came out 115, 122, 194.5, 194.5 ms at
    1, 2, 4, 8 tokens: extrapolated from its last two points, every token
    past 8 (and so every draft at batch 16, read at 16x the tokens) cost
    nothing. Past the end the slope is at least the range's average."""
    c = CostCurve({1: [(1, 0.115), (2, 0.122), (4, 0.1945), (8, 0.1945)]})
    mean = (0.1945 - 0.115) / 7
    assert c.predict(1, 8) == pytest.approx(0.1945)
    assert c.predict(1, 16) == pytest.approx(0.1945 + 8 * mean)
    assert c.predict(16, 2) > c.predict(16, 1) > c.predict(1, 8)
    # inside the range nothing changes; a flat curve stays flat
    assert c.predict(1, 6) == pytest.approx(0.1945)
    flat = CostCurve.flat(0.05)
    assert flat.predict(16, 4) == pytest.approx(flat.predict(1, 1))


def test_model_corrects_from_seen_steps():
    m = CostModel(CostCurve.flat(0.05))
    m.observe(1, 1, 5.0)  # the first tree steps of an engine are not booked
    m.observe(1, 1, 5.0)
    for _ in range(30):
        m.observe(1, 1, 0.10)
    assert m.predict(1, 1) == pytest.approx(0.05)  # nothing agreed yet
    m.agreed(m.local_factors())
    assert m.predict(1, 1) == pytest.approx(0.10, rel=0.05)
    assert m.predict(4, 1) == pytest.approx(m.curve.predict(4, 1))  # other bucket
    assert bucket_of(5) == 4 and bucket_of(1) == 1
    # steps with and without trees are corrected apart: steps without
    # trees fit a line (what a draft token costs), here 20 ms + 5 ms/token
    for _ in range(60):
        for q in (1, 3, 5):
            m.observe(1, q, 0.020 + 0.005 * (q - 1), tree=False)
    m.agreed(m.local_factors())
    assert m.predict(1, 1, tree=False) == pytest.approx(0.020, rel=0.05)
    assert m.predict(1, 4, tree=False) == pytest.approx(0.035, rel=0.05)
    assert m.predict(1, 1, tree=True) == pytest.approx(0.10, rel=0.05)


def test_steps_at_one_length_keep_the_curves_draft_cost():
    """An engine that hardly drafts sees almost only 1-token steps: they
    set the line's height, but tell nothing of what a draft token costs, so
    the slope stays the curve's (it went to 0 once the prior was forgotten:
    drafts looked free), and a few noisy draft steps cannot swing it."""
    m = CostModel(curve_from(avx2_bf16))  # each extra token: a quarter step
    prior_slope = m.predict(4, 2, tree=False) - m.predict(4, 1, tree=False)
    for i in range(600):
        m.observe(4, 1, 2 * STEP * 4 * (1 + 0.05 * (i % 3)), tree=False)
    m.observe(4, 1.25, 2 * STEP * 4, tree=False)  # one draft step, no dearer
    m.agreed(m.local_factors())
    assert m.predict(4, 1, tree=False) == pytest.approx(2 * STEP * 4, rel=0.1)
    slope = m.predict(4, 2, tree=False) - m.predict(4, 1, tree=False)
    assert 0.5 * prior_slope < slope < 2 * prior_slope


def test_a_draft_token_is_priced_as_vllms_rows_not_the_tree_paths_requests():
    """The curve's steps of several requests go through the tree-attention
    path, whose cost grows per request (a 2-core Xeon with AMX, bfloat16,
    16 requests: 23 ms more for each request's second token, 1.4 ms a
    token, where a draft token inside vLLM's steps cost about 0.25 ms).
    vLLM runs a step's rows as one batch of tokens: a draft token is priced
    as one more token of a one-request step of as many tokens, never above
    the tree path's price; batch 1 keeps the curve's."""
    batch1 = [(t, STEP * (1 + 0.01 * (t - 1))) for t in (1, 2, 4, 8, 16, 24, 32, 48, 64)]
    m = CostModel(CostCurve({1: batch1, 16: [(1, 1.6 * STEP), (2, 3.2 * STEP)]}))
    step = m.predict(16, 1.0, tree=False)
    one = m.predict(16, 1 + 1 / 16, tree=False) - step
    assert one == pytest.approx(0.01 * STEP, rel=0.2)  # batch 1's price of a token
    tree_path = m.curve.predict(16, 1 + 1 / 16) - m.curve.predict(16, 1)
    assert one < tree_path / 5
    # the plane's prior slope follows (an engine that drafts little keeps it)
    m.observe(16, 1.0, step, tree=False)
    m.agreed(m.local_factors())
    assert m.predict(16, 1 + 1 / 16, tree=False) - m.predict(16, 1.0, tree=False) < tree_path / 5
    assert m.plain(1, 4) == pytest.approx(m._rows(1, 4))
    # a batch-1 curve dearer per token than the tree path: the tree path's
    steep = [(t, STEP * (1 + 0.5 * (t - 1))) for t in (1, 2, 4, 8, 16, 32, 64)]
    dear = CostModel(CostCurve({1: steep, 16: [(1, 1.6 * STEP), (2, 2.0 * STEP)]}))
    assert dear.plain(16, 1.5) == pytest.approx(dear._rows(16, 1.5))


def test_more_requests_with_fewer_drafts_each_keep_the_draft_cost():
    """Fed from a queue, bucket 8 runs steps of 9-15 requests, and the more
    there are the less each drafts. Fitted in tokens per request alone, the
    extra requests' cost hid the drafts' (the fit's slope went to 0: drafts
    looked free and the planner over-drafted at batch 16). Fitted in
    requests and the step's draft tokens together, both come out."""
    # measured under load: level from 2 tokens on
    m = CostModel(CostCurve({1: [(1, 0.152), (2, 0.1627), (4, 0.1627), (8, 0.1627)]}))
    per_request, per_draft = 0.006, 0.004
    rng = random.Random(0)
    for _ in range(400):
        r = rng.randint(9, 15)
        # each request drafts 1-4 tokens, less often the more there are
        lens = [rng.randint(1, 4) if rng.random() < (16 - r) / 8 else 0 for _ in range(r)]
        drafts = sum(lens)
        sec = 0.080 + per_request * r + per_draft * drafts
        m.observe(r, 1 + drafts / r, sec * rng.uniform(0.97, 1.03), tree=False,
                  drafting=sum(k > 0 for k in lens))
    m.agreed(m.local_factors())
    for r in (9, 12, 15):
        n = round(r * (16 - r) / 8)  # a step as seen there: n requests draft
        drafts = 2.5 * n
        step = m.predict(r, 1 + drafts / r, tree=False, drafting=n)
        assert step == pytest.approx(0.080 + per_request * r + per_draft * drafts, rel=0.05)
        # what one more request with a 2-token draft adds to it
        more = m.predict(r, 1 + (drafts + 2) / r, tree=False, drafting=n + 1) - step
        assert more == pytest.approx(2 * per_draft, rel=0.3)


def test_the_first_draft_token_of_a_request_is_priced_apart():
    """Measured on an AVX2 EPYC in float32 at batch 4 (one engine, the
    patterns taking turns step by step): 4 requests with 1 draft token each
    cost 16.2 ms over a step without drafts, 1 request with 4 cost 12.2.
    Drafting requests are a feature of the plain plane of their own, so
    spreading drafts thin is priced, and a 1-token draft that gains little
    is not taken for a 2.5 ms token when it costs 9.5."""
    a, per_token, per_request = 0.050, 0.0025, 0.007
    m = CostModel(curve_from(lambda total: 1.0 + 0.05 * (total - 1)))
    rng = random.Random(1)
    for _ in range(300):
        lens = [rng.choice((0, 0, 1, 2, 4)) for _ in range(4)]
        d, n = sum(lens), sum(k > 0 for k in lens)
        sec = a + per_token * d + per_request * n
        m.observe(4, 1 + d / 4, sec * rng.uniform(0.98, 1.02), tree=False, drafting=n)
    m.agreed(m.local_factors())
    spread = m.predict(4, 2, tree=False, drafting=4)  # 1 draft token each
    one = m.predict(4, 2, tree=False, drafting=1)  # 4 in one request
    assert spread - one == pytest.approx(3 * per_request, rel=0.2)
    assert one == pytest.approx(a + 4 * per_token + per_request, rel=0.03)

    # batch 1: a draft that gains 0.15 tokens pays at 2.5 ms, not at 9.5
    def first_draft(model):
        views = [view(acceptance(p_unchecked=0.15, tree_by_g=[0.0] * 8, window_extra=0.0),
                      unchecked=1, trees=False)]
        return Planner(model).plan(views)[0].kind

    cheap, dear = CostModel(curve_from(avx2_bf16)), CostModel(curve_from(avx2_bf16))
    for model, jump in ((cheap, 0.0), (dear, 0.007)):
        for i in range(200):
            d = i % 3
            model.observe(1, 1 + d, 0.050 + 0.0025 * d + jump * (d > 0), tree=False)
        model.agreed(model.local_factors())
    assert first_draft(cheap) == "draft" and first_draft(dear) == "off"


def test_a_step_that_waited_does_not_drag_the_plain_plane():
    """A process paused between two steps (a benchmark's turns, a stall)
    books one step of seconds: least squares would follow it (fitted that
    way, a plane came out at -558 ms + 149 ms per drafting request)."""
    m = CostModel(curve_from(avx2_bf16))
    rng = random.Random(2)
    for i in range(300):
        lens = [rng.choice((0, 0, 1, 3)) for _ in range(4)]
        d, n = sum(lens), sum(k > 0 for k in lens)
        sec = 0.060 + 0.003 * d + 0.001 * n
        if i % 25 == 24:
            sec = 6.0  # waited for the other engines' turns
        m.observe(4, 1 + d / 4, sec, tree=False, drafting=n)
        if i % 32 == 31:
            m.agreed(m.local_factors())
    m.agreed(m.local_factors())
    assert m.predict(4, 1, tree=False) == pytest.approx(0.060, rel=0.1)
    assert m.predict(4, 2, tree=False, drafting=1) == pytest.approx(0.073, rel=0.1)


def test_steps_without_trees_teach_nothing_where_the_step_cost_is_not_learnt():
    """``learn_plain`` off (an engine's default, ``learn_step_cost``): steps
    without trees, however slow, leave a draft's price at the curve's and
    the verification as measured; steps with trees still correct the
    trees' price. On (as the model's default), the same steps move it."""
    curve = curve_from(avx2_bf16)
    verify = {"sampled": {4: (0.001, 0.0005, 0.0, 0.002)}}
    for learn in (False, True):
        m = CostModel(CostCurve(curve.points, verify))
        m.learn_plain = learn
        before = (m.predict(4, 2, tree=False, drafting=4), m.verify_seen(4, True))
        for i in range(200):
            n = i % 5
            m.observe(4, 1 + n / 4, 0.2 + 0.02 * n, tree=False, drafting=n,
                      verify_least=(0.001, 0.0005) if n else None)
            m.observe(4, 3.0, 2 * m.curve.predict(4, 3.0), tree=True)
        m.agreed(m.local_factors())
        after = (m.predict(4, 2, tree=False, drafting=4), m.verify_seen(4, True))
        assert m.factors[(4, True)] > 1.5  # trees learnt either way
        if learn:
            assert after[0] > 1.5 * before[0]
        else:
            assert after == before and (4, False) not in m.factors
    # an assumed curve (cost_model "off", an engine without trees) has no
    # measured price to hold: its steps set the scale whatever learn_plain
    m = CostModel(CostCurve.flat(0.05, 0.1), source="assumed")
    m.learn_plain = False
    for _ in range(100):
        m.observe(4, 1.0, 0.2, tree=False, drafting=0)
    m.agreed(m.local_factors())
    assert m.predict(4, 1.0, tree=False) == pytest.approx(0.2, rel=0.1)


def test_auto_learns_the_step_cost_from_large_buckets_only():
    """``learn_plain = "auto"`` (``learn_step_cost: "auto"``): slow steps
    without trees correct a draft's price in buckets of
    ``AUTO_LEARN_BUCKET`` requests or more, and leave it at the curve's
    below."""
    curve = curve_from(avx2_bf16)
    m = CostModel(curve)
    m.learn_plain = "auto"
    big, small = CostModel.AUTO_LEARN_BUCKET, CostModel.AUTO_LEARN_BUCKET // 2
    assert m.learns_plain(big) and m.learns_plain(2 * big) and not m.learns_plain(small)
    before = {b: m.predict(b, 2, tree=False, drafting=b) for b in (small, big)}
    for i in range(200):
        n = i % 5
        for b in (small, big):
            m.observe(b, 1 + n / b, 3 * curve.predict(b, 1) * (1 + 0.2 * n), tree=False,
                      drafting=n)
    m.agreed(m.local_factors())
    assert (small, False) not in m.factors and (big, False) in m.factors
    assert m.predict(small, 2, tree=False, drafting=small) == before[small]
    assert m.predict(big, 2, tree=False, drafting=big) > 1.5 * before[big]
    for flag, buckets in ((True, (1, small, big)), (False, ())):
        m.learn_plain = flag
        assert [b for b in (1, small, big) if m.learns_plain(b)] == list(buckets)


def test_a_step_with_trees_never_costs_less_than_without():
    """The tree factor and the plain line learn from different steps; where
    they disagree (steps without trees slower than the curve, tree steps
    faster), a tree must not look cheaper than no tree."""
    m = CostModel(curve_from(avx2_bf16))
    for _ in range(40):
        m.observe(16, 1.0, 3 * m.curve.predict(16, 1.0), tree=False)
        m.observe(16, 2.0, 0.3 * m.curve.predict(16, 2.0), tree=True)
    m.agreed(m.local_factors())
    assert m.factors[(16, True)] < 1
    for q in (1.0, 1.5, 2.0, 4.0):
        assert m.predict(16, q, tree=True) >= m.predict(16, q, tree=False)


def test_trees_follow_the_plain_steps_until_seen():
    """A curve from a file or another machine: plain steps run twice as
    slow as it says. Before any tree step is seen, trees are expected twice
    as slow too (else a tree looks as cheap as no tree and runs where it
    cannot pay); once seen, their own factor rules."""
    m = CostModel(curve_from(avx2_bf16))
    for _ in range(100):
        m.observe(1, 1, 2 * m.plain(1, 1), tree=False)
    m.agreed(m.local_factors())
    assert m.predict(1, 5, tree=True) == pytest.approx(2 * m.curve.predict(1, 5), rel=0.05)
    planner = Planner(m)
    assert planner.plan([view(acceptance(**HIGH), unchecked=0)])[0].kind != "tree"
    for _ in range(60):
        m.observe(1, 5, 1.8 * m.curve.predict(1, 5), tree=True)
    m.agreed(m.local_factors())
    assert m.predict(1, 5, tree=True) == pytest.approx(1.8 * m.curve.predict(1, 5), rel=0.05)


def test_steps_without_trees_lose_the_tree_paths_jump():
    # The ladder runs every row through the tree path: from 1 to 2 rows it
    # jumps by a fixed cost that vLLM's own attention does not pay.
    c = CostCurve({1: [(1, 0.024), (2, 0.034), (16, 0.036), (64, 0.080)]})
    m = CostModel(c)
    assert m.predict(1, 1, tree=False) == pytest.approx(0.024)
    assert m.predict(1, 5, tree=False) == pytest.approx(0.024 + 4 * 0.002 / 14, rel=1e-6)
    assert m.predict(1, 5, tree=True) == pytest.approx(c.predict(1, 5))
    assert m.predict(1, 64, tree=False) < m.predict(1, 64, tree=True)


def test_measure_curve_respects_its_budget():
    clock = [0.0]

    def time_step(b, t):
        s = 0.01 * b * (1 + t / 8)
        clock[0] += s
        return s

    full = measure_curve(time_step, batches=(1, 2), tokens=(1, 4, 16), budget_s=100,
                         repeats=3, clock=lambda: clock[0])
    assert full.points[2][-1] == (16, pytest.approx(0.06))
    clock[0] = 0.0
    cut = measure_curve(time_step, batches=(1, 2, 4), tokens=(1, 4, 16), budget_s=0.1,
                        repeats=3, clock=lambda: clock[0])
    assert 1 in cut.points and 4 not in cut.points
    wishes = []
    agreed = measure_curve(time_step, batches=(1,), tokens=(1, 4, 16), budget_s=100,
                           keep_going=lambda wish: wishes.append(wish) or len(wishes) < 3)
    assert [t for t, _ in agreed.points[1]] == [1, 4]
    # A budget spent on the first point (a slow first forward, a loaded
    # machine) still leaves the first batch its first MIN_POINTS sizes.
    clock[0] = 0.0
    slow = measure_curve(time_step, batches=(1, 2), tokens=(1, 2, 4, 8, 16), budget_s=1e-6,
                         repeats=1, clock=lambda: clock[0])
    assert [t for t, _ in slow.points[1]] == [1, 2, 4, 8] and 2 not in slow.points


def test_measure_curve_measures_every_batch_before_long_token_counts():
    """Breadth first: a budget that cannot hold the whole ladder still
    gives every batch its first two sizes (what one more request and a
    first draft token cost there), then lengthens the batches in turn."""
    clock, order = [0.0], []

    def time_step(b, t):
        order.append((b, t))
        s = 0.01 * b * (1 + t / 8)
        clock[0] += s
        return s

    tokens = (1, 2, 4, 8, 16, 32, 64)
    c = measure_curve(time_step, batches=(1, 2, 4, 8, 16), tokens=tokens, budget_s=2.5,
                      repeats=1, clock=lambda: clock[0])
    assert sorted(c.points) == [1, 2, 4, 8, 16]
    assert all([t for t, _ in c.points[b]][:2] == [1, 2] for b in c.points)
    assert [t for t, _ in c.points[1]] == list(tokens)  # then batch 1 in full
    assert len(c.points[16]) == 2  # the budget ran out before the last batch's long sizes
    firsts = [p for i, p in enumerate(order) if i % 2 == 0]  # each point's warm-up
    assert firsts[:8] == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (4, 1), (4, 2)]
    # tensor parallel: rank 0's "no" stops every rank at the same point
    wishes = []
    agreed = measure_curve(time_step, batches=(1, 2, 4), tokens=tokens, budget_s=100,
                           keep_going=lambda wish: wishes.append(wish) or len(wishes) <= 6)
    assert {b: [t for t, _ in p] for b, p in agreed.points.items()} == {
        1: [1, 2, 4, 8], 2: [1, 2]}


def test_measured_curve_never_falls_with_more_tokens():
    noisy = {1: 0.09, 2: 0.015, 4: 0.018, 8: 0.002, 16: 0.012}  # another process ran
    c = measure_curve(lambda b, t: noisy[t], batches=(1,), tokens=tuple(noisy), repeats=1)
    assert [s for _, s in c.points[1]] == [0.002, 0.002, 0.002, 0.002, 0.012]


def test_cache_roundtrip_and_key_changes(tmp_path):
    cache = CostCache(tmp_path)
    key = cache_key("m", "bfloat16", 1, 1, "0.32.0", "cpu")
    pts = {1: [(1, 0.05), (2, 0.05), (4, 0.06), (16, 0.07)]}
    curve = CostCurve(pts, {"sampled": {1: (0.003, 0.0005), 4: (0.004, 0.001)},
                            "greedy": {1: (0.0002, 0.0001)}})
    assert cache.load(key) is None
    cache.save(key, curve)
    assert cache.load(key).points == curve.points
    assert cache.load(key).verify == curve.verify
    # a curve without the verification costs (it could not be timed) is kept
    cache.save(key, CostCurve(pts))
    assert cache.load(key) == CostCurve(pts)
    cache.save(key, curve)
    for change in ({"dtype": "float32"}, {"model": "other"}, {"tensor_parallel": 2},
                   {"vllm": "0.33.0"}):
        assert cache.load({**key, **change}) is None
    assert key["hardware"].get("cpu") or key["hardware"].get("machine")


def test_corrupt_or_foreign_cache_is_ignored_with_a_warning(tmp_path, caplog):
    cache = CostCache(tmp_path)
    key = cache_key("m", "float32", 1, 1, "0.32.0", "cpu")
    path = cache.path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    bad = {
        "garbage": "{not json",
        "foreign": json.dumps({"version": 1, "key": {**key, "model": "x"},
                               "curve": {"1": [[1, 0.1]]}}),
        "old": json.dumps({"version": 0, "key": key, "curve": {"1": [[1, 0.1]]}}),
        "bad values": json.dumps({"version": 1, "key": key, "curve": {"1": [[1, -3]]}}),
        "no curve": json.dumps({"version": 1, "key": key}),
        "a list": json.dumps([1, 2]),
    }
    logging.getLogger("vllm.vllm_lookahead").propagate = True
    for name, text in bad.items():
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm.vllm_lookahead.planner.cost_cache"):
            assert cache.load(key) is None, name
        assert "ignoring" in caplog.text, name
    assert load_curve(tmp_path / "missing.json") is None


def test_timed_under_load_sees_another_busy_process():
    import subprocess
    import sys
    import time

    from vllm_lookahead.planner.machine import timed_under_load

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start spinning
        # we idle, it spins: about one core of other load
        took, cores = timed_under_load(lambda: time.sleep(0.5))
    finally:
        busy.kill()
        busy.wait()
    assert took >= 0.5 and cores > 0.5


def test_verify_costs_interpolate_by_batch_and_kind():
    c = CostCurve({1: [(1, STEP), (16, 2 * STEP)]},
                  {"sampled": {1: (0.002, 0.0004), 4: (0.004, 0.0008)},
                   "greedy": {1: (0.0002, 0.0)}})
    assert c.verify_row(1, True)[:2] == (0.002, 0.0004)
    assert c.verify_row(2, True)[:2] == pytest.approx((0.002 + 0.002 / 3, 0.0004 + 0.0004 / 3))
    assert c.verify_row(16, True)[:2] == (0.004, 0.0008)  # the largest measured batch's
    assert c.verify_row(3, False)[:2] == (0.0002, 0.0)
    assert CostCurve({1: [(1, STEP)]}).verify_row(1, True)[:2] == (0.0, 0.0)  # not measured
    # the bonus row a rejected draft saves: 0 where not given (a file by hand)
    assert CostModel(c).bonus(2, True) == 0.0
    b = CostCurve({1: [(1, STEP)]}, {"sampled": {1: (0.002, 0.0004, 0.003),
                                                 4: (0.004, 0.0008, 0.0015)}})
    assert b.verify_row(2, True)[:2] == pytest.approx((0.002 + 0.002 / 3, 0.0004 + 0.0004 / 3))
    assert CostModel(b).bonus(2, True) == pytest.approx(0.0025)
    assert CostModel(b).bonus(2, False) == 0.0
    assert CostModel(b).bonus(16, True) == pytest.approx(0.0015)
    assert CostCurve.from_dict(b.to_dict(), b.verify_dict()).verify == b.verify
    # what a step pays once where any request drafts: 0 where not given
    assert CostModel(b).switch(2, True) == 0.0 and CostModel(b).switch(4, True) == 0.0
    s = CostCurve({1: [(1, STEP)]}, {"sampled": {1: (0.002, 0.0004, 0.003, 0.0),
                                                 4: (0.001, 0.0008, 0.0015, 0.003)}})
    assert CostModel(s).switch(2, True) == pytest.approx(0.001)
    assert s.verify_row(9, True) == (0.001, 0.0008, 0.0015, 0.003)
    assert CostModel(s).switch(4, False) == 0.0
    assert CostCurve.from_dict(s.to_dict(), s.verify_dict()).verify == s.verify
    with pytest.raises(ValueError, match="verification cost"):
        CostCurve({1: [(1, STEP)]}, {"sampled": {1: (0.1, 0.1, 0.1, 0.1, 0.1)}})
    with pytest.raises(ValueError, match="verification cost"):
        CostCurve({1: [(1, STEP)]}, {"sampled": {1: (0.1, 0.1, -0.1)}})
    assert CostModel(c).verify(4, True) == (0.004, 0.0008)
    with pytest.raises(ValueError, match="verification"):
        CostCurve({1: [(1, STEP)]}, {"beam": {1: (0.1, 0.1)}})
    with pytest.raises(ValueError, match="verification cost"):
        CostCurve({1: [(1, STEP)]}, {"sampled": {1: (-0.1, 0.0)}})
    assert "verify_ms" in CostModel(c).snapshot()


def test_the_cost_model_learns_the_forward_apart_from_the_verification():
    """Steps booked less the verification the plan counted: a plane that
    saw drafting steps (whose time was mostly the verifier's) does not price
    the forward's draft tokens at the verifier's cost too."""
    from vllm_lookahead.proposer import StepTimer

    cm = CostModel(CostCurve.flat(0.03, 0.02))
    planner = Planner(cm)
    timer = StepTimer(None)
    now = 0.0
    for i in range(200):
        drafting = i % 2
        verify = 0.004 if drafting else 0.0
        forward = 0.03 * (1 + 0.02 * 3 * drafting)
        timer.planned((1, 1.0 + 3 * drafting, False, drafting, verify,
                       (0.004, 0.0) if drafting else None), now)
        now += forward + verify
        timer.book(planner, now, True, 1)
    cm.agreed(cm.local_factors())
    assert cm.predict(1, 4.0, tree=False, drafting=1) == pytest.approx(0.03 * 1.06, rel=0.05)


def test_a_plane_slope_is_held_at_its_floor():
    """A slope the steps put below 0 is held at 0 and the rest refitted."""
    from vllm_lookahead.planner.fit import Plane

    line = Plane()
    for k in range(40):
        v = k % 5
        line.add((0.0, float(v), float(v > 0)), 1.0 + 0.5 * (v > 0) - 0.1 * v)
    # q held at 0, r refitted to the drafting steps' mean: 1.5 - 0.1 * 2.5 - 1
    assert line.fit() == pytest.approx((1.0, 0.0, 0.0, 0.25), abs=1e-9)


def test_cost_caches_answer_as_the_curve_does():
    """The curve's per-batch ladders and the plain step's memo are the
    curve's own numbers: the same answers as computed afresh, before and
    after a pickle round trip (a recording of planner calls,
    benchmarks/planner_replay.py), and a pickled curve is equal to its
    original."""
    import pickle

    curve = curve_from(avx2_bf16, batches=(1, 2, 4, 8), tokens=(1, 2, 4, 8, 16))
    m = CostModel(curve)
    grid = [(b, t) for b in (1, 2, 3, 4, 5, 8, 12, 16, 40) for t in (1.0, 1.25, 2.0, 3.5, 8.0, 30.0)]
    first = [m.plain(b, t) for b, t in grid]
    assert first == [m._plain_of(b, t) for b, t in grid]  # memo = computed
    assert first == [m.plain(b, t) for b, t in grid]  # and read again
    def rows(b, t):  # CostModel._rows as its docstring says, nothing kept
        c1 = curve.predict(b, 1)
        if t <= 1:
            return c1
        jump = max(curve.predict(b, 2) - c1 - max(curve.predict(b, 16) - curve.predict(b, 2),
                                                  0.0) / 14, 0.0)
        return max(curve.predict(b, t) - jump, c1)

    def plain(b, t):
        if b <= 1 or t <= 1:
            return rows(b, t)
        c1 = curve.predict(b, 1)
        return max(min(rows(b, t), c1 + rows(1, b * t) - rows(1, b)), c1)

    assert first == [plain(b, t) for b, t in grid]
    # the curve's ladder read where it was measured, and between
    assert [curve.predict(4, t) for t, _ in curve.points[4]] == [s for _, s in curve.points[4]]
    assert curve.predict(4, 3.0) == pytest.approx(sum(s for t, s in curve.points[4] if t in (2, 4)) / 2)
    again = pickle.loads(pickle.dumps(m))
    assert again.curve == curve
    assert [again.plain(b, t) for b, t in grid] == first
    assert [again.predict(b, t, tree=True) for b, t in grid] == [m.predict(b, t, tree=True)
                                                                 for b, t in grid]


def test_plain_memo_is_bounded():
    m = CostModel(curve_from(avx2_bf16))
    for i in range(CostModel.MEMO_SIZE + 10):
        m.plain(4, 1.0 + i / 1000)
    assert len(m._plain) <= CostModel.MEMO_SIZE

