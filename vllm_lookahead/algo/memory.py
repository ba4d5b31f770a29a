"""A token memory shared by an engine's requests (n samples, repeated questions, templates).

Documents (a request's prompt tail and accepted text, oldest evicted first) are indexed
per key length by a direct-mapped table ``hash(scope, key) -> (doc, pos)``, each place
chained to the slot's previous holder; two set-associative tables keep the windows'
n-grams and each token's followers. A lookup sees its own scope only, never the asker's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import numpy as np

from vllm_lookahead.algo.state import MAX_PLACES, MIN_PROB, agreement, vote_draft

#: Key lengths, longest first: long keys name the context, short ones phrases.
KEY_LENS = (12, 6, 3, 2)
#: Prompt tokens a document starts with (a repeated question finds its answer).
PROMPT_TAIL = 24
MIN_DOC_TOKENS = 16
#: Set-associative tables: n-grams per key token (G is 3), capacity tokens per set.
WAYS, TOKENS_PER_SET = 4, 32
#: ``SamplingParams.extra_args`` key carrying a request's scope to the workers.
SCOPE_KEY = "_lookahead_memory_scope"


def scope_of(cache_salt: str | None) -> int:
    """A 63-bit digest of a ``cache_salt`` (0: none), the same in every process."""
    if not cache_salt:
        return 0
    d = hashlib.blake2b(str(cache_salt).encode("utf-8"), digest_size=8).digest()
    return (int.from_bytes(d, "little") >> 1) or 1


class _Doc:
    __slots__ = ("scope", "tokens", "prev", "indexed", "full")

    def __init__(self, scope: int) -> None:
        self.scope = scope
        self.tokens = array("i")
        # per key length and place: the slot's previous holder (doc << 32 | pos, -1: none)
        self.prev = tuple(array("q", [-1]) for _ in KEY_LENS)
        self.indexed = 0  # places j < indexed have their keys in the tables
        self.full = False


class SharedMemory:
    """At most ``capacity`` (>= 256) tokens of text; a place is indexed once
    ``delay`` tokens (N) follow it."""

    def __init__(self, capacity: int, delay: int = 4, min_prob: float = MIN_PROB) -> None:
        if capacity < 256:
            raise ValueError(f"memory capacity must be >= 256 tokens, got {capacity}")
        self.capacity = int(capacity)
        self.delay = max(int(delay), 1)
        self.min_prob = float(min_prob)
        self.max_docs = max(self.capacity // MIN_DOC_TOKENS, 1)
        self._mask = (1 << max((self.capacity - 1).bit_length(), 8)) - 1
        self._hmask = (1 << max((self.capacity // TOKENS_PER_SET - 1).bit_length(), 4)) - 1
        self._gram = max(self.delay - 1, 1)  # n-gram length of the two tables
        self._docs: OrderedDict[int, _Doc] = OrderedDict()
        self._next_id = 0
        self.evicted = 0  # documents evicted since start
        self.clear()

    def clear(self) -> None:
        """Forget everything (``reset_prefix_cache``)."""
        slots, ways = self._mask + 1, (self._hmask + 1) * WAYS
        self._doc = tuple(array("i", [-1]) * slots for _ in KEY_LENS)
        self._pos = tuple(array("i", [0]) * slots for _ in KEY_LENS)
        # harvest and followers: a (scope, key) tag per way (0: empty), its n-gram
        self._htag, self._ftag = array("q", [0]) * ways, array("q", [0]) * ways
        self._hgram, self._fgram = (array("i", [0]) * (ways * self._gram) for _ in "hf")
        self._docs.clear()
        self.tokens = 0  # held over all documents
        self.harvested = 0  # n-grams added since start or the last clear

    def open(self, scope: int, prompt: np.ndarray) -> int:
        """A new document of ``prompt``'s last :data:`PROMPT_TAIL` tokens; its id."""
        doc_id = self._next_id
        self._next_id = (doc_id + 1) & 0x7FFFFFFF  # int32 tables
        self._docs[doc_id] = _Doc(scope)
        self._evict()
        self.extend(doc_id, np.asarray(prompt)[-PROMPT_TAIL:])
        return doc_id

    def extend(self, doc_id: int, tokens) -> None:
        """Append accepted ``tokens`` to a document (not if evicted or full)."""
        doc = self._docs.get(doc_id)
        k = len(tokens)
        if doc is None or doc.full or k == 0:
            return
        if len(doc.tokens) + k > self.capacity:
            doc.full = True
            return
        doc.tokens.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
        self.tokens += k
        self._index(doc_id, doc, len(doc.tokens) - self.delay)
        if self.tokens > self.capacity:
            self._evict()

    def close(self, doc_id: int) -> None:
        """The request finished: index its last places too."""
        doc = self._docs.get(doc_id)
        if doc is not None:
            self._index(doc_id, doc, len(doc.tokens) - 1)

    def add_ngram(self, scope: int, key: int, cont) -> None:
        """An n-gram a Jacobi window produced (``delay - 1`` tokens after ``key``)."""
        if len(cont) == self._gram:
            self._push(self._htag, self._hgram, scope, key, cont)
            self.harvested += 1

    def _push(self, tags, grams, scope: int, key: int, cont) -> None:
        """``key -> cont`` to the front of its set (moved, or the oldest leaves)."""
        tag, base = self._set(scope, key)
        g, cont, at = self._gram, list(cont), WAYS - 1
        held = tags[base : base + WAYS]
        if tag in held:
            for w, t in enumerate(held):
                if t == tag and grams[(base + w) * g : (base + w + 1) * g].tolist() == cont:
                    at = w
                    break
        if at:  # ways 0..at-1 down one (a slice is a copy)
            tags[base + 1 : base + at + 1] = tags[base : base + at]
            grams[(base + 1) * g : (base + at + 1) * g] = grams[base * g : (base + at) * g]
        tags[base] = tag
        grams[base * g : (base + 1) * g] = array("i", cont)

    def _set(self, scope: int, key: int) -> tuple[int, int]:
        """The nonzero tag of ``(scope, key)`` and the first way of its set."""
        return ((hash((scope, int(key), 0x5EED)) & 0x7FFFFFFFFFFFFFFF) or 1,
                (hash((scope, int(key))) & self._hmask) * WAYS)

    def _index(self, doc_id: int, doc: _Doc, upto: int) -> None:
        """Index places ``doc.indexed .. upto`` (j: key ``tokens[j-m:j]``), feed the followers."""
        start = max(doc.indexed, 1)
        if upto < start:
            return
        mask, scope, follow = self._mask, doc.scope, self._gram
        base = max(start - KEY_LENS[0], 0)
        seq = doc.tokens[base : upto + follow].tolist()
        tables = tuple(zip(KEY_LENS, self._doc, self._pos, doc.prev))
        push, ftag, fgram = self._push, self._ftag, self._fgram
        for j in range(start, upto + 1):
            at = j - base
            if at + follow <= len(seq):
                push(ftag, fgram, scope, seq[at - 1], seq[at : at + follow])
            for m, docs, poss, prev in tables:
                if j < m:
                    prev.append(-1)
                    continue
                slot = hash((scope, *seq[at - m : at])) & mask
                held = docs[slot]
                prev.append((held << 32) | poss[slot] if held >= 0 else -1)
                docs[slot], poss[slot] = doc_id, j
        doc.indexed = upto + 1

    def _evict(self) -> None:  # the oldest documents, while past a bound
        while self._docs and (self.tokens > self.capacity or len(self._docs) > self.max_docs):
            self.tokens -= len(self._docs.popitem(last=False)[1].tokens)
            self.evicted += 1

    def ngrams(self, scope: int, key: int) -> list[tuple[int, ...]]:
        """Continuations the windows of ``scope``'s requests produced for ``key``."""
        return self._read(self._htag, self._hgram, scope, key)

    def followers(self, scope: int, key: int) -> list[tuple[int, ...]]:
        """The ``delay - 1`` tokens that followed ``key`` in ``scope``'s text."""
        return self._read(self._ftag, self._fgram, scope, key)

    def _read(self, tags, grams, scope: int, key: int) -> list[tuple[int, ...]]:
        tag, base = self._set(scope, key)
        g = self._gram
        return [tuple(grams[w * g : (w + 1) * g])
                for w in range(base, base + WAYS) if tags[w] == tag]

    def lookup(self, scope: int, own: int | None, text: np.ndarray, n: int, k: int,
               longer_than: int = 0) -> tuple[list[int], int, str]:
        """``(draft, key length, agreement)``: the ``k`` tokens the newest places of the
        longest key (> ``longer_than``) ending ``text[:n]`` vote for, ``own`` left out."""
        if k <= 0:
            return [], 0, ""
        for t, m in enumerate(KEY_LENS):
            if m <= longer_than:
                break
            if n < m:
                continue
            key = text[n - m : n].tolist()
            slot = hash((scope, *key)) & self._mask
            conts = self._places(t, self._doc[t][slot], self._pos[t][slot], scope, own, key, k)
            cont = vote_draft(conts, k, self.min_prob)
            if cont:
                return cont, m, agreement(conts, cont)
        return [], 0, ""

    def _places(self, t: int, doc_id: int, j: int, scope: int, own: int | None,
                key: list[int], k: int) -> list[list[int]]:
        """Up to ``k`` tokens after each newest place of ``key`` along the slot's
        chain (collisions, other scopes and ``own`` skipped)."""
        m, out, hops = len(key), [], 0
        while doc_id >= 0 and len(out) < MAX_PLACES and hops < 4 * MAX_PLACES:
            hops += 1
            doc = self._docs.get(doc_id)
            if doc is None:  # evicted: older places are older still
                break
            chain = doc.prev[t]
            nxt = chain[j] if j < len(chain) else -1
            if (doc_id != own and doc.scope == scope and m <= j <= len(doc.tokens)
                    and doc.tokens[j - m : j].tolist() == key):
                cont = doc.tokens[j : j + k].tolist()
                if cont:
                    out.append(cont)
            doc_id, j = (nxt >> 32, nxt & 0xFFFFFFFF) if nxt >= 0 else (-1, 0)
        return out

    def __len__(self) -> int:
        return len(self._docs)

    def nbytes(self) -> int:
        """Bytes held: the tables and the documents' arrays."""
        arrays = [*self._doc, *self._pos, self._htag, self._hgram, self._ftag, self._fgram]
        for d in self._docs.values():
            arrays += [d.tokens, *d.prev]
        return sum(a.itemsize * len(a) for a in arrays)
