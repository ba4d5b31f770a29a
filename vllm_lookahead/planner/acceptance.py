"""Measured acceptance: what a step gains from each kind of draft.

Per request, running estimates of the tokens a step gains from

* an **unchecked draft** (prompt lookup: the continuation of the text's
  longest earlier-seen suffix, or the pool's guess): the chance ``p`` that
  each next draft token is accepted (geometric), so a draft of length k gains
  ``p + p^2 + ... + p^k`` tokens. It is updated from the text itself,
  whatever ran: the proposer looks the draft up anyway and compares it
  with the tokens that come out, over as many steps as its length needs
  (:meth:`RequestAcceptance.observe_unchecked`), so it never goes stale
  and a lookup that was not drafted is judged on all its tokens, not on
  the first one alone. Learnt per kind of lookup (:data:`LOOKUP_KINDS`); a
  match's ``p`` is multiplied by the engine's factor for how the key's
  places agreed on its first token (one place, all, split:
  :meth:`AcceptancePrior.agreement_factor`);
* a **tree** with ``g`` candidates and the Jacobi window on or off: the
  candidate tokens the model confirms, ``m``. One tree with G candidates
  tells what every g <= G would have confirmed (the best of the first g);
  leaving out the candidates that came from the window tells what the tree
  would have confirmed without it (:meth:`RequestAcceptance.observe_tree`).
  The window's gain is learnt for the whole window (W columns) and read
  for a tree of w columns as ``sqrt(w / W)`` of it (an assumption: the
  columns' n-grams overlap). Candidates the window harvested into the pool
  earlier credit the window when they confirm more than the text's, even in
  a tree without the window. A step without a tree learns nothing about
  trees, so between trees the estimates relax towards the engine's prior
  (:meth:`relax`) -- once the engine has measured trees: before that the
  prior is an assumption, and nothing is pulled towards it;
* a **checked draft** (the chain a tree confirmed): per-token acceptance
  ``p_checked`` (1 with greedy decoding; lower when sampling).

The engine's prior (:class:`AcceptancePrior`) learns from every request:
the unchecked kinds from all requests' probes pooled, the rest as running
means; new requests start from it, and a request's unchecked rates keep
reading the engine's current ones until its own probes outweigh them.

Pure Python, no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field


#: Upper ends of the long own-text match kinds (``suffix8``: 5-8 tokens).
LONG_SUFFIX_KINDS = (8, 16, 24)
#: Kinds of unchecked lookup, learnt apart per request: the continuation
#: of a 4-, 3- or 2-token suffix seen earlier in the text, of a 12-, 6-, 3-
#: or 2-token suffix in the engine's shared memory (other requests' text,
#: :mod:`.memory`), what followed the newest token alone in the memory's
#: text (``memory1``: where the request's own pool has nothing for it), or
#: the pool's guess for the newest token alone; where lookups run past N
#: (``lookup_len``), also of a suffix of 17-24, 9-16 or 5-8 tokens seen
#: earlier in the text (:func:`match_kind`).
LOOKUP_KINDS = (*(f"suffix{b}" for b in reversed(LONG_SUFFIX_KINDS)), "suffix4", "suffix3",
                "suffix2", "memory12", "memory6", "memory3", "memory2", "memory1", "pool",
                "poolsplit")
#: The guesses for the newest token alone (no key's places voted on them,
#: so no agreement class). The pool's guess is two kinds: ``"pool"``, its
#: token's only continuation or one seen more often than the others
#: together, and ``"poolsplit"``, the most often seen (then newest) of
#: continuations none of which has most of the counts
#: (:func:`pool_kind`). Replayed sampled text (SmolLM2, T 0.8, top-p
#: 0.95, the pool of the text's own n-grams; ``benchmarks/replay_drafts.py
#: --by-kind``, stop 63): first tokens matched 0.39 against 0.17 of the
#: time on the template set, 0.25 against 0.21 on HumanEval and 0.18
#: against 0.13 on MT-Bench (n=4).
GUESS_KINDS = ("memory1", "pool", "poolsplit")
#: The kinds that match a key (all but the guesses).
MATCH_KINDS = tuple(k for k in LOOKUP_KINDS if k not in GUESS_KINDS)
#: How the key's places agreed on a match's first token
#: (``state.agreement``, appended to its kind: ``"suffix3+"``): one place,
#: every place the same, split; and the factor of each class's acceptance
#: over all matches' assumed before any was seen. Learnt engine-wide
#: (:meth:`AcceptancePrior.agreement_factor`): a request sees too few of
#: each class to learn them itself.
AGREEMENT_PRIOR = {"": 1.0, "+": 1.2, "-": 0.6}
#: The share of matches assumed of each class (so that the pooled rate the
#: factors divide by starts at the one-place rate: every factor as
#: assumed).
AGREEMENT_MIX = {"": 0.625, "+": 0.25, "-": 0.125}
#: Highest per-token acceptance a class factor may lift an estimate to.
P_MAX = 0.98


def pool_kind(counts: list[int], best: int) -> str:
    """The kind of the pool's guess ``best`` among its token's
    continuations seen ``counts`` times (each at least once):
    ``"pool"`` where it holds more than half of the counts (as the only
    one does), else ``"poolsplit"``."""
    return "pool" if 2 * counts[best] > sum(counts) else "poolsplit"


def split_kind(kind: str) -> tuple[str, str]:
    """``"suffix3+"`` -> ``("suffix3", "+")``; ``"pool"`` -> ``("pool", "")``."""
    if kind and kind[-1] in "+-":
        return kind[:-1], kind[-1]
    return kind, ""


def match_kind(source: str, m: int) -> str:
    """The kind of a match of ``m`` tokens from ``source`` (``"suffix"``:
    the request's own text, ``"memory"``: the shared memory, whose key
    lengths are kinds as they are): ``suffix2``..``suffix4``, then the
    long buckets ``suffix8`` (5-8), ``suffix16`` (9-16), ``suffix24``
    (17 and more)."""
    if source == "suffix" and m > 4:
        m = next((b for b in LONG_SUFFIX_KINDS if m <= b), LONG_SUFFIX_KINDS[-1])
    return f"{source}{m}"


def geometric_gain(p: float, k: int) -> float:
    """Expected accepted tokens of a k-token draft whose tokens are each
    accepted with probability ``p`` (given the previous ones were)."""
    if k <= 0 or p <= 0:
        return 0.0
    if p >= 1:
        return float(k)
    return p * (1 - p**k) / (1 - p)


def window_root(share: float) -> float:
    """``sqrt(share)`` of a tree's share of its W window columns, at most 1
    (0 for none): the factor of :func:`window_gain`."""
    if not share or share <= 0:
        return 0.0
    return min(float(share), 1.0) ** 0.5


def window_gain(full: float, share: float) -> float:
    """The window's gain for a tree with ``share`` of its W columns, from
    ``full``, the gain of all W: ``full * sqrt(share)`` (0 for none)."""
    root = window_root(share)
    return full * root if root else 0.0


@dataclass
class _Rate:
    """A geometric acceptance rate from (accepted, rejected) counts with
    exponential forgetting; ``prior`` pseudo-counts at rate ``p0``."""

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
    """A request's geometric rate of one lookup kind: its own (accepted,
    rejected) counts, forgetting ``keep`` a probe, over ``w`` pseudo-counts
    at the engine's rate for the kind *now* (``rates[kind]``, the prior's
    live dict), ``w`` forgetting with them. So a request reads what the
    engine learns while it runs (the n samples of one prompt learn a kind
    together, not each from the prior of its start), until its own probes
    outweigh it. Built with counts alone (``w`` 0), the counts' rate."""

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
    """Engine-wide estimates new requests start from, and relax towards.

    Attributes:
        p_unchecked, p_checked: per-token acceptance of unchecked / checked
            drafts.
        tree_cands: ``[g]`` -> confirmed tokens of a tree checking g+1
            candidates from the text (not from the window).
        tree_window: confirmed tokens the window's candidates added on top
            of the others (the window's marginal gain).
        weight: pseudo-count of the prior in a new request's rates.
        ema: weight of one request's outcome in the prior's checked-draft
            and tree estimates (the unchecked kinds are pooled instead,
            :meth:`learn_unchecked`).
    """

    max_cands: int
    #: per kind of lookup (see :data:`LOOKUP_KINDS`); filled in post-init
    p_unchecked: dict = None
    p_checked: float = 0.95
    tree_cands: list[float] = field(default_factory=list)
    tree_window: float = 0.3
    weight: float = 4.0
    ema: float = 0.02

    def __post_init__(self) -> None:
        if not isinstance(self.p_unchecked, dict):
            p = 0.5 if self.p_unchecked is None else float(self.p_unchecked)
            # a longer matched suffix predicts its continuation better: past
            # 4 tokens (lookups past N) the text is being copied (replayed
            # sampled HumanEval and MT-Bench text, n=4: the first token of a
            # 5-8 token match's continuation matched about 0.8 of the time,
            # each next one after a match 0.75-0.9)
            self.p_unchecked = {"suffix24": min(p * 1.7, P_MAX), "suffix16": min(p * 1.7, P_MAX),
                                "suffix8": min(p * 1.5, P_MAX),
                                "suffix4": p, "suffix3": p * 0.9, "suffix2": p * 0.8,
                                "memory12": p, "memory6": p * 0.9, "memory3": p * 0.7,
                                "memory2": p * 0.65, "memory1": p * 0.6, "pool": p * 0.6,
                                "poolsplit": p * 0.4}
        # per kind, every request's probes pooled (accepted tokens, misses),
        # from pseudo-counts at the assumed rates
        w = self.UNCHECKED_WEIGHT
        self.pooled = {k: _Rate(p * w, (1 - p) * w) for k, p in self.p_unchecked.items()}
        # per agreement class, its matches' first tokens accepted and not
        # (forgetting slowly), from pseudo-counts at the assumed factors
        # of 0.5, in the assumed mix
        w = self.AGREEMENT_WEIGHT
        self.agreement = {a: _Rate(0.5 * f * w * AGREEMENT_MIX[a],
                                   (1 - 0.5 * f) * w * AGREEMENT_MIX[a])
                          for a, f in AGREEMENT_PRIOR.items()}
        self._update_factors()
        if not self.tree_cands:
            # Before any tree ran: LADE's figures (about one confirmed token
            # per step with a handful of candidates), rising with g.
            self.tree_cands = [0.8 * (1 - 0.5 ** (g + 1)) / (1 - 0.5 ** self.max_cands)
                               for g in range(self.max_cands)]

    #: trees the engine has learnt from (the prior is LADE's figures at 0)
    trees_seen: int = 0
    #: Calibration of the unchecked drafts the planner chose: accepted over
    #: expected draft tokens, summed with forgetting (``CALIBRATION_KEEP``
    #: per draft); ``calibration`` scales every unchecked gain, within
    #: [``CALIBRATION_MIN``, ``CALIBRATION_MAX``] once ``CALIBRATION_AFTER``
    #: tokens were expected. It takes back what the verifier did not give
    #: (the planner picks the drafts it expects most of, whose estimates
    #: can run high) and gives what it gave beyond the estimates: over the
    #: 1088 sampled lookahead rows saved up to stop 62, most run with a
    #: ceiling of 1, the verifier accepted a median 1.05x the tokens the
    #: planner expected (quartiles 1.00 and 1.11) and 1.12x on the template
    #: set (110 of its 113 rows above 1): the ceiling left the planner
    #: drafting less than it measured paid (``benchmarks/planned_vs_seen.py``).
    #: Seeded requests never read it (their priors are their own and are
    #: never calibrated).
    planned: float = 0.0
    seen: float = 0.0
    calibration: float = 1.0
    #: Pseudo-counts (tokens) of each lookup kind's assumed rate in the
    #: engine's pooled counts, and the forgetting of a kind's counts per
    #: probe of that kind (:meth:`learn_unchecked`).
    UNCHECKED_WEIGHT = 8.0
    UNCHECKED_KEEP = 0.99
    #: Pseudo-counts of the agreement classes' assumed rates (all classes
    #: together), and the forgetting of their counts per probe.
    AGREEMENT_WEIGHT = 32.0
    AGREEMENT_KEEP = 0.998
    CALIBRATION_KEEP = 0.98
    CALIBRATION_AFTER = 8.0
    CALIBRATION_MIN = 0.3
    CALIBRATION_MAX = 1.5

    def tree_gain(self, g: int, window: float) -> float:
        """``window``: the share of the W columns the tree carries (0: off;
        True: all)."""
        base = self.tree_cands[min(g, self.max_cands) - 1] if g > 0 else 0.0
        return base + window_gain(self.tree_window, window)

    def calibrate(self, expected: float, accepted: int) -> None:
        """A planned unchecked draft: ``expected`` draft tokens accepted by
        the (calibrated) estimate a step ago, ``accepted`` by the verifier."""
        k = self.CALIBRATION_KEEP
        self.planned = self.planned * k + expected / self.calibration
        self.seen = self.seen * k + accepted
        if self.planned >= self.CALIBRATION_AFTER:
            self.calibration = min(self.CALIBRATION_MAX,
                                   max(self.CALIBRATION_MIN, self.seen / self.planned))

    def learn_unchecked(self, kind: str, hits: int, missed: bool) -> None:
        """A request's probe of ``kind`` ended: ``hits`` tokens matched,
        then a mismatch (``missed``) or the draft's end. Every request's
        probes are pooled per kind, forgetting ``UNCHECKED_KEEP`` per probe
        of the kind, so the engine's rate follows the probes themselves.
        Learnt before as a running mean of the requests' smoothed rates
        (each starting at the prior itself), a kind whose tokens are right
        5% of the time, probed 3 times a request, took the prior from 0.30
        to 0.25, 0.19 and 0.15 in 8, 24 and 48 requests; pooled, to 0.11,
        0.07 and 0.06 (means of 100 simulated runs)."""
        rate = self.pooled[kind]
        rate.add(hits, missed, self.UNCHECKED_KEEP)
        self.p_unchecked[kind] = rate.p

    def observe_agreement(self, agree: str, first_accepted: bool) -> None:
        """A scored match of agreement class ``agree``, whose first token
        was accepted or not. Counted by its first token alone: each match
        once, however long it ran (counted by tokens, the long runs of
        unanimous matches would weigh the pooled rate towards their class
        and the others' factors down). Every class forgets at each match,
        so the pooled counts weigh the classes by how often they occur."""
        for rate in self.agreement.values():
            rate.add(0, False, self.AGREEMENT_KEEP)
        self.agreement[agree].add(int(first_accepted), not first_accepted, 1.0)
        self._update_factors()

    def _update_factors(self) -> None:
        """The classes' factors from their counts, kept until the next
        match is scored (the planner reads them for every draft length of
        every request each step)."""
        rates = self.agreement.values()
        hits, misses = sum(r.hits for r in rates), sum(r.misses for r in rates)
        total = hits / (hits + misses) if hits + misses > 0 else 0.0
        self._factors = {a: r.p / total if total > 0 else 1.0
                         for a, r in self.agreement.items()}

    def agreement_factor(self, agree: str) -> float:
        """The class's share of matches whose first token was accepted over
        all matches' (the classes' counts pooled): what a match's
        per-token estimate, learnt over every class, is multiplied by for
        a match of this class."""
        return self._factors[agree]

    def learn_checked(self, p: float) -> None:
        self.p_checked += self.ema * (p - self.p_checked)

    def learn_tree(self, per_g: list[float], window_extra: float | None) -> None:
        """One tree's outcome: a running mean over the first trees (the
        assumed start is forgotten fast), then an EMA."""
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
    """One request's acceptance estimates (see the module docstring).

    Args:
        prior: the engine's :class:`AcceptancePrior` (shared, updated by
            every request's outcomes).
        keep: forgetting factor of the request's own counts per update.
        relax: how far, per step without a tree, the tree estimates move
            back towards the prior.
    """

    def __init__(self, prior: AcceptancePrior, keep: float = 0.9, relax: float = 0.05) -> None:
        self.prior = prior
        self.keep = keep
        self.relax_rate = relax
        w = prior.weight
        rates = prior.p_unchecked
        self.unchecked = {k: _RequestRate(0.0, 0.0, w, rates, k) for k in rates}
        self.checked = _Rate(prior.p_checked * w, (1 - prior.p_checked) * w)
        self.tree_cands = list(prior.tree_cands)
        self.tree_window = prior.tree_window
        #: Unchecked lookups compared with the tokens that came.
        self.seen = 0
        #: The lookup being scored (:meth:`observe_unchecked`), its kind and
        #: its tokens matched so far.
        self._probe: list | None = None
        self._probe_kind = "suffix4"
        self._probe_hits = 0
        #: Trees this request ran, and steps since its last one.
        self.tree_runs = 0
        self.since_tree = 0

    # -- what the planner reads ------------------------------------------------
    def unchecked_p(self, kind: str = "suffix4") -> float:
        """Per-token acceptance of an unchecked draft of ``kind`` (a
        :data:`LOOKUP_KINDS` entry, a match's with its agreement class
        appended): the request's rate of the kind, times the engine's
        factor of the class (:meth:`AcceptancePrior.agreement_factor`) for
        a match, at most :data:`P_MAX` then."""
        base, agree = split_kind(kind)
        p = self.unchecked[base].p
        if base in GUESS_KINDS:
            return p
        return min(p * self.prior.agreement_factor(agree), max(p, P_MAX))

    def unchecked_gain(self, k: int, kind: str = "suffix4") -> float:
        """Expected accepted tokens of a k-token unchecked draft, scaled by
        the engine's calibration (:meth:`AcceptancePrior.calibrate`)."""
        return geometric_gain(self.unchecked_p(kind), k) * self.prior.calibration

    def tree_gain(self, g: int, window: float) -> float:
        """Expected confirmed tokens of a tree with ``g`` candidates and
        ``window`` of the W window columns (0: off; True: all). Each
        confirmed token is drafted, checked, in the next step."""
        return self.tree_gains(((g, window_root(window)),))[0]

    def tree_gains(self, shapes) -> list[float]:
        """:meth:`tree_gain` of each of ``shapes``, ``(g, root)`` pairs
        (``root``: :func:`window_root` of its window share), in one pass
        (the planner prices a dozen trees per request per step)."""
        cands, window = self.tree_cands, self.tree_window
        last = len(cands)
        return [(cands[(g if g < last else last) - 1] if g > 0 else 0.0)
                + (window * root if root else 0.0) for g, root in shapes]

    # -- what the proposer reports ---------------------------------------------
    def observe_unchecked(self, draft, produced, kind: str = "suffix4") -> None:
        """The unchecked draft looked up before a step (``kind`` of lookup:
        :data:`LOOKUP_KINDS`; empty: none), and the tokens the step
        produced (whatever was drafted).

        A lookup is scored against the text over as many steps as its
        length needs (a *probe*; one at a time, lookups made while one is
        open are not scored): each matching token is a hit, the first
        mismatch a miss and the end of the probe. Scored against one step's
        tokens alone, a lookup the planner did not draft would be judged
        on its first token only (a step without a draft produces one), and
        the planner would project a long draft from first tokens, which
        are accepted less often than the tokens after an accepted one."""
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
        rate = self.unchecked[kind]
        rate.add(hits, missed, self.keep)
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
        """A tree ran: ``matches[c]`` tokens of candidate c (in the order
        the tree checked them) were confirmed; ``from_window[c]``: the
        candidate came from the Jacobi window (this step's or one that
        harvested it earlier); ``window_on``: the share of the W columns
        the tree carried (0: none)."""
        g_max = len(self.tree_cands)
        self.tree_runs += 1
        self.since_tree = 0
        # Candidates from the prompt / text: what the tree confirms without
        # the window, by how many of them it checks.
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
        if window_on:
            # normalised to the whole window (see window_gain)
            extra = (max(matches, default=0) - best) / window_gain(1.0, window_on)
        elif any(from_window):
            # n-grams an earlier window harvested: credit where they beat
            # the text's candidates (no window now: no evidence against it)
            gained = max(matches, default=0) - best
            extra = gained if gained > 0 else None
        if extra is not None:
            self.tree_window += a * (extra - self.tree_window)
        self.prior.learn_tree(per_g, extra)

    def relax(self) -> None:
        """A step without a tree: tree estimates move towards the prior,
        once the engine has measured trees (never towards its assumed
        start)."""
        r = self.relax_rate
        p = self.prior
        self.since_tree += 1
        if p.trees_seen <= 0:
            return
        for g in range(len(self.tree_cands)):
            self.tree_cands[g] += r * (p.tree_cands[min(g, len(p.tree_cands) - 1)]
                                       - self.tree_cands[g])
        self.tree_window += r * (p.tree_window - self.tree_window)
