"""Figures of one timed section and against vanilla (pure: no engine).

Every figure comes from what a child process measured around a timed
section: vLLM's counters and, for lookahead, ``get_lookahead_stats``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SOURCES = ("window", "prompt", "memory", "model")
ARMS = ("tree", "pool", "off")

# vLLM metric names read around every timed section.
M_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
M_DRAFTS = "vllm:spec_decode_num_drafts"
M_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
M_ITERATIONS = "vllm:iteration_tokens_total"  # histogram: count = engine steps
# Histograms observed once per request per engine step that gave it tokens
# (its first, then every later one): their counts add up to request-steps.
M_TTFT = "vllm:time_to_first_token_seconds"
M_ITL = "vllm:inter_token_latency_seconds"

# Fields of get_lookahead_stats() that are ratios or gauges, not counters:
# their before/after difference means nothing.
_LA_NOT_COUNTERS = frozenset({"acceptance_rate", "step_compression", "tokens_per_forward",
                              "live_requests", "pool_ngrams"})

# A timed section during which other processes kept more than this many
# CPU cores busy on average (machine-wide busy time minus the engine
# process's own) is flagged: vLLM on CPU runs OpenMP threads on every core
# and slows down by an order of magnitude when one of them is descheduled,
# while its own CPU time stays high.
NOISY_OTHER_LOAD = 0.25


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def _delta(after: dict | None, before: dict | None, key: str) -> float | None:
    if not after or not before or key not in after or key not in before:
        return None
    a, b = after[key], before[key]
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    return a - b


def section_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """Derived figures of one (dataset, batch size) section of one engine.

    ``raw`` holds what the child measured: ``output_tokens``, ``elapsed_s``,
    ``metrics_before/after`` (vLLM counters by name) and, for lookahead,
    ``la_before/after`` (``get_lookahead_stats`` dicts). Every figure that
    cannot be computed is ``None`` (shown as "-").

    Step compression S = output tokens / request-steps. Every request-step
    (one target forward a request takes part in, its prefill included)
    yields tokens, and vLLM observes its latency histograms once per
    request-step (time to first token, then inter-token latency): their
    counts are the request-steps where the metrics have them. Else
    request-steps = output tokens - accepted draft tokens (every
    request-step yields exactly one token that is not an accepted draft
    token), which over-counts where a request's end (max_tokens, EOS) cuts
    off draft tokens vLLM already counted as accepted: a draft of up to K
    tokens per request, so long drafts (suffix decoding's K = 24) inflate
    S; ``accepted_cut`` is that over-count where both are known.
    """
    out_tokens = raw.get("output_tokens")
    elapsed = raw.get("elapsed_s")
    mb, ma = raw.get("metrics_before"), raw.get("metrics_after")
    accepted = _delta(ma, mb, M_ACCEPTED)
    drafts = _delta(ma, mb, M_DRAFTS)
    draft_tokens = _delta(ma, mb, M_DRAFT_TOKENS)
    engine_steps = _delta(ma, mb, M_ITERATIONS)
    kind = raw.get("kind")
    if accepted is None and kind == "vanilla":
        accepted = drafts = draft_tokens = 0

    fig: dict[str, Any] = {
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": _ratio(out_tokens, elapsed),
        # --queue: tokens/s of the steps run with the batch full (no drain)
        "full_tokens_per_s": _ratio((raw.get("full_batch") or {}).get("tokens"),
                                    (raw.get("full_batch") or {}).get("seconds")),
        "accepted_tokens": accepted,
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "engine_steps": engine_steps,
    }
    request_steps = None
    ttft, itl = _delta(ma, mb, M_TTFT), _delta(ma, mb, M_ITL)
    counted = ttft + itl if ttft is not None and itl is not None else None
    fig["accepted_cut"] = None
    if counted:
        request_steps = counted
        if out_tokens is not None and accepted is not None:
            fig["accepted_cut"] = accepted - (out_tokens - counted)
    elif out_tokens is not None and accepted is not None:
        request_steps = out_tokens - accepted
    fig["request_steps"] = request_steps
    fig["step_compression"] = _ratio(out_tokens, request_steps) if request_steps else None
    # the formula before request-steps were counted (over-counts at cut drafts)
    from_accepted = (out_tokens - accepted if out_tokens is not None and accepted is not None
                     else None)
    fig["step_compression_from_accepted"] = (_ratio(out_tokens, from_accepted)
                                             if from_accepted else None)
    fig["mean_accepted_len"] = (1 + accepted / drafts) if drafts else None
    fig["acceptance_rate"] = _ratio(accepted, draft_tokens) if draft_tokens else None

    la_b, la_a = raw.get("la_before"), raw.get("la_after")
    share = {s: None for s in SOURCES}
    proposer_ms = None
    forwards = 1.0 if kind in ("vanilla", "ngram", "suffix") else None
    la_step_compression = None
    if la_a is not None and la_b is not None:
        src_b = la_b.get("accepted_by_source") or {}
        src_a = la_a.get("accepted_by_source") or {}
        # (an engine from before the shared memory has no "memory" source)
        by_src = {s: _delta(src_a, src_b, s) if s in src_a else 0 for s in SOURCES}
        total = sum(v for v in by_src.values() if v is not None)
        if total and all(v is not None for v in by_src.values()):
            share = {s: by_src[s] / total for s in SOURCES}
        fig["accepted_by_source"] = by_src
        arms_b, arms_a = la_b.get("arm_steps"), la_a.get("arm_steps")
        if isinstance(arms_a, dict) and isinstance(arms_b, dict):
            by_arm = {a: _delta(arms_a, arms_b, a) for a in ARMS}
            n_arm = sum(v for v in by_arm.values() if v is not None)
            if n_arm and all(v is not None for v in by_arm.values()):
                fig["arm_share"] = {a: by_arm[a] / n_arm for a in ARMS}
        shapes_b, shapes_a = la_b.get("shape_steps") or {}, la_a.get("shape_steps") or {}
        if isinstance(shapes_a, dict):
            shapes = {k: v - shapes_b.get(k, 0) for k, v in shapes_a.items()}
            fig["planner_shapes"] = {k: v for k, v in sorted(shapes.items(), key=lambda kv: -kv[1])
                                     if v > 0}
        kinds_b, kinds_a = la_b.get("drafts_by_kind") or {}, la_a.get("drafts_by_kind") or {}
        if isinstance(kinds_a, dict):
            # [drafts, draft tokens, accepted tokens] of the section per kind
            kinds = {k: [x - y for x, y in zip(v, kinds_b.get(k, [0, 0, 0]))]
                     for k, v in kinds_a.items()}
            fig["drafts_by_kind"] = {k: v for k, v in sorted(kinds.items()) if v[0] > 0}
        if la_a.get("cost_model"):
            fig["cost_model"] = la_a["cost_model"]
        p_time = _delta(la_a, la_b, "proposer_time_s")
        if p_time is not None and engine_steps:
            proposer_ms = 1000.0 * p_time / engine_steps
        passes = _delta(la_a, la_b, "lookahead_passes")
        if passes is not None and engine_steps:
            forwards = 1.0 + passes / engine_steps
        gen = _delta(la_a, la_b, "generated_tokens")
        steps = _delta(la_a, la_b, "decode_steps")
        la_step_compression = _ratio(gen, steps) if steps else None
        # the acceptance model's calibration where it decides: draft
        # tokens accepted over those the planner expected, its own drafts
        expected = _delta(la_a, la_b, "planned_gain")
        seen = _delta(la_a, la_b, "planned_gain_seen")
        fig["planned_gain_ratio"] = _ratio(seen, expected)
        fig["lookahead_deltas"] = {
            k: _delta(la_a, la_b, k)
            for k in sorted(set(la_a) & set(la_b))
            if isinstance(la_a[k], (int, float)) and not isinstance(la_a[k], bool)
            and k not in _LA_NOT_COUNTERS
        }
    fig["share"] = share
    fig["proposer_ms_per_step"] = proposer_ms
    fig["forwards_per_step"] = forwards
    fig["tokens_per_forward"] = _ratio(fig["step_compression"], forwards)
    fig["la_step_compression"] = la_step_compression
    cpu, machine = raw.get("cpu_s"), raw.get("machine_cpu_s")
    fig["cpu_share"] = _ratio(cpu, elapsed) if cpu is not None else None
    fig["other_load"] = None
    if cpu is not None and machine is not None and elapsed:
        fig["other_load"] = max(0.0, (machine - cpu) / elapsed)
    return fig


def combine_passes(passes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One raw section (as :func:`section_figures` takes it) of consecutive
    timed passes of one engine (``--repeat``): counters from the first
    pass's "before" to the last's "after", tokens, seconds and outputs
    added up."""
    if not passes:
        raise ValueError("no passes")
    first, last = passes[0], passes[-1]

    def total(key: str) -> float | None:
        values = [p.get(key) for p in passes]
        return None if any(v is None for v in values) else sum(values)

    fulls = [p.get("full_batch") for p in passes]
    full = None
    if all(isinstance(f, dict) for f in fulls):
        full = {k: sum(f.get(k, 0) for f in fulls) for k in ("tokens", "seconds", "steps")}
    outputs: list | None = []
    for p in passes:
        if p.get("outputs") is None:
            outputs = None
            break
        outputs.extend(p["outputs"])
    return {
        "kind": first.get("kind"),
        "output_tokens": total("output_tokens"),
        "elapsed_s": total("elapsed_s"),
        "cpu_s": total("cpu_s"),
        "machine_cpu_s": total("machine_cpu_s"),
        "full_batch": full,
        "outputs": outputs,
        "metrics_before": first.get("metrics_before"),
        "metrics_after": last.get("metrics_after"),
        "la_before": first.get("la_before"),
        "la_after": last.get("la_after"),
    }


def pass_label(first: int, last: int) -> str:
    """``"1"``, ``"2"`` or ``"2-5"``: the passes (1-based) a row covers."""
    return str(first) if first == last else f"{first}-{last}"


def match_count(outputs: Sequence[Sequence[int]] | None,
                reference: Sequence[Sequence[int]] | None) -> tuple[int, int] | None:
    """(prompts whose tokens equal the reference's, prompts) or None."""
    if outputs is None or reference is None or len(outputs) != len(reference):
        return None
    return sum(list(a) == list(b) for a, b in zip(outputs, reference)), len(reference)


def first_differences(outputs, reference) -> list[int | None] | None:
    """Per prompt, the index of the first differing token (None: equal)."""
    if outputs is None or reference is None or len(outputs) != len(reference):
        return None
    diffs: list[int | None] = []
    for a, b in zip(outputs, reference):
        a, b = list(a), list(b)
        if a == b:
            diffs.append(None)
            continue
        n = min(len(a), len(b))
        diffs.append(next((i for i in range(n) if a[i] != b[i]), n))
    return diffs


def add_relative_figures(rows: list[dict[str, Any]],
                         outputs: dict[tuple, list[list[int]]] | None = None) -> None:
    """Fill ``ratio`` (tokens/s over vanilla's), ``full_ratio`` (the same
    over the steps run with the batch full, ``--queue``) and, given the
    output tokens keyed by row key, ``match`` / ``first_diff`` against
    vanilla's, in place.

    The reference is the vanilla row with the same model, dtype, dataset and
    batch size (and, for the rows of ``--repeat`` passes, the same passes).
    """
    vanilla: dict[tuple, dict[str, Any]] = {}
    for r in rows:  # the first vanilla row listed (an A/A copy, vanilla#2, is not it)
        if r.get("kind") == "vanilla" and not r.get("error"):
            vanilla.setdefault(_ref_key(r), r)
    for row in rows:
        ref = vanilla.get(_ref_key(row))
        row["ratio"] = row["full_ratio"] = None
        row["reference"] = ref is row
        if ref is not None and not row.get("error"):
            row["ratio"] = _ratio(row.get("tokens_per_s"), ref.get("tokens_per_s"))
            row["full_ratio"] = _ratio(row.get("full_tokens_per_s"),
                                       ref.get("full_tokens_per_s"))
        if outputs is not None:
            mine = outputs.get(row_key(row))
            theirs = outputs.get(row_key(ref)) if ref is not None else None
            m = match_count(mine, theirs)
            row["match"] = list(m) if m else None
            row["first_diff"] = first_differences(mine, theirs) if m and m[0] < m[1] else None


def _group_key(row: dict[str, Any]) -> tuple:
    return (row.get("model"), row.get("dtype"), row.get("dataset"), row.get("batch_size"))


def _ref_key(row: dict[str, Any]) -> tuple:
    return (*_group_key(row), row.get("pass"))


def row_key(row: dict[str, Any]) -> tuple:
    return (*_group_key(row), row.get("method"), row.get("pass"))


def noisy_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows timed while other processes kept more than NOISY_OTHER_LOAD
    cores busy."""
    return [r for r in rows if not r.get("error") and r.get("other_load") is not None
            and r["other_load"] > NOISY_OTHER_LOAD]
