"""vLLM's CPU rejection sampler, cheaper, sampling what it samples (patched in by
:mod:`.patches`): top-p from a row's :data:`WINDOW` largest logits, the recovered tokens'
noise only where it matters, and draft rows computed only up to the first rejection.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

#: Largest logits looked at per row (the nucleus must end within them).
WINDOW = 256
#: Distance from p below which the cut is left to vLLM's float32 sums.
MARGIN = 2e-5
#: How near its threshold a tie row's decision may come without vLLM's sort
#: (absolute for the accept test, relative for the recovered token's product).
TIE_GUARD = 1e-4


@dataclass
class TopPCounts:
    """Draft rows the verifier saw, by what it did with them (the ``verify_*`` stats)."""

    rows: int = 0  # seen by top_k_top_p_rows
    fallback_rows: int = 0  # of them, left to vLLM's sort
    draft_rows: int = 0  # handed to verify_sampled_rows
    verified_rows: int = 0  # of them, computed
    bonus_rows: int = 0  # requests whose bonus token lazy_bonus handled
    bonus_rows_sampled: int = 0  # of them, sampled
    tie_rows: int = 0  # rows with a tie across the cut (_TieRow)
    tie_rows_sorted: int = 0  # of them, sorted after all


#: This process's counts (one engine per worker process).
COUNTS = TopPCounts()


def __getattr__(name: str):
    if name == "LAZY_VERIFY":  # whether verify_sampled_rows is patched in (the planner reads it)
        from vllm_lookahead.patches.registry import APPLIED

        return "vllm.v1.sample.rejection_sampler:rejection_sample" in APPLIED
    raise AttributeError(name)


def top_k_top_p_rows(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor,
                     fallback, ties: dict | None = None, window: int = WINDOW,
                     margin: float = MARGIN) -> torch.Tensor:
    """``logits`` [rows, vocab] masked in place to top-k ``k`` [rows] (None: none) and
    top-p ``p`` [rows] as ``fallback`` (vLLM's ``apply_top_k_top_p``) masks them.

    A row is decided here only where vLLM's answer is certain (cut inside the window,
    masses more than ``margin`` from p, no tie at the cut, p < 1); others go to
    ``fallback``. With a ``ties`` dict, a row whose only doubt is a tie keeps its tie
    group and ``ties[row] = (cut logit, tokens vLLM keeps)`` (:class:`_TieRow`).
    """
    rows, vocab = logits.shape
    COUNTS.rows += rows
    if rows == 0:
        return logits
    w = min(window, vocab)
    top, _ = logits.topk(w, dim=-1)  # [rows, w], descending
    idx = torch.arange(rows, device=logits.device)
    ok = p < 1
    masked = logits
    if k is not None:
        # vLLM's top-k (ties kept), into a copy: rows left to the fallback
        # must reach it as they came (its sort order depends on the row)
        kk = k.to(torch.long)
        limited = kk < vocab
        ok &= ~limited | (kk <= w)
        kth = top[idx, (kk - 1).clamp(min=0, max=w - 1)].unsqueeze(1)
        kth = torch.where(limited.unsqueeze(1) & ok.unsqueeze(1), kth,
                          torch.full_like(kth, float("-inf")))
        masked = logits.masked_fill(logits < kth, float("-inf"))
        top.masked_fill_(top < kth, float("-inf"))
    # log-sum-exp from the row's largest logit (torch.logsumexp is several
    # times slower on the CPU); its rounding is within MARGIN's reach
    mx = top[:, :1]
    lse = mx.double() + torch.log(torch.exp(masked - mx).sum(dim=-1, keepdim=True).double())
    probs = torch.exp(top.double() - lse)
    above = torch.cumsum(probs, dim=-1) - probs  # mass ranked above each
    p64 = p.to(torch.float64)
    m = (above < p64.unsqueeze(1)).sum(dim=-1)  # kept tokens (the first m)
    last = (m - 1).clamp(min=0, max=w - 1)
    nxt = m.clamp(max=w - 1)
    ok &= (m >= 1) & (m < w)
    ok &= (p64 - above[idx, last]) > margin
    ok &= (above[idx, nxt] - p64) > margin
    cut = top[idx, last].unsqueeze(1)  # the m-th logit
    untied = top[idx, nxt] < cut.squeeze(1)  # the (m+1)-th is below the cut
    if ties is not None:
        for row in (ok & ~untied).nonzero().squeeze(1).tolist():
            ties[row] = (float(cut[row, 0]), int(m[row]))
    else:
        ok &= untied
    if bool(ok.all()):
        return logits.masked_fill_(masked < cut, float("-inf"))
    fine = ok.nonzero().squeeze(1)
    if fine.numel():
        sub = masked[fine]
        logits[fine] = sub.masked_fill_(sub < cut[fine], float("-inf"))
    rest = (~ok).nonzero().squeeze(1)
    COUNTS.fallback_rows += int(rest.numel())
    logits[rest] = fallback(logits[rest], None if k is None else k[rest], p[rest])
    return logits


def recovered_inv_q(num_draft_tokens: list[int], target_probs: torch.Tensor, generators: dict,
                    dtype: torch.dtype, device) -> torch.Tensor:
    """``inv_q`` [batch, vocab], reciprocal Exp(1) noise, for vLLM's
    ``_sample_recovered_tokens``: a seeded request's over the vocabulary as vLLM
    draws it, an unseeded one's only where a ``target_probs`` row is above 0."""
    batch, vocab = len(num_draft_tokens), target_probs.shape[-1]
    inv_q = torch.zeros((batch, vocab), dtype=dtype, device=device)
    start = 0
    for i, n in enumerate(num_draft_tokens):
        if n <= 0:
            continue
        gen = generators.get(i)
        if gen is not None:
            inv_q[i].exponential_(generator=gen).reciprocal_()
        else:
            _noise_on_support(inv_q[i], (target_probs[start:start + n] > 0).any(dim=0))
        start += n
    return inv_q


def _noise_on_support(inv_q: torch.Tensor, support: torch.Tensor) -> None:
    """Reciprocal Exp(1) draws into ``inv_q`` [vocab] where ``support`` holds."""
    idx = support.nonzero().squeeze(1)
    if idx.numel():
        inv_q[idx] = torch.empty(idx.numel(), dtype=inv_q.dtype,
                                 device=inv_q.device).exponential_().reciprocal_()


def verify_sampled_rows(output: torch.Tensor, draft_token_ids: torch.Tensor,
                        num_draft_tokens: list[int], target_logits: torch.Tensor,
                        top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                        bonus_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                        is_greedy: torch.Tensor | None, generators: dict, constrain,
                        q_dtype: torch.dtype = torch.float32) -> None:
    """vLLM 0.32's rejection sampling of the sampled requests' drafts (no draft
    probabilities), into ``output`` [batch, max_spec_len + 1], a draft row computed
    only while its request accepted every token before it. ``target_logits``
    [num_tokens, vocab] (temperature applied); ``top_k``, ``top_p``, ``uniform_probs``
    [num_tokens]; ``bonus_token_ids`` [batch, 1]; ``is_greedy`` [batch] or None;
    ``constrain(logits, k, p, ties=None)``: :func:`top_k_top_p_rows` with vLLM's."""
    batch = len(num_draft_tokens)
    vocab = target_logits.shape[-1]
    device = target_logits.device
    greedy = [False] * batch if is_greedy is None else is_greedy.tolist()
    starts = list(itertools.accumulate(num_draft_tokens, initial=0))
    bonus = bonus_token_ids.view(-1)
    inv_q = {}
    alive = []
    for i, n in enumerate(num_draft_tokens):
        if greedy[i]:
            continue
        if n <= 0:
            output[i, 0] = bonus[i]
            continue
        gen = generators.get(i)
        if gen is not None:
            inv_q[i] = torch.empty(vocab, dtype=q_dtype, device=device) \
                .exponential_(generator=gen).reciprocal_()
        alive.append(i)
    COUNTS.draft_rows += sum(num_draft_tokens[i] for i in alive)
    d = 0
    while alive:
        rows = torch.tensor([starts[i] + d for i in alive], dtype=torch.long, device=device)
        sub = target_logits[rows]
        ties: dict[int, tuple[float, int]] = {}
        k_rows = None if top_k is None else top_k[rows]
        p_rows = None if top_p is None else top_p[rows]
        if top_k is not None or top_p is not None:
            sub = constrain(sub, k_rows, p_rows, ties=ties)
        probs = sub.softmax(dim=-1, dtype=torch.float32)
        toks = draft_token_ids[rows].to(torch.long)
        p_tok = probs.gather(1, toks.clamp(min=0).unsqueeze(1)).squeeze(1)
        u_rows = uniform_probs[rows].to(torch.float32)
        accepted = ((toks >= 0) & (p_tok >= u_rows)).tolist()
        COUNTS.verified_rows += len(alive)
        toks_list = toks.tolist()
        tie_rows = {}
        if ties:
            COUNTS.tie_rows += len(ties)
            u_list = u_rows.tolist()
            for j, (cut, m) in ties.items():
                tie = tie_rows[j] = _TieRow(sub[j], cut, m)
                acc = tie.accepts(toks_list[j], u_list[j])
                if acc is None:
                    probs[j] = tie.exact(target_logits[rows[j]], constrain, k_rows, p_rows, j)
                    acc = toks_list[j] >= 0 and bool(probs[j, toks_list[j]] >= u_rows[j])
                accepted[j] = acc
        nxt = []
        for j, i in enumerate(alive):
            if accepted[j]:
                output[i, d] = toks_list[j]
                if d + 1 == num_draft_tokens[i]:
                    output[i, d + 1] = bonus[i]
                else:
                    nxt.append(i)
                continue
            tie = tie_rows.get(j)
            if tie is not None and not tie.resolved:
                q = inv_q.get(i)
                tok = tie.recovered(toks_list[j], q)
                if tok is not None:
                    output[i, d] = tok
                    continue
                probs[j] = tie.exact(target_logits[rows[j]], constrain, k_rows, p_rows, j)
                if q is None:  # the noise drawn on the superset's support
                    q = tie.noise_row(vocab, q_dtype)
                    inv_q[i] = q
            prob = probs[j]
            if toks_list[j] >= 0:
                prob[toks_list[j]] = 0
            q = inv_q.get(i)
            if q is None:
                q = torch.zeros(vocab, dtype=q_dtype, device=device)
                _noise_on_support(q, prob > 0)
            output[i, d] = int((prob * q.to(torch.float32)).argmax())
        alive = nxt
        d += 1


class _TieRow:
    """A draft row whose nucleus cut falls in tied logits: vLLM keeps ``m`` tokens,
    which of the tied ones depends on its unstable sort. A token above the cut is
    decided from the known mass; a tied one, or one within :data:`TIE_GUARD` of its
    threshold, takes vLLM's sort (:meth:`exact`) with the same noise."""

    def __init__(self, row: torch.Tensor, cut: float, m: int) -> None:
        self.row = row  # float [vocab] masked below the cut
        self.cut = cut
        self.support = (row >= cut).nonzero().squeeze(1)  # the superset, ascending
        vals = row[self.support].double()
        self.top = float(vals.max())
        self.e = torch.exp(vals - self.top)  # unnormalised probabilities
        above = vals > cut
        tied_kept = m - int(above.sum())
        self.z = float(self.e[above].sum()) + tied_kept * math.exp(cut - self.top)
        self.resolved = False  # exact() taken: the row is vLLM's own
        self._noise: torch.Tensor | None = None  # unseeded: on the support

    def accepts(self, tok: int, u: float) -> bool | None:
        """Whether vLLM accepts draft token ``tok`` against draw ``u`` (None: ask the sort)."""
        if tok < 0:
            return False  # a padded position: rejected
        x = float(self.row[tok])
        if x < self.cut:
            return 0.0 >= u  # masked: probability 0
        if x == self.cut:
            return None
        p = math.exp(x - self.top) / self.z
        if abs(p - u) <= TIE_GUARD:
            return None
        return p >= u

    def recovered(self, tok: int, q: torch.Tensor | None) -> int | None:
        """The recovered token after ``tok`` was rejected (None: ask the sort); ``q``
        a seeded request's noise [vocab], None: drawn here on the support."""
        e = self.e.clone()
        if tok >= 0:
            e[self.support == tok] = 0.0
        if q is None:
            self._noise = torch.zeros_like(e)
            _noise_on_support(self._noise, e > 0)
            noise = self._noise
        else:
            noise = q[self.support].double()
        prod = e * noise
        if len(prod) > 1:
            two = prod.topk(2)
            best, second = int(two.indices[0]), float(two.values[1])
            if second >= float(two.values[0]) * (1.0 - TIE_GUARD):
                return None
        else:
            best = 0
        if float(prod[best]) <= 0.0:
            return None  # no mass left: vLLM's tie-break over the row
        token = int(self.support[best])
        return token if float(self.row[token]) > self.cut else None

    def exact(self, raw: torch.Tensor, constrain, k_rows, p_rows, j: int) -> torch.Tensor:
        """The row's float32 probabilities as vLLM computes them from ``raw`` logits."""
        self.resolved = True
        COUNTS.tie_rows_sorted += 1
        row = constrain(raw.unsqueeze(0).clone(), None if k_rows is None else k_rows[j:j + 1],
                        None if p_rows is None else p_rows[j:j + 1])
        return row.softmax(dim=-1, dtype=torch.float32)[0]

    def noise_row(self, vocab: int, dtype: torch.dtype) -> torch.Tensor:
        """The noise :meth:`recovered` drew, as a [vocab] row."""
        q = torch.zeros(vocab, dtype=dtype, device=self.row.device)
        if self._noise is not None:
            q[self.support] = self._noise.to(dtype)
        return q
