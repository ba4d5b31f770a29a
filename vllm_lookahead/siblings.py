"""What a token gained by one of a parent request's n samples is worth.

vLLM answers a request with ``n`` samples when its last sample ends. A token
one sample gains moves that end only where the sample would have ended last,
and only by what it leaves the sample behind the next one; elsewhere it frees
the sample's batch slot a step earlier. Planning every sample as a request
of its own overvalues its drafts: sixteen tied samples that each draft now
and then spread apart, and the parent ends with the one that gained least.

Model (numpy and one numba-jitted kernel, no vLLM; unit-tested): sample ``i`` with ``r_i`` tokens left
to its ``max_tokens`` and a typical draft of ``K_i`` tokens each accepted
with probability ``p_i`` (accepted ``A_i``, truncated geometric: mean
``mu_i``, variance ``v_i`` a step) needs ``S_i`` more steps, normal with
mean ``r_i / (1 + mu_i)`` and variance ``r_i v_i / (1 + mu_i)**3`` (renewal
theory; at least :data:`SPREAD_FLOOR` squared: steps are whole). The parent
ends after ``max_i S_i`` steps. Sample ``j`` gaining ``a`` tokens now ends
``a / (1 + mu_j)`` steps sooner; the parent's expected end moves by
``E[max S] - E[max S']`` (computed on a grid from the normal CDFs), averaged
over ``A_j``. That share of its expected gain ends the parent sooner, worth
``end_value`` tokens of the step a parent step; the rest frees its slot,
worth ``slot_value``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

#: Smallest spread of a sample's steps to its end (steps): a sample a whole
#: token behind another ends after it; tied samples end together.
SPREAD_FLOOR = 0.3
#: Most grid points of the integral.
_MAX_POINTS = 1024
_SQRT_HALF = math.sqrt(0.5)


def accepted_pmf(p: float, k: int) -> np.ndarray:
    """P(A = a), a = 0..k, of a k-token draft whose tokens are each
    accepted with probability ``p`` given the previous ones were."""
    k = max(int(k), 1)
    p = min(max(float(p), 0.0), 1.0)
    a = np.arange(k + 1)
    pmf = p ** a * (1.0 - p)
    pmf[k] = p ** k
    return pmf


def end_shares(remaining: list[int], draws: list[tuple[float, int]]) -> list[float]:
    """Per sample of one parent, the share of its expected gain from a
    draft now that ends the parent sooner (0..1; see the module docstring).

    Args:
        remaining: per sample, tokens left to its ``max_tokens``.
        draws: per sample, ``(p, K)``: its typical draft's per-token
            acceptance and length.
    """
    return end_shares_many([(remaining, draws)])[0]


def end_shares_many(parents: list[tuple[list[int], list[tuple[float, int]]]]) -> list[list[float]]:
    """:func:`end_shares` of several parents, ``[(remaining, draws)]``, in
    one call of the jitted :func:`_end_shares_kernel` (the proposer runs
    this every step; each parent keeps its own grid)."""
    starts = np.zeros(len(parents) + 1, dtype=np.int64)
    np.cumsum([len(rem) for rem, _ in parents], out=starts[1:])
    n = int(starts[-1])
    r = np.empty(n)
    p = np.empty(n)
    k = np.empty(n, dtype=np.int64)
    i = 0
    for rem, draws in parents:
        for left, (pi, ki) in zip(rem, draws):
            r[i], p[i], k[i] = left, pi, ki
            i += 1
    out = np.zeros(n)
    if n:
        _end_shares_kernel(r, p, k, starts, out)
    flat = out.tolist()
    return [flat[starts[j]: starts[j + 1]] for j in range(len(parents))]


@njit(cache=True, nogil=True)
def _end_shares_kernel(r, p, k, starts, out):  # pragma: no cover - jitted
    """The shares of every parent (module docstring), into ``out``.

    Args:
        r: float [S] tokens each sample has left (all parents' samples in
            a row); p: float [S] its per-token acceptance; k: int [S] its
            typical draft's length.
        starts: int [P + 1] where each parent's samples start in them.
        out: float [S] each sample's share.

    Per parent a grid over the end steps (a third of the narrowest spread
    that can be last, :data:`_MAX_POINTS` at most); the parent's expected
    end moved by sample u gaining a tokens is the integral of
    ``prod_{v != u} F_v(x) * (F_u(x + a / (1 + mu_u)) - F_u(x))``, the
    normal CDFs floored at 1e-300.
    """
    n_all = r.size
    k_max = 1
    for i in range(n_all):
        k_max = max(k_max, k[i])
    pmf = np.zeros((n_all, k_max + 1))
    mu = np.zeros(n_all)
    mean = np.zeros(n_all)
    sd = np.zeros(n_all)
    for i in range(n_all):
        pi = min(max(p[i], 0.0), 1.0)
        ki = max(k[i], 1)
        m1 = 0.0
        m2 = 0.0
        for a in range(ki + 1):
            # P(A = a): p^a (1 - p) below K, p^K at K
            f = pi ** a if a == ki else pi ** a * (1.0 - pi)
            pmf[i, a] = f
            m1 += a * f
            m2 += a * a * f
        mu[i] = m1
        ri = max(r[i], 0.0)
        mean[i] = ri / (1.0 + m1)
        sd[i] = math.sqrt(max(ri * (m2 - m1 * m1) / (1.0 + m1) ** 3, 0.0) + SPREAD_FLOOR ** 2)
    for q in range(starts.size - 1):
        s0, s1 = starts[q], starts[q + 1]
        if s1 - s0 == 0:
            continue
        if s1 - s0 == 1:
            out[s0] = 1.0
            continue
        # Below lo some sample surely has not ended: the max is above it
        # with or without a shift; a sample that surely ends before lo is
        # never last.
        lo = -np.inf
        hi = -np.inf
        reach = -np.inf
        for i in range(s0, s1):
            lo = max(lo, mean[i] - 4.0 * sd[i])
            hi = max(hi, mean[i] + 4.0 * sd[i])
            reach = max(reach, max(k[i], 1) / (1.0 + mu[i]))
        hi += reach
        step = np.inf
        for i in range(s0, s1):
            if mean[i] + 4.0 * sd[i] >= lo:
                step = min(step, sd[i])
        points = int(min(max((hi - lo) / (step / 3.0), 16.0), float(_MAX_POINTS)))
        h = (hi - lo) / points
        x = np.empty(points + 1)
        for c in range(points):
            x[c] = c * h + lo
        x[points] = hi
        dx = x[1] - x[0]
        cdf = np.empty((s1 - s0, points + 1))
        log_all = np.zeros(points + 1)  # log P(every sample ended by x)
        for j in range(s1 - s0):
            i = s0 + j
            for c in range(points + 1):
                f = max(_ndtr((x[c] - mean[i]) / sd[i]), 1e-300)
                cdf[j, c] = f
                log_all[c] += math.log(f)
        for j in range(s1 - s0):
            i = s0 + j
            out[i] = 0.0
            if mean[i] + 4.0 * sd[i] < lo:
                continue
            others = np.empty(points + 1)
            for c in range(points + 1):
                others[c] = math.exp(log_all[c] - math.log(cdf[j, c]))
            steps = 0.0  # parent steps sooner, by the gain's pmf
            first = 0.0
            for a in range(1, max(k[i], 1) + 1):
                shift = a / (1.0 + mu[i])
                mass = 0.0
                for c in range(points + 1):
                    moved = max(_ndtr((x[c] + shift - mean[i]) / sd[i]), 1e-300)
                    mass += others[c] * (moved - cdf[j, c])
                if a == 1:
                    first = mass
                steps += pmf[i, a] * mass
            steps *= dx
            expect = mu[i]
            if expect <= 0.0:  # a draft that never hits: value one token
                steps = first * dx
                expect = 1.0
            out[i] = min(max(steps * (1.0 + mu[i]) / expect, 0.0), 1.0)


@njit(cache=True, nogil=True, inline="always")
def _ndtr(x):  # pragma: no cover - jitted
    """Standard normal CDF."""
    return 0.5 * math.erfc(-x * _SQRT_HALF)
