"""A cost model's fit of steps without trees: exponentially weighted
least squares of a plane with slopes held to priors
(:class:`~vllm_lookahead.planner.cost_model.CostModel` keeps one per batch bucket).

Pure Python (no numpy): a few unknowns, fitted once per step.
"""

from __future__ import annotations


class Plane:
    """Exponentially weighted least squares of ``y = a + p*u + q*v + r*m``
    (``u``: requests past the batch bucket's size, ``v``: the step's draft
    tokens, all requests together, ``m``: requests with a draft), each
    slope held towards a prior slope that is never forgotten
    (:meth:`set_slope_prior`: ``strength`` in weight times squared units):
    where the steps seen hardly vary in a feature (an engine that drafts
    little), they set the plane's height and leave that slope at its prior.

    Fitting them at once keeps them apart where they move together: fed
    from a queue, a step of more requests carries fewer draft tokens each
    (a fit in tokens per request alone took the extra requests' cost for
    the drafts' saving and priced drafts at nothing); and the first draft
    token of a request costs more than the next ones (on an AVX2 EPYC in
    float32, 4 requests with 1 draft token each cost a third more than 1
    request with 4).
    """

    K = 3  # slopes
    __slots__ = ("w", "mx", "my", "cxx", "cxy", "prior", "strength", "floor")

    def __init__(self) -> None:
        # weighted sums: w; x (per feature); y; x x^T; x y
        self.w = self.my = 0.0
        self.mx = [0.0] * self.K
        self.cxx = [[0.0] * self.K for _ in range(self.K)]
        self.cxy = [0.0] * self.K
        self.prior = [0.0] * self.K
        self.strength = [0.0] * self.K
        #: the least each slope may be (:meth:`fit`)
        self.floor = [0.0] * self.K

    def set_slope_prior(self, slopes, strengths) -> None:
        self.prior, self.strength = list(slopes), list(strengths)

    def set_floors(self, floors) -> None:
        """The least each slope may be (0 unless set: more rows never cost
        less; below 0 where the step times booked have a cost taken out
        that may be overstated, see
        :class:`~vllm_lookahead.planner.cost_model.CostModel`)."""
        self.floor = [min(float(f), 0.0) for f in floors]

    def add(self, x, y: float, weight: float = 1.0, keep: float = 1.0) -> None:
        k = self.K
        self.w = self.w * keep + weight
        self.my = self.my * keep + weight * y
        for i in range(k):
            xi = x[i]
            self.mx[i] = self.mx[i] * keep + weight * xi
            self.cxy[i] = self.cxy[i] * keep + weight * xi * y
            row = self.cxx[i]
            for j in range(k):
                row[j] = row[j] * keep + weight * xi * x[j]

    def fit(self) -> tuple[float, ...]:
        """``(a, p, q, r)``; no slope below its floor (0 unless
        :meth:`set_floors`: more rows never cost less): a slope that comes
        out below is held at its floor and the rest refitted."""
        k, w = self.K, self.w
        mx = [v / w for v in self.mx]
        my = self.my / w
        cov = [[self.cxx[i][j] - w * mx[i] * mx[j] for j in range(k)] for i in range(k)]
        cy = [self.cxy[i] - w * mx[i] * my for i in range(k)]
        held: dict[int, float] = {}
        while True:
            free = [i for i in range(k) if i not in held]
            a = [[cov[i][j] + (self.strength[i] if i == j else 0.0) for j in free] for i in free]
            b = [cy[i] - sum(cov[i][j] * f for j, f in held.items())
                 + self.strength[i] * self.prior[i] for i in free]
            sol = _solve(a, b) if free else []
            slopes = [0.0] * k
            for i, f in held.items():
                slopes[i] = f
            for i, v in zip(free, sol):
                slopes[i] = v
            low = [i for i in free if slopes[i] < self.floor[i]]
            if not low:
                break
            i = min(low, key=lambda i: slopes[i] - self.floor[i])
            held[i] = self.floor[i]
        return (my - sum(s * m for s, m in zip(slopes, mx)), *slopes)


def plane_features(batch: int, bucket: int, tokens: float, drafting: int | None) -> tuple:
    """:class:`Plane`'s ``(u, v, m)`` of a step of ``batch`` requests in
    batch bucket ``bucket`` (the rest as
    :meth:`~vllm_lookahead.planner.cost_model.CostModel.predict` takes them)."""
    batch = max(int(batch), 1)
    draft = batch * (max(tokens, 1.0) - 1)
    if drafting is None:
        drafting = batch if draft > 0 else 0
    return (batch - bucket, draft, min(drafting, batch))


def plane_seconds(coeffs, x) -> float:
    """A fitted plane's seconds (``coeffs``: :meth:`Plane.fit`'s ``(a, p,
    q, r)``) at features ``x`` (:func:`plane_features`), at least 1 us."""
    a, *slopes = coeffs
    return max(a + sum(s * v for s, v in zip(slopes, x)), 1e-6)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting (a few
    unknowns); 0 for an unknown the equations leave free."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-18:
            continue
        for r in range(n):
            if r != c and m[r][c]:
                f = m[r][c] / m[c][c]
                for j in range(c, n + 1):
                    m[r][j] -= f * m[c][j]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-18 else 0.0 for i in range(n)]
