"""Lookahead statistics that a program can read.

vLLM's own spec-decode metrics (``vllm:spec_decode_*``: drafts, draft tokens,
accepted tokens, per position) count our drafts with no help from us: they are
computed by the scheduler from what the verifier accepted. This module adds
the figures only lookahead knows: where accepted tokens came from (window
n-grams, prompt/context n-grams, the lookahead pass's own next-token
prediction), how many lookahead passes ran and how big the pools are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vllm_lookahead.algo.state import SOURCES

#: Name of the worker method :mod:`vllm_lookahead.patches` adds to vLLM's
#: workers (``WorkerBase.lookahead_stats`` = :func:`worker_stats`), called
#: through ``collective_rpc``.
WORKER_STATS_METHOD = "lookahead_stats"

#: How a request ran a step: a tree, a draft without tree, neither.
ARMS = ("tree", "pool", "off")


@dataclass
class LookaheadStats:
    """Counters of one proposer (one worker rank), since engine start.

    Attributes:
        decode_steps: request-steps that produced tokens (a request sampled
            in one engine step counts once; its prefill step included).
        generated_tokens: tokens produced over those request-steps.
        lookahead_passes: tree-masked forwards of the target model run by
            the proposer (one per engine step, batched over requests).
        lookahead_query_tokens: tree nodes queried over all passes.
        drafts / draft_tokens: drafts handed to the verifier and their length.
        accepted_tokens: draft tokens the verifier accepted.
        accepted_by_source: accepted tokens by where the draft token came
            from: "window" (Jacobi n-gram), "prompt" (n-gram of the prompt or
            accepted text), "model" (the pass's next-token prediction).
        live_requests, pool_ngrams: current number of request states and
            n-grams held in their pools.
        proposer_time_s: wall time spent in the proposer (separate mode:
            the lookahead pass included; fused mode: the tree rows ride in
            vLLM's forward and are not counted here).
        fused_steps: engine steps whose forward carried tree tokens (fused).
        trees_dropped: planned trees not run because vLLM scheduled the
            request differently than planned (draft cut, preemption).
        unchecked_drafts: drafts taken from the pool without a check by the
            model (no tree fitted ``max_tree_tokens``, or the tree would
            pass ``max_model_len``).
        steps_window_off / steps_off: steps where the tree-token budget left
            the windows out / where the batch was too big for lookahead.
        steps_quiet: steps where no request's draft could pay at that batch
            size (:meth:`~vllm_lookahead.planner.planner.Planner.any_pays`), so the
            per-request work (lookups, pool updates, planning) was skipped.
        requests_quiet: request-steps left out so, in quiet steps or by the
            request's own bound (``step.QuietBatches``).
        requests_unpaid: request-steps left off after their lookup, without
            the planner's search: what they found could not pay with the
            others off (``step._cannot_pay``).
        planned_gain, planned_gain_seen: over the unchecked drafts the
            planner chose, the draft tokens it expected the verifier to
            accept (from the request's acceptance estimate) and those it
            accepted: how well the acceptance model is calibrated where it
            decides.
        fused_trees: request trees that rode in vLLM's forward (fused).
        pass_requests: request trees run in an extra forward (separate mode
            only: fused-mode catch-ups ride in the step).
        catch_up_requests: fused mode: catch-up trees, a request without a
            checked chain (its first step, a miss, a chain used up)
            re-anchoring inside its step, with no extra forward.
        sibling_steps: request-steps planned as one of the n samples of a
            parent with another sample live (``parent_latency``).
        sibling_ahead_steps: those of them planned with a token worth less
            than a token: a sample unlikely to end last
            (:func:`~vllm_lookahead.planner.planner.sibling_weights`).
        arm_steps: request-steps by how the request ran: "tree", "pool"
            (a draft without tree: the last tree's checked chain or the
            unchecked lookup) or "off" (no draft).
        shape_steps: request-steps by the shape the planner chose
            (``"off"``, ``"draft:K"``, ``"tree:wWgG"``; planner only).
        drafts_by_kind: per kind of draft (a lookup's kind, ``drafting.
            lookup``: ``"suffix4+"``, ``"memory6"``, ``"pool"``, ...; or
            ``"checked"``, a tree's chain), ``[drafts, draft tokens,
            accepted tokens]``.
        seeded_by_batch: seeded sampled requests by the batch their drafts
            are priced in (``RequestState.seeded_batch``: their parent's n
            or ``seeded_batch``), counted when their state is built (again
            after a preemption).
    """

    decode_steps: int = 0
    generated_tokens: int = 0
    lookahead_passes: int = 0
    lookahead_query_tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_source: dict[str, int] = field(
        default_factory=lambda: {s: 0 for s in SOURCES}
    )
    live_requests: int = 0
    pool_ngrams: int = 0
    proposer_time_s: float = 0.0
    fused_steps: int = 0
    trees_dropped: int = 0
    unchecked_drafts: int = 0
    steps_window_off: int = 0
    steps_off: int = 0
    steps_quiet: int = 0
    requests_quiet: int = 0
    requests_unpaid: int = 0
    sibling_steps: int = 0
    sibling_ahead_steps: int = 0
    planned_gain: float = 0.0
    planned_gain_seen: int = 0
    fused_trees: int = 0
    pass_requests: int = 0
    catch_up_requests: int = 0
    arm_steps: dict[str, int] = field(default_factory=lambda: {a: 0 for a in ARMS})
    shape_steps: dict[str, int] = field(default_factory=dict)
    drafts_by_kind: dict[str, list[int]] = field(default_factory=dict)
    seeded_by_batch: dict[str, int] = field(default_factory=dict)

    @property
    def step_compression(self) -> float:
        """Generated tokens per request-step of the verifier (1.0 = vanilla)."""
        return self.generated_tokens / self.decode_steps if self.decode_steps else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per target-model forward a request took part in:
        the verification steps plus the extra lookahead passes (every step
        in separate mode, catch-up steps in fused mode)."""
        forwards = self.decode_steps + self.pass_requests
        return self.generated_tokens / forwards if forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["step_compression"] = self.step_compression
        d["acceptance_rate"] = self.acceptance_rate
        d["tokens_per_forward"] = self.tokens_per_forward
        return d


def worker_drafter(worker):
    """A vLLM worker's drafter (our proposer, or whatever else it runs; None
    without one)."""
    return getattr(getattr(worker, "model_runner", None), "drafter", None)


def worker_stats(worker) -> dict | None:
    """Runs inside a vLLM worker: installed as ``WorkerBase.lookahead_stats``
    by :mod:`vllm_lookahead.patches` and called through ``collective_rpc``."""
    get = getattr(worker_drafter(worker), "get_stats", None)
    if get is None:
        return None
    stats = get()
    # steps sampled by vLLM's plain sampler, no request drafting (patch 14)
    stats["plain_sampler_steps"] = getattr(worker.model_runner, "lookahead_plain_samples", 0)
    # draft rows whose top-p the CPU verifier decided, and those it left to
    # vLLM's sort (patch 15; 0 off the CPU platform)
    from vllm_lookahead.cpu.sampling import COUNTS

    stats["verify_top_p_rows"] = COUNTS.rows
    stats["verify_top_p_fallback_rows"] = COUNTS.fallback_rows
    # draft rows with a tie across the nucleus's cut decided without the
    # sort, and those of them that still took it (cpu_sampling._TieRow)
    stats["verify_tie_rows"] = COUNTS.tie_rows
    stats["verify_tie_rows_sorted"] = COUNTS.tie_rows_sorted
    # sampled requests' draft rows verified lazily, and the rows computed
    # (up to each draft's first rejection; patch 15)
    stats["verify_draft_rows"] = COUNTS.draft_rows
    stats["verify_rows_computed"] = COUNTS.verified_rows
    # requests of drafting steps whose bonus token was sampled lazily, and
    # the bonus rows sampled (the others were thrown away; patch 15)
    stats["verify_bonus_rows"] = COUNTS.bonus_rows
    stats["verify_bonus_rows_sampled"] = COUNTS.bonus_rows_sampled
    return stats


def get_lookahead_stats(llm) -> dict:
    """Stats of the lookahead proposer of a ``vllm.LLM``.

    Works with in-process and multi-process engines (uses
    ``LLM.collective_rpc``). Every tensor-parallel rank runs the same proposer
    on the same inputs, so rank 0's figures are returned.

    Raises:
        RuntimeError: the engine does not run lookahead decoding.
    """
    results = llm.collective_rpc(WORKER_STATS_METHOD)
    found = [r for r in results if r is not None]
    if not found:
        raise RuntimeError("this engine does not run lookahead decoding")
    return found[0]
