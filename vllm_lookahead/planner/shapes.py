"""What the planner chooses from: a request's shapes and its view of the step.

A :class:`Shape` is how one request runs one step (off, a draft of k tokens,
or a lookahead tree of w window columns and g candidates); a
:class:`RequestView` is what the planner knows of the request; the functions
price a draft's verification by vLLM's rejection sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

from vllm_lookahead.attn_mask import tree_size
from vllm_lookahead.planner.acceptance import RequestAcceptance, geometric_gain, window_root


class Shape(NamedTuple):
    """How one request runs one step.

    Attributes:
        kind: "off", "draft" or "tree".
        draft: draft tokens handed to the verifier (a fused tree: the
            checked chain's expected length).
        window, cands, nodes: tree window columns, candidates, query tokens.
        tokens: expected tokens the step yields for the request.
        extra_s: seconds outside the shared forward (verification, a
            separate pass's share).
    """

    kind: str
    draft: int = 0
    window: int = 0
    cands: int = 0
    nodes: int = 0
    tokens: float = 1.0
    extra_s: float = 0.0

    @property
    def query(self) -> int:
        """Query tokens of the request in the step's forward."""
        return 1 + self.draft + self.nodes

    def label(self) -> str:
        if self.kind == "tree":
            return f"tree:w{self.window}g{self.cands}"
        return f"draft:{self.draft}" if self.kind == "draft" else "off"


OFF = Shape("off")
#: A :class:`Shape` from all its fields in order (the planner's inner loop).
_shape = partial(tuple.__new__, Shape)


@dataclass
class RequestView:
    """What the planner needs of one decoding request.

    Attributes:
        acc: its acceptance estimates.
        ngram_size, window_size, guess_set_size: its N, W, G (upper bounds).
        room: the longest draft vLLM takes now.
        chain: length of the checked chain the last tree left (0: none).
        unchecked: length of the unchecked lookup now; lookup_kind: its kind.
        trees: whether a tree may run; fixed: plan exactly this shape.
        weight: what a gained token beyond its one is worth, in tokens of
            the step (``siblings.sibling_weights``).
        verify: vLLM's verifier's seconds for its draft, ``(first, next)``.
        lazy: draft rows past the first rejection cost nothing.
        bonus: seconds a draft rejected anywhere saves (its lazy bonus row).
        switch: seconds a step pays once where any request drafts.
    """

    acc: RequestAcceptance
    ngram_size: int
    window_size: int
    guess_set_size: int
    room: int
    chain: int = 0
    unchecked: int = 0
    lookup_kind: str = "suffix4"
    trees: bool = True
    fixed: Shape | None = None
    weight: float = 1.0
    verify: tuple[float, float] = (0.0, 0.0)
    lazy: bool = False
    bonus: float = 0.0
    switch: float = 0.0

    def draft_p(self, tree: bool = False) -> float:
        """Per-token acceptance of its draft: a tree's checked chain
        (``tree``), the chain the last tree left, or its lookup."""
        if tree:
            return self.acc.checked.p
        return draft_p(self.acc, "suffix4" if self.chain > 0 else self.lookup_kind)

    def verify_s(self, draft: int, p: float = 1.0,
                 verify: tuple[float, float] | None = None) -> float:
        """Verifier seconds of a ``draft``-token draft accepted at ``p`` a
        token (``verify``: ``(first, next)`` in place of the view's): lazy,
        the rows expected less the bonus row expected saved (may be < 0)."""
        pair = self.verify if verify is None else verify
        if not self.lazy:
            return verify_seconds(pair, draft)
        return (verify_seconds(pair, draft, verified_rows(draft, p))
                - bonus_saving(self.bonus, draft, p))


def verified_rows(draft: int, p: float) -> float:
    """Draft rows a lazy verifier computes, ``1 + p + ... + p^(draft-1)``."""
    return 1.0 + geometric_gain(p, draft - 1) if draft > 0 else 0.0


def draft_p(acc: RequestAcceptance, kind: str = "suffix4") -> float:
    """Per-token acceptance of an unchecked draft of ``kind``, calibrated."""
    return min(acc.unchecked_p(kind) * acc.prior.calibration, 1.0)


def verify_seconds(verify: tuple[float, float], draft: int, rows: float | None = None) -> float:
    """Verifier seconds of a ``draft``-token draft from ``(first, next)``;
    ``rows``: the rows computed (None: all)."""
    if draft <= 0:
        return 0.0
    return verify[0] + verify[1] * ((draft if rows is None else max(rows, 1.0)) - 1)


def bonus_saving(bonus: float, draft: int, p: float) -> float:
    """Seconds a draft saves where its ``bonus`` row is sampled only after
    the whole draft is accepted: ``bonus * (1 - p^draft)``."""
    if draft <= 0 or bonus <= 0:
        return 0.0
    return bonus * (1.0 - min(max(p, 0.0), 1.0) ** draft)


@lru_cache(maxsize=128)
def draft_lengths(k_max: int) -> tuple[int, ...]:
    """Draft lengths weighed for a lookup of ``k_max`` tokens: 1..8, then
    12, 16, 24, 32, 48 below it, and ``k_max``."""
    ks = set(range(1, min(k_max, 8) + 1)) | {k for k in (12, 16, 24, 32, 48) if k < k_max}
    if k_max > 0:
        ks.add(k_max)
    return tuple(sorted(ks))


def _cand_steps(g_max: int) -> list[int]:
    """1, 2, 4, ... up to and including ``g_max``."""
    out, g = [], 1
    while g < g_max:
        out.append(g)
        g *= 2
    return out + [g_max] if g_max >= 1 else out


@lru_cache(maxsize=256)
def _tree_options(ngram_size: int, window_size: int, g_max: int) -> tuple:
    """``(window columns, candidates, nodes)`` of each tree shape: no window
    or 1, 2, 4, ... W columns, each with 0, 1, 2, 4, ... G candidates."""
    return tuple((w, g, tree_size(ngram_size, w, g))
                 for w in [0] + _cand_steps(window_size)
                 for g in [0] + _cand_steps(g_max) if g or w)


@lru_cache(maxsize=256)
def _tree_table(ngram_size: int, window_size: int, g_max: int) -> tuple:
    """:func:`_tree_options` and each shape's ``(g, window root)`` for
    :meth:`RequestAcceptance.tree_gains`."""
    options = _tree_options(ngram_size, window_size, g_max)
    cols = max(window_size, 1)
    return options, tuple((g, window_root(w / cols)) for w, g, _ in options)
