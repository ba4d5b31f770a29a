"""Measured cost of an engine step, by batch size and query tokens.

Whether a lookahead tree pays depends on what extra query tokens cost on the
machine at hand: on an Intel Xeon with AMX a bf16 step of 16 tokens costs
about as much as one of 1 token, on an AVX2-only EPYC it costs 4-5 times as
much, on a GPU tokens are free up to ~128. So the planner never guesses: it
asks a :class:`CostModel`, built from

* a :class:`CostCurve` measured when the engine starts (the real model's
  step, in the shape a lookahead step has: a few query tokens per request
  over a cached prefix), cached on disk by :class:`~.cost_cache.CostCache`
  under a key of model, dtype, parallel sizes, hardware and vLLM version,
  so a restart reuses it; and
* a running correction from the step times the engine actually sees
  (:meth:`CostModel.observe`), per batch bucket.

Pure Python (no torch, no vLLM): the clock and the forward are the caller's
(:func:`measure_curve` takes a ``time_step(batch, tokens)`` callback).

Units: seconds per engine step; ``tokens`` is query tokens *per request*
(1 for a vanilla decoding step, ``1 + draft + tree`` for a lookahead step).
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from vllm_lookahead.planner.fit import Plane, plane_features, plane_seconds
# Re-exported for callers that take them from here (demo.py, benchmarks/).
from vllm_lookahead.planner.machine import hardware_id, machine_busy_s  # noqa: F401

#: Format version of the cache files (a :meth:`CostCurve.to_dict` with its
#: key and its :meth:`CostCurve.verify_dict`, :mod:`.cost_cache`); a file of
#: another version is ignored (version 1, without the verification costs,
#: is read as a curve without them).
CACHE_VERSION = 2
#: The kinds of request whose verification :attr:`CostCurve.verify` times
#: (``seeded``: sampled with a request's own ``torch.Generator``, which
#: vLLM's samplers draw from row by row).
VERIFY_KINDS = ("sampled", "greedy", "seeded")
#: Query tokens per request the engine-start ladder measures.
TOKEN_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64)
#: Batch buckets the ladder measures (cut to the engine's max_num_seqs).
BATCH_LADDER = (1, 2, 4, 8, 16)
#: Points of the first batch measured whatever the budget (1, 2, 4, 8 tokens).
MIN_POINTS = 4


def bucket_of(num_requests: int) -> int:
    """1, 2, 4, 8, ...: the largest power of two <= ``num_requests``."""
    return 1 << (max(int(num_requests), 1).bit_length() - 1)


@dataclass
class CostCurve:
    """Step seconds measured per batch bucket at a ladder of query tokens
    per request, and what vLLM's verifier adds for a request's draft.

    Attributes:
        points: ``{batch: [(tokens_per_request, seconds), ...]}``, tokens
            ascending, at least one point per batch.
        verify: ``{"sampled" | "greedy": {batch: (first_s, next_s)}}``: the
            seconds vLLM's rejection sampler adds to a step of ``batch``
            such requests over its plain sampler when one of them drafts
            one token (``first_s``), and per further draft token of that
            request (``next_s``) -- the sampler's work only (logits rows,
            top-p, recovered tokens), not the forward's, which ``points``
            time -- and ``bonus_s``, what the request's bonus row costs
            where a lazy verifier samples it only after a wholly accepted
            draft (patch 15's ``lazy_bonus``; ``first_s`` counts it, a
            draft rejected anywhere saves it; 0 where nothing skips it, or
            in a file without it), and ``switch_s``, what a step pays once
            where any of its requests drafts (vLLM's rejection sampler in
            place of its plain sampler) beyond what each drafting request
            adds: ``first_s`` is then each drafting request's own first
            token (0 in a file without it, whose ``first_s`` counts both,
            and at batch 1, where the two are one):
            ``{kind: {batch: (first_s, next_s, bonus_s, switch_s)}}``.
            Empty: not measured (the planner then counts nothing for it,
            and the steps seen teach it as they can).
    """

    points: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    verify: dict[str, dict[int, tuple[float, float, float, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clean = {}
        for b, pts in self.points.items():
            pts = sorted((int(t), float(s)) for t, s in pts)
            if int(b) < 1 or not pts or any(t < 1 or not s > 0 or not math.isfinite(s)
                                            for t, s in pts):
                raise ValueError(f"bad cost curve points for batch {b}: {pts}")
            clean[int(b)] = pts
        if not clean:
            raise ValueError("a cost curve needs at least one batch size")
        self.points = dict(sorted(clean.items()))
        verify = {}
        for kind, table in (self.verify or {}).items():
            if kind not in VERIFY_KINDS:
                raise ValueError(f"bad verification kind {kind!r} (want one of {VERIFY_KINDS})")
            rows = {}
            for b, pair in table.items():
                vals = tuple(float(x) for x in pair)
                if (int(b) < 1 or len(vals) not in (2, 3, 4)
                        or not all(x >= 0 and math.isfinite(x) for x in vals)):
                    raise ValueError(f"bad verification cost for batch {b}: {pair}")
                rows[int(b)] = (*vals, 0.0, 0.0)[:4]
            if rows:
                verify[kind] = dict(sorted(rows.items()))
        self.verify = verify
        self._index()

    def _index(self) -> None:
        """What :meth:`predict` reads on every call, taken once (the points
        never change after construction): the batches, ascending, and each
        batch's token ladder."""
        self._bs = list(self.points)
        self._ts = {b: [t for t, _ in pts] for b, pts in self.points.items()}

    def __setstate__(self, state: dict) -> None:
        # a curve pickled before these were kept (a recording of planner
        # calls, benchmarks/planner_replay.py) gets them
        self.__dict__.update(state)
        self._index()

    @property
    def batches(self) -> list[int]:
        return list(self._bs)

    def _at(self, batch: int, tokens: float) -> float:
        """Piecewise-linear in tokens for one measured batch; linear
        extrapolation past the last point, flat below the first. Past the
        last point the slope is the last two points' or the whole range's
        average, whichever is steeper: a curve whose last points came out
        level (noise, a measurement under load) must not price every token
        past its end at nothing."""
        pts = self.points[batch]
        ts = self._ts[batch]
        if tokens <= ts[0] or len(pts) == 1:
            if len(pts) == 1:
                t0, s0 = pts[0]
                return s0 * max(tokens, 1.0) / t0 if tokens > t0 else s0
            return pts[0][1]
        i = bisect.bisect_left(ts, tokens)
        if i >= len(pts):
            (t0, s0), (t1, s1) = pts[-2], pts[-1]
            mean = (s1 - pts[0][1]) / (t1 - pts[0][0])
            slope = max((s1 - s0) / (t1 - t0), mean, 0.0)
            return s1 + slope * (tokens - t1)
        (t0, s0), (t1, s1) = pts[i - 1], pts[i]
        return s0 + max((s1 - s0) / (t1 - t0), 0.0) * (tokens - t0)

    def predict(self, batch: int, tokens: float) -> float:
        """Seconds of a step of ``batch`` requests with ``tokens`` query
        tokens each (on average). Between measured batch sizes: linear in
        the batch size; past the largest: the largest's curve at the same
        total number of tokens."""
        batch = max(int(batch), 1)
        tokens = max(float(tokens), 1.0)
        bs = self._bs
        if batch in self.points:
            return self._at(batch, tokens)
        if batch > bs[-1]:
            top = bs[-1]
            return self._at(top, tokens * batch / top)
        if batch < bs[0]:
            return self._at(bs[0], tokens)
        i = bisect.bisect_left(bs, batch)
        lo, hi = bs[i - 1], bs[i]
        f = (batch - lo) / (hi - lo)
        return (1 - f) * self._at(lo, tokens) + f * self._at(hi, tokens)

    def verify_at(self, batch: int, sampled: bool, seeded: bool = False) -> tuple[float, float]:
        """``(first_s, next_s)`` of :attr:`verify` for a request of a
        ``batch``-request step (``sampled``: a sampled request, else a
        greedy one; ``seeded``: a sampled one with its own generator, where
        measured, else as ``sampled``): linear in the batch size between
        measured sizes, the nearest measured size outside them; ``(0, 0)``
        if not measured."""
        first, nxt, _, _ = self._verify_row(batch, sampled, seeded)
        return first, nxt

    def bonus_at(self, batch: int, sampled: bool) -> float:
        """``bonus_s`` of :attr:`verify` (as :meth:`verify_at`): what a
        draft rejected anywhere saves of ``first_s`` where the verifier
        samples bonus rows lazily; 0 if not measured."""
        return self._verify_row(batch, sampled)[2]

    def switch_at(self, batch: int, sampled: bool, seeded: bool = False) -> float:
        """``switch_s`` of :attr:`verify` (as :meth:`verify_at`): what a
        ``batch``-request step pays once where any request drafts; 0 if not
        measured."""
        return self._verify_row(batch, sampled, seeded)[3]

    def _verify_row(self, batch: int, sampled: bool,
                    seeded: bool = False) -> tuple[float, float, float, float]:
        table = None
        if seeded and sampled:
            table = self.verify.get("seeded")
        if not table:
            table = self.verify.get("sampled" if sampled else "greedy")
        if not table:
            return (0.0, 0.0, 0.0, 0.0)
        batch = max(int(batch), 1)
        bs = list(table)
        if batch <= bs[0]:
            return table[bs[0]]
        if batch >= bs[-1]:
            return table[bs[-1]]
        i = bisect.bisect_left(bs, batch)
        lo, hi = bs[i - 1], bs[i]
        f = (batch - lo) / (hi - lo)
        return tuple((1 - f) * a + f * b for a, b in zip(table[lo], table[hi]))

    def to_dict(self) -> dict:
        return {str(b): [[t, s] for t, s in pts] for b, pts in self.points.items()}

    def verify_dict(self) -> dict:
        """:attr:`verify` as JSON keeps it (:meth:`from_dict`'s ``verify``)."""
        return {kind: {str(b): list(pair) for b, pair in table.items()}
                for kind, table in self.verify.items()}

    @classmethod
    def from_dict(cls, d: dict, verify: dict | None = None) -> "CostCurve":
        return cls({int(b): [(int(t), float(s)) for t, s in pts] for b, pts in d.items()},
                   {kind: {int(b): tuple(pair) for b, pair in table.items()}
                    for kind, table in (verify or {}).items()})

    @classmethod
    def flat(cls, seconds: float = 1.0, per_token: float = 0.0) -> "CostCurve":
        """A synthetic curve: ``seconds * (1 + per_token * (tokens - 1))``."""
        return cls({1: [(1, seconds), (64, seconds * (1 + per_token * 63))]})


def monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """A step never gets cheaper with more tokens: each point becomes the
    least cost measured at its size or above (noise -- another process on
    the cores -- only ever adds time)."""
    out, low = [], math.inf
    for t, s in reversed(points):
        low = min(low, s)
        out.append((t, low))
    return out[::-1]


def measure_curve(
    time_step: Callable[[int, int], float],
    batches=BATCH_LADDER,
    tokens=TOKEN_LADDER,
    budget_s: float = 8.0,
    repeats: int = 3,
    keep_going: Callable[[bool], bool] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> CostCurve:
    """Measure a :class:`CostCurve` with ``time_step(batch, tokens)`` (one
    step's seconds), the least of ``repeats`` runs per point (other load
    only ever adds time) after one warm-up run.

    Breadth first, then deep, until ``budget_s`` is spent: the first batch's
    first :data:`MIN_POINTS` sizes (whatever the budget: one point tells
    nothing of what a draft token costs; extrapolated from one point, each
    token costs a whole step, and no draft ever runs to show otherwise),
    then every further batch's first two sizes (what a request and its
    first draft token cost at that batch: the planner's question at every
    batch size, which a queue or n samples fill), then each batch's further
    sizes in turn (trees, long drafts). Unmeasured points are extrapolated
    by :meth:`CostCurve.predict`. A batch keeps its points only if it got
    at least two.

    ``keep_going(local_wish) -> bool`` decides, before each point, whether
    to go on (tensor parallel ranks must run the same forwards: the proposer
    passes a broadcast of rank 0's wish); once it says no, nothing more is
    measured.
    """
    start = clock()
    batches, tokens = list(batches), list(tokens)
    got: dict[int, list[tuple[int, float]]] = {b: [] for b in batches}

    def point(b: int, forced: bool) -> bool:
        """Measure batch ``b``'s next size; False: stop the ladder."""
        wish = forced or clock() - start < budget_s
        go = keep_going(wish) if keep_going is not None else wish
        if not go:
            return False
        t = tokens[len(got[b])]
        time_step(b, t)  # warm-up
        got[b].append((t, min(time_step(b, t) for _ in range(max(repeats, 1)))))
        return True

    def fill(b: int, upto: int, forced: bool = False) -> bool:
        while len(got[b]) < min(upto, len(tokens)):
            if not point(b, forced):
                return False
        return True

    go = bool(batches) and fill(batches[0], MIN_POINTS, forced=True)
    for b in batches[1:]:
        go = go and fill(b, 2)
    for b in batches:
        go = go and fill(b, len(tokens))
    points = {b: monotone(pts) for b, pts in got.items()
              if len(pts) >= 2 or (b == batches[0] and pts)}
    return CostCurve(points)


class CostModel:
    """A :class:`CostCurve` plus what the step times seen teach, per batch
    bucket and kind of step.

    * Steps **with trees**: the curve (measured through the tree-attention
      path, which such steps run), times a running correction factor
      (before any tree step of the batch bucket: the plain plane's height
      over the curve's, see below): the
      exponentially weighted mean of log(seen / predicted), each step's
      ratio clipped to ``[1/2, 2]``, the first :data:`SKIP_FIRST` steps of
      an engine left out.
    * Steps **without trees** (vLLM's rows only: the newest token and a
      draft, through vLLM's own attention): per batch bucket ``b``, a plane
      ``a + p * (requests - b) + q * draft_tokens + r * drafting``
      (``draft_tokens``: the whole step's, ``requests * (tokens - 1)``;
      ``drafting``: requests with a draft) fitted to the step times seen
      (weighted least squares with forgetting), starting from the curve
      less its fixed jump from 1 to 2 rows, its draft tokens priced at most
      as one more token of a one-request step of as many tokens
      (:meth:`plain`), as a prior.
      ``q`` and ``r`` matter: they are what a draft costs, which the
      tree-path curve does not tell; ``q`` moves off the curve's only as
      far as steps with different drafts show (an engine that drafts
      little keeps the curve's), apart from what more requests cost (a
      queue that keeps a batch full runs steps of 9-15 requests in bucket
      8, drafting less per request the more there are) and from what a
      request's first draft token costs beyond the next ones (``r``).
      The steps are booked less the verification as measured
      (:meth:`verify`, timed apart at start-up, which can overstate what it
      adds inside a real step several times: at batch 1 on a Zen 4 in
      bfloat16, 0.6 ms a sampled next token timed apart, 0.14 ms in the
      steps, forward included), so ``q`` and ``r`` may come out below 0,
      down to the negated verification of the cheapest kind of draft in
      the bucket's steps (a step's least, averaged over the steps the plane
      remembers). That part comes off the verification
      (:meth:`verify_seen`, each kind's never below nothing), not off the
      forward: :meth:`predict` reads such slopes as 0. The slopes are fitted over
      about ``1 / SLOPE_EMA`` steps (a draft's cost is the machine's, and
      its estimate from a few steps scatters: at batch 1, ten drafting
      steps leave ``q`` and ``r`` uncertain by more than they are), the
      height follows the last ``1 / ema`` or so.

    With tensor parallelism every rank must plan alike: :meth:`agreed`
    installs the corrections all ranks use (the proposer broadcasts rank 0's
    every ``agree_every`` steps), and :meth:`predict` reads only those.
    """

    #: Pseudo-observations the curve's plain plane counts for (forgotten
    #: as steps are seen).
    PRIOR_WEIGHT = 4.0
    #: How strongly the plain plane's slopes are held to their priors,
    #: never forgotten, in weight times squared units: for the draft
    #: tokens' slope times the bucket's size squared (one step with a draft
    #: one token per request longer than the others counts as much), for
    #: the requests' times the bucket's size (a queue moves the batch size
    #: within a bucket all the time, and a curve measured under load may
    #: tell little of it), for the drafting requests' once (its prior, 0,
    #: is no measurement: the steps seen decide).
    SLOPE_PRIOR = 1.0
    #: Steps with trees not booked at the start of an engine (one-time costs).
    SKIP_FIRST = 2
    #: The forgetting of the plain plane's fit (its slopes); its height
    #: follows faster, at ``ema`` (an offset of the last steps' residuals).
    SLOPE_EMA = 0.005
    #: Whether steps without trees are booked (the plain plane learnt);
    #: False: they are priced from the curve (:meth:`plain`) and the
    #: verification as measured, whatever the steps show
    #: (``LookaheadConfig.learn_step_cost``; ``"auto"`` by default in an
    #: engine)
    #: -- unless the curve was assumed (``source`` "assumed": nothing
    #: measured, the steps are all that sets its scale). ``"auto"``: only
    #: in buckets of :attr:`AUTO_LEARN_BUCKET` requests or more
    #: (:meth:`learns_plain`).
    learn_plain: bool | str = True
    #: The smallest bucket whose plain steps ``learn_plain = "auto"``
    #: learns from. In a step of that many requests many of them draft, so
    #: the steps spread in draft tokens and drafting requests and the
    #: plane's slopes are fitted from every step; in a step of a few, a
    #: handful of slow drafting steps set them (at 4 requests on the AMX
    #: Xeon they moved several times over from run to run, stop 51). And
    #: there the start-up price comes out short: what vLLM's CPU attention
    #: pays per request with more than one query token, which the curve's
    #: tree-path steps and batch-1 rows (:meth:`plain`) do not show, grows
    #: with the requests that draft (paired at 16 samples: learnt better in
    #: all six rows on the AMX Xeon, stop 52, and in all six of three runs
    #: on the Zen 5, stop 53; at 4 the start-up price read better on the
    #: Xeon, stops 51-52, and on the Zen 5, -4.9 and -3.9% learnt, stop 53;
    #: at 8, on the Zen 5, +0.3 and +1.4% learnt).
    AUTO_LEARN_BUCKET = 8

    def __init__(self, curve: CostCurve, ema: float = 0.05, source: str = "measured") -> None:
        self.curve = curve
        #: batch -> (the curve's one-token step, its jump from 1 to 2 rows):
        #: :meth:`_rows`' constants of the (never changing) curve
        self._jumps: dict[int, tuple[float, float]] = {}
        #: (batch, tokens) -> :meth:`plain`
        self._plain: dict[tuple[int, float], float] = {}
        self.ema = ema
        self.source = source
        self._log: dict[int, float] = {}  # steps with trees: bucket -> log factor
        self._n: dict[int, int] = {}
        self._lines: dict[int, Plane] = {}  # steps without trees: bucket -> fit
        self._level: dict[int, float] = {}  # bucket -> recent residual of the fit
        #: bucket -> the least (first, next) verification of a drafting
        #: request's kind in the steps booked, their running mean over the
        #: steps the plane remembers (the planes' slope floors)
        self._least: dict[int, tuple[float, float]] = {}
        #: agreed corrections, used by predict: (bucket, True) -> factor,
        #: (bucket, False) -> (a, p, q, r) of the plain plane.
        self.factors: dict[tuple[int, bool], object] = {}
        #: predict's answers since the last :meth:`agreed` (they depend on
        #: the curve and the agreed corrections only; the planner asks the
        #: same few questions for every request of every step).
        self._memo: dict[tuple[int, float, bool], float] = {}
        #: :meth:`agreed` calls so far (what the planner keeps of the
        #: model's answers is kept for one generation)
        self.generation = 0

    def __setstate__(self, state: dict) -> None:
        # a model pickled before a cache was added to it (a recording of
        # planner calls, benchmarks/planner_replay.py) gets it empty
        self.__dict__.update(state)
        self.__dict__.setdefault("_jumps", {})
        self.__dict__.setdefault("_plain", {})

    def plain(self, batch: int, tokens: float) -> float:
        """Curve seconds of a step without trees (see the class doc): the
        curve less its fixed jump from 1 to 2 rows, and never more per
        draft token than a one-request step of as many query tokens pays
        for one more (:meth:`_rows`). The curve's alone, so kept for good
        (bounded: :attr:`MEMO_SIZE`)."""
        key = (batch, tokens)
        got = self._plain.get(key)
        if got is None:
            if len(self._plain) >= self.MEMO_SIZE:
                self._plain.clear()
            got = self._plain[key] = self._plain_of(batch, tokens)
        return got

    def _plain_of(self, batch: int, tokens: float) -> float:
        tree_path = self._rows(batch, tokens)
        if batch <= 1 or tokens <= 1:
            return tree_path
        # vLLM runs a step's rows as one batch of tokens: a draft token
        # costs its linear layers what one more token of a step of as many
        # tokens costs, whichever requests they belong to. The curve's
        # steps of several requests go through the tree-attention path,
        # whose cost per request (several times a plain row's per token at
        # 16 requests on a 2-core Xeon) vLLM's rows do not pay; read as a
        # draft's price there, it kept drafts off at 16 sampled sequences,
        # where they paid (and a plane that sees no drafts never learns
        # their slope).
        c1 = self.curve.predict(batch, 1)
        rows = c1 + self._rows(1, batch * tokens) - self._rows(1, batch)
        return max(min(tree_path, rows), c1)

    def _rows(self, batch: int, tokens: float) -> float:
        """The curve at ``batch`` requests of ``tokens`` query tokens, less
        its fixed jump from 1 to 2 rows (the tree path's mask and
        gather), at least its one-token step."""
        got = self._jumps.get(batch)
        if got is None:
            c1 = self.curve.predict(batch, 1)
            c2, c16 = self.curve.predict(batch, 2), self.curve.predict(batch, 16)
            slope = max(c16 - c2, 0.0) / 14
            got = self._jumps[batch] = (c1, max(c2 - c1 - slope, 0.0))
        c1, jump = got
        if tokens <= 1:
            return c1
        return max(self.curve.predict(batch, tokens) - jump, c1)

    def verify(self, batch: int, sampled: bool, seeded: bool = False) -> tuple[float, float]:
        """What vLLM's verifier adds for one request's draft in a step of
        ``batch`` requests, ``(first token's seconds, each next one's)``, as
        measured with the curve (:meth:`CostCurve.verify_at`; ``seeded``: a
        sampled request with its own generator, where measured). It is not in
        :meth:`predict`: the planner counts it per request (a sampled
        request's draft costs far more to verify than a greedy one's), and
        the steps booked with :meth:`observe` have it taken out. Nothing
        timed while the engine runs moves it (a seeded request's draft is
        priced with it); :meth:`verify_seen` is what the steps taught."""
        return self.curve.verify_at(batch, sampled, seeded)

    def bonus(self, batch: int, sampled: bool) -> float:
        """What a request's bonus row costs in a ``batch``-request step
        where the verifier samples it only after a wholly accepted draft
        (:meth:`CostCurve.bonus_at`, measured with the curve; nothing timed
        while the engine runs moves it): a draft rejected anywhere saves
        it, so a sampled draft's verification may cost less than nothing
        (on the CPU, where vLLM's plain top-p sorts the vocabulary and a
        draft row's top-p does not, patch 15)."""
        return self.curve.bonus_at(batch, sampled)

    def switch(self, batch: int, sampled: bool, seeded: bool = False) -> float:
        """What a ``batch``-request step pays once where any request drafts
        (:meth:`CostCurve.switch_at`, measured with the curve): vLLM's
        rejection sampler's own cost over its plain sampler's, beyond each
        drafting request's first token (:meth:`verify`). Like it, taken
        out of the steps booked."""
        return self.curve.switch_at(batch, sampled, seeded)

    def verify_seen(self, batch: int, sampled: bool) -> tuple[float, float]:
        """:meth:`verify` as the steps corrected it, ``(first, next)``
        seconds: what the planner prices an unseeded request's draft with.
        Where the plain plane's draft slopes came out below 0 (they may,
        down to the negated verification of the cheapest kind of draft in
        the steps, see the class doc), that part is taken off the
        verification here, never below nothing, and :meth:`predict` reads
        the slopes as 0: a forward never gets cheaper for more query tokens
        (a step with a tree and no draft, which has no verification to
        undo, must not look cheaper than a plain one), while a draft's
        price, forward plus verification, is the plane's."""
        first, nxt = self.verify(batch, sampled)
        line = self.factors.get((bucket_of(batch), False))
        if line is None:
            return first, nxt
        _, _, q, r = line
        q, r = min(q, 0.0), min(r, 0.0)  # the part of the slopes below 0
        return max(first + q + r, 0.0), max(nxt + q, 0.0)

    #: Answers :meth:`predict` keeps between two agreements.
    MEMO_SIZE = 4096

    def predict(self, batch: int, tokens: float, tree: bool = True,
                drafting: int | None = None) -> float:
        """Seconds of a step of ``batch`` requests with ``tokens`` query
        tokens each on average, ``tree``: with lookahead trees in it,
        ``drafting`` of the requests with more than one query token (None:
        all of them if ``tokens`` > 1, else none)."""
        key = (batch, tokens, tree, drafting)
        s = self._memo.get(key)
        if s is None:
            if len(self._memo) >= self.MEMO_SIZE:
                self._memo.clear()
            s = self._memo[key] = self._predict(batch, tokens, tree, drafting)
        return s

    def _predict(self, batch: int, tokens: float, tree: bool, drafting: int | None) -> float:
        b = bucket_of(batch)
        if tree:
            factor = self.factors.get((b, True))
            if factor is None:
                # No tree step seen in this bucket: a machine that runs
                # plain steps slower (faster) than the curve says runs trees
                # so too.
                line = self.factors.get((b, False))
                factor = line[0] / max(self.plain(b, 1), 1e-12) if line is not None else 1.0
            # A step with trees does all a step without them does, and more:
            # never predicted cheaper (the two corrections learn apart).
            return max(self.curve.predict(batch, tokens) * factor,
                       self._predict(batch, tokens, False, drafting))
        line = self.factors.get((b, False))
        if line is None:
            return self.plain(batch, tokens)
        a, p, q, r = line  # slopes below 0 are verify_seen's
        return plane_seconds((a, p, max(q, 0.0), max(r, 0.0)),
                             plane_features(batch, b, tokens, drafting))

    def observe(self, batch: int, tokens: float, seconds: float, tree: bool = True,
                drafting: int | None = None,
                verify_least: tuple[float, float] | None = None) -> None:
        """A step of ``batch`` requests, ``tokens`` query tokens each on
        average, ``tree``: with trees, ``drafting``: requests with more than
        one query token (as :meth:`predict`), took ``seconds`` (less the
        verification counted for its drafts, ``verify_least``: the least
        ``(first, next)`` of :meth:`verify` among its drafting requests'
        kinds; None: none counted)."""
        if not seconds > 0 or not math.isfinite(seconds):
            return
        b = bucket_of(batch)
        if not tree and self.source != "assumed" and not self.learns_plain(b):
            return
        if not tree:
            line = self._lines.get(b)
            if line is None:
                line = self._lines[b] = Plane()
                # the prior: the curve's plain step (its height; forgotten
                # as steps are seen) ...
                line.add(plane_features(b, b, 1, None), self.plain(b, 1), self.PRIOR_WEIGHT)
                # ... and what a draft token costs: the curve's (held, never
                # forgotten: pseudo-steps with drafts, forgotten slowly as
                # the slopes are, would hold the slope against steps that
                # drafted nothing); a drafting request
                # (its first draft token's extra): nothing, until seen
                line.set_slope_prior(
                    (max(self.plain(2 * b, 1) - self.plain(b, 1), 0.0) / b,
                     (self.plain(b, 8) - self.plain(b, 1)) / (7 * b), 0.0),
                    (self.SLOPE_PRIOR * b, self.SLOPE_PRIOR * b * b, self.SLOPE_PRIOR))
            if verify_least is not None:
                # the verification taken out of the steps the plane
                # remembers (forgotten as they are: a greedy warm-up must not
                # hold a sampled engine's floors up for good)
                old = self._least.get(b)
                e = self.SLOPE_EMA
                first, nxt = self._least[b] = verify_least if old is None else (
                    (1 - e) * old[0] + e * verify_least[0], (1 - e) * old[1] + e * verify_least[1])
                # a draft token's slope may undo it, no more (see the class
                # doc; verify_seen keeps each kind's price at 0 or more)
                line.set_floors((0.0, -nxt, min(nxt - first, 0.0)))
            # One step moves the fit by at most a factor 2 of evidence over
            # the plane's own prediction: a step that waited (a pause of the
            # process between two steps) must not drag it (least squares
            # follows outliers); a real change gets there in a few steps.
            x = plane_features(batch, b, tokens, drafting)
            pred = plane_seconds(line.fit(), x)
            level = self._level.get(b, 0.0)
            seconds = min(max(seconds, (pred + level) / 2), 2 * (pred + level))
            line.add(x, seconds, 1.0, keep=1 - self.SLOPE_EMA)
            self._level[b] = (1 - self.ema) * level + self.ema * (seconds - pred)
            return
        n = self._n.get(b, 0)
        self._n[b] = n + 1
        if n < self.SKIP_FIRST:
            return  # the first tree steps of an engine carry one-time costs
        # one step moves the factor by at most a factor 2 of evidence
        r = math.log(seconds / self.curve.predict(batch, tokens))
        r = min(max(r, -math.log(2)), math.log(2))
        # A plain mean for the first few, then exponential forgetting.
        w = max(1.0 / (n - self.SKIP_FIRST + 1), self.ema)
        self._log[b] = (1 - w) * self._log.get(b, 0.0) + w * r

    def learns_plain(self, bucket: int) -> bool:
        """Whether the steps without trees of ``bucket`` requests correct
        the price of a draft (:attr:`learn_plain`, the curve assumed or
        not aside)."""
        if self.learn_plain == "auto":
            return bucket >= self.AUTO_LEARN_BUCKET
        return bool(self.learn_plain)

    def local_factors(self) -> dict[tuple[int, bool], object]:
        out: dict[tuple[int, bool], object] = {(b, True): math.exp(v) for b, v in self._log.items()}
        for b, line in self._lines.items():
            a, *slopes = line.fit()
            out[(b, False)] = (a + self._level.get(b, 0.0), *slopes)
        return out

    def agreed(self, factors: dict) -> None:
        self.factors = dict(factors)
        self._memo.clear()
        self.generation += 1

    def snapshot(self) -> dict:
        corr = {}
        for (b, t), f in sorted(self.factors.items()):
            if t:
                corr[f"{b}:tree"] = round(f, 3)
            else:
                # [a, per request past the bucket's size, per draft
                # token, per drafting request]
                corr[f"{b}:plain_ms"] = [round(x * 1e3, 3) for x in f]
        return {
            "source": self.source,
            "curve_ms": {str(b): [[t, round(s * 1e3, 3)] for t, s in pts]
                         for b, pts in self.curve.points.items()},
            # per kind and batch: [first draft token, each next one, the
            # bonus row a rejected draft saves, what a step pays once where
            # any request drafts]
            "verify_ms": {kind: {str(b): [round(x * 1e3, 3) for x in pair]
                                 for b, pair in table.items()}
                          for kind, table in self.curve.verify.items()},
            "correction": corr,
        }
