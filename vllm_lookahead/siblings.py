"""What a token gained by one of a parent request's n samples is worth.

vLLM answers a request with ``n`` samples when its last sample ends. A token
one sample gains moves that end only where the sample would have ended last,
and only by what it leaves the sample behind the next one; elsewhere it frees
the sample's batch slot a step earlier. Planning every sample as a request
of its own overvalues its drafts: sixteen tied samples that each draft now
and then spread apart, and the parent ends with the one that gained least.

Model (numpy, no vLLM; unit-tested): sample ``i`` with ``r_i`` tokens left
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

#: Smallest spread of a sample's steps to its end (steps): a sample a whole
#: token behind another ends after it; tied samples end together.
SPREAD_FLOOR = 0.3
#: Most grid points of the integral.
_MAX_POINTS = 1024


def _ndtr(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF (Abramowitz and Stegun 7.1.26, error < 2e-7)."""
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
                + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-z * z)
    return 0.5 * (1.0 + np.where(x >= 0, erf, -erf))


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
    n = len(remaining)
    if n == 0:
        return []
    if n == 1:
        return [1.0]
    # Samples alike in (r, p to 2 decimals, K) are computed once. (Few
    # numpy calls: the proposer runs this every step, on arrays of a few
    # hundred floats, where each call's overhead is most of its cost.)
    keys: dict = {}
    index = [keys.setdefault((int(r), round(float(p), 2), max(int(k), 1)), len(keys))
             for r, (p, k) in zip(remaining, draws)]
    uniq = list(keys)
    n_u = len(uniq)
    counts = np.bincount(np.asarray(index), minlength=n_u).astype(np.float64)
    arr = np.array(uniq, dtype=np.float64)  # [U, 3]: r, p, K
    r = np.maximum(arr[:, 0], 0.0)
    p = np.minimum(np.maximum(arr[:, 1], 0.0), 1.0)
    k = arr[:, 2].astype(np.int64)
    k_max = int(k.max())
    a = np.arange(k_max + 1, dtype=np.float64)
    # P(A = a): p^a (1 - p) below K, p^K at K, 0 past K  [U, k_max + 1]
    pmf = p[:, None] ** a[None, :] * (1.0 - p[:, None])
    pmf[a[None, :] > k[:, None]] = 0.0
    pmf[np.arange(n_u), k] = p ** k
    mu = pmf @ a
    var = pmf @ (a * a) - mu * mu
    mean = r / (1.0 + mu)
    sd = np.sqrt(np.maximum(r * var / (1.0 + mu) ** 3, 0.0) + SPREAD_FLOOR ** 2)
    # Below lo some sample surely has not ended: the max is above it with
    # or without a shift (equal parts of both integrals); a sample that
    # surely ends before lo is never last.
    lo = float((mean - 4.0 * sd).max())
    near = mean + 4.0 * sd >= lo
    hi = float((mean + 4.0 * sd).max()) + float((k / (1.0 + mu)).max())
    step = float(sd[near].min()) / 3.0  # a third of the narrowest spread that counts
    points = int(min(max((hi - lo) / step, 16), _MAX_POINTS))
    # np.linspace(lo, hi, points + 1), as it computes it
    x = np.arange(points + 1, dtype=np.float64) * ((hi - lo) / points) + lo
    x[-1] = hi
    dx = x[1] - x[0]
    rows = np.flatnonzero(near)
    # sample u gaining a tokens ends a / (1 + mu) steps sooner  [R, k_max, points]
    shift = a[None, 1:, None] / (1.0 + mu[rows, None, None])
    # the normal CDFs of every sample on the grid [U, points] and of the
    # near ones shifted [R, k_max, points], in one call
    z = np.concatenate((((x[None, :] - mean[:, None]) / sd[:, None]).ravel(),
                        ((x[None, None, :] + shift - mean[rows, None, None])
                         / sd[rows, None, None]).ravel()))
    log_cdf = np.log(np.maximum(_ndtr(z), 1e-300))
    cut = n_u * x.size
    log_f = log_cdf[:cut].reshape(n_u, x.size)
    moved = log_cdf[cut:].reshape(rows.size, k_max, x.size)
    total = counts @ log_f  # log P(every sample ended by x)  [points]
    out_u = np.zeros(n_u)
    if rows.size:
        diff = np.exp((total - log_f[rows])[:, None, :] + moved) - np.exp(total)[None, None, :]
        steps = np.einsum("ra,ra->r", pmf[rows, 1:], diff.sum(axis=2)) * dx  # parent steps sooner
        expect = mu[rows]
        never = expect <= 0
        if never.any():  # a draft that never hits: value one token
            steps = np.where(never, diff[:, 0, :].sum(axis=1) * dx, steps)
            expect = np.where(never, 1.0, expect)
        out_u[rows] = np.minimum(np.maximum(steps * (1.0 + mu[rows]) / expect, 0.0), 1.0)
    shares = out_u.tolist()
    return [shares[u] for u in index]
