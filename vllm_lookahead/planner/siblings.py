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
    return end_shares_many([(remaining, draws)])[0]


def end_shares_many(parents: list[tuple[list[int], list[tuple[float, int]]]]) -> list[list[float]]:
    """:func:`end_shares` of several parents, ``[(remaining, draws)]``, in
    one pass: the same numbers, with the numpy calls shared (the proposer
    runs this every step, on arrays of a few hundred floats a parent, where
    each call's overhead is most of its cost). Each parent keeps its own
    grid; the parents' arrays are padded to the largest and the padding
    masked out."""
    out: list = [None] * len(parents)
    todo = []
    for j, (remaining, draws) in enumerate(parents):
        if len(remaining) == 0:
            out[j] = []
        elif len(remaining) == 1:
            out[j] = [1.0]
        else:
            todo.append(j)
    if not todo:
        return out
    # Samples alike in (r, p to 2 decimals, K) are computed once.
    index, uniq = [], []
    for j in todo:
        remaining, draws = parents[j]
        keys: dict = {}
        index.append([keys.setdefault((int(r), round(float(p), 2), max(int(k), 1)), len(keys))
                      for r, (p, k) in zip(remaining, draws)])
        uniq.append(list(keys))
    n_p, n_u = len(todo), max(len(u) for u in uniq)
    arr = np.zeros((n_p, n_u, 3))  # r, p, K; padding: r 0, p 0, K 1
    arr[:, :, 2] = 1.0
    real = np.zeros((n_p, n_u), dtype=bool)
    counts = np.zeros((n_p, n_u))
    for q, (keys, idx) in enumerate(zip(uniq, index)):
        arr[q, : len(keys)] = keys
        real[q, : len(keys)] = True
        counts[q, : len(keys)] = np.bincount(np.asarray(idx), minlength=len(keys))
    r = np.maximum(arr[:, :, 0], 0.0)
    p = np.minimum(np.maximum(arr[:, :, 1], 0.0), 1.0)
    k = arr[:, :, 2].astype(np.int64)
    k_max = int(k.max())
    a = np.arange(k_max + 1, dtype=np.float64)
    # P(A = a): p^a (1 - p) below K, p^K at K, 0 past K  [P, U, k_max + 1]
    pmf = p[..., None] ** a * (1.0 - p[..., None])
    pmf[a > k[..., None]] = 0.0
    np.put_along_axis(pmf, k[..., None], (p ** k)[..., None], axis=2)
    mu = np.einsum("pua,a->pu", pmf, a)
    var = np.einsum("pua,a->pu", pmf, a * a) - mu * mu
    mean = r / (1.0 + mu)
    sd = np.sqrt(np.maximum(r * var / (1.0 + mu) ** 3, 0.0) + SPREAD_FLOOR ** 2)
    # Below lo some sample surely has not ended: the max is above it with
    # or without a shift (equal parts of both integrals); a sample that
    # surely ends before lo is never last.
    lo = np.where(real, mean - 4.0 * sd, -np.inf).max(axis=1)  # [P]
    near = real & (mean + 4.0 * sd >= lo[:, None])
    hi = (np.where(real, mean + 4.0 * sd, -np.inf).max(axis=1)
          + np.where(real, k / (1.0 + mu), -np.inf).max(axis=1))
    step = np.where(near, sd, np.inf).min(axis=1) / 3.0  # a third of the narrowest spread that counts
    points = np.minimum(np.maximum((hi - lo) / step, 16), _MAX_POINTS).astype(np.int64)
    width = int(points.max()) + 1
    # np.linspace(lo, hi, points + 1) of each parent, as it computes it;
    # past a parent's last point, its last point again (masked out)
    col = np.arange(width, dtype=np.float64)
    x = col[None, :] * ((hi - lo) / points)[:, None] + lo[:, None]
    inside = col[None, :] <= points[:, None]
    x = np.where(col[None, :] >= points[:, None], hi[:, None], x)
    dx = x[:, 1] - x[:, 0]
    sel_p, sel_u = np.nonzero(near)
    # sample u gaining a tokens ends a / (1 + mu) steps sooner  [R, k_max, X]
    shift = a[None, 1:, None] / (1.0 + mu[sel_p, sel_u, None, None])
    # the normal CDFs of every sample on its parent's grid [P, U, X] and of
    # the near ones shifted [R, k_max, X], in one call (padding: mean 0, sd 1)
    m_all, s_all = np.where(real, mean, 0.0), np.where(real, sd, 1.0)
    z = np.concatenate((((x[:, None, :] - m_all[..., None]) / s_all[..., None]).ravel(),
                        ((x[sel_p, None, :] + shift - mean[sel_p, sel_u, None, None])
                         / sd[sel_p, sel_u, None, None]).ravel()))
    log_cdf = np.log(np.maximum(_ndtr(z), 1e-300))
    cut = n_p * n_u * width
    log_f = log_cdf[:cut].reshape(n_p, n_u, width)
    moved = log_cdf[cut:].reshape(sel_p.size, k_max, width)
    total = np.einsum("pu,pux->px", counts, log_f)  # log P(every sample ended by x)  [P, X]
    shares = np.zeros((n_p, n_u))
    if sel_p.size:
        diff = (np.exp((total[sel_p] - log_f[sel_p, sel_u])[:, None, :] + moved)
                - np.exp(total[sel_p])[:, None, :])
        diff *= inside[sel_p][:, None, :]
        mass = diff.sum(axis=2)  # [R, k_max]
        steps = np.einsum("ra,ra->r", pmf[sel_p, sel_u, 1:], mass) * dx[sel_p]  # parent steps sooner
        expect = mu[sel_p, sel_u]
        never = expect <= 0
        if never.any():  # a draft that never hits: value one token
            steps = np.where(never, mass[:, 0] * dx[sel_p], steps)
            expect = np.where(never, 1.0, expect)
        shares[sel_p, sel_u] = np.minimum(
            np.maximum(steps * (1.0 + mu[sel_p, sel_u]) / expect, 0.0), 1.0)
    for q, j in enumerate(todo):
        row = shares[q].tolist()
        out[j] = [row[u] for u in index[q]]
    return out
