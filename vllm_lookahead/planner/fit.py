"""The plane :class:`~.cost_model.CostModel` fits, per batch bucket, to the
steps without trees: exponentially weighted least squares, each slope held
towards a prior and at 0 or more."""

from __future__ import annotations


class Plane:
    """``y = a + p*u + q*v + r*m`` (:func:`plane_features`: ``u`` requests past
    the bucket's size, ``v`` the step's draft tokens, ``m`` its drafting
    requests), fitted together so that what more requests cost is not taken
    for what their drafts cost. Each slope is held towards its ``prior`` with a
    never-forgotten ``strength``, so a feature the steps hardly vary keeps its
    prior slope."""

    K = 3
    __slots__ = ("w", "mx", "my", "cxx", "cxy", "prior", "strength")

    def __init__(self) -> None:
        # weighted sums of 1, x, y, x x^T and x y
        self.w = self.my = 0.0
        self.mx, self.cxy = [0.0] * self.K, [0.0] * self.K
        self.cxx = [[0.0] * self.K for _ in range(self.K)]
        self.prior, self.strength = [0.0] * self.K, [0.0] * self.K

    def add(self, x, y: float, weight: float = 1.0, keep: float = 1.0) -> None:
        """Book ``y`` at features ``x``, the sums so far scaled by ``keep``."""
        self.w = self.w * keep + weight
        self.my = self.my * keep + weight * y
        for i, xi in enumerate(x):
            self.mx[i] = self.mx[i] * keep + weight * xi
            self.cxy[i] = self.cxy[i] * keep + weight * xi * y
            row = self.cxx[i]
            for j in range(self.K):
                row[j] = row[j] * keep + weight * xi * x[j]

    def fit(self) -> tuple[float, ...]:
        """``(a, p, q, r)``; a slope that comes out below 0 (more rows never
        cost less) is held at 0 and the others refitted."""
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
            slopes = [0.0] * k
            for i, v in (*held.items(), *zip(free, _solve(a, b))):
                slopes[i] = v
            low = [i for i in free if slopes[i] < 0.0]
            if not low:
                return (my - sum(s * m for s, m in zip(slopes, mx)), *slopes)
            held[min(low, key=lambda i: slopes[i])] = 0.0


def plane_features(batch: int, bucket: int, tokens: float, drafting: int | None) -> tuple:
    """``(u, v, m)`` of a step of ``batch`` requests in ``bucket`` with
    ``tokens`` query tokens each on average, ``drafting`` of them drafting
    (None: all if ``tokens`` > 1)."""
    batch = max(int(batch), 1)
    draft = batch * (max(tokens, 1.0) - 1)
    if drafting is None:
        drafting = batch if draft > 0 else 0
    return (batch - bucket, draft, min(drafting, batch))


def plane_seconds(coeffs, x) -> float:
    """The plane ``coeffs = (a, p, q, r)`` at features ``x``, at least 1 us."""
    a, *slopes = coeffs
    return max(a + sum(s * v for s, v in zip(slopes, x)), 1e-6)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting; 0 for an
    unknown the equations leave free."""
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
