"""Per-request lookahead state: the n-gram pool and the Jacobi window.

Pure logic (numpy only), unit-tested without an engine. The vLLM glue in
``proposer.py`` keeps one :class:`RequestState` per request id.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

#: Where an n-gram in the pool came from.
SOURCE_WINDOW = "window"  # harvested from the Jacobi window
SOURCE_PROMPT = "prompt"  # an n-gram of the prompt or of the accepted text
SOURCE_MEMORY = "memory"  # other requests' text (the engine's shared memory)
#: Draft token that is the target's own next-token prediction from the
#: lookahead pass (not an n-gram token).
SOURCE_MODEL = "model"
SOURCES = (SOURCE_WINDOW, SOURCE_PROMPT, SOURCE_MEMORY, SOURCE_MODEL)


class NGramPool:
    """N-gram pool of one request: key token -> at most ``cap`` continuations.

    Each key keeps an LRU list of ``(N-1)``-token continuations: adding one
    that is present moves it to the newest end and bumps its count; adding a
    new one to a full list drops the oldest. The source recorded for a
    continuation is the one that first added it.
    """

    __slots__ = ("cap", "_d")

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"pool cap must be >= 1, got {cap}")
        self.cap = cap
        # key -> OrderedDict[cont tuple -> [count, source]], oldest first
        self._d: dict[int, OrderedDict[tuple[int, ...], list]] = {}

    def add(self, key: int, cont: tuple[int, ...], source: str) -> None:
        entries = self._d.get(key)
        if entries is None:
            entries = self._d[key] = OrderedDict()
        entry = entries.get(cont)
        if entry is not None:
            entry[0] += 1
            entries.move_to_end(cont)
            return
        entries[cont] = [1, source]
        if len(entries) > self.cap:
            entries.popitem(last=False)

    def get(self, key: int) -> list[tuple[tuple[int, ...], int, str]]:
        """Continuations of ``key``, newest first, as (tokens, count, source)."""
        entries = self._d.get(key)
        if not entries:
            return []
        return [(c, e[0], e[1]) for c, e in reversed(entries.items())]

    def count(self, key: int) -> int:
        """Number of continuations of ``key``."""
        entries = self._d.get(key)
        return len(entries) if entries else 0

    def __len__(self) -> int:
        """Number of stored continuations (all keys)."""
        return sum(len(e) for e in self._d.values())

    @property
    def num_keys(self) -> int:
        return len(self._d)


class JacobiWindow:
    """The N-1 levels of Jacobi guesses of one request.

    ``levels`` is int32 [N-1, W]: row 0 is level 0 (only its first W-1 columns
    are used: with the root in front they form the trunk ``B0``), rows
    1..N-2 are levels 1..N-2.
    """

    __slots__ = ("n", "w", "levels", "steps")

    def __init__(self, ngram_size: int, window_size: int, init_tokens: np.ndarray) -> None:
        self.n = ngram_size
        self.w = window_size
        self.levels = np.asarray(init_tokens, dtype=np.int32).reshape(
            ngram_size - 1, window_size
        ).copy()
        #: Jacobi steps taken; the window is warm (its levels come from the
        #: model, not from the random initialisation) once steps >= N-2.
        self.steps = 0

    @classmethod
    def random_init(
        cls, ngram_size: int, window_size: int, context: np.ndarray, seed: int
    ) -> "JacobiWindow":
        """Fill every level with tokens drawn from ``context`` (LADE's init),
        deterministically from ``seed``."""
        rng = np.random.default_rng(seed)
        context = np.asarray(context, dtype=np.int32)
        size = (ngram_size - 1) * window_size
        if context.size == 0:
            init = np.zeros(size, dtype=np.int32)
        else:
            init = context[rng.integers(0, context.size, size=size)]
        return cls(ngram_size, window_size, init)

    @property
    def warm(self) -> bool:
        return self.steps >= self.n - 2

    def columns(self, root: int, new: np.ndarray) -> list[tuple[int, tuple[int, ...]]]:
        """The n-grams of this step as (key, continuation), one per column
        the tree carried (``len(new)``: the first w <= W columns).

        Column j is ``(B0[j], B_1[j], ..., B_{N-2}[j], new[j])`` where
        ``B0 = [root, L0[0], ..., L0[W-2]]``.
        """
        w = len(new)
        trunk = np.empty(w, dtype=np.int32)
        trunk[0] = root
        trunk[1:] = self.levels[0, : w - 1]
        upper = self.levels[1:, :w]  # [N-2, w]
        cols = np.concatenate([upper, np.asarray(new, dtype=np.int32)[None, :]], axis=0)
        t = trunk.tolist()
        c = cols.T.tolist()  # [w][N-1]
        return [(t[j], tuple(c[j])) for j in range(w)]

    def shift(self, new: np.ndarray) -> None:
        """One Jacobi step: ``L0 <- L1[1:]``, ``L_l <- L_{l+1}``, newest <- new,
        over the first ``len(new)`` columns (a tree may carry fewer than W:
        the others keep their guesses until a tree carries them)."""
        new = np.asarray(new, dtype=np.int32)
        w = len(new)
        if self.n == 2:
            self.levels[0, : w - 1] = new[1:]
        else:
            self.levels[0, : w - 1] = self.levels[1, 1:w]
            self.levels[1:-1, :w] = self.levels[2:, :w]
            self.levels[-1, :w] = new
        self.steps += 1


def sibling_group(req_id: str) -> str | None:
    """The parent of a request that is one of the n samples of a request:
    vLLM names the samples ``"{index}_{parent id}"``
    (``vllm.v1.engine.parallel_sampling.ParentRequest``); None for any other
    id."""
    head, sep, parent = req_id.partition("_")
    return parent if sep and head.isdigit() and parent else None


#: Key of a request's ``SamplingParams.extra_args`` under which the
#: frontend writes its parent's n (``patches`` 13): vLLM gives each of the n
#: samples ``n = 1``, and a seeded sample's draft is priced in a step of n.
SAMPLES_KEY = "_lookahead_samples"


def request_seed(base_seed: int, prompt_token_ids: np.ndarray) -> int:
    """Seed of a request's window: a function of the base seed and the prompt
    tokens only, so every tensor-parallel rank (and every rerun) agrees."""
    data = np.asarray(prompt_token_ids, dtype=np.int32).tobytes()
    return (zlib.crc32(data) ^ (base_seed * 0x9E3779B1)) & 0xFFFFFFFF


@dataclass
class RequestState:
    """Everything lookahead keeps for one request."""

    window: JacobiWindow
    pool: NGramPool
    num_prompt_tokens: int = 0
    #: The request's output cap (``SamplingParams.max_tokens``), if any.
    max_tokens: int | None = None
    #: Its parent request when it is one of n samples (``sibling_group``),
    #: else None.
    group: str | None = None
    #: Its own bound for quiet steps (``planner.BestCase``, taken at the
    #: last full step; None: none yet) and, by batch size, the least weight
    #: at which a draft of it could pay (``Planner.pay_weight``;
    #: ``step.QuietBatches``).
    quiet_best: object = None
    quiet_pays: dict = field(default_factory=dict)
    #: Number of the request's tokens whose n-grams are in the pool
    #: (0 when the prompt pool is off).
    pooled_upto: int = 0
    #: Sources of the draft handed to the verifier last step, per position.
    draft_sources: list[str] = field(default_factory=list)
    #: The request's own settings (``config.RequestSettings``).
    settings: object = None
    #: Fused mode: the tree planned for the request's next step.
    plan: object = None
    #: Whether the last draft was checked by a tree (else unchecked).
    draft_checked: bool = False
    #: The kind of the step's draft, for the stats: the lookup's kind
    #: (``lookup_kind``) or ``"checked"`` (a tree's chain).
    draft_kind: str = ""
    #: The draft tokens the planner expected the verifier to accept of the
    #: last step's unchecked draft (None: not planned so), to compare with
    #: what it accepted (``LookaheadStats.planned_gain``).
    draft_expect: float | None = None
    #: The unchecked draft looked up for the last step (whatever ran), to
    #: learn its acceptance from the text that came.
    lookup: list = field(default_factory=list)
    lookup_sources: list = field(default_factory=list)
    lookup_kind: str = "pool"
    #: Acceptance estimates (``acceptance.RequestAcceptance``).
    acc: object = None
    #: A sampled request with a seed: planned from its text alone.
    seeded: bool = False
    #: The batch a seeded request's draft is priced in
    #: (``Planner.steady_draft``): fixed when it starts (its parent's n, or
    #: ``LookaheadConfig.seeded_batch``), never the batch it meets.
    seeded_batch: int = 1
    #: A sampled request (temperature > 0): its drafts cost vLLM's
    #: sampled verification (``CostModel.verify``).
    sampled: bool = False
    #: Its bonus rows may be sampled lazily, only after a wholly accepted
    #: draft (``lazy_bonus.request_applies``): a rejected draft saves one.
    lazy_bonus: bool = False
    #: Its document in the engine's shared memory (None: not in it) and
    #: whether it drafts from the memory (not a seeded request's).
    memory_doc: int | None = None
    memory_reads: bool = False
    #: Its scope there (``memory.scope_of(cache_salt)``) and how many of its
    #: tokens the memory has.
    memory_scope: int = 0
    memory_upto: int = 0
    #: Its own text, indexed for the lookup (:class:`TextIndex`).
    text_index: "TextIndex" = field(default_factory=lambda: TextIndex())

    def add_context_ngrams(self, tokens: np.ndarray, n: int, upto: int) -> None:
        """Add every n-gram of ``tokens[:upto]`` not added yet (prompt pool)."""
        start = max(self.pooled_upto - n + 1, 0)
        if upto - start >= n:
            toks = np.asarray(tokens[start:upto]).tolist()
            for i in range(len(toks) - n + 1):
                self.pool.add(toks[i], tuple(toks[i + 1 : i + n]), SOURCE_PROMPT)
        self.pooled_upto = max(self.pooled_upto, upto)


def suffix_lookup(tokens: np.ndarray, n: int, k: int, min_len: int = 2,
                  max_len: int = 4) -> list[int]:
    """The continuation of :func:`suffix_match` alone."""
    return suffix_match(tokens, n, k, min_len, max_len)[0]


#: Places of a key that vote on a lookup's draft (the newest ones;
#: :func:`vote_draft`).
MAX_PLACES = 16
#: A voted draft stops where fewer than this share of the key's places
#: agree with it all the way (suffix decoding's ``min_token_prob`` is 0.1).
MIN_PROB = 0.1


def suffix_match(tokens: np.ndarray, n: int, k: int, min_len: int = 2,
                 max_len: int = 4, min_prob: float | None = None,
                 max_places: int = MAX_PLACES) -> tuple[list[int], int]:
    """Prompt lookup with a multi-token key: the ``k`` tokens that followed
    the most recent earlier occurrence of the longest suffix of
    ``tokens[:n]`` (``max_len`` down to ``min_len`` tokens long), or ``[]``.

    The pool keys n-grams by one token (LADE); matching 2-4 tokens of the
    text, as vLLM's ``ngram`` method does, picks far more precise
    continuations where the output copies from the prompt (code). Numpy,
    O(n) per call.

    Args:
        tokens: int array, at least ``n`` long (the request's tokens).
        n: number of valid tokens.
        k: longest continuation returned.
        min_prob: None: the newest place's continuation. A share: the
            newest ``max_places`` places of the longest suffix vote
            (:func:`vote_draft`).

    Returns:
        (continuation, length of the matched suffix); ``([], 0)`` for none.
    """
    cont, m, _ = suffix_vote(tokens, n, k, min_len, max_len, min_prob, max_places)
    return cont, m


def suffix_vote(tokens: np.ndarray, n: int, k: int, min_len: int = 2,
                max_len: int = 4, min_prob: float | None = None,
                max_places: int = MAX_PLACES) -> tuple[list[int], int, str]:
    """:func:`suffix_match` and the places' :func:`agreement` on its first
    token: ``(continuation, matched length, agreement)``."""
    if k <= 0 or n - 1 < min_len:
        return [], 0, ""
    t = np.asarray(tokens[:n])
    # Ends e <= n - 2 of the earlier places where the last min_len tokens
    # occur (one pass over the text; the suffix itself ends at n - 1).
    hit = t[min_len - 1: n - 1] == t[n - 1]
    for j in range(1, min_len):
        hit &= t[min_len - 1 - j: n - 1 - j] == t[n - 1 - j]
    ends = np.flatnonzero(hit) + (min_len - 1)
    if not ends.size:
        return [], 0, ""
    # Then one token further back at a time, while some place still
    # matches (O(match length) numpy calls, not one search per length).
    m, top = min_len, min(max_len, n - 1)
    while m < top:
        longer = ends[ends >= m]
        longer = longer[t[longer - m] == t[n - 1 - m]]
        if not longer.size:
            break
        ends, m = longer, m + 1
    cont, agree = _continue(t, ends, k, min_prob, max_places)
    return cont, m, agree


def _continue(t: np.ndarray, ends: np.ndarray, k: int, min_prob: float | None,
              max_places: int) -> tuple[list[int], str]:
    """The draft after the places ending at ``ends`` (ascending) of ``t``,
    and the places' :func:`agreement`."""
    if min_prob is None or ends.size == 1:
        e = int(ends[-1])
        return t[e + 1: e + 1 + k].tolist(), ""
    conts = [t[e + 1: e + 1 + k].tolist() for e in ends[::-1][:max_places].tolist()]
    draft = vote_draft(conts, k, min_prob)
    return draft, agreement(conts, draft)


def vote_draft(conts: list[list[int]], k: int, min_prob: float) -> list[int]:
    """The draft that the continuations of a key's places (newest first)
    vote for, token by token, as a suffix tree's counts do: each next token
    is the one most of the places that agree with the draft so far continue
    with (the newest place's among equals); the draft stops where the places
    that agree with it all the way are fewer than ``min_prob`` of all (a
    frequency estimate of the chance the whole draft is right; suffix
    decoding's ``min_token_prob``). One place: its continuation."""
    if not conts:
        return []
    if len(conts) == 1:
        return conts[0][:k]
    out: list[int] = []
    agree = conts
    need = min_prob * len(conts)
    for d in range(k):
        votes: dict[int, int] = {}
        for c in agree:
            if d < len(c):
                votes[c[d]] = votes.get(c[d], 0) + 1
        if not votes:
            break
        best = max(votes.values())
        if best < need:
            break
        tok = next(c[d] for c in agree if d < len(c) and votes[c[d]] == best)
        out.append(tok)
        agree = [c for c in agree if d < len(c) and c[d] == tok]
    return out


#: Agreement classes of a voted lookup (:func:`agreement`): one place, all
#: places agreeing on its first token, the places split.
AGREEMENTS = ("", "+", "-")


def agreement(conts: list[list[int]], draft: list[int]) -> str:
    """How the places a draft was voted from (their continuations) agree
    on its first token: ``""`` one place (or no draft), ``"+"`` two or more
    places, every one continuing with it, ``"-"`` some place continuing
    otherwise. On sampled text (SmolLM2, T 0.8, top-p 0.95; HumanEval and
    MT-Bench at n 4, the template set; replayed), the first token of a
    unanimous draft matched the sample 73-100% of the time, of a split
    one 11-31%, of a one-place one 34-88%, by key kind and length (cells
    of 14 drafts or more; ``benchmarks/replay_drafts.py --by-kind``): the
    planner multiplies a match's estimate by its class's factor
    (``acceptance.AcceptancePrior.agreement_factor``)."""
    if len(conts) < 2 or not draft:
        return ""
    first = draft[0]
    return "+" if all(c and c[0] == first for c in conts) else "-"


def choose_candidate(
    matches: list[int], counts: list[int]
) -> int:
    """Index of the best candidate: longest confirmed prefix, then the most
    often seen, then the newest (lowest index, candidates come newest first).
    Returns -1 for an empty list."""
    best = -1
    for i, (m, c) in enumerate(zip(matches, counts)):
        if best < 0 or (m, c) > (matches[best], counts[best]):
            best = i
    return best


class TextIndex:
    """A request's own text, indexed as it grows, for :func:`suffix_vote`'s
    lookup of its newest tokens: the same answers, without a pass over the
    whole text per step. Keeps the text as a Python list and, per pair of
    tokens, the places (ends, ascending) where it occurs; each call adds
    what the text gained since the last.

    A lookup costs a dict read and a pass over the places of the text's
    last two tokens, against :func:`suffix_vote`'s half a dozen numpy
    calls over the whole text (which the forward between two steps leaves
    out of the caches)."""

    __slots__ = ("toks", "ends")

    def __init__(self) -> None:
        self.toks: list[int] = []
        #: (token e-1, token e) -> the ends e with that pair, ascending
        #: (every e <= len(toks) - 2: the newest pair is added with the
        #: next token, as the lookup's own suffix is no earlier place)
        self.ends: dict[tuple[int, int], list[int]] = {}

    def vote(self, tokens: np.ndarray, n: int, k: int, min_prob: float | None = None,
             max_len: int = 4, max_places: int = MAX_PLACES) -> tuple[list[int], int, str]:
        """:func:`suffix_vote` ``(tokens, n, k, 2, max_len, min_prob,
        max_places)``. ``tokens[:n]`` must extend the text of the last call,
        as a request's tokens do (a preempted request gets a new state); a
        shorter text, or one whose token where the last call's text ended
        differs, is indexed afresh (a check of one token, not of all)."""
        toks = self.toks
        have = len(toks)
        if n < have or (have and int(tokens[have - 1]) != toks[-1]):
            self.toks, self.ends = [], {}
            toks, have = self.toks, 0
        if n > have:
            toks.extend(np.asarray(tokens[have:n]).tolist())
            ends = self.ends
            # pairs ending at e = have - 1 .. n - 2 (before: up to have - 2)
            for e in range(max(have - 1, 1), n - 1):
                key = (toks[e - 1], toks[e])
                got = ends.get(key)
                if got is None:
                    ends[key] = [e]
                else:
                    got.append(e)
        if k <= 0 or n - 1 < 2:
            return [], 0, ""
        ends = self.ends.get((toks[n - 2], toks[n - 1]))
        if not ends:
            return [], 0, ""
        m, top = 2, min(max_len, n - 1)
        while m < top:
            want = toks[n - 1 - m]
            longer = [e for e in ends if e >= m and toks[e - m] == want]
            if not longer:
                break
            ends, m = longer, m + 1
        if min_prob is None or len(ends) == 1:
            e = ends[-1]
            return toks[e + 1: e + 1 + k], m, ""
        conts = [toks[e + 1: e + 1 + k] for e in reversed(ends[-max_places:])]
        draft = vote_draft(conts, k, min_prob)
        return draft, m, agreement(conts, draft)
