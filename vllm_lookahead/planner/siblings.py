"""What a token gained by one of a parent request's n samples is worth: vLLM answers
the parent when its last sample ends. Sample i (``r_i`` tokens left, accepting
``A_i`` tokens a step: mean ``mu_i``, variance ``v_i``) needs ``S_i`` steps, normal
with mean ``r_i / (1 + mu_i)`` and variance ``r_i v_i / (1 + mu_i)**3`` (renewal
theory). The share of its gain that moves ``E[max S]`` is worth a parent step; the
rest only frees its batch slot early."""

from __future__ import annotations

import math

import numpy as np

#: Smallest spread of a sample's steps to its end (steps): steps are whole.
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


def end_shares_many(parents: list[tuple[list[int], list[tuple[float, int]]]]) -> list[list[float]]:
    """Per parent ``(remaining, draws)`` -- per sample its tokens left to
    ``max_tokens`` and its typical draft's ``(p, K)`` -- per sample the share
    (0..1) of its expected gain from a draft now that ends the parent sooner.
    All parents in one pass (padded to the largest, each on its own grid):
    the numpy calls' overhead is most of their cost at these sizes."""
    out: list = [None] * len(parents)
    todo = []
    for j, (remaining, draws) in enumerate(parents):
        if len(remaining) <= 1:
            out[j] = [1.0] * len(remaining)
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
    # Below lo some sample surely has not ended (equal parts of both
    # integrals); a sample that surely ends before lo is never last.
    lo = np.where(real, mean - 4.0 * sd, -np.inf).max(axis=1)  # [P]
    near = real & (mean + 4.0 * sd >= lo[:, None])
    hi = (np.where(real, mean + 4.0 * sd, -np.inf).max(axis=1)
          + np.where(real, k / (1.0 + mu), -np.inf).max(axis=1))
    step = np.where(near, sd, np.inf).min(axis=1) / 3.0  # a third of the narrowest spread
    points = np.minimum(np.maximum((hi - lo) / step, 16), _MAX_POINTS).astype(np.int64)
    width = int(points.max()) + 1
    # np.linspace(lo, hi, points + 1) of each parent; past its last point, hi (masked out)
    col = np.arange(width, dtype=np.float64)
    x = col[None, :] * ((hi - lo) / points)[:, None] + lo[:, None]
    inside = col[None, :] <= points[:, None]
    x = np.where(col[None, :] >= points[:, None], hi[:, None], x)
    dx = x[:, 1] - x[:, 0]
    sel_p, sel_u = np.nonzero(near)
    # sample u gaining a tokens ends a / (1 + mu) steps sooner  [R, k_max, X]
    shift = a[None, 1:, None] / (1.0 + mu[sel_p, sel_u, None, None])
    # the CDFs of every sample on its parent's grid [P, U, X] and of the
    # near ones shifted [R, k_max, X], in one call (padding: mean 0, sd 1)
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


def sibling_rows(groups: list, remaining: list) -> list[list[int]]:
    """The rows of each parent (``groups[r]``, None: none) with two or more
    live samples, all with an output cap (``remaining[r]`` not None)."""
    members: dict = {}
    for r, g in enumerate(groups):
        if g is not None:
            members.setdefault(g, []).append(r)
    return [rows for rows in members.values()
            if len(rows) >= 2 and all(remaining[r] is not None for r in rows)]


def sibling_weights(groups: list, remaining: list, slot_value, end_value,
                    draws: list) -> list[float]:
    """Per request, what a token it gains is worth in tokens of the step
    (``RequestView.weight``): for a sample of a parent (``groups``, tokens
    left ``remaining``, typical draft ``draws`` ``(p, K)``), its end share
    times ``end_value(k)`` plus the rest times ``slot_value(k)`` (``k``: the
    parent's live samples); 1 for a request without live siblings or cap."""
    out = [1.0] * len(groups)
    parents = sibling_rows(groups, remaining)
    every = end_shares_many([([remaining[r] for r in rows], [draws[r] for r in rows])
                             for rows in parents])
    for rows, shares in zip(parents, every):
        value, slot = end_value(len(rows)), slot_value(len(rows))
        for r, share in zip(rows, shares):
            out[r] = share * value + (1.0 - share) * slot
    return out


def _plain(cost, batch: int) -> float:
    return cost.predict(max(batch, 1), 1.0, tree=False)


def drain_value(cost, batch: int, samples: int) -> float:
    """A token that frees one of a parent's ``samples`` live samples' slot a
    step earlier, in tokens of a ``batch``-request step (``cost``: a
    ``CostModel``): the mean a sample adds to a plain step, at the plain rate,
    as they drain, ``b (c(b) - c(b - k + 1)) / ((k - 1) c(b))``, k at least 2."""
    k = max(samples, 2)
    c = _plain(cost, batch)
    if batch <= 1 or c <= 0:
        return 1.0
    last = _plain(cost, batch - k + 1)
    return min(max(batch * (c - last) / ((k - 1) * c), 0.0), 1.0)


def end_value(cost, batch: int, samples: int) -> float:
    """A parent of ``samples`` live samples ending a step sooner, in tokens of
    a ``batch``-request step: its last step (its last sample with the others,
    ``c(b - k + 1)``) at the plain rate less the others' tokens,
    ``b c(b - k + 1) / c(b) - (b - k)``; between one slot's value and ``k``."""
    c = _plain(cost, batch)
    if c <= 0 or batch <= 1:
        return 1.0
    last = _plain(cost, batch - samples + 1)
    return min(max(batch * last / c - max(batch - samples, 0), drain_value(cost, batch, 1)),
               float(samples))
