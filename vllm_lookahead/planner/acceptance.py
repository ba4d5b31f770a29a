"""Measured acceptance: per request, running estimates of an unchecked draft's
per-token acceptance per kind of lookup, the tokens a tree of ``g`` candidates and
a share of the window confirms, and a checked draft's per-token acceptance. The
engine's :class:`AcceptancePrior` pools every request's outcomes; requests start
from it and their tree estimates relax towards it between trees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Upper ends of the long own-text match kinds (``suffix8``: 5-8 tokens).
LONG_SUFFIX_KINDS = (8, 16, 24)
#: Kinds of unchecked lookup, learnt apart: a suffix of the text or of the
#: shared memory's, or a guess for the newest token alone (GUESS_KINDS).
LOOKUP_KINDS = (*(f"suffix{b}" for b in reversed(LONG_SUFFIX_KINDS)), "suffix4", "suffix3",
                "suffix2", "memory12", "memory6", "memory3", "memory2", "memory1", "pool",
                "poolsplit")
GUESS_KINDS = ("memory1", "pool", "poolsplit")
#: How a match's key places agreed on its first token (``"suffix3+"``: one
#: place, all, split): each class's assumed factor and share of matches.
AGREEMENT_PRIOR = {"": 1.0, "+": 1.2, "-": 0.6}
AGREEMENT_MIX = {"": 0.625, "+": 0.25, "-": 0.125}
#: Highest per-token acceptance a class factor may lift an estimate to.
P_MAX = 0.98


def pool_kind(counts: list[int], best: int) -> str:
    """``"pool"`` where ``counts[best]`` is over half the counts, else ``"poolsplit"``."""
    return "pool" if 2 * counts[best] > sum(counts) else "poolsplit"


def split_kind(kind: str) -> tuple[str, str]:
    """``"suffix3+"`` -> ``("suffix3", "+")``; ``"pool"`` -> ``("pool", "")``."""
    if kind and kind[-1] in "+-":
        return kind[:-1], kind[-1]
    return kind, ""


def match_kind(source: str, m: int) -> str:
    """The kind of an ``m``-token match from ``source`` ("suffix" past 4: 8, 16, 24)."""
    if source == "suffix" and m > 4:
        m = next((b for b in LONG_SUFFIX_KINDS if m <= b), LONG_SUFFIX_KINDS[-1])
    return f"{source}{m}"


def geometric_gain(p: float, k: int) -> float:
    """Expected accepted tokens of a k-token draft accepted at ``p`` a token."""
    if k <= 0 or p <= 0:
        return 0.0
    if p >= 1:
        return float(k)
    return p * (1 - p**k) / (1 - p)


def window_root(share: float) -> float:
    """The part of the whole window's gain a tree with ``share`` of its
    columns gets: ``sqrt(share)`` (the columns' n-grams overlap)."""
    if not share or share <= 0:
        return 0.0
    return min(float(share), 1.0) ** 0.5


@dataclass
class _Rate:
    """A geometric rate from (accepted, rejected) counts with forgetting."""

    hits: float
    misses: float

    @property
    def p(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total > 0 else 0.0

    def add(self, hits: int, missed: bool, keep: float) -> None:
        self.hits = self.hits * keep + hits
        self.misses = self.misses * keep + (1 if missed else 0)


@dataclass
class _RequestRate(_Rate):
    """A request's rate of a lookup kind: its counts over ``w`` pseudo-counts
    at the engine's rate *now* (``rates[kind]``): the samples of a prompt
    learn together until their own probes outweigh the engine's."""

    w: float = 0.0
    rates: dict | None = None
    kind: str = ""

    @property
    def p(self) -> float:
        w = self.w
        total = self.hits + self.misses + w
        if total <= 0:
            return 0.0
        return (self.hits + w * self.rates[self.kind] if w else self.hits) / total

    def add(self, hits: int, missed: bool, keep: float) -> None:
        super().add(hits, missed, keep)
        self.w *= keep


@dataclass
class AcceptancePrior:
    """Engine-wide estimates new requests start from and relax towards:
    ``p_unchecked`` per lookup kind (a number: the ``suffix4`` rate the others
    are assumed from), ``p_checked``, ``tree_cands[g]`` (tokens a tree of g+1
    text candidates confirms), ``tree_window`` (what the whole window adds),
    ``weight`` (pseudo-count in a new request's rates), ``ema`` (of one
    outcome), ``calibration`` (accepted over expected unchecked tokens)."""

    max_cands: int
    p_unchecked: dict = None
    p_checked: float = 0.95
    tree_cands: list[float] = field(default_factory=list)
    tree_window: float = 0.3
    weight: float = 4.0
    ema: float = 0.02
    trees_seen: int = 0
    planned: float = 0.0
    seen: float = 0.0
    calibration: float = 1.0

    #: Pseudo-counts of the assumed rates and forgetting per probe: each
    #: lookup kind's, the agreement classes' (together); then calibration's
    #: forgetting, expected tokens before it applies, and its bounds.
    UNCHECKED_WEIGHT = 8.0
    UNCHECKED_KEEP = 0.99
    AGREEMENT_WEIGHT = 32.0
    AGREEMENT_KEEP = 0.998
    CALIBRATION_KEEP = 0.98
    CALIBRATION_AFTER = 8.0
    CALIBRATION_MIN = 0.3
    CALIBRATION_MAX = 1.5

    def __post_init__(self) -> None:
        if not isinstance(self.p_unchecked, dict):
            p = 0.5 if self.p_unchecked is None else float(self.p_unchecked)
            # a longer match predicts better (past 4 tokens text is copied)
            self.p_unchecked = {"suffix24": min(p * 1.7, P_MAX), "suffix16": min(p * 1.7, P_MAX),
                                "suffix8": min(p * 1.5, P_MAX),
                                "suffix4": p, "suffix3": p * 0.9, "suffix2": p * 0.8,
                                "memory12": p, "memory6": p * 0.9, "memory3": p * 0.7,
                                "memory2": p * 0.65, "memory1": p * 0.6, "pool": p * 0.6,
                                "poolsplit": p * 0.4}
        w = self.UNCHECKED_WEIGHT
        self.pooled = {k: _Rate(p * w, (1 - p) * w) for k, p in self.p_unchecked.items()}
        # per agreement class, its matches' first tokens (the factors of 0.5)
        w = self.AGREEMENT_WEIGHT
        self.agreement = {a: _Rate(0.5 * f * w * AGREEMENT_MIX[a],
                                   (1 - 0.5 * f) * w * AGREEMENT_MIX[a])
                          for a, f in AGREEMENT_PRIOR.items()}
        self._update_factors()
        if not self.tree_cands:
            # before any tree ran: LADE's figures, rising with g
            self.tree_cands = [0.8 * (1 - 0.5 ** (g + 1)) / (1 - 0.5 ** self.max_cands)
                               for g in range(self.max_cands)]

    def calibrate(self, expected: float, accepted: int) -> None:
        """A planned unchecked draft: ``expected`` tokens, ``accepted`` ones."""
        k = self.CALIBRATION_KEEP
        self.planned = self.planned * k + expected / self.calibration
        self.seen = self.seen * k + accepted
        if self.planned >= self.CALIBRATION_AFTER:
            self.calibration = min(self.CALIBRATION_MAX,
                                   max(self.CALIBRATION_MIN, self.seen / self.planned))

    def learn_unchecked(self, kind: str, hits: int, missed: bool) -> None:
        """A probe of ``kind`` ended after ``hits`` matches (``missed``: then a miss)."""
        rate = self.pooled[kind]
        rate.add(hits, missed, self.UNCHECKED_KEEP)
        self.p_unchecked[kind] = rate.p

    def observe_agreement(self, agree: str, first_accepted: bool) -> None:
        """A scored match of class ``agree``, by its first token."""
        for rate in self.agreement.values():
            rate.add(0, False, self.AGREEMENT_KEEP)
        self.agreement[agree].add(int(first_accepted), not first_accepted, 1.0)
        self._update_factors()

    def _update_factors(self) -> None:
        rates = self.agreement.values()
        hits, misses = sum(r.hits for r in rates), sum(r.misses for r in rates)
        total = hits / (hits + misses) if hits + misses > 0 else 0.0
        self._factors = {a: r.p / total if total > 0 else 1.0
                         for a, r in self.agreement.items()}

    def agreement_factor(self, agree: str) -> float:
        """The class's first-token acceptance over all matches'."""
        return self._factors[agree]

    def learn_checked(self, p: float) -> None:
        self.p_checked += self.ema * (p - self.p_checked)

    def learn_tree(self, per_g: list[float], window_extra: float | None) -> None:
        """One tree's outcome: a mean over the first trees, then an EMA."""
        self.trees_seen += 1
        rate = max(self.ema, 1.0 / (self.trees_seen + 1))
        for g, m in enumerate(per_g[: self.max_cands]):
            self.tree_cands[g] += rate * (m - self.tree_cands[g])
        if window_extra is not None:
            self.tree_window += rate * (window_extra - self.tree_window)

    def snapshot(self) -> dict:
        return {
            "p_unchecked": {k: round(v, 3) for k, v in self.p_unchecked.items()},
            "p_checked": round(self.p_checked, 3),
            "tree_confirmed_by_candidates": [round(m, 3) for m in self.tree_cands],
            "tree_window_extra": round(self.tree_window, 3),
            "trees_seen": self.trees_seen,
            "unchecked_calibration": round(self.calibration, 3),
            "agreement_factors": {a or "one": round(self.agreement_factor(a), 3)
                                  for a in self.agreement},
        }


class RequestAcceptance:
    """One request's estimates (``keep``: forgetting of its counts per
    update; ``relax``: pull of its tree estimates to the ``prior`` a step)."""

    def __init__(self, prior: AcceptancePrior, keep: float = 0.9, relax: float = 0.05) -> None:
        self.prior = prior
        self.keep = keep
        self.relax_rate = relax
        w, rates = prior.weight, prior.p_unchecked
        self.unchecked = {k: _RequestRate(0.0, 0.0, w, rates, k) for k in rates}
        self.checked = _Rate(prior.p_checked * w, (1 - prior.p_checked) * w)
        self.tree_cands = list(prior.tree_cands)
        self.tree_window = prior.tree_window
        #: lookups scored; the open probe, its kind and tokens matched so far
        self.seen = 0
        self._probe: list | None = None
        self._probe_kind = "suffix4"
        self._probe_hits = 0
        #: trees run, and steps since the last
        self.tree_runs = 0
        self.since_tree = 0

    def unchecked_p(self, kind: str = "suffix4") -> float:
        """Per-token acceptance of a lookup of ``kind`` (a match's times its
        agreement class's factor, at most :data:`P_MAX`)."""
        base, agree = split_kind(kind)
        p = self.unchecked[base].p
        if base in GUESS_KINDS:
            return p
        return min(p * self.prior.agreement_factor(agree), max(p, P_MAX))

    def unchecked_gain(self, k: int, kind: str = "suffix4") -> float:
        """Expected accepted tokens of a k-token unchecked draft, calibrated."""
        return geometric_gain(self.unchecked_p(kind), k) * self.prior.calibration

    def tree_gains(self, shapes) -> list[float]:
        """Tokens confirmed by a tree of each ``(g candidates, window_root(share))``."""
        cands, window = self.tree_cands, self.tree_window
        last = len(cands)
        return [(cands[(g if g < last else last) - 1] if g > 0 else 0.0)
                + (window * root if root else 0.0) for g, root in shapes]

    def observe_unchecked(self, draft, produced, kind: str = "suffix4") -> None:
        """Score the lookup ``draft`` (of ``kind``) against the tokens steps
        ``produced``, over as many steps as it needs (one probe at a time),
        so an undrafted lookup is judged on all its tokens."""
        if self._probe is None:
            if not draft:
                return
            self._probe, self._probe_kind, self._probe_hits = list(draft), kind, 0
        probe, hits = self._probe, self._probe_hits
        for tok in produced:
            if tok != probe[hits]:
                self._end_probe(hits, True)
                return
            hits += 1
            if hits == len(probe):
                self._end_probe(hits, False)
                return
        self._probe_hits = hits

    def _end_probe(self, hits: int, missed: bool) -> None:
        kind, agree = split_kind(self._probe_kind)
        self._probe = None
        self.seen += 1
        self.unchecked[kind].add(hits, missed, self.keep)
        self.prior.learn_unchecked(kind, hits, missed)
        if kind not in GUESS_KINDS:
            self.prior.observe_agreement(agree, hits > 0)

    def observe_checked(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        accepted = min(accepted, drafted)
        self.checked.add(accepted, accepted < drafted, self.keep)
        self.prior.learn_checked(self.checked.p)

    def observe_tree(self, matches: list[int], from_window: list[bool], window_on: float) -> None:
        """A tree ran: ``matches[c]`` tokens of candidate c confirmed,
        ``from_window[c]`` from a window; ``window_on``: its column share."""
        g_max = len(self.tree_cands)
        self.tree_runs += 1
        self.since_tree = 0
        # the text's candidates: what the tree confirms without the window
        per_g, best = [], 0
        for m, win in zip(matches, from_window):
            if not win:
                best = max(best, m)
                per_g.append(best)
        per_g = (per_g + [best] * g_max)[:g_max]
        a = 1 - self.keep
        for g in range(g_max):
            self.tree_cands[g] += a * (per_g[g] - self.tree_cands[g])
        extra = None
        if window_on:  # normalised to the whole window
            extra = (max(matches, default=0) - best) / window_root(window_on)
        elif any(from_window):
            # n-grams an earlier window harvested: credit where they beat the text's
            gained = max(matches, default=0) - best
            extra = gained if gained > 0 else None
        if extra is not None:
            self.tree_window += a * (extra - self.tree_window)
        self.prior.learn_tree(per_g, extra)

    def relax(self) -> None:
        """A step without a tree: tree estimates move towards the prior
        (once the engine has measured trees)."""
        r, p = self.relax_rate, self.prior
        self.since_tree += 1
        if p.trees_seen <= 0:
            return
        for g in range(len(self.tree_cands)):
            self.tree_cands[g] += r * (p.tree_cands[min(g, len(p.tree_cands) - 1)]
                                       - self.tree_cands[g])
        self.tree_window += r * (p.tree_window - self.tree_window)
