"""A token memory shared by an engine's requests.

Lookahead's pool and prompt lookup live and die with one request. Much of
what an engine serves repeats across requests (n samples of one prompt, the
same question again, one template over many inputs): :class:`SharedMemory`
keeps the text of the engine's requests -- the tail of each prompt and
everything accepted after it, fed step by step, so requests running at the
same time see each other's text -- and answers "what followed the last
``m`` tokens of this text elsewhere?" for ``m`` in :data:`KEY_LENS`.

Pure Python, no vLLM (its tables and documents are Python arrays,
``array.array``: read and written a few scalars at a time, where numpy's
per-scalar cost was most of the memory's time in the engine); one per
proposer (per tensor-parallel rank: every rank feeds it the same tokens in
the same order and hashes deterministically, so all ranks draft alike).

Layout and bounds:

* **documents**: one int32 array per request (its prompt's last
  :data:`PROMPT_TAIL` tokens, then its accepted tokens), in a FIFO.
  Together they hold at most ``capacity`` tokens and ``capacity //
  MIN_DOC_TOKENS`` documents; past either, the **oldest document is
  evicted** (finished or not). A document that would alone pass the
  capacity stops growing.
* **index**: per key length ``m`` a direct-mapped table of
  ``2^ceil(log2(capacity))`` slots ``(document, position)``: the slot of
  ``hash(scope, m tokens)`` points at the newest place those tokens were
  followed by at least ``delay`` tokens (so a running request's newest
  tokens are indexed ``delay`` tokens late: a match always has a
  continuation to draft), and each place keeps the slot's previous
  holder (``_Doc.prev``): a chain of the key's places, newest first,
  broken where a document was evicted. A collision overwrites the slot
  (and mixes the chain); a lookup verifies each place's document is
  alive, in the same scope, and holds the key tokens there, and the
  newest :data:`~vllm_lookahead.algo.state.MAX_PLACES` places vote on the draft
  (:func:`~vllm_lookahead.algo.state.vote_draft`). Fixed tables of
  ``len(KEY_LENS) * slots * 8`` bytes, and 32 bytes per held token for
  the chains.

* **harvest**: the n-grams the requests' Jacobi windows produced (a key
  token and its ``delay - 1``-token continuation), in a set-associative
  table of ``capacity // HARVEST_TOKENS_PER_SET`` sets of
  :data:`HARVEST_WAYS` n-grams each, keyed by ``hash(scope, key token)``,
  newest first; a new n-gram pushes the set's oldest out. Fixed size.
* **followers**: the same kind of table, fed with the documents' own text
  as it is indexed (every place's token and the ``delay - 1`` tokens
  after it): what followed a single token elsewhere, newest first, for a
  request whose own text has never seen its newest token followed (the
  lookup's last resort, kind ``memory1``; replayed n=4 samples, decoded:
  tokens per step 1.109 to 1.147 on MT-Bench, 1.493 to 1.537 on HumanEval).

With the default capacity (131072 tokens) the whole memory is about 9 MB
(:meth:`SharedMemory.nbytes`).

Isolation: every document carries a *scope* (a digest of vLLM's
``cache_salt``, the key that keeps tenants' prefix caches apart; requests
without one share the empty scope); a lookup only ever returns text of its
own scope, and never of the asking request's own document.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import numpy as np

from vllm_lookahead.algo.state import MAX_PLACES, MIN_PROB, agreement, vote_draft

#: Key lengths looked up, longest first: a long key names the context (the
#: question before an answer), a short one finds phrases. The 2-token key
#: answers where a request's own text has no match at all (before it, the
#: lookup's last resorts were the pool's and ``memory1``'s single-token
#: guesses): replayed n=16 samples, decoded (Zen 5, stop 56), tokens per
#: step 1.213 to 1.228 on MT-Bench, 1.686 to 1.692 on HumanEval; a 4-token
#: key on top of it added nothing.
KEY_LENS = (12, 6, 3, 2)
#: Prompt tokens a request's document starts with (so the key at the
#: boundary of prompt and answer is indexed: a repeated question finds its
#: earlier answer).
PROMPT_TAIL = 24
#: Documents are bounded to ``capacity // MIN_DOC_TOKENS``.
MIN_DOC_TOKENS = 16

#: The harvest table: n-grams kept per key token (the most a tree checks
#: by default is G = 3), and tokens of capacity per set of them.
HARVEST_WAYS = 4
HARVEST_TOKENS_PER_SET = 32

_EMPTY_SCOPE = 0

#: ``SamplingParams.extra_args`` key under which the plugin hands a
#: request's scope (:func:`scope_of` its ``cache_salt``) to the workers;
#: set by the engine for every request, whatever the caller sent.
SCOPE_KEY = "_lookahead_memory_scope"


def scope_of(cache_salt: str | None) -> int:
    """The scope of a request: a 63-bit digest of its ``cache_salt``
    (0 without one). Deterministic across processes (TP ranks agree)."""
    if not cache_salt:
        return _EMPTY_SCOPE
    d = hashlib.blake2b(str(cache_salt).encode("utf-8"), digest_size=8).digest()
    return (int.from_bytes(d, "little") >> 1) or 1


def _tag(scope: int, key: int) -> int:
    """A nonzero 63-bit tag of ``(scope, key token)`` (a harvest table way)."""
    return (hash((scope, int(key), 0x5EED)) & 0x7FFFFFFFFFFFFFFF) or 1


class _Doc:
    __slots__ = ("scope", "tokens", "prev", "n", "indexed", "full")

    def __init__(self, scope: int) -> None:
        self.scope = scope
        #: its tokens (int32; ``array``, not numpy: the memory reads and
        #: writes them a few at a time, where a numpy scalar costs several
        #: times a Python list's or array's)
        self.tokens = array("i")
        #: per key length, for each place j < indexed: the place the key's
        #: slot held before j took it (``doc << 32 | pos``; -1: none), a
        #: chain, newest first
        self.prev = tuple(array("q", [-1]) for _ in KEY_LENS)  # place 0: never a key's end
        self.n = 0
        #: positions j < indexed have their keys (ending at j) in the tables
        self.indexed = 0
        self.full = False


class SharedMemory:
    """Text of an engine's requests, looked up by the last tokens of another.

    Args:
        capacity: most tokens held over all documents (>= 256).
        delay: a place is indexed once this many tokens follow it (the
            longest draft the memory is asked for).
    """

    def __init__(self, capacity: int, delay: int = 4, min_prob: float = MIN_PROB) -> None:
        if capacity < 256:
            raise ValueError(f"memory capacity must be >= 256 tokens, got {capacity}")
        self.capacity = int(capacity)
        self.delay = max(int(delay), 1)
        self.min_prob = float(min_prob)
        self.max_docs = max(self.capacity // MIN_DOC_TOKENS, 1)
        self._slots = slots = 1 << max(int(self.capacity - 1).bit_length(), 8)
        self._mask = slots - 1
        self._docs: OrderedDict[int, _Doc] = OrderedDict()
        self._sets = sets = 1 << max(int(self.capacity // HARVEST_TOKENS_PER_SET - 1).bit_length(), 4)
        self._hmask = sets - 1
        #: n-gram length of the harvest and followers tables
        self._gram = max(self.delay - 1, 1)
        self._reset_tables()
        self.harvested = 0  # n-grams added since start (or the last clear)
        self._next_id = 0
        self.tokens = 0  # held over all documents
        self.evicted = 0  # documents evicted since start

    def _reset_tables(self) -> None:
        """The index (per key length, a slot's document, -1 for none, and
        position) and the two set-associative tables (per set and way, in
        flat arrays: the (scope, key) tag, 0 for empty, and the n-gram),
        empty. Python arrays (``array.array``), read and written a scalar at a
        time: a numpy scalar costs several times more."""
        slots, ways = self._slots, self._sets * HARVEST_WAYS
        self._doc = tuple(array("i", [-1]) * slots for _ in KEY_LENS)
        self._pos = tuple(array("i", [0]) * slots for _ in KEY_LENS)
        self._htag = array("q", [0]) * ways
        self._hgram = array("i", [0]) * (ways * self._gram)
        #: the followers table, as the harvest's (fed with the text)
        self._ftag = array("q", [0]) * ways
        self._fgram = array("i", [0]) * (ways * self._gram)

    # -- writing -----------------------------------------------------------
    def open(self, scope: int, prompt: np.ndarray) -> int:
        """A new document for a request, starting with the last
        :data:`PROMPT_TAIL` tokens of its ``prompt``. Returns its id."""
        doc_id = self._next_id
        # ids wrap at 2^31 (int32 tables): the documents of 2^31 requests ago
        # are long evicted
        self._next_id = (self._next_id + 1) & 0x7FFFFFFF
        self._docs[doc_id] = _Doc(scope)
        self._evict()
        self.extend(doc_id, np.asarray(prompt)[-PROMPT_TAIL:])
        return doc_id

    def extend(self, doc_id: int, tokens) -> None:
        """Append ``tokens`` (accepted text) to a document; index the places
        now followed by ``delay`` tokens. A document evicted or full takes
        nothing."""
        doc = self._docs.get(doc_id)
        k = len(tokens)
        if doc is None or doc.full or k == 0:
            return
        if doc.n + k > self.capacity:
            doc.full = True
            return
        doc.tokens.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
        doc.n += k
        self.tokens += k
        self._index(doc_id, doc, doc.n - self.delay)
        if self.tokens > self.capacity:
            self._evict()

    def close(self, doc_id: int) -> None:
        """The request finished: index its last places too (they will not
        be followed by more)."""
        doc = self._docs.get(doc_id)
        if doc is not None:
            self._index(doc_id, doc, doc.n - 1)

    def add_ngram(self, scope: int, key: int, cont) -> None:
        """An n-gram a request's Jacobi window produced: ``key`` followed by
        ``cont`` (``delay - 1`` tokens; other lengths are ignored). It
        becomes the newest of its key's set; the oldest leaves."""
        if len(cont) != self._gram:
            return
        self._push(self._htag, self._hgram, scope, key, cont)
        self.harvested += 1

    def _push(self, table_tags, table_grams, scope: int, key: int, cont) -> None:
        """``key`` followed by ``cont`` into a set-associative table (the
        harvest's or the followers'): the newest of its key's set, the
        set's oldest out."""
        tag = _tag(scope, key)
        base = (hash((scope, int(key))) & self._hmask) * HARVEST_WAYS
        g = self._gram
        cont = list(cont)
        at = HARVEST_WAYS - 1
        held = table_tags[base: base + HARVEST_WAYS]
        if tag in held:
            for w, t in enumerate(held):
                if t == tag and table_grams[(base + w) * g: (base + w + 1) * g].tolist() == cont:
                    at = w
                    break
        # shift ways 0..at-1 down one (a slice is a copy), the n-gram in front
        if at:
            table_tags[base + 1: base + at + 1] = table_tags[base: base + at]
            table_grams[(base + 1) * g: (base + at + 1) * g] = table_grams[base * g: (base + at) * g]
        table_tags[base] = tag
        table_grams[base * g: (base + 1) * g] = array("i", cont)

    def ngrams(self, scope: int, key: int) -> list[tuple[int, ...]]:
        """The continuations of ``key`` the windows of ``scope``'s requests
        produced, newest first (at most :data:`HARVEST_WAYS`)."""
        return self._read(self._htag, self._hgram, scope, key)

    def followers(self, scope: int, key: int) -> list[tuple[int, ...]]:
        """The ``delay - 1`` tokens that followed the token ``key`` in the
        text of ``scope``'s requests (the asking request's own included),
        newest first (at most :data:`HARVEST_WAYS`)."""
        return self._read(self._ftag, self._fgram, scope, key)

    def _read(self, table_tags, table_grams, scope: int, key: int) -> list[tuple[int, ...]]:
        tag = _tag(scope, key)
        base = (hash((scope, int(key))) & self._hmask) * HARVEST_WAYS
        g = self._gram
        return [tuple(table_grams[w * g: (w + 1) * g])
                for w in range(base, base + HARVEST_WAYS) if table_tags[w] == tag]

    def clear(self) -> None:
        """Forget everything (``reset_prefix_cache``)."""
        self._reset_tables()
        self.harvested = 0
        self._docs.clear()
        self.tokens = 0

    def _index(self, doc_id: int, doc: _Doc, upto: int) -> None:
        """Index the places ``doc.indexed .. upto`` (continuation start j:
        the key is ``tokens[j-m:j]``)."""
        mask = self._mask
        scope = doc.scope
        start = max(doc.indexed, 1)
        if upto < start:
            return
        follow = self._gram  # the followers' continuation length
        base = max(start - KEY_LENS[0], 0)
        seq = doc.tokens[base: min(upto + follow, doc.n)].tolist()
        n_seq = len(seq)
        tables = tuple(zip(KEY_LENS, self._doc, self._pos, doc.prev))
        push, ftag, fgram = self._push, self._ftag, self._fgram
        for j in range(start, upto + 1):
            at = j - base
            if at + follow <= n_seq:
                push(ftag, fgram, scope, seq[at - 1], seq[at: at + follow])
            for m, docs, poss, prev in tables:
                if j < m:
                    prev.append(-1)
                    continue
                slot = hash((scope, *seq[at - m: at])) & mask
                held = docs[slot]
                prev.append((held << 32) | poss[slot] if held >= 0 else -1)
                docs[slot] = doc_id
                poss[slot] = j
        doc.indexed = upto + 1

    def _evict(self) -> None:
        """Drop the oldest documents while past either bound."""
        while self._docs and (self.tokens > self.capacity or len(self._docs) > self.max_docs):
            _, old = self._docs.popitem(last=False)
            self.tokens -= old.n
            self.evicted += 1

    # -- reading -----------------------------------------------------------
    def lookup(self, scope: int, own: int | None, text: np.ndarray, n: int,
               k: int) -> tuple[list[int], int]:
        """:meth:`lookup_vote` without the agreement."""
        cont, m, _ = self.lookup_vote(scope, own, text, n, k)
        return cont, m

    def lookup_vote(self, scope: int, own: int | None, text: np.ndarray, n: int,
                    k: int, longer_than: int = 0) -> tuple[list[int], int, str]:
        """What followed the longest key (:data:`KEY_LENS`) of
        ``text[:n]``'s suffix in the other documents of ``scope``: at most
        ``k`` tokens, the key's length, and the places'
        :func:`~vllm_lookahead.algo.state.agreement` on its first token;
        ``([], 0, "")`` for none.
        ``own``: the asking request's document (never answered from).
        ``longer_than``: only keys longer than this are looked up (the
        caller has a match that long already).

        The newest :data:`MAX_PLACES` places of the key vote, token by
        token, as a suffix tree's counts do: each next token is the one most
        of the places still agreeing with the draft continue with (the
        newest among equals), and the draft stops where the share of the
        places that agree with it all the way falls below ``min_prob``
        (one place: its whole continuation, as far as it goes)."""
        if k <= 0:
            return [], 0, ""
        mask = self._mask
        for t, m in enumerate(KEY_LENS):
            if m <= longer_than:
                break  # the keys are longest first
            if n < m:
                continue
            key = text[n - m: n].tolist()
            slot = hash((scope, *key)) & mask
            conts = self._continuations(t, self._doc[t][slot], self._pos[t][slot],
                                        scope, own, key, k)
            if not conts:
                continue
            cont = vote_draft(conts, k, self.min_prob)
            if cont:
                return cont, m, agreement(conts, cont)
        return [], 0, ""

    def _continuations(self, t: int, doc_id: int, j: int, scope: int, own: int | None,
                       key: list[int], k: int) -> list[list[int]]:
        """Up to ``k`` tokens after each of the newest :data:`MAX_PLACES`
        places of ``key`` (key length ``KEY_LENS[t]``) in live documents of
        ``scope`` other than ``own``, newest first; following the slot's
        chain (:attr:`_Doc.prev`), places of other keys (a hash collision)
        and of evicted documents skipped."""
        m = len(key)
        out: list[list[int]] = []
        hops = 0
        while doc_id >= 0 and len(out) < MAX_PLACES and hops < 4 * MAX_PLACES:
            hops += 1
            doc = self._docs.get(doc_id)
            if doc is None:  # evicted: older places are older still
                break
            chain = doc.prev[t]
            nxt = chain[j] if j < len(chain) else -1
            if (doc_id != own and doc.scope == scope and m <= j <= doc.n
                    and doc.tokens[j - m: j].tolist() == key):
                cont = doc.tokens[j: min(j + k, doc.n)].tolist()
                if cont:
                    out.append(cont)
            doc_id, j = (nxt >> 32, nxt & 0xFFFFFFFF) if nxt >= 0 else (-1, 0)
        return out

    # -- figures -----------------------------------------------------------
    def __len__(self) -> int:
        """Documents held."""
        return len(self._docs)

    def nbytes(self) -> int:
        """Bytes held: the index tables and the documents' arrays."""
        tables = (*self._doc, *self._pos, self._htag, self._hgram, self._ftag, self._fgram)
        return int(sum(a.itemsize * len(a) for a in tables)
                   + sum(d.tokens.itemsize * len(d.tokens)
                         + sum(c.itemsize * len(c) for c in d.prev)
                         for d in self._docs.values()))
