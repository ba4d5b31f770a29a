"""Lookahead statistics a program can read (``get_lookahead_stats``): the
figures only lookahead knows (README, "Statistics", lists every key); vLLM's
``vllm:spec_decode_*`` metrics already count our drafts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vllm_lookahead.algo.state import SOURCES

#: The worker method :mod:`vllm_lookahead.patches` adds (:func:`worker_stats`).
WORKER_STATS_METHOD = "lookahead_stats"

#: How a request ran a step: with a tree, with a draft but no tree, neither.
ARMS = ("tree", "pool", "off")

#: ``cpu.sampling.COUNTS`` fields whose stats key is not ``verify_<field>``.
_VERIFY_KEYS = {"rows": "top_p_rows", "fallback_rows": "top_p_fallback_rows",
                "verified_rows": "rows_computed"}


@dataclass
class LookaheadStats:
    """Counters of one proposer (worker rank) since start; a request-step is
    one request in one engine step."""

    decode_steps: int = 0  # request-steps that produced tokens
    generated_tokens: int = 0
    lookahead_passes: int = 0  # separate tree-masked forwards
    lookahead_query_tokens: int = 0  # tree nodes queried
    drafts: int = 0  # drafts handed to the verifier
    draft_tokens: int = 0
    accepted_tokens: int = 0
    #: accepted draft tokens by source (state.SOURCES)
    accepted_by_source: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SOURCES})
    live_requests: int = 0  # request states held
    pool_ngrams: int = 0  # n-grams in their pools
    proposer_time_s: float = 0.0  # in the proposer (not tree rows in vLLM's forward)
    fused_steps: int = 0  # engine steps whose forward carried tree tokens
    trees_dropped: int = 0  # planned trees vLLM scheduled otherwise
    unchecked_drafts: int = 0  # drafts no tree checked
    steps_window_off: int = 0  # steps whose tree budget left the windows out
    steps_off: int = 0  # steps at or past disable_batch_size
    requests_unpaid: int = 0  # request-steps off after their lookup, unsearched
    sibling_steps: int = 0  # request-steps of samples planned for their parent
    sibling_ahead_steps: int = 0  # of them planned at less than a token
    #: over the unchecked drafts the planner chose: tokens expected accepted, and accepted
    planned_gain: float = 0.0
    planned_gain_seen: int = 0
    fused_trees: int = 0  # trees that rode in vLLM's forward
    pass_requests: int = 0  # trees run in an extra forward (separate mode)
    catch_up_requests: int = 0  # fused catch-up trees
    arm_steps: dict[str, int] = field(default_factory=lambda: {a: 0 for a in ARMS})
    shape_steps: dict[str, int] = field(default_factory=dict)  # "off", "draft:K", "tree:wWgG"
    #: per draft kind ("suffix4+", "memory6", "pool", "checked", ...):
    #: [drafts, draft tokens, accepted tokens]
    drafts_by_kind: dict[str, list[int]] = field(default_factory=dict)
    seeded_by_batch: dict[str, int] = field(default_factory=dict)  # seeded requests by priced batch

    def to_dict(self) -> dict:
        """The counters with their ratios; ``steps_quiet``, ``requests_quiet``
        stay 0 (nothing skips a step's per-request work)."""
        forwards = self.decode_steps + self.pass_requests
        return {**asdict(self), "steps_quiet": 0, "requests_quiet": 0,
                "step_compression": _ratio(self.generated_tokens, self.decode_steps),
                "acceptance_rate": _ratio(self.accepted_tokens, self.draft_tokens),
                "tokens_per_forward": _ratio(self.generated_tokens, forwards)}


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def worker_drafter(worker):
    """A vLLM worker's drafter (None without one)."""
    return getattr(getattr(worker, "model_runner", None), "drafter", None)


def worker_stats(worker) -> dict | None:
    """``WorkerBase.lookahead_stats`` (patched in): the drafter's stats with
    the process's plain-sampler and CPU verifier counts (patches 14, 15)."""
    get = getattr(worker_drafter(worker), "get_stats", None)
    if get is None:
        return None
    from vllm_lookahead.cpu.sampling import COUNTS

    return {**get(),
            "plain_sampler_steps": getattr(worker.model_runner, "lookahead_plain_samples", 0),
            **{f"verify_{_VERIFY_KEYS.get(k, k)}": v for k, v in asdict(COUNTS).items()}}


def get_lookahead_stats(llm) -> dict:
    """Stats of a ``vllm.LLM``'s lookahead proposer (in-process or not,
    through ``collective_rpc``; every rank drafts alike, rank 0's figures).
    Raises ``RuntimeError`` where the engine does not run lookahead."""
    found = [r for r in llm.collective_rpc(WORKER_STATS_METHOD) if r is not None]
    if not found:
        raise RuntimeError("this engine does not run lookahead decoding")
    return found[0]
