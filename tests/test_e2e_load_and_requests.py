"""Per-request settings (``SamplingParams.extra_args``), load shedding
(``max_tree_tokens``, ``disable_batch_size``) and the per-step planner, end
to end: outputs stay
identical to vanilla vLLM (float32, greedy, SmolLM2, real prompts) and the
counters show the mechanism really ran."""

from __future__ import annotations

import pytest

from vllm_lookahead.stats import get_lookahead_stats

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

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(smollm2_path):
    return token_prompts(real_prompt_ids(smollm2_path, 3, 3))


def _params(extra=None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args=extra)


@pytest.fixture(scope="module")
def vanilla(smollm2_path, prompts):
    with engine(smollm2_path, max_num_seqs=16) as llm:
        return generate_ids(llm, prompts, _params(), batch=True)


def _same(out, ref):
    bad = [(i, first_mismatch(o, r)) for i, (o, r) in enumerate(zip(out, ref)) if o != r]
    assert len(out) == len(ref) and not bad, f"differs from vanilla (index, token): {bad}"


def _delta(before, after, key):
    return after[key] - before[key]


@pytest.fixture(scope="module")
def la(smollm2_path, vanilla):
    # After ``vanilla``: closing an in-process engine breaks the live ones.
    with engine(smollm2_path, LOOKAHEAD, max_num_seqs=16) as llm:
        yield llm


def test_request_can_turn_lookahead_off(la, prompts, vanilla):
    before = get_lookahead_stats(la)
    out = generate_ids(la, prompts, _params({"lookahead": False}), batch=True)
    flush(la)
    after = get_lookahead_stats(la)
    _same(out, vanilla)
    # no request drafts: every step samples with vLLM's plain sampler
    # (patches, 14), not the rejection sampler
    assert _delta(before, after, "plain_sampler_steps") >= MAX_TOKENS
    assert _delta(before, after, "drafts") == 0
    assert _delta(before, after, "fused_trees") == 0
    assert _delta(before, after, "pass_requests") == 0
    assert after["live_requests"] == 0


def test_mixed_batch_per_request_settings(la, prompts, vanilla):
    """Half the batch off, some with lowered N/W/G, the rest default."""
    from vllm import SamplingParams

    extras = [
        {"lookahead": False},
        {"lookahead": {"ngram_size": 3, "window_size": 2, "guess_set_size": 2}},
        None,
        {"lookahead_window_size": 0},
        {"lookahead": {"enabled": False}},
        {"lookahead": {"ngram_size": 2}},
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args=e) for e in extras]
    before = proposer(la).get_stats()
    outs = la.generate(prompts, params, use_tqdm=False)
    flush(la)
    after = proposer(la).get_stats()
    _same([list(o.outputs[0].token_ids) for o in outs], vanilla)
    assert _delta(before, after, "accepted_tokens") > 0


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"lookahead": {"ngram_size": 9}}, "ngram_size"),
        ({"lookahead": {"window_size": -1}}, "window_size"),
        ({"lookahead_guess_set_size": 0}, "guess_set_size"),
        ({"lookahead": {"windw_size": 2}}, "windw_size"),
        ({"lookahead": "yes"}, "lookahead"),
    ],
)
def test_bad_request_settings_rejected_engine_keeps_running(la, prompts, vanilla, extra, field):
    with pytest.raises(ValueError) as ei:
        la.generate(prompts[:1], _params(extra), use_tqdm=False)
    assert field in str(ei.value)
    # Nothing was lost: the engine still serves the next request exactly.
    _same(generate_ids(la, prompts[:1], _params(), batch=True), vanilla[:1])


def test_disable_batch_size_turns_lookahead_off_for_big_batches(smollm2_path, prompts, vanilla):
    from vllm import SamplingParams

    spec = {**LOOKAHEAD, "disable_batch_size": 4}
    # Six at once; three stop after 16 tokens, so the batch drops below 4.
    lengths = [16, 16, 16, MAX_TOKENS, MAX_TOKENS, MAX_TOKENS]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths]
    with engine(smollm2_path, spec, max_num_seqs=16) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        flush(llm)
        st = proposer(llm).get_stats()
    _same([list(o.outputs[0].token_ids) for o in outs], [v[:n] for v, n in zip(vanilla, lengths)])
    assert st["steps_off"] > 0
    # Once fewer than 4 requests decode, lookahead comes back.
    assert st["drafts"] > 0 and st["accepted_tokens"] > 0


@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_tree_token_budget_sheds_windows(smollm2_path, prompts, vanilla, mode):
    # (N-1)(W+G) = 30 nodes per request (29 + root); 6 requests need 180:
    # a budget of 60 leaves the windows out (6 x (1 + 3 x 3) = 60 with
    # 3 candidates, or fewer) but still checks candidates.
    spec = {**LOOKAHEAD, "mode": mode, "max_tree_tokens": 60}
    with engine(smollm2_path, spec, max_num_seqs=16) as llm:
        out = generate_ids(llm, prompts, _params(), batch=True)
        flush(llm)
        st = proposer(llm).get_stats()
    _same(out, vanilla)
    assert st["steps_window_off"] > 0
    assert st["accepted_tokens"] > 0
    per_step = st["lookahead_query_tokens"] / max(st["fused_steps"] + st["lookahead_passes"], 1)
    assert per_step <= 60


def test_vllm_batch_size_draft_schedule_is_honoured(smollm2_path, prompts, vanilla):
    """vLLM's own ``num_speculative_tokens_per_batch_size`` passes through:
    with 4+ requests decoding, drafts are at most 1 token long."""
    from vllm import SamplingParams

    spec = {**LOOKAHEAD, "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 64, 1]]}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with engine(smollm2_path, spec, max_num_seqs=16, disable_log_stats=False) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)  # 6 decode together
        metrics = {m.name: m for m in llm.get_metrics()}
    out = [list(o.outputs[0].token_ids) for o in outs]
    # ignore_eos may run past vanilla's EOS: compare vanilla's length.
    _same([o[: len(v)] for o, v in zip(out, vanilla)], vanilla)
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert per_pos[0] > 0
    assert sum(per_pos[1:]) == 0, per_pos


def _curve_file(tmp_path, name, per_token):
    """A cost-curve file (``cost_model`` accepts a path): a 50 ms step plus
    ``per_token`` of it for every extra query token, at batch 1 to 16."""
    import json

    from vllm_lookahead.planner.cost_model import CACHE_VERSION, CostCurve

    pts = {b: [(t, 0.05 * (1 + per_token * (b * t - 1))) for t in (1, 8, 64)]
           for b in (1, 2, 4, 8, 16)}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"version": CACHE_VERSION, "curve": CostCurve(pts).to_dict()}))
    return str(path)


@pytest.mark.parametrize("mode", ["fused", "separate"])
@pytest.mark.parametrize("machine", ["free-tokens", "steep"])
def test_planner_follows_the_cost_curve_and_stays_exact(smollm2_path, prompts, vanilla, mode,
                                                        machine, tmp_path):
    """The planner (``adaptive``, the default) chooses each request's shape
    from the step cost curve: where query tokens cost nothing it runs fused
    trees, where each one costs a quarter step it runs none but the few it
    explores.
    Whatever it picks, the outputs stay identical, batched and one request
    at a time."""
    from vllm import SamplingParams

    per_token = {"free-tokens": 0.0, "steep": 0.25}[machine]  # AVX2 bf16-like
    spec = {**LOOKAHEAD, "mode": mode, "adaptive": True,
            "cost_model": _curve_file(tmp_path, machine, per_token)}
    with engine(smollm2_path, spec, max_num_seqs=16) as llm:
        one = generate_ids(llm, prompts, _params(), batch=False)
        # The 6 prompts together, with lengths that shrink the batch.
        lengths = [16, 32, 48, MAX_TOKENS, MAX_TOKENS, MAX_TOKENS]
        outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n)
                                      for n in lengths], use_tqdm=False)
        flush(llm)
        st = proposer(llm).get_stats()
    _same(one, vanilla)
    _same([list(o.outputs[0].token_ids) for o in outs], [v[:n] for v, n in zip(vanilla, lengths)])
    assert st["cost_model"]["source"].startswith("file:")
    arms = st["arm_steps"]
    assert sum(st["shape_steps"].values()) == sum(arms.values()) > 0
    if machine == "free-tokens" and mode == "fused":
        assert arms["tree"] > 0 and st["lookahead_query_tokens"] > 0, arms
    elif machine == "free-tokens":
        # Separate mode: free query tokens do not make its second forward
        # free, so whether a tree pays depends on what it confirms; only
        # exactness is promised.
        pass
    else:
        # Even the smallest tree (3 nodes) makes a one-request step cost
        # 1.75x a plain one here, for a fraction of a token: never chosen
        # for its value. The planner may only explore one (at most 1.5
        # plain steps, within 3% of the time): at batch 6, where 3 more
        # tokens cost a third of a step; short drafts still pay.
        assert arms["tree"] == st["explored_trees"] <= 8, (arms, st["explored_trees"])
        assert arms["pool"] > 0 and st["accepted_tokens"] > 0, arms


@pytest.mark.parametrize("parent", [True, False])
def test_n_samples_are_planned_for_their_parent(smollm2_path, prompts, vanilla, tmp_path,
                                                parent):
    """The samples of an ``n`` > 1 request reach the proposer as siblings
    (vLLM's child ids): with ``parent_latency`` they are planned for their
    parent (``sibling_steps``; those whose tokens are worth less than a
    token, ``sibling_ahead_steps``; on by default); off, never. Separate requests are never
    siblings; greedy output next to them stays exact."""
    from vllm import SamplingParams

    spec = {**LOOKAHEAD, "adaptive": True, "parent_latency": parent,
            "cost_model": _curve_file(tmp_path, "steep", 0.25)}
    with engine(smollm2_path, spec, max_num_seqs=16) as llm:
        generate_ids(llm, prompts[:3], _params(), batch=True)
        flush(llm)
        apart = proposer(llm).get_stats()["sibling_steps"]
        outs = llm.generate(prompts[:2] + prompts[:1],
                            [SamplingParams(temperature=0.8, top_p=0.95, n=3,
                                            max_tokens=MAX_TOKENS)] * 2 + [_params()],
                            use_tqdm=False)
        flush(llm)
        st = proposer(llm).get_stats()
    assert apart == 0
    assert [len(o.outputs) for o in outs] == [3, 3, 1]
    assert all(0 < len(c.token_ids) <= MAX_TOKENS for o in outs[:2] for c in o.outputs)
    _same([list(outs[2].outputs[0].token_ids)], vanilla[:1])
    assert st["sibling_ahead_steps"] <= st["sibling_steps"]
    if parent:
        # 2 parents of 3 samples: every step they decode with a sibling
        assert st["sibling_steps"] > 0, st
    else:
        assert st["sibling_steps"] == st["sibling_ahead_steps"] == 0, st


def test_quiet_batches_skip_the_work_and_stay_exact(smollm2_path, prompts, vanilla, tmp_path):
    """Where every extra query token costs more than a step's worth of
    tokens, no draft can pay at any batch size: the proposer drafts nothing
    and stays exact (``steps_quiet`` stays 0: no step skips its work)."""
    spec = {**LOOKAHEAD, "adaptive": True,
            "cost_model": _curve_file(tmp_path, "hopeless", 1.5)}
    with engine(smollm2_path, spec, max_num_seqs=16) as llm:
        one = generate_ids(llm, prompts[:2], _params(), batch=False)
        together = generate_ids(llm, prompts, _params(), batch=True)
        st = proposer(llm).get_stats()
    _same(one, vanilla[:2])
    _same(together, vanilla)
    assert st["steps_quiet"] == st["requests_quiet"] == 0, st
    assert st["drafts"] == 0 and st["arm_steps"]["pool"] == st["arm_steps"]["tree"] == 0, st
    assert st["shape_steps"] == {"off": st["arm_steps"]["off"]}


def test_seeded_sampling_is_reproducible_under_the_planner(smollm2_path, prompts):
    """A sampled request with a seed gives the same tokens at every run, as
    in vLLM without speculation: its drafts come from its text alone, never
    from timing. Seeded requests run next to greedy ones (whose plan does
    follow timing), twice on one engine and once on a fresh one."""
    from vllm import SamplingParams

    spec = {"method": "lookahead", "disable_batch_size": 0}
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS)
              for i in range(3)]
    # and the 2 samples of one seeded request (each priced in a step of 2)
    pair = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=200, max_tokens=MAX_TOKENS)
    params = seeded + [_params(), _params(), pair]
    batch = prompts[:3] + prompts[3:5] + prompts[5:6]

    def run(llm):
        outs = llm.generate(batch, params, use_tqdm=False)
        return ([list(o.outputs[0].token_ids) for o in outs[:3]]
                + [list(c.token_ids) for c in outs[5].outputs])

    with engine(smollm2_path, spec, max_num_seqs=16) as llm:
        first, second = run(llm), run(llm)
        flush(llm)
        st = proposer(llm).get_stats()
    with engine(smollm2_path, spec, max_num_seqs=16) as llm:
        fresh = run(llm)
    assert first == second == fresh
    assert len(first) == 5 and all(len(o) > 8 for o in first)
    assert st["drafts"] > 0  # the seeded and greedy requests did get drafts
    # the samples of the n=2 request were priced in a step of 2 (their n
    # reached the workers), the n=1 ones alone; counted per state built
    # (again after a preemption)
    assert set(st["seeded_by_batch"]) == {"1", "2"}, st["seeded_by_batch"]
    assert st["seeded_by_batch"]["2"] >= 4 and st["seeded_by_batch"]["1"] >= 6
    # the engine's seeded_batch, where larger than n, is the batch priced
    with engine(smollm2_path, dict(spec, seeded_batch=3), max_num_seqs=16) as llm:
        llm.generate(batch[:1] + batch[5:], [seeded[0], pair], use_tqdm=False)
        assert proposer(llm).get_stats()["seeded_by_batch"] == {"3": 3}


@pytest.mark.parametrize(
    "settings",
    [
        # vLLM's defaults, with a token budget small enough that every
        # prompt is prefilled in chunks; each prompt twice, so the second
        # copy starts from prefix-cache hits.
        dict(enable_prefix_caching=True, enable_chunked_prefill=True,
             max_num_batched_tokens=64),
        dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    ],
    ids=["prefix-cache+chunked-prefill", "both-off"],
)
def test_prefix_caching_and_chunked_prefill(smollm2_path, prompts, settings):
    """Lookahead equals vanilla vLLM run with the same cache/prefill settings
    (the reference is per setting: chunked and whole prefills need not agree
    to the last bit with each other)."""
    # Prompts of 2+ KV blocks (128 tokens on CPU): a second prompt sharing
    # the first one's beginning, submitted after it, hits the prefix cache.
    long = [list(p["prompt_token_ids"]) * 2 for p in prompts[:3]]
    rounds = [token_prompts(long), token_prompts([t + t[:16] for t in long])]
    with engine(smollm2_path, max_num_seqs=16, **settings) as llm:
        ref = [ids for r in rounds for ids in generate_ids(llm, r, _params(), batch=True)]
    with engine(smollm2_path, LOOKAHEAD, max_num_seqs=16, disable_log_stats=False,
                **settings) as llm:
        out = [ids for r in rounds for ids in generate_ids(llm, r, _params(), batch=True)]
        metrics = {m.name: m for m in llm.get_metrics()}
        flush(llm)
        st = proposer(llm).get_stats()
    _same(out, ref)
    assert st["accepted_tokens"] > 0 and st["live_requests"] == 0
    if settings["enable_prefix_caching"]:
        hits = metrics.get("vllm:prefix_cache_hits")
        assert hits is not None and hits.value > 0, "no prefix-cache hit: the test proves nothing"
