"""Per-request lookahead state (n-gram pool, Jacobi window) and the text lookups; numpy only."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

#: Where a draft token came from: a window n-gram, own text, shared memory, the model.
SOURCE_WINDOW, SOURCE_PROMPT, SOURCE_MEMORY, SOURCE_MODEL = "window", "prompt", "memory", "model"
SOURCES = (SOURCE_WINDOW, SOURCE_PROMPT, SOURCE_MEMORY, SOURCE_MODEL)

#: Places of a key that vote on a lookup's draft (the newest ones).
MAX_PLACES = 16
#: A voted draft stops where fewer places agree (suffix decoding's ``min_token_prob``).
MIN_PROB = 0.1

#: ``SamplingParams.extra_args`` key of a sample's parent's n (``patches`` 13).
SAMPLES_KEY = "_lookahead_samples"


class NGramPool:
    """Key token -> at most ``cap`` continuations (N-1 tokens) in LRU order, each
    with its count and first source; a new one pushes the oldest out of a full list."""

    __slots__ = ("cap", "_d")

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"pool cap must be >= 1, got {cap}")
        self.cap = cap
        # key -> OrderedDict[cont -> [count, source]], oldest first
        self._d: dict[int, OrderedDict[tuple[int, ...], list]] = {}

    def add(self, key: int, cont: tuple[int, ...], source: str) -> None:
        entries = self._d.get(key) or self._d.setdefault(key, OrderedDict())  # never empty
        entry = entries.get(cont)
        if entry is not None:
            entry[0] += 1
            entries.move_to_end(cont)
            return
        entries[cont] = [1, source]
        if len(entries) > self.cap:
            entries.popitem(last=False)

    def get(self, key: int) -> list[tuple[tuple[int, ...], int, str]]:
        """(continuation, count, source) of ``key``, newest first."""
        return [(c, e[0], e[1]) for c, e in reversed(self._d.get(key, {}).items())]

    def count(self, key: int) -> int:
        return len(self._d.get(key, ()))

    def __len__(self) -> int:  # continuations over all keys
        return sum(len(e) for e in self._d.values())


class JacobiWindow:
    """A request's Jacobi guesses: ``levels`` int32 [N-1, W], row l level l (row 0's
    first W-1 columns, after the root, form the trunk ``B0``); ``warm`` after N-2 steps."""

    __slots__ = ("n", "w", "levels", "steps")

    def __init__(self, ngram_size: int, window_size: int, init_tokens: np.ndarray) -> None:
        self.n, self.w, self.steps = ngram_size, window_size, 0
        self.levels = np.array(init_tokens, dtype=np.int32).reshape(ngram_size - 1, window_size)

    @classmethod
    def random_init(cls, ngram_size: int, window_size: int, context: np.ndarray,
                    seed: int) -> "JacobiWindow":
        """Every level drawn from ``context`` (LADE's init; zeros without one)."""
        context = np.asarray(context, dtype=np.int32)
        size = (ngram_size - 1) * window_size
        rng = np.random.default_rng(seed)
        init = context[rng.integers(0, context.size, size=size)] if context.size else np.zeros(size)
        return cls(ngram_size, window_size, init)

    @property
    def warm(self) -> bool:
        return self.steps >= self.n - 2

    def columns(self, root: int, new: np.ndarray) -> list[tuple[int, tuple[int, ...]]]:
        """The (key, continuation) n-grams ``(B0[j], B_1[j], .., new[j])`` of the
        first ``len(new)`` columns, ``B0 = [root, L0[0], ..., L0[W-2]]``."""
        w = len(new)
        trunk = [int(root)] + self.levels[0, : w - 1].tolist()
        cols = np.concatenate([self.levels[1:, :w], np.asarray(new, np.int32)[None, :]]).T.tolist()
        return [(trunk[j], tuple(cols[j])) for j in range(w)]

    def shift(self, new: np.ndarray) -> None:
        """A Jacobi step of the first ``len(new)`` columns: ``L0 <- L1[1:]``, ``L_l <- L_{l+1}``."""
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
    """The parent id of one of n samples (``"{index}_{parent id}"``), else None."""
    head, sep, parent = req_id.partition("_")
    return parent if sep and head.isdigit() and parent else None


def request_seed(base_seed: int, prompt_token_ids: np.ndarray) -> int:
    """A request's window seed, from its prompt only: every TP rank agrees."""
    data = np.asarray(prompt_token_ids, dtype=np.int32).tobytes()
    return (zlib.crc32(data) ^ (base_seed * 0x9E3779B1)) & 0xFFFFFFFF


@dataclass
class RequestState:
    """Everything lookahead keeps for one request."""

    window: JacobiWindow
    pool: NGramPool
    num_prompt_tokens: int = 0
    max_tokens: int | None = None  # SamplingParams.max_tokens
    group: str | None = None  # parent id of one of n samples (sibling_group)
    pooled_upto: int = 0  # tokens whose n-grams are in the pool
    settings: object = None  # config.RequestSettings
    plan: object = None  # fused: the tree planned for its next step
    #: Last step's draft: sources per token, tree-checked, kind, planned gain.
    draft_sources: list[str] = field(default_factory=list)
    draft_checked: bool = False
    draft_kind: str = ""
    draft_expect: float | None = None
    #: The unchecked lookup of this step (``drafting.lookup``), its sources and kind.
    lookup: list = field(default_factory=list)
    lookup_sources: list = field(default_factory=list)
    lookup_kind: str = "pool"
    acc: object = None  # acceptance.RequestAcceptance
    seeded: bool = False  # sampled with a seed: planned from its text alone
    seeded_batch: int = 1  # the batch a seeded draft is priced in
    sampled: bool = False  # temperature > 0
    lazy_bonus: bool = False  # its bonus rows may be sampled lazily
    #: Its shared-memory document, whether it reads it, its scope, tokens held.
    memory_doc: int | None = None
    memory_reads: bool = False
    memory_scope: int = 0
    memory_upto: int = 0
    text_index: "TextIndex" = field(default_factory=lambda: TextIndex())

    def add_context_ngrams(self, tokens: np.ndarray, n: int, upto: int) -> None:
        """Add every n-gram of ``tokens[:upto]`` not added yet (prompt pool)."""
        start = max(self.pooled_upto - n + 1, 0)
        if upto - start >= n:
            toks = np.asarray(tokens[start:upto]).tolist()
            for i in range(len(toks) - n + 1):
                self.pool.add(toks[i], tuple(toks[i + 1 : i + n]), SOURCE_PROMPT)
        self.pooled_upto = max(self.pooled_upto, upto)


def choose_candidate(matches: list[int], counts: list[int]) -> int:
    """The best candidate: longest confirmed prefix, most seen, newest; -1: none."""
    return max(range(len(matches)), key=lambda i: (matches[i], counts[i], -i), default=-1)


def suffix_lookup(tokens: np.ndarray, n: int, k: int, max_len: int = 4) -> list[int]:
    """The ``k`` tokens after the newest earlier place of ``tokens[:n]``'s longest
    suffix (2..``max_len`` tokens) seen before, or ``[]``."""
    if k <= 0 or n < 3:
        return []
    t = np.asarray(tokens[:n])
    # ends e <= n-2 of the earlier places of the last two tokens
    ends = np.flatnonzero((t[1 : n - 1] == t[n - 1]) & (t[: n - 2] == t[n - 2])) + 1
    if not ends.size:
        return []
    m = 2
    while m < min(max_len, n - 1):  # one token further back at a time
        longer = ends[ends >= m]
        longer = longer[t[longer - m] == t[n - 1 - m]]
        if not longer.size:
            break
        ends, m = longer, m + 1
    e = int(ends[-1])
    return t[e + 1 : e + 1 + k].tolist()


def vote_draft(conts: list[list[int]], k: int, min_prob: float = MIN_PROB) -> list[int]:
    """The draft a key's places (continuations, newest first) vote for token by token
    (ties: the newest), until fewer than ``min_prob`` of them agree with all of it."""
    if len(conts) <= 1:
        return conts[0][:k] if conts else []
    out: list[int] = []
    agree, need = conts, min_prob * len(conts)
    for d in range(k):
        votes: dict[int, int] = {}
        for c in agree:
            if d < len(c):
                votes[c[d]] = votes.get(c[d], 0) + 1
        best = max(votes.values(), default=0)
        if not best or best < need:
            break
        tok = next(c[d] for c in agree if d < len(c) and votes[c[d]] == best)
        out.append(tok)
        agree = [c for c in agree if d < len(c) and c[d] == tok]
    return out


def agreement(conts: list[list[int]], draft: list[int]) -> str:
    """Whether the places agree on the draft's first token: ``""`` one place (or
    no draft), ``"+"`` all of two or more, ``"-"`` not all."""
    if len(conts) < 2 or not draft:
        return ""
    return "+" if all(c and c[0] == draft[0] for c in conts) else "-"


class TextIndex:
    """A request's own text, indexed as it grows: ``ends[(a, b)]`` the ascending e
    with ``toks[e-1:e+1] == [a, b]``."""

    __slots__ = ("toks", "ends")

    def __init__(self) -> None:
        self.toks: list[int] = []
        # every e <= len(toks) - 2: the newest pair is the lookup's own suffix
        self.ends: dict[tuple[int, int], list[int]] = {}

    def vote(self, tokens: np.ndarray, n: int, k: int,
             max_len: int = 4) -> tuple[list[int], int, str]:
        """``(draft, length, agreement)`` of ``tokens[:n]``'s longest suffix seen
        before (2..``max_len`` tokens); a text that does not extend the last restarts."""
        toks, have = self.toks, len(self.toks)
        if n < have or (have and int(tokens[have - 1]) != toks[-1]):
            self.toks, self.ends = [], {}
            toks, have = self.toks, 0
        if n > have:
            toks.extend(np.asarray(tokens[have:n]).tolist())
            for e in range(max(have - 1, 1), n - 1):
                self.ends.setdefault((toks[e - 1], toks[e]), []).append(e)
        if k <= 0 or n < 3:
            return [], 0, ""
        ends = self.ends.get((toks[n - 2], toks[n - 1]))
        if not ends:
            return [], 0, ""
        m = 2
        while m < min(max_len, n - 1):
            want = toks[n - 1 - m]
            longer = [e for e in ends if e >= m and toks[e - m] == want]
            if not longer:
                break
            ends, m = longer, m + 1
        conts = [toks[e + 1 : e + 1 + k] for e in reversed(ends[-MAX_PLACES:])]
        draft = vote_draft(conts, k)
        return draft, m, agreement(conts, draft)
