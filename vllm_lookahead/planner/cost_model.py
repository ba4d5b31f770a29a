"""What an engine step costs, in seconds for ``tokens`` query tokens per
request: a :class:`CostCurve` measured at start-up (:mod:`vllm_lookahead.branch.warmup`,
cached by :mod:`.cost_cache`), corrected by the step times seen (:class:`CostModel`)."""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable

from vllm_lookahead.planner.fit import Plane, plane_features, plane_seconds
from vllm_lookahead.planner.machine import hardware_id, machine_busy_s  # noqa: F401 (re-export)

CACHE_VERSION = 2  # of a cache file (:mod:`.cost_cache`)
#: ``seeded``: sampled with the request's own generator
VERIFY_KINDS = ("sampled", "greedy", "seeded")
#: The start-up ladder; the first batch's first MIN_POINTS sizes are measured whatever the budget.
TOKEN_LADDER, BATCH_LADDER, MIN_POINTS = (1, 2, 4, 8, 16, 24, 32, 48, 64), (1, 2, 4, 8, 16), 4


def bucket_of(num_requests: int) -> int:
    """1, 2, 4, 8, ...: the largest power of two <= ``num_requests``."""
    return 1 << (max(int(num_requests), 1).bit_length() - 1)


@dataclass
class CostCurve:
    """``points``: step seconds, ``{batch: [(tokens, seconds), ...]}``.
    ``verify``: what vLLM's verifier adds over its plain sampler,
    ``{kind: {batch: (first, next, bonus, switch)}}`` seconds: a drafting
    request's first draft token, each next one, the bonus row a rejected draft
    saves where it is sampled lazily, and what a step pays once where any
    request drafts; rows of 2 or 3 figures are padded with 0; empty: unknown.
    """

    points: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    verify: dict[str, dict[int, tuple[float, float, float, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        points = {}
        for b, pts in self.points.items():
            pts = sorted((int(t), float(s)) for t, s in pts)
            if int(b) < 1 or not pts or any(t < 1 or not 0 < s < math.inf for t, s in pts):
                raise ValueError(f"bad cost curve points for batch {b}: {pts}")
            points[int(b)] = pts
        if not points:
            raise ValueError("a cost curve needs at least one batch size")
        self.points = dict(sorted(points.items()))
        verify = {}
        for kind, table in (self.verify or {}).items():
            if kind not in VERIFY_KINDS:
                raise ValueError(f"bad verification kind {kind!r} (want one of {VERIFY_KINDS})")
            rows = {}
            for b, row in table.items():
                vals = tuple(float(x) for x in row)
                if int(b) < 1 or len(vals) not in (2, 3, 4) or not all(0 <= x < math.inf
                                                                       for x in vals):
                    raise ValueError(f"bad verification cost for batch {b}: {row}")
                rows[int(b)] = (*vals, 0.0, 0.0)[:4]
            if rows:
                verify[kind] = dict(sorted(rows.items()))
        self.verify = verify
        # what predict reads on every call
        self._bs = list(self.points)
        self._ts = {b: [t for t, _ in pts] for b, pts in self.points.items()}

    def _at(self, batch: int, tokens: float) -> float:
        """One measured batch: piecewise linear, flat below the first point;
        past the last, the steeper of the last two points' and the range's
        slope (a curve level at its end must not price more tokens at 0)."""
        pts, ts = self.points[batch], self._ts[batch]
        if len(pts) == 1:
            t0, s0 = pts[0]
            return s0 * max(tokens, 1.0) / t0 if tokens > t0 else s0
        if tokens <= ts[0]:
            return pts[0][1]
        i = bisect.bisect_left(ts, tokens)
        if i >= len(pts):
            (t0, s0), (t1, s1) = pts[-2], pts[-1]
            mean = (s1 - pts[0][1]) / (t1 - pts[0][0])
            return s1 + max((s1 - s0) / (t1 - t0), mean, 0.0) * (tokens - t1)
        (t0, s0), (t1, s1) = pts[i - 1], pts[i]
        return s0 + max((s1 - s0) / (t1 - t0), 0.0) * (tokens - t0)

    def predict(self, batch: int, tokens: float) -> float:
        """Seconds of a step of ``batch`` requests of ``tokens`` query tokens
        each: linear in the batch between measured sizes; past the largest,
        the largest's at the same total tokens."""
        batch, tokens, bs = max(int(batch), 1), max(float(tokens), 1.0), self._bs
        if batch in self.points:
            return self._at(batch, tokens)
        if batch > bs[-1]:
            return self._at(bs[-1], tokens * batch / bs[-1])
        if batch < bs[0]:
            return self._at(bs[0], tokens)
        i = bisect.bisect_left(bs, batch)
        lo, hi = bs[i - 1], bs[i]
        f = (batch - lo) / (hi - lo)
        return (1 - f) * self._at(lo, tokens) + f * self._at(hi, tokens)

    def verify_row(self, batch: int, sampled: bool,
                   seeded: bool = False) -> tuple[float, float, float, float]:
        """:attr:`verify`'s row for a request of a ``batch``-request step
        (greedy unless ``sampled``; ``seeded``: the seeded kind where
        measured, else the sampled): linear in the batch between measured
        sizes, the nearest outside them; zeros where not measured."""
        table = self.verify.get("seeded") if seeded and sampled else None
        table = table or self.verify.get("sampled" if sampled else "greedy")
        if not table:
            return (0.0, 0.0, 0.0, 0.0)
        batch, bs = max(int(batch), 1), list(table)
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
        return {kind: {str(b): list(row) for b, row in table.items()}
                for kind, table in self.verify.items()}

    @classmethod
    def from_dict(cls, d: dict, verify: dict | None = None) -> "CostCurve":
        """The curve of :meth:`to_dict` and :meth:`verify_dict` (keys as strings)."""
        return cls(d, verify or {})

    @classmethod
    def flat(cls, seconds: float = 1.0, per_token: float = 0.0) -> "CostCurve":
        """A synthetic curve: ``seconds * (1 + per_token * (tokens - 1))``."""
        return cls({1: [(1, seconds), (64, seconds * (1 + per_token * 63))]})


def measure_curve(time_step: Callable[[int, int], float], batches=BATCH_LADDER,
                  tokens=TOKEN_LADDER, budget_s: float = 6.0, repeats: int = 3,
                  keep_going: Callable[[bool], bool] | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> CostCurve:
    """A :class:`CostCurve` from ``time_step(batch, tokens) -> seconds``, per
    point the least of ``repeats`` after a warm-up. Breadth first until
    ``budget_s`` is spent: the first batch's first :data:`MIN_POINTS` sizes
    whatever the budget, every further batch's first two, then the rest in
    turn; a batch keeps two points or none. ``keep_going(wish) -> bool``, asked
    before each point, may stop it (tensor parallel ranks: rank 0's wish)."""
    start = clock()
    batches, tokens = list(batches), list(tokens)
    got: dict[int, list[tuple[int, float]]] = {b: [] for b in batches}

    def fill(b: int, upto: int, forced: bool = False) -> bool:
        while len(got[b]) < min(upto, len(tokens)):
            wish = forced or clock() - start < budget_s
            if not (keep_going(wish) if keep_going is not None else wish):
                return False
            t = tokens[len(got[b])]
            time_step(b, t)  # warm-up
            got[b].append((t, min(time_step(b, t) for _ in range(max(repeats, 1)))))
        return True

    go = bool(batches) and fill(batches[0], MIN_POINTS, forced=True)
    for b in batches[1:]:
        go = go and fill(b, 2)
    for b in batches:
        go = go and fill(b, len(tokens))
    # each point the least measured at its size or above: other load only adds time
    lows = {b: list(accumulate((s for _, s in reversed(pts)), min))[::-1]
            for b, pts in got.items()}
    return CostCurve({b: [(t, low) for (t, _), low in zip(pts, lows[b])]
                      for b, pts in got.items() if len(pts) >= 2 or (b == batches[0] and pts)})


class CostModel:
    """A :class:`CostCurve` corrected by the steps seen, per batch bucket.

    Steps with trees: the curve (timed through the tree path) times a running
    mean of log(seen / predicted), each step's clipped to [1/2, 2]. Steps
    without (vLLM's own rows): a :class:`~.fit.Plane` fitted to the steps
    booked less the verification as measured, from the prior :meth:`plain`,
    where :meth:`learns_plain`.
    :meth:`predict` reads only the corrections :meth:`agreed` installed (tensor
    parallel ranks must plan alike) and keeps its answers until the next.
    """

    #: The plane's prior: its height's weight in steps (forgotten), its
    #: slopes' strength (held for ever); the forgetting of its slopes (its
    #: height follows at ``ema``); tree steps not booked at the start.
    PRIOR_WEIGHT, SLOPE_PRIOR, SLOPE_EMA, SKIP_FIRST = 4.0, 1.0, 0.005, 2
    #: Whether steps without trees teach the plane (``learn_step_cost``):
    #: True, False or "auto" (buckets of :attr:`AUTO_LEARN_BUCKET` or more);
    #: an assumed curve (``source`` "assumed") always learns.
    learn_plain: bool | str = True
    AUTO_LEARN_BUCKET = 8
    #: Answers :meth:`predict` and :meth:`plain` keep.
    MEMO_SIZE = 4096

    def __init__(self, curve: CostCurve, ema: float = 0.05, source: str = "measured") -> None:
        self.curve, self.ema, self.source = curve, ema, source
        self._plain: dict[tuple[int, float], float] = {}
        self._log: dict[int, float] = {}  # bucket -> log tree factor
        self._n: dict[int, int] = {}  # bucket -> tree steps seen
        self._lines: dict[int, Plane] = {}
        self._level: dict[int, float] = {}  # bucket -> recent residual of the plane
        #: agreed corrections: (bucket, True) -> tree factor, (bucket, False) -> plane
        self.factors: dict[tuple[int, bool], object] = {}
        self._memo: dict[tuple, float] = {}

    def plain(self, batch: int, tokens: float) -> float:
        """The curve's price of a step without trees: less the tree path's
        fixed jump from 1 to 2 rows, and past batch 1 a draft token never
        dearer than one more token of a one-request step of as many tokens
        (vLLM runs a step's rows as one batch of tokens)."""
        return _memo(self._plain, (batch, tokens), self._plain_of, self.MEMO_SIZE)

    def _plain_of(self, batch: int, tokens: float) -> float:
        tree_path = self._rows(batch, tokens)
        if batch <= 1 or tokens <= 1:
            return tree_path
        c1 = self.curve.predict(batch, 1)
        rows = c1 + self._rows(1, batch * tokens) - self._rows(1, batch)
        return max(min(tree_path, rows), c1)

    def _rows(self, batch: int, tokens: float) -> float:
        """The curve less the tree path's jump from 1 to 2 rows (mask, gather),
        at least its 1-token step."""
        c1, c2, c16 = (self.curve.predict(batch, t) for t in (1, 2, 16))
        if tokens <= 1:
            return c1
        jump = max(c2 - c1 - max(c16 - c2, 0.0) / 14, 0.0)
        return max(self.curve.predict(batch, tokens) - jump, c1)

    def verify(self, batch: int, sampled: bool, seeded: bool = False) -> tuple[float, float]:
        """``(first, next)`` seconds vLLM's verifier adds for a request's draft,
        as measured (not in :meth:`predict`; what a seeded draft is priced with)."""
        return self.curve.verify_row(batch, sampled, seeded)[:2]

    def bonus(self, batch: int, sampled: bool) -> float:
        """What a request's lazily sampled bonus row costs: a rejected draft saves it."""
        return self.curve.verify_row(batch, sampled)[2]

    def switch(self, batch: int, sampled: bool, seeded: bool = False) -> float:
        """What a step pays once where any of its requests drafts."""
        return self.curve.verify_row(batch, sampled, seeded)[3]

    def verify_seen(self, batch: int, sampled: bool) -> tuple[float, float]:
        """What an unseeded request's draft is priced with: :meth:`verify`."""
        return self.verify(batch, sampled)

    def predict(self, batch: int, tokens: float, tree: bool = True,
                drafting: int | None = None) -> float:
        """Seconds of a step of ``batch`` requests, ``tokens`` query tokens each
        on average, ``drafting`` of them drafting (None: all if ``tokens`` > 1)."""
        return _memo(self._memo, (batch, tokens, tree, drafting), self._predict, self.MEMO_SIZE)

    def _predict(self, batch: int, tokens: float, tree: bool, drafting: int | None) -> float:
        b = bucket_of(batch)
        line = self.factors.get((b, False))
        if tree:
            factor = self.factors.get((b, True))
            if factor is None:  # no tree step seen: as the plain steps go
                factor = line[0] / max(self.plain(b, 1), 1e-12) if line is not None else 1.0
            # never cheaper than the same step without trees
            return max(self.curve.predict(batch, tokens) * factor,
                       self._predict(batch, tokens, False, drafting))
        if line is None:
            return self.plain(batch, tokens)
        return plane_seconds(line, plane_features(batch, b, tokens, drafting))

    def observe(self, batch: int, tokens: float, seconds: float, tree: bool = True,
                drafting: int | None = None,
                verify_least: tuple[float, float] | None = None) -> None:
        """Book a step (as :meth:`predict` describes it) that took ``seconds``
        less the verification its plan counted (``verify_least`` is unused)."""
        if not 0 < seconds < math.inf:
            return
        b = bucket_of(batch)
        if not tree:
            if self.source != "assumed" and not self.learns_plain(b):
                return
            self._observe_plain(batch, b, tokens, seconds, drafting)
            return
        n = self._n[b] = self._n.get(b, 0) + 1
        if n <= self.SKIP_FIRST:
            return
        r = math.log(seconds / self.curve.predict(batch, tokens))
        r = min(max(r, -math.log(2)), math.log(2))
        w = max(1.0 / (n - self.SKIP_FIRST), self.ema)  # a plain mean at first
        self._log[b] = (1 - w) * self._log.get(b, 0.0) + w * r

    def _observe_plain(self, batch, b, tokens, seconds, drafting) -> None:
        line = self._lines.get(b)
        if line is None:
            line = self._lines[b] = Plane()
            # the prior: the curve's plain step (forgotten as steps come) and
            # its draft slopes (held for ever; a drafting request's: 0)
            line.add(plane_features(b, b, 1, None), self.plain(b, 1), self.PRIOR_WEIGHT)
            line.prior = (max(self.plain(2 * b, 1) - self.plain(b, 1), 0.0) / b,
                          (self.plain(b, 8) - self.plain(b, 1)) / (7 * b), 0.0)
            line.strength = (self.SLOPE_PRIOR * b, self.SLOPE_PRIOR * b * b, self.SLOPE_PRIOR)
        # one step moves the fit by at most a factor 2 of evidence (a step
        # that waited on a pause of the process must not drag it)
        x = plane_features(batch, b, tokens, drafting)
        pred = plane_seconds(line.fit(), x)
        level = self._level.get(b, 0.0)
        seconds = min(max(seconds, (pred + level) / 2), 2 * (pred + level))
        line.add(x, seconds, 1.0, keep=1 - self.SLOPE_EMA)
        self._level[b] = (1 - self.ema) * level + self.ema * (seconds - pred)

    def learns_plain(self, bucket: int) -> bool:
        """Whether steps without trees of ``bucket`` teach the plane."""
        if self.learn_plain == "auto":
            return bucket >= self.AUTO_LEARN_BUCKET
        return bool(self.learn_plain)

    def local_factors(self) -> dict[tuple[int, bool], object]:
        """This process's corrections, for :meth:`agreed`."""
        out: dict[tuple[int, bool], object] = {(b, True): math.exp(v) for b, v in self._log.items()}
        for b, line in self._lines.items():
            a, *slopes = line.fit()
            out[(b, False)] = (a + self._level.get(b, 0.0), *slopes)
        return out

    def agreed(self, factors: dict) -> None:
        self.factors = dict(factors)
        self._memo.clear()

    def snapshot(self) -> dict:
        """The stats' ``cost_model``: milliseconds; ``verify_ms`` rows as
        :attr:`CostCurve.verify`'s, ``plain_ms`` as the plane's ``(a, p, q, r)``."""
        corr = {f"{b}:tree" if t else f"{b}:plain_ms": round(f, 3) if t else
                [round(x * 1e3, 3) for x in f] for (b, t), f in sorted(self.factors.items())}
        return {
            "source": self.source,
            "curve_ms": {str(b): [[t, round(s * 1e3, 3)] for t, s in pts]
                         for b, pts in self.curve.points.items()},
            "verify_ms": {kind: {str(b): [round(x * 1e3, 3) for x in row]
                                 for b, row in table.items()}
                          for kind, table in self.curve.verify.items()},
            "correction": corr,
        }


def _memo(memo: dict, key: tuple, compute: Callable[..., float], size: int) -> float:
    """``compute(*key)``, kept in ``memo`` (emptied when it holds ``size``)."""
    got = memo.get(key)
    if got is None:
        if len(memo) >= size:
            memo.clear()
        got = memo[key] = compute(*key)
    return got
