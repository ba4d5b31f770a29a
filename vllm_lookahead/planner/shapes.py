"""What the planner chooses from: a request's :class:`Shape` options (off, a
draft of k tokens, a tree of w window columns and g candidates), its
:class:`RequestView`, and the prices of vLLM's verification of a draft."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

from vllm_lookahead.attn_mask import tree_size
from vllm_lookahead.planner.acceptance import RequestAcceptance, geometric_gain, window_root


class Shape(NamedTuple):
    """How one request runs one step: ``kind`` "off", "draft" or "tree";
    ``draft`` tokens to verify (a tree: its chain's expected length); expected
    ``tokens``; ``extra_s`` seconds outside the shared forward."""

    kind: str
    draft: int = 0
    window: int = 0
    cands: int = 0
    nodes: int = 0
    tokens: float = 1.0
    extra_s: float = 0.0

    @property
    def query(self) -> int:
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
    """What the planner needs of one request: ``room`` for a draft, the checked
    ``chain``'s and ``unchecked`` lookup's lengths, a ``fixed`` shape, the
    ``weight`` of a gained token (:mod:`.siblings`), the verifier's ``(first,
    next)`` seconds, ``lazy`` rows, the ``bonus`` row a rejected draft saves,
    the ``switch`` a step pays once where any request drafts."""

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
        """Per-token acceptance of its draft (``tree``: a tree's chain)."""
        if tree:
            return self.acc.checked.p
        return draft_p(self.acc, "suffix4" if self.chain > 0 else self.lookup_kind)

    def verify_s(self, draft: int, p: float = 1.0,
                 verify: tuple[float, float] | None = None) -> float:
        """Verifier seconds of a ``draft``-token draft accepted at ``p``
        (``verify`` for the view's; lazy: rows expected less bonus saved)."""
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
    """Verifier seconds from ``(first, next)`` (``rows`` computed; None: all)."""
    if draft <= 0:
        return 0.0
    return verify[0] + verify[1] * ((draft if rows is None else max(rows, 1.0)) - 1)


def bonus_saving(bonus: float, draft: int, p: float) -> float:
    """Seconds saved where the ``bonus`` row follows only a wholly accepted draft."""
    if draft <= 0 or bonus <= 0:
        return 0.0
    return bonus * (1.0 - min(max(p, 0.0), 1.0) ** draft)


@lru_cache(maxsize=128)
def draft_lengths(k_max: int) -> tuple[int, ...]:
    """Draft lengths weighed: 1..8, 12, 16, 24, 32, 48 below ``k_max``, ``k_max``."""
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
def _tree_table(ngram_size: int, window_size: int, g_max: int) -> tuple:
    """``(columns, candidates, nodes)`` per tree (0, 1, 2, 4.. W x 0, 1, 2, 4.. G),
    and each one's ``(g, window root)``."""
    options = tuple((w, g, tree_size(ngram_size, w, g))
                    for w in [0] + _cand_steps(window_size)
                    for g in [0] + _cand_steps(g_max) if g or w)
    cols = max(window_size, 1)
    return options, tuple((g, window_root(w / cols)) for w, g, _ in options)
