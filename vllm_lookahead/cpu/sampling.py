"""The rejection sampler's CPU costs, cut without changing what it samples
(CPU platform; patch 15 in :mod:`.patches`).

Under top-p sampling vLLM 0.32's CPU rejection sampler spends more on a
draft token than the forward does:

* **top-p by sorting the whole vocabulary** (``apply_top_k_top_p_pytorch``)
  for every draft row: about 3.6 ms per row for a 49k vocabulary on a
  2-core Zen 4. The nucleus of a sampled row is small (median 3 tokens,
  99th percentile under 200 for SmolLM2 at T 0.8, top-p 0.95), so a
  partial top-k of the row decides it (:func:`top_k_top_p_rows`):

  1. the row's :data:`WINDOW` largest logits, in descending order (after
     vLLM's top-k mask, if the row has a top-k), and their probabilities
     (softmax over the whole row, float64 sums);
  2. a token of rank r is kept iff the mass of the tokens ranked above it
     is below p (vLLM's rule: it masks a token where the ascending
     cumulative mass up to it is at most 1 - p, keeping at least the
     largest); the kept tokens are the first m;
  3. the row is masked below the m-th logit.

  A row is decided this way only where the answer cannot differ from
  vLLM's: the cut falls inside the window, the masses on both sides of it
  are more than :data:`MARGIN` away from p (vLLM sums 49k float32
  probabilities, we sum a few in float64), no token outside the m kept
  ties the m-th logit (vLLM's sort is not stable: among tied tokens it
  keeps whichever its order puts last; bfloat16 logits tie often), the
  row's top-k (if any) is within the window, and p < 1. Every other row
  goes to vLLM's own function, so the kept set is vLLM's in every case but
  those within float32 rounding of the threshold. The verifier
  (:func:`verify_sampled_rows`) takes a row whose only doubt is a tie
  across the cut without the sort wherever its outcome does not depend on
  which tied tokens vLLM keeps (:class:`_TieRow`): a quarter of the draft
  rows on MT-Bench tied, 2 of 84 still sorted.
* **exponential noise over the whole vocabulary for every request of the
  batch** (vLLM draws a ``[batch, vocab]`` tensor for the recovered tokens
  whenever any request drafts, about 1 ms per row):
  :func:`recovered_inv_q` draws it for the requests with a draft only (the
  others' rows are never read), seeded requests from their own generator
  exactly as vLLM does, the others only where their target probabilities
  are above 0 (the nucleus: elsewhere the noise multiplies 0).

* **every draft row verified** (top-k/top-p, softmax, the accept test),
  where only the rows up to a request's first rejected token decide what
  it samples: the rows after it are thrown away. A long draft of a
  sampled request is mostly rejected early (a 16-token draft cost vLLM's
  CPU verifier 19 ms more than no draft at batch 1 on the AMX Xeon, the
  forward 12 ms). :func:`verify_sampled_rows` walks the requests' drafts
  position by position and computes a row only while its request has
  accepted every token before it. A row it computes is the row vLLM
  computes, and it tests it against the same uniform draw, so what a
  request samples is vLLM's (a seeded request's the very tokens, its
  generator drawn as vLLM draws it); only the work for rows past a
  rejection is saved.

Pure torch, any device (the patch installs them on the CPU platform only:
on CUDA vLLM's top-p and noise run in Triton kernels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Whether this process's rejection sampler verifies sampled requests'
#: drafts with :func:`verify_sampled_rows` (set by patch 15, CPU platform).
LAZY_VERIFY = False
#: Largest logits looked at per row (the nucleus must end within them).
WINDOW = 256
#: Distance from p below which the cut is left to vLLM's own sums. vLLM's
#: (float32 softmax, a float32 cumulative sum over the sorted row) and
#: this module's (float64 from the window, float32 log-sum-exp) differed
#: by at most 3.1e-6 over 48,000 language-model-like rows (bfloat16 and
#: float32, five temperatures; stop 48, ``benchmarks/HISTORY.md``): 2e-5
#: leaves six times that. It was 1e-4 until stop 48, which sent one draft
#: row in eight to the sort on MT-Bench.
MARGIN = 2e-5


@dataclass
class TopPCounts:
    """Rows seen by :func:`top_k_top_p_rows` and rows left to the fallback;
    draft rows of sampled requests handed to :func:`verify_sampled_rows`
    and rows it computed; requests of drafting steps whose bonus tokens
    :func:`~vllm_lookahead.cpu.lazy_bonus.forward` handled, and the bonus rows
    it sampled (the others were not used)."""

    rows: int = 0
    fallback_rows: int = 0
    draft_rows: int = 0
    verified_rows: int = 0
    bonus_rows: int = 0
    bonus_rows_sampled: int = 0
    #: draft rows with a tie across the cut decided without vLLM's sort
    #: (:class:`_TieRow`), and those of them that still needed it
    tie_rows: int = 0
    tie_rows_sorted: int = 0


#: This process's counts (read by the workers' stats; one engine per
#: worker process).
COUNTS = TopPCounts()


def top_k_top_p_rows(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor,
                     fallback, counts: TopPCounts | None = None, window: int = WINDOW,
                     margin: float = MARGIN, ties: dict | None = None) -> torch.Tensor:
    """Mask ``logits`` ``[rows, vocab]`` (float, in place) to each row's
    top-k ``k`` ``[rows]`` (None: none; ``vocab``: none for that row) and
    then top-p nucleus ``p`` ``[rows]``, as ``fallback(logits, k, p)``
    (vLLM's ``apply_top_k_top_p``) would, and return them. Rows this
    function cannot decide exactly (module doc) are passed to ``fallback``.

    ``ties`` (a dict): a row whose only doubt is a tie across the cut is
    not sorted but masked below the cut, its whole tie group kept (a
    superset of vLLM's kept set), and ``ties[row] = (cut, m)``: the cut's
    logit and how many tokens vLLM keeps (those above the cut and
    ``m`` less their count of the tied ones, which ones depending on the
    order vLLM's unstable sort gives them). :func:`verify_sampled_rows`
    decides most such rows without knowing which (:class:`_TieRow`).
    """
    rows, vocab = logits.shape
    if counts is not None:
        counts.rows += rows
    if rows == 0:
        return logits
    w = min(window, vocab)
    top, _ = logits.topk(w, dim=-1)  # [rows, w], descending
    idx = torch.arange(rows, device=logits.device)
    ok = p < 1
    masked = logits
    if k is not None:
        # vLLM's top-k: mask below the k-th largest logit (ties kept). Into
        # a copy: the rows left to the fallback must reach it as they came
        # (the order vLLM's sort gives tied logits depends on the whole row)
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
    # no tie across the cut: the largest logit outside the m kept ones is
    # the window's (m+1)-th (m < w), below the cut
    untied = top[idx, nxt] < cut.squeeze(1)
    if ties is not None:
        # a tie the only doubt: the row masked below the cut, ties kept
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
    if counts is not None:
        counts.fallback_rows += int(rest.numel())
    logits[rest] = fallback(logits[rest], None if k is None else k[rest], p[rest])
    return logits


def recovered_inv_q(num_draft_tokens: list[int], target_probs: torch.Tensor, generators: dict,
                    dtype: torch.dtype, device) -> torch.Tensor:
    """``[batch, vocab]`` ``inv_q`` for vLLM's ``_sample_recovered_tokens``
    (the reciprocals of Exp(1) noise, one row per request, shared by its
    draft positions): a request's recovered token at a position is the
    argmax of ``prob * inv_q`` over the vocabulary, ``prob`` the target's
    probabilities there (less the draft's).

    * A seeded request with a draft (``generators[i]``): its generator's
      draw over the whole vocabulary, exactly as vLLM draws it, so its
      tokens are vLLM's.
    * Any other request with a draft: draws only where some draft position
      of the request has a target probability above 0 (its ``target_probs``
      rows, ``[num_tokens, vocab]``, top-k/top-p applied), 0 elsewhere.
      Where the probability is 0 the product is 0 whatever the noise, so
      every argmax, and the tie-break of a row with no mass left (index 0),
      is what a full draw gives, in distribution; under top-p the support
      is the nucleus, a few tokens, and the draw costs nothing next to a
      full row (1 ms per request for a 49k vocabulary on a 2-core Zen 4).
    * A request without a draft: 0 (its row is never read).
    """
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
    """Fill ``inv_q`` ``[vocab]`` (zeros) with the reciprocals of Exp(1)
    draws where ``support`` (bool ``[vocab]``) holds, in index order, from
    the default generator; elsewhere it stays 0 (the noise there would
    multiply a probability of 0)."""
    idx = support.nonzero().squeeze(1)
    if idx.numel():
        inv_q[idx] = torch.empty(idx.numel(), dtype=inv_q.dtype,
                                 device=inv_q.device).exponential_().reciprocal_()


def verify_sampled_rows(output: torch.Tensor, draft_token_ids: torch.Tensor,
                        num_draft_tokens: list[int], target_logits: torch.Tensor,
                        top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                        bonus_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                        is_greedy: torch.Tensor | None, generators: dict, constrain,
                        q_dtype: torch.dtype = torch.float32,
                        counts: TopPCounts | None = None) -> None:
    """vLLM's rejection sampling of the sampled (non-greedy) requests' drafts
    when the drafter gives no probabilities (n-gram drafts: each draft
    token's draft probability is 1), computing a draft row only where the
    request accepted every token before it.

    Per request and draft position, as vLLM 0.32's kernels do: the row's
    target probabilities are the softmax of its logits after top-k/top-p
    (``constrain``); the draft token is accepted iff its probability (float32)
    is at least the position's uniform draw (``uniform_probs``, float32 as
    the CPU kernel reads it; a padded draft token, -1, is rejected); at the
    first rejected position the request's token is the recovered one, the
    argmax over the vocabulary of the probabilities less the draft token's
    times the request's inverse Exp(1) noise; a request that accepted its
    whole draft appends its bonus token. The noise of a seeded request
    (``generators[i]``) is drawn from its generator over the whole
    vocabulary once, before anything else of its, exactly as vLLM draws it,
    whether it is used or not; another request's only where it is used (on
    the row's support: elsewhere it multiplies 0, :func:`recovered_inv_q`).

    Args:
        output: int ``[batch, max_spec_len + 1]`` filled with vLLM's
            placeholder; the sampled requests' rows are written (greedy
            requests' are left to vLLM's greedy kernel).
        draft_token_ids: int ``[num_tokens]``, the requests' drafts in order.
        num_draft_tokens: per request, its draft's length.
        target_logits: float32 ``[num_tokens, vocab]``, divided by the
            temperature, top-k/top-p not applied.
        top_k, top_p: ``[num_tokens]`` per draft row (vLLM's expanded
            ones), or None.
        bonus_token_ids: int ``[batch, 1]``.
        uniform_probs: float64 ``[num_tokens]`` (vLLM's
            ``generate_uniform_probs``).
        is_greedy: bool ``[batch]`` or None (none greedy).
        generators: request index -> its ``torch.Generator``.
        constrain: ``(logits, k, p, ties=None) -> logits`` applying
            top-k/top-p to rows (the verifier's ``apply_top_k_top_p``:
            :func:`top_k_top_p_rows`, which with a ``ties`` dict hands over
            the rows whose cut falls in a tie, :class:`_TieRow`).
        q_dtype: the noise's dtype (float64 with vLLM's fp64 Gumbel).
    """
    batch = len(num_draft_tokens)
    vocab = target_logits.shape[-1]
    device = target_logits.device
    greedy = [False] * batch if is_greedy is None else is_greedy.tolist()
    starts, start = [], 0
    for n in num_draft_tokens:
        starts.append(start)
        start += n
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
    if counts is not None:
        counts.draft_rows += sum(num_draft_tokens[i] for i in alive)
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
        if counts is not None:
            counts.verified_rows += len(alive)
        toks_list = toks.tolist()
        tie_rows = {}
        if ties:
            if counts is not None:
                counts.tie_rows += len(ties)
            u_list = u_rows.tolist()
            for j, (cut, m) in ties.items():
                tie = tie_rows[j] = _TieRow(sub[j], cut, m)
                acc = tie.accepts(toks_list[j], u_list[j])
                if acc is None:
                    probs[j] = tie.exact(target_logits[rows[j]], constrain, k_rows, p_rows,
                                         j, counts)
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
                probs[j] = tie.exact(target_logits[rows[j]], constrain, k_rows, p_rows,
                                     j, counts)
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


#: How near a decision on a tie row (:class:`_TieRow`) may come to its
#: threshold and still be taken without vLLM's sort: the acceptance test's
#: probability against its uniform draw (absolute), the recovered token's
#: product against the runner-up's (relative). vLLM computes both in
#: float32 over the kept row (a sum of at most :data:`WINDOW` terms);
#: the tie row's are float64 over a superset of it, normalised as vLLM's.
TIE_GUARD = 1e-4


class _TieRow:
    """A sampled draft row whose nucleus cut falls inside a group of tied
    logits (bfloat16 logits tie often), handed over by
    :func:`top_k_top_p_rows` (``ties``) masked below the cut: the tokens
    above the cut, all kept by vLLM, and the whole tie group, of which
    vLLM keeps ``m`` less the tokens above (which ones: the order its
    unstable sort gives them). The nucleus's mass is known without
    knowing which, so:

    * a draft token above the cut is accepted iff its probability (its
      share of that mass) is at least the draft's uniform draw, as vLLM
      tests it; one below the cut has probability 0; one in the tie group
      needs the sort (:meth:`exact`);
    * after a rejection the recovered token is the argmax of probability
      times the request's noise over the kept tokens: taken over the
      superset, a winner above the cut wins over every subset of it that
      holds it, so it is vLLM's; a tied winner needs the sort, with the
      same noise (drawn on the superset's support, which holds the kept
      set's: the same independent draws, the same distribution).

    Decisions within :data:`TIE_GUARD` of their threshold take the sort
    too (float32 rounding). A seeded request's noise is its generator's
    full draw, as vLLM's, so its tokens are vLLM's.
    """

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
        """Whether vLLM accepts draft token ``tok`` against draw ``u``
        (None: only the sort can say)."""
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
        """The recovered token after draft token ``tok`` was rejected,
        ``q`` the request's noise (``[vocab]``, a seeded request's; None:
        drawn here on the superset's support), or None (the sort decides)."""
        e = self.e.clone()
        if tok >= 0:
            e[self.support == tok] = 0.0
        if q is None:
            # as _noise_on_support draws it, on the support (here the
            # superset's, less the draft token)
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

    def exact(self, raw: torch.Tensor, constrain, k_rows, p_rows, j: int,
              counts: TopPCounts | None) -> torch.Tensor:
        """The row as vLLM computes it (``raw``: its logits before top-k and
        top-p; ``constrain`` sorts it): its float32 probabilities."""
        self.resolved = True
        if counts is not None:
            counts.tie_rows_sorted += 1
        row = constrain(raw.unsqueeze(0).clone(), None if k_rows is None else k_rows[j:j + 1],
                        None if p_rows is None else p_rows[j:j + 1])
        return row.softmax(dim=-1, dtype=torch.float32)[0]

    def noise_row(self, vocab: int, dtype: torch.dtype) -> torch.Tensor:
        """The noise :meth:`recovered` drew on the superset's support, as a
        ``[vocab]`` row (0 elsewhere: the kept set's support is inside)."""
        q = torch.zeros(vocab, dtype=dtype, device=self.row.device)
        if self._noise is not None:
            q[self.support] = self._noise.to(dtype)
        return q
