"""Per-step planner: how each request of the batch runs this step.

For every decoding request the planner picks a *shape*:

* ``off``: no draft, no tree (a vanilla step for that request);
* ``draft``: a draft of k tokens and no tree -- the chain the last tree
  checked (if any), else an unchecked guess (prompt lookup / the pool);
* ``tree``: the lookahead tree with ``w <= W`` window columns and
  ``g <= G`` candidates (plus, in fused mode, the checked chain as draft).

It maximises the batch's expected generated tokens per second: the tokens
each shape is expected to yield come from the request's measured acceptance
(:mod:`.acceptance`), the seconds of the step from the measured cost of a
step with that many query tokens (:mod:`.cost_model`). The user's N, W, G
are upper bounds; a shape never pays for itself "to find out": a tree runs
only where its predicted rate is the best (estimates of a tree a request
has not run lately drift back to the engine's prior, so trees come back
when the engine's experience says they pay).

The search is coordinate ascent on ``tokens - lambda * seconds``
(Dinkelbach), lambda being the plan's current tokens per second: each
request in turn takes its best shape given the others', for a few sweeps,
from every request off, and (where the verifier's switch, paid once a step
where any request drafts, could keep drafts that pay only together from
ever being reached so) again from every request drafting; the better plan
is kept.

Pure Python: unit-tested on synthetic cost curves without an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

from vllm_lookahead.planner.acceptance import P_MAX, RequestAcceptance, geometric_gain, window_root
from vllm_lookahead.attn_mask import tree_size
from vllm_lookahead.planner.siblings import end_shares_many

#: Steps a tree is expected to keep running once started, before the engine
#: has seen any (a fused tree that starts without a checked chain confirms
#: nothing in its first step: that step's gain is lost once over these);
#: then the measured figure is used.
TREE_HORIZON = 8


class Shape(NamedTuple):
    """How one request runs one step (a named tuple: the planner makes a
    dozen per request per step).

    Attributes:
        kind: "off", "draft" or "tree".
        draft: draft tokens handed to the verifier this step (for a fused
            tree: the checked chain's expected length).
        window, cands: tree window columns and candidates (0 without tree).
        nodes: tree query tokens (0 without tree).
        tokens: expected tokens the step yields for the request.
        extra_s: seconds of the step outside the shared forward (a catch-up
            pass's share).
    """

    kind: str
    draft: int = 0
    window: int = 0
    cands: int = 0
    nodes: int = 0
    tokens: float = 1.0
    extra_s: float = 0.0

    @property
    def query(self) -> int:
        """Query tokens of the request in the step's forward."""
        return 1 + self.draft + self.nodes

    def label(self) -> str:
        if self.kind == "tree":
            return f"tree:w{self.window}g{self.cands}"
        if self.kind == "draft":
            return f"draft:{self.draft}"
        return "off"


OFF = Shape("off")
#: A :class:`Shape` from all its fields in order (no defaults to fill: the
#: planner's inner loop makes a dozen a request).
_shape = partial(tuple.__new__, Shape)


@dataclass
class RequestView:
    """What the planner needs of one decoding request.

    Attributes:
        acc: the request's acceptance estimates.
        ngram_size, window_size, guess_set_size: its N, W, G (upper bounds).
        room: the longest draft vLLM will take (``num_speculative_tokens``,
            ``max_model_len``).
        chain: length of the checked chain the last tree left (0: none).
        unchecked: length of the unchecked draft available now (0: none).
        lookup_kind: its kind (``acceptance.LOOKUP_KINDS``).
        trees: whether a tree may run (False: per-request or seeded).
        fixed: plan this request with exactly this shape (no search).
        weight: what a token the request gains beyond its one is worth, in
            tokens of the step (:func:`sibling_weights`; 1: all of it).
        verify: seconds vLLM's verifier adds for a draft of the request,
            ``(first token, each next one)``
            (:meth:`~vllm_lookahead.planner.cost_model.CostModel.verify`).
        lazy: its draft rows are verified lazily (rows past the first
            rejection cost nothing).
        bonus: seconds of ``verify[0]`` a draft saves where it is rejected
            anywhere (its bonus row, sampled lazily only after a wholly
            accepted draft,
            :meth:`~vllm_lookahead.planner.cost_model.CostModel.bonus`; 0: none).
        switch: seconds a step pays once where any of its requests drafts
            (vLLM's rejection sampler over its plain one, beyond each
            drafting request's ``verify``:
            :meth:`~vllm_lookahead.planner.cost_model.CostModel.switch`); a plan
            charges its requests' largest once.
    """

    acc: RequestAcceptance
    ngram_size: int
    window_size: int
    guess_set_size: int
    room: int
    chain: int = 0
    unchecked: int = 0
    lookup_kind: str = "suffix4"
    trees: bool = True
    fixed: Shape | None = None
    weight: float = 1.0
    verify: tuple[float, float] = (0.0, 0.0)
    lazy: bool = False
    bonus: float = 0.0
    switch: float = 0.0

    def draft_p(self, tree: bool = False) -> float:
        """Per-token acceptance of the draft this request hands the
        verifier: a tree's checked chain (``tree``), the chain the last
        tree left, or its unchecked lookup (:func:`draft_p`)."""
        if tree:
            return self.acc.checked.p
        return draft_p(self.acc, "suffix4" if self.chain > 0 else self.lookup_kind)

    def verify_s(self, draft: int, p: float = 1.0,
                 verify: tuple[float, float] | None = None) -> float:
        """Seconds vLLM's verifier adds for a draft of ``draft`` tokens,
        each accepted with probability ``p`` (given the ones before):
        where the request's draft rows are verified lazily (``lazy``), a
        row past the first rejection costs nothing
        (:func:`verified_rows`), and where its bonus row is sampled
        lazily (``bonus``) a draft rejected anywhere saves that row
        (:func:`bonus_saving`): the result may be below 0. ``verify``:
        ``(first, next)`` seconds to price it with in place of the view's
        (the step's booking uses the verification as measured)."""
        pair = self.verify if verify is None else verify
        if not self.lazy:
            return verify_seconds(pair, draft)
        return (verify_seconds(pair, draft, verified_rows(draft, p))
                - bonus_saving(self.bonus, draft, p))


def verified_rows(draft: int, p: float) -> float:
    """Draft rows a lazy verifier (``cpu_sampling.verify_sampled_rows``)
    is expected to compute for a draft of ``draft`` tokens each accepted
    with probability ``p``: row d is computed where the d tokens before it
    were accepted, ``1 + p + ... + p^(draft-1)``."""
    if draft <= 0:
        return 0.0
    return 1.0 + geometric_gain(p, draft - 1)


def draft_p(acc: RequestAcceptance, kind: str = "suffix4") -> float:
    """Per-token acceptance of a request's unchecked draft of ``kind`` as
    the planner values it (calibrated, :meth:`RequestAcceptance.unchecked_gain`)."""
    return min(acc.unchecked_p(kind) * acc.prior.calibration, 1.0)


def verify_seconds(verify: tuple[float, float], draft: int, rows: float | None = None) -> float:
    """Seconds vLLM's verifier adds for a draft of ``draft`` tokens, from
    its ``(first token, each next one)`` seconds; 0 without a draft.
    ``rows``: the draft rows it computes (None: all ``draft``; a lazy
    verifier's expectation, :func:`verified_rows`)."""
    if draft <= 0:
        return 0.0
    return verify[0] + verify[1] * ((draft if rows is None else max(rows, 1.0)) - 1)


def bonus_saving(bonus: float, draft: int, p: float) -> float:
    """Expected seconds a draft of ``draft`` tokens, each accepted with
    probability ``p`` (given the ones before), saves of its verification
    where its bonus row, ``bonus`` seconds, is sampled only after the whole
    draft is accepted: ``bonus * (1 - p^draft)``; 0 without a draft."""
    if draft <= 0 or bonus <= 0:
        return 0.0
    return bonus * (1.0 - min(max(p, 0.0), 1.0) ** draft)


def sibling_rows(groups: list, remaining: list) -> list[list[int]]:
    """The requests planned for their parent (:func:`sibling_weights`), by
    parent: the rows of each parent with two or more live samples, all with
    an output cap (``groups``, ``remaining`` as there)."""
    members: dict = {}
    for r, g in enumerate(groups):
        if g is not None:
            members.setdefault(g, []).append(r)
    return [rows for rows in members.values()
            if len(rows) >= 2 and all(remaining[r] is not None for r in rows)]


def sibling_weights(groups: list, remaining: list, slot_value, end_value,
                    draws: list) -> list[float]:
    """What a gained token is worth to each request of a step whose
    requests may be the n samples of one parent request (vLLM answers the
    parent when its last sample ends), in tokens of the step.

    Of what a sample's draft is expected to gain, the share that ends the
    parent sooner (:func:`~vllm_lookahead.planner.siblings.end_shares`, every
    parent's in one pass: where the sample would end last, by what it
    leaves it behind the next) is worth
    ``end_value(k)`` tokens a parent step (``k``: the parent's live
    samples, :meth:`Planner.end_value`); the rest only frees the sample's
    batch slot a step earlier, worth ``slot_value(k)`` a token
    (:meth:`Planner.drain_value`). So sixteen tied samples that draft now and
    then are worth about ``end_value / 16`` and their slot; a lone laggard
    ``end_value``. A request without live siblings or without an output
    cap is worth 1.

    Args:
        groups: per request, its parent (None: not one of n samples).
        remaining: per request, tokens left to its ``max_tokens`` (None:
            no cap).
        slot_value: ``k -> tokens`` of the step that a token is worth
            which only frees a batch slot of a parent with ``k`` live
            samples, in [0, 1] (:meth:`Planner.drain_value`).
        end_value: ``k -> tokens`` of the step a parent step of a parent
            with ``k`` live samples is worth (:meth:`Planner.end_value`).
        draws: per request, ``(p, K)``: its typical draft's per-token
            acceptance and length.

    Returns:
        per request, its weight (``RequestView.weight``).
    """
    out = [1.0] * len(groups)
    parents = sibling_rows(groups, remaining)
    every = end_shares_many([([remaining[r] for r in rows], [draws[r] for r in rows])
                             for rows in parents])
    for rows, shares in zip(parents, every):
        value, slot = end_value(len(rows)), slot_value(len(rows))
        for r, share in zip(rows, shares):
            out[r] = share * value + (1.0 - share) * slot
    return out


@lru_cache(maxsize=128)
def draft_lengths(k_max: int) -> tuple[int, ...]:
    """The draft lengths the planner weighs for an unchecked draft of at
    most ``k_max`` tokens: every length up to 8, then a ladder
    (12, 16, 24, 32, 48) and ``k_max`` itself, so a long lookup costs a
    few more shapes, not one per token."""
    ks = set(range(1, min(k_max, 8) + 1)) | {k for k in (12, 16, 24, 32, 48) if k < k_max}
    if k_max > 0:
        ks.add(k_max)
    return tuple(sorted(ks))


@lru_cache(maxsize=256)
def _tree_options(ngram_size: int, window_size: int, g_max: int) -> tuple:
    """The tree shapes of a request with these N, W, G: ``(window columns,
    candidates, nodes)`` for no window and 1, 2, 4, ... up to W columns,
    each with no candidate (window only), 1, 2, 4, ... up to G."""
    out = []
    for w in [0] + _cand_steps(window_size):
        for g in [0] + _cand_steps(g_max):
            if g or w:
                out.append((w, g, tree_size(ngram_size, w, g)))
    return tuple(out)


@lru_cache(maxsize=256)
def _tree_table(ngram_size: int, window_size: int, g_max: int) -> tuple:
    """:func:`_tree_options`, and each shape's ``(g, root)`` for
    :meth:`RequestAcceptance.tree_gains` (``root``: the square root of its
    share of the W window columns)."""
    options = _tree_options(ngram_size, window_size, g_max)
    cols = max(window_size, 1)
    return options, tuple((g, window_root(w / cols)) for w, g, _ in options)


def _cand_steps(g_max: int) -> list[int]:
    """1, 2, 4, ... up to and including ``g_max``."""
    out, g = [], 1
    while g < g_max:
        out.append(g)
        g *= 2
    if g_max >= 1:
        out.append(g_max)
    return out


class Planner:
    """Chooses every request's :class:`Shape` for a step.

    Args:
        cost: anything with ``predict(batch, tokens_per_request, tree,
            drafting) -> seconds`` (a
            :class:`~vllm_lookahead.planner.cost_model.CostModel`).
        fused: trees ride in the verification forward (else a second pass).
        sweeps: coordinate-ascent sweeps per step.
    """

    #: Share of the predicted step time the planner may lose to trying a
    #: tree it does not predict best (its acceptance is only ever learnt
    #: from trees that run); never a tree that would make the step more
    #: than EXPLORE_MAX_STEP times a plain one (a tree step of several
    #: plain steps is never tried).
    EXPLORE_SHARE = 0.03
    EXPLORE_MAX_STEP = 1.5
    #: A request is explored while it has run no tree, or this many steps
    #: after its last one (what it learnt may be stale).
    EXPLORE_AFTER = 64
    #: Trees the engine's prior has learnt from (``AcceptancePrior.
    #: trees_seen``) past which a request that has run none starts from
    #: that prior, as from a tree of its own: it is explored only
    #: :attr:`EXPLORE_AFTER` steps into its life. (Stop 59, AVX2 EPYC,
    #: batch 1: every 64-token request spent one tree step, +30% of a step,
    #: learning what the 16 before it had learnt.)
    EXPLORE_KNOWN = 16

    def __init__(self, cost, fused: bool = True, sweeps: int = 3) -> None:
        self.cost = cost
        self.fused = fused
        self.sweeps = sweeps
        #: predicted seconds of the steps planned, and of the steps that
        #: explored (deterministic: every TP rank plans alike)
        self.planned_s = 0.0
        self.explore_s = 0.0
        self.explored = 0
        self._turn = 0
        #: requests the search left off without weighing them (:meth:`_paying`)
        self.left_off = 0
        #: tree steps per catch-up (the proposer updates it from its
        #: counts: tree runs that end soon make a catch-up dearer).
        self.horizon = float(TREE_HORIZON)
        #: vLLM's verifier computes a sampled request's draft rows only up
        #: to its first rejection (patch 15 on the CPU platform,
        #: ``cpu_sampling.verify_sampled_rows``): a draft's verification is
        #: priced by the rows expected (:func:`verified_rows`).
        self.lazy_verify = False
    #: ``LookaheadConfig.min_draft_p`` (:meth:`draft_cap`; the proposer
    #: sets it per planner; a class default, so a planner pickled before
    #: it was added reads 0)
    min_draft_p = 0.0

    def draft_cap(self, p: float) -> int:
        """The longest unchecked draft :meth:`shapes` weighs for a
        per-token acceptance ``p``: the largest k with ``p^k >=
        min_draft_p`` (0: none; no cap where ``min_draft_p`` is 0 or
        ``p`` is 1)."""
        floor = self.min_draft_p
        if floor <= 0.0 or p >= 1.0:
            return 1 << 30
        if p < floor:
            return 0
        return int(math.log(floor) / math.log(p) + 1e-9)

    # -- the shapes of one request ------------------------------------------------
    def shapes(self, v: RequestView, batch: int) -> list[Shape]:
        """The shapes request ``v`` may take in a ``batch``-request step,
        :data:`OFF` first; its trees where it may run them (``v.trees``)."""
        if v.fixed is not None:
            return [v.fixed]
        out = [OFF]
        if v.room <= 0:
            return out
        acc = v.acc
        if v.chain > 0:
            # The chain the last tree checked is drafted once; the steps
            # after it draft unchecked guesses: value the policy, not the
            # one step (a tree's value below is its steady state too).
            k = min(v.chain, v.room)
            out.append(Shape("draft", draft=k, tokens=1 + acc.unchecked_gain(k),
                             extra_s=v.verify_s(k, v.draft_p())))
        elif v.unchecked > 0:
            p = v.draft_p()
            for k in draft_lengths(min(v.unchecked, v.room, self.draft_cap(p))):
                out.append(Shape("draft", draft=k,
                                 tokens=1 + acc.unchecked_gain(k, v.lookup_kind),
                                 extra_s=v.verify_s(k, p)))
        if not v.trees:
            return out
        n = v.ngram_size
        checked = acc.checked.p
        extra_1 = 0.0
        if not self.fused:
            # Separate mode: a second forward every step (its tokens are
            # counted in the batch's tokens).
            extra_1 = self.cost.predict(1, 1) / max(batch, 1)
        # A catch-up tree rides in this step but confirms no draft until
        # the next: one step of the run without its gain.
        catch_up = (1.0 - 1.0 / max(self.horizon, 1.0)) if self.fused and v.chain <= 0 else None
        table, roots = _tree_table(n, v.window_size, v.guess_set_size)
        cap, room = n - 1, v.room
        p_chain = v.draft_p(tree=True)  # the checked chain's, as verified
        verify = {}  # d -> v.verify_s(d, p_chain): a few lengths for a dozen trees
        for (w, g, nodes), m in zip(table, acc.tree_gains(roots)):
            if m > cap:
                m = cap
            # Steady state: each step drafts the chain the last tree
            # confirmed (about m tokens) and checks the next tree.
            d = int(round(m))
            if d > room:
                d = room
            gain = m * checked
            if catch_up is not None:
                gain *= catch_up
            vs = verify.get(d)
            if vs is None:
                vs = verify[d] = v.verify_s(d, p_chain)
            out.append(_shape(("tree", d, w, g, nodes, 1 + gain, extra_1 + vs)))
        return out

    #: What a seeded request's draft costs beyond the forward's rows, in
    #: one-request steps, the first draft token and each next one, where the
    #: curve has no verification costs (:attr:`CostCurve.verify`: a curve
    #: file written by hand or by an older version). These are upper bounds
    #: of what the steps seen measured on an AVX2 EPYC in float32 under
    #: top-p sampling (first 20-25%, next 6-13% of a step).
    SEEDED_FIRST = 0.25
    SEEDED_NEXT = 0.15

    def steady_draft(self, acc: RequestAcceptance, kind: str, k_max: int,
                     batch: int = 1) -> int:
        """A seeded request's draft length (its tokens must be the same on
        every run, so nothing timed while it runs may decide it): the k <=
        ``k_max`` with the most expected tokens per second of a
        ``batch``-request step where it alone drafts, its acceptance ``acc``
        learnt from its own text (``kind`` of lookup), the seconds from the
        cost curve as the engine started (no correction from the steps
        seen: :meth:`CostModel.plain`) plus what vLLM's verifier adds, as
        measured with the curve (a seeded request's where measured, else a
        sampled one's, :meth:`CostModel.verify` and :meth:`CostModel.switch`
        at that batch; without them
        :attr:`SEEDED_FIRST`, :attr:`SEEDED_NEXT` of a one-request step), no
        longer than :meth:`draft_cap` allows. 0: no draft.

        ``batch`` must be fixed before the request starts (the proposer
        gives its parent's n, vLLM running the n samples together, or
        ``LookaheadConfig.seeded_batch`` where larger). In a b-request step
        a draft pays only where its gain beats b x its seconds / the
        step's, and a batched step grows less than b-fold: priced alone,
        4 seeded samples batched read 0.91x vanilla on MT-Bench (stop 59,
        AVX2 EPYC; README)."""
        plain = getattr(self.cost, "plain", None)
        if plain is None:  # a bare cost curve (tests)
            def plain(batch, tokens):
                return self.cost.predict(batch, tokens, False)
        b = max(int(batch), 1)
        step = max(plain(b, 1), 1e-12)
        # a seeded request's verification: vLLM's samplers draw its noise
        # from its own generator, row by row (measured apart at start-up)
        first, nxt = self.verify(b, True, seeded=True)
        first += self.switch(b, True, seeded=True)  # the only request drafting, as priced
        if not (first or nxt):
            one = max(plain(1, 1), 1e-12)
            first, nxt = one * self.SEEDED_FIRST, one * self.SEEDED_NEXT
        best, best_rate = 0, b / step
        p = draft_p(acc, kind)
        for k in range(1, min(k_max, self.draft_cap(p)) + 1):
            verify = verify_seconds((first, nxt), k,
                                    verified_rows(k, p) if self.lazy_verify else None)
            rate = ((b + acc.unchecked_gain(k, kind))
                    / max(plain(b, 1 + k / b) + verify, 1e-12))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def verify(self, batch: int, sampled: bool, seeded: bool = False) -> tuple[float, float]:
        """What vLLM's verifier adds for a draft of a request of a
        ``batch``-request step, as measured with the curve
        (:meth:`CostModel.verify`: a seeded request's draft is priced with
        it, ``seeded``: as measured for requests with their own generators);
        ``(0, 0)`` for a cost without it (a bare curve in tests)."""
        measured = getattr(self.cost, "verify", None)
        return measured(batch, sampled, seeded) if callable(measured) else (0.0, 0.0)

    def bonus(self, batch: int) -> float:
        """What a sampled request's bonus row costs in a ``batch``-request
        step where it is sampled lazily (:meth:`CostModel.bonus`; 0 for a
        cost without it, or where the verifier is not lazy)."""
        measured = getattr(self.cost, "bonus", None)
        if not self.lazy_verify or not callable(measured):
            return 0.0
        return measured(batch, True)

    def switch(self, batch: int, sampled: bool, seeded: bool = False) -> float:
        """What a ``batch``-request step pays once where any request drafts
        (:meth:`CostModel.switch`, ``seeded`` as :meth:`verify`; 0 for a
        cost without it)."""
        measured = getattr(self.cost, "switch", None)
        return measured(batch, sampled, seeded) if callable(measured) else 0.0

    def verify_seen(self, batch: int, sampled: bool) -> tuple[float, float]:
        """:meth:`verify` as the steps seen corrected it
        (:meth:`CostModel.verify_seen`): an unseeded request's draft."""
        seen = getattr(self.cost, "verify_seen", None)
        return seen(batch, sampled) if callable(seen) else self.verify(batch, sampled)

    def slot_value(self, batch: int) -> float:
        """What a request's token is worth, in tokens of a ``batch``-request
        step, when it only frees the request's batch slot a step earlier
        (:func:`sibling_weights`): the seconds one request adds to a plain
        step at that size, at the plain step's tokens per second,
        ``b * (c(b) - c(b-1)) / c(b)``; 1 for a lone request."""
        if batch <= 1:
            return 1.0
        c = self.cost.predict(batch, 1.0, tree=False)
        c_less = self.cost.predict(batch - 1, 1.0, tree=False)
        if c <= 0:
            return 1.0
        return min(max(batch * (c - c_less) / c, 0.0), 1.0)

    def drain_value(self, batch: int, samples: int) -> float:
        """What a token of one of a parent's ``samples`` live samples is
        worth, in tokens of a ``batch``-request step, when it only frees the
        sample's batch slot a step earlier (:func:`sibling_weights`): the
        slot is freed near the parent's end, as its samples drain from the
        step, so at the mean cost one of them adds over that drain,
        ``b (c(b) - c(b - k + 1)) / ((k - 1) c(b))``, at the plain step's
        tokens per second; :meth:`slot_value` for a lone sample."""
        if batch <= 1 or samples <= 1:
            return self.slot_value(batch)
        c, last = self._drain_costs(batch, samples)
        if c <= 0:
            return 1.0
        return min(max(batch * (c - last) / ((samples - 1) * c), 0.0), 1.0)

    def end_value(self, batch: int, samples: int) -> float:
        """What ending a parent request of ``samples`` live samples a step
        sooner is worth, in tokens of a ``batch``-request step
        (:func:`sibling_weights`): its last step runs its last sample with
        the step's ``batch - samples`` other requests, ``c(batch - samples
        + 1)`` seconds, at the plain step's tokens per second ``batch /
        c(batch)``, less the others' tokens, which that step gains too and
        which they gain anyway: ``b c(b - k + 1) / c(b) - (b - k)``. On a
        flat machine that is ``k`` (the parent's slots); where a step costs
        ``a + m b``, ``1 + (k - 1) a / c(b)``. Between :meth:`slot_value`
        and ``samples``."""
        c, last = self._drain_costs(batch, samples)
        if c <= 0 or batch <= 1:
            return 1.0
        others = max(batch - samples, 0)
        return min(max(batch * last / c - others, self.slot_value(batch)), float(samples))

    def _drain_costs(self, batch: int, samples: int) -> tuple[float, float]:
        """Plain step seconds with the ``batch`` requests, and with one of
        a parent's ``samples`` left among the others (its last step)."""
        return (self.cost.predict(batch, 1.0, tree=False),
                self.cost.predict(max(batch - samples + 1, 1), 1.0, tree=False))

    def plan(self, views: list[RequestView], max_tree_tokens: int = 0,
             others: int = 0, explore: bool = False) -> list[Shape]:
        """One shape per request (in the order of ``views``); ``others``:
        more requests in the step, off (one query token each).
        ``explore``: where the plan has no tree, perhaps try one
        (:meth:`_explore`; the engine's steps do, the value tests not)."""
        r_n = len(views)
        if r_n == 0:
            if explore and others > 0:
                # every request left out after its lookup (off): the step
                # still counts towards the exploration's share
                self.planned_s += self.cost.predict(others, 1.0, tree=False)
            return []
        batch = r_n + max(others, 0)
        options = [self.shapes(v, batch) for v in views]
        memo: dict[tuple[int, bool, int], float] = {}

        def seconds(total_query: int, trees: int, drafting: int) -> float:
            key = (total_query, trees > 0, drafting)
            s = memo.get(key)
            if s is None:
                s = memo[key] = self.cost.predict(batch, (total_query + batch - r_n) / batch,
                                                  tree=trees > 0, drafting=drafting)
            return s

        # the verifier's switch, paid once where any request drafts
        switch = max(v.switch for v in views)
        pays = self._bound(batch, r_n, seconds)
        # requests whose drafts could pay beside another drafting one
        drafts_pay = [v.fixed is None and any(s.kind == "draft" and pays(v, s) for s in o)
                      for v, o in zip(views, options)]
        searched = self._prune(views, options, pays, drafts_pay, switch)
        # Per option: (query tokens, whether a tree, tokens, extra seconds,
        # whether more than one query token, whether a draft to verify).
        # (a request's gain beyond its one token counted at its weight)
        rows = []
        for v, opts in zip(views, searched):
            weight, row = v.weight, []
            for kind, draft, _, _, nodes, tokens, extra_s in opts:
                q = 1 + draft + nodes  # Shape.query
                row.append((q, kind == "tree", 1.0 + weight * (tokens - 1.0), extra_s, q > 1,
                            draft > 0))
            rows.append(row)

        def search(pick: list[int]) -> tuple[list[int], float]:
            """Coordinate ascent from ``pick``: each request in turn takes
            its best option given the others', for a few sweeps. Returns
            the picks and the plan's tokens per second."""
            q_tot = sum(rows[r][j][0] for r, j in enumerate(pick))
            extra = sum(rows[r][j][3] for r, j in enumerate(pick))
            tok = sum(rows[r][j][2] for r, j in enumerate(pick)) + (batch - r_n)  # others: 1 each
            n_tree = sum(rows[r][j][1] for r, j in enumerate(pick))
            n_draft = sum(rows[r][j][4] for r, j in enumerate(pick))
            n_ver = sum(rows[r][j][5] for r, j in enumerate(pick))
            for _ in range(self.sweeps):
                lam = tok / (seconds(q_tot, n_tree, n_draft) + extra + (switch if n_ver else 0.0))
                changed = False
                for r, opts in enumerate(rows):
                    if len(opts) == 1:
                        continue
                    cq, ctree, ctok, cextra, cdraft, cver = opts[pick[r]]
                    q_base = q_tot - cq
                    t_base = n_tree - ctree
                    d_base = n_draft - cdraft
                    v_base = n_ver - cver
                    best, best_val = pick[r], None
                    for j, (oq, otree, otok, oextra, odraft, over) in enumerate(opts):
                        # seconds(), its memo read inline (the search's
                        # innermost line: hundreds a step at 16 sequences)
                        key = (q_base + oq, t_base + otree > 0, d_base + odraft)
                        sec = memo.get(key)
                        if sec is None:
                            sec = seconds(*key)
                        if v_base or over:
                            sec += switch
                        val = otok - lam * (sec + oextra)
                        if best_val is None or val > best_val + 1e-12:
                            best, best_val = j, val
                    if best != pick[r]:
                        nq, ntree, ntok, nextra, ndraft, nver = opts[best]
                        q_tot += nq - cq
                        extra += nextra - cextra
                        tok += ntok - ctok
                        n_tree += ntree - ctree
                        n_draft += ndraft - cdraft
                        n_ver += nver - cver
                        pick[r] = best
                        changed = True
                if not changed:
                    break
            return pick, tok / (seconds(q_tot, n_tree, n_draft) + extra
                                + (switch if n_ver else 0.0))

        pick, rate = search([0] * r_n)
        if switch > 0 and sum(drafts_pay) >= 2:
            # The verifier's switch is paid once where any request drafts:
            # from every request off, the first to move pays it alone, so
            # drafts that pay only together (at 16 sampled sequences on the
            # CPU, where a rejected draft saves its sorted bonus row) are
            # never reached. So search again from every request whose
            # drafts could pay drafting its shortest one (its option 1),
            # and keep the better plan.
            start = [int(d) for d in drafts_pay]
            if start != pick:
                other, other_rate = search(start)
                if other_rate > rate * (1 + 1e-9):
                    pick, rate = other, other_rate
        chosen = [searched[r][pick[r]] for r in range(r_n)]
        if max_tree_tokens > 0:
            chosen = self._fit(chosen, options, max_tree_tokens)
        if not explore:
            return chosen
        sec = seconds(sum(c.query for c in chosen), sum(c.kind == "tree" for c in chosen),
                      sum(c.query > 1 for c in chosen)) + sum(c.extra_s for c in chosen) \
            + (switch if any(c.draft > 0 for c in chosen) else 0.0)
        self.planned_s += sec
        if not any(c.kind == "tree" for c in chosen):
            self._explore(chosen, options, views, sec, seconds, max_tree_tokens, switch, batch)
        return chosen

    @staticmethod
    def _bound(batch: int, r_n: int, seconds):
        """``pays(view, shape, once=0)``: whether ``shape`` could beat off
        for its request in any plan of a ``batch``-step of ``r_n`` views
        (``seconds`` as in :meth:`plan`): its weighted gain beats its cost
        in the step with every other request off -- its forward's seconds
        beyond the plain step, its own extra seconds and ``once`` where it
        drafts, at the plain step's rate. The search moves a request from
        off only so: the step's cost rises at least as fast and the plan's
        rate only rises as others move."""
        plain = seconds(r_n, 0, 0)
        lam = batch / plain  # the all-off plan's tokens per second

        def pays(v: RequestView, s: Shape, once: float = 0.0) -> bool:
            q = 1 + s.draft + s.nodes
            sec = seconds(r_n - 1 + q, int(s.kind == "tree"), int(q > 1)) - plain + s.extra_s
            return v.weight * (s.tokens - 1.0) > lam * (sec + (once if s.draft else 0.0))
        return pays

    def _prune(self, views, options, pays, drafts_pay, switch: float) -> list[list[Shape]]:
        """Per request, the shapes the search weighs (``pays``:
        :meth:`_bound`): all of them where a tree could pay, off and its
        drafts where a draft could (``drafts_pay``), else off alone; the
        one request left that could draft, where no fixed one drafts, pays
        the verifier's ``switch`` alone. Fixed views keep their shape."""
        def keep(v: RequestView, opts: list[Shape], drafts: bool, once: float) -> list[Shape]:
            n = 1 + sum(s.kind == "draft" for s in opts)
            if any(pays(v, s, once) for s in opts[n:]):
                return opts
            return opts[:n] if drafts else opts[:1]

        out = [opts if v.fixed is not None else keep(v, opts, d, 0.0)
               for v, opts, d in zip(views, options, drafts_pay)]
        movers = [r for r, (v, o) in enumerate(zip(views, out)) if v.fixed is None and len(o) > 1]
        if len(movers) == 1 and switch > 0 and not any(
                v.fixed is not None and v.fixed.draft > 0 for v in views):
            r = movers[0]
            out[r] = keep(views[r], out[r],
                          any(pays(views[r], s, switch) for s in out[r] if s.kind == "draft"),
                          switch)
        self.left_off += sum(v.fixed is None and len(o) == 1 for v, o in zip(views, out))
        return out

    def explore_due(self, acc) -> bool:
        """Whether a request of acceptance ``acc`` (a
        :class:`~vllm_lookahead.planner.acceptance.RequestAcceptance`) is due an
        exploration tree: it has run none and the engine's prior knows
        fewer than :attr:`EXPLORE_KNOWN` trees, or its last tree (or, with
        the prior known, its start) is :attr:`EXPLORE_AFTER` steps back."""
        known = getattr(getattr(acc, "prior", None), "trees_seen", 0) >= self.EXPLORE_KNOWN
        return not ((getattr(acc, "tree_runs", 0) or known)
                    and getattr(acc, "since_tree", 0) < self.EXPLORE_AFTER)

    def _explore(self, chosen, options, views, sec, seconds, max_tree_tokens,
                 switch: float, batch: int) -> None:
        """Give one request (in turn) that has not run a tree (or not for
        :attr:`EXPLORE_AFTER` steps; one that has run none, once the
        engine's prior knows :attr:`EXPLORE_KNOWN` trees, counts as having
        run one at its start) the tree predicted to lose least
        against the plan (time lost, at the plan's tokens per second), so
        long as the steps so explored take at most :attr:`EXPLORE_SHARE` of
        the predicted time planned so far; never a tree that would make the
        step more than :attr:`EXPLORE_MAX_STEP` times a plain step (every
        request off)."""
        credit = self.EXPLORE_SHARE * self.planned_s - self.explore_s
        if credit <= 0 or sec <= 0:
            return
        r_n = len(chosen)
        plain = seconds(r_n, 0, 0)  # the step with every request off (1 token each)
        if credit < plain:
            # A tree step costs at least a plain one (the curve is
            # monotone, a tree never predicted cheaper): no tree fits the
            # credit yet, so skip the search (most steps between two).
            return
        tok = sum(c.tokens for c in chosen)
        rate = tok / sec
        q = sum(c.query for c in chosen)
        n_draft = sum(c.query > 1 for c in chosen)
        extra = sum(c.extra_s for c in chosen)
        n_ver = sum(c.draft > 0 for c in chosen)
        for k in range(r_n):
            r = (self._turn + k) % r_n
            v = views[r]
            if v.fixed is not None or not v.trees:
                continue
            acc = v.acc
            if not self.explore_due(acc):
                continue
            cur = chosen[r]
            best = None
            for o in options[r]:
                if o.kind != "tree" or (max_tree_tokens and o.nodes > max_tree_tokens):
                    continue
                s2 = seconds(q - cur.query + o.query, 1,
                             n_draft - (cur.query > 1) + (o.query > 1)) + extra - cur.extra_s \
                    + o.extra_s
                if o.draft > 0 or n_ver - (cur.draft > 0) > 0:
                    s2 += switch
                if s2 > self.EXPLORE_MAX_STEP * plain:
                    continue
                lost = (s2 - sec) - (o.tokens - cur.tokens) / rate
                if s2 <= credit and (best is None or lost < best[0]):
                    best = (lost, s2, o)
            if best is not None:
                chosen[r] = best[2]
                self.explore_s += best[1]
                self.explored += 1
                self._turn = r + 1
                return

    @staticmethod
    def _fit(chosen: list[Shape], options: list[list[Shape]], budget: int) -> list[Shape]:
        """Shrink trees until the step's tree tokens fit ``budget``: the
        tree that loses the fewest tokens per node removed goes down to the
        next best smaller shape, until it fits."""
        chosen = list(chosen)
        while sum(s.nodes for s in chosen) > budget:
            best = None
            for r, s in enumerate(chosen):
                if s.nodes == 0:
                    continue
                smaller = [o for o in options[r] if o.nodes < s.nodes]
                if not smaller:
                    smaller = [OFF]
                alt = max(smaller, key=lambda o: o.tokens)
                loss = (s.tokens - alt.tokens) / (s.nodes - alt.nodes)
                if best is None or loss < best[0]:
                    best = (loss, r, alt)
            if best is None:
                break
            chosen[best[1]] = best[2]
        return chosen
