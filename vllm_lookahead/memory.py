"""A token memory shared by an engine's requests.

Lookahead's pool and prompt lookup live and die with one request. Much of
what an engine serves repeats across requests (n samples of one prompt, the
same question again, one template over many inputs): :class:`SharedMemory`
keeps the text of the engine's requests -- the tail of each prompt and
everything accepted after it, fed step by step, so requests running at the
same time see each other's text -- and answers "what followed the last
``m`` tokens of this text elsewhere?" for ``m`` in :data:`KEY_LENS`.

Pure numpy, no vLLM; one per proposer (per tensor-parallel rank: every
rank feeds it the same tokens in the same order and hashes deterministically,
so all ranks draft alike).

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
  continuation to draft). A collision overwrites; a lookup verifies the
  document is alive, in the same scope, and holds the key tokens there.
  Fixed size: ``len(KEY_LENS) * slots * 12`` bytes.

With the default capacity (131072 tokens) the whole memory is about 6 MB
(:meth:`SharedMemory.nbytes`).

Isolation: every document carries a *scope* (a digest of vLLM's
``cache_salt``, the key that keeps tenants' prefix caches apart; requests
without one share the empty scope); a lookup only ever returns text of its
own scope, and never of the asking request's own document.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

#: Key lengths looked up, longest first: a long key names the context (the
#: question before an answer), a short one finds phrases.
KEY_LENS = (12, 6, 3)
#: Prompt tokens a request's document starts with (so the key at the
#: boundary of prompt and answer is indexed: a repeated question finds its
#: earlier answer).
PROMPT_TAIL = 24
#: Documents are bounded to ``capacity // MIN_DOC_TOKENS``.
MIN_DOC_TOKENS = 16

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


class _Doc:
    __slots__ = ("scope", "tokens", "n", "indexed", "full")

    def __init__(self, scope: int) -> None:
        self.scope = scope
        self.tokens = np.empty(64, dtype=np.int32)
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

    def __init__(self, capacity: int, delay: int = 4) -> None:
        if capacity < 256:
            raise ValueError(f"memory capacity must be >= 256 tokens, got {capacity}")
        self.capacity = int(capacity)
        self.delay = max(int(delay), 1)
        self.max_docs = max(self.capacity // MIN_DOC_TOKENS, 1)
        slots = 1 << max(int(self.capacity - 1).bit_length(), 8)
        self._mask = slots - 1
        self._doc = np.full((len(KEY_LENS), slots), -1, dtype=np.int64)
        self._pos = np.zeros((len(KEY_LENS), slots), dtype=np.int32)
        self._docs: OrderedDict[int, _Doc] = OrderedDict()
        self._next_id = 0
        self.tokens = 0  # held over all documents
        self.evicted = 0  # documents evicted since start

    # -- writing -----------------------------------------------------------
    def open(self, scope: int, prompt: np.ndarray) -> int:
        """A new document for a request, starting with the last
        :data:`PROMPT_TAIL` tokens of its ``prompt``. Returns its id."""
        doc_id = self._next_id
        self._next_id += 1
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
        need = doc.n + k
        if need > doc.tokens.size:
            grown = np.empty(max(need, 2 * doc.tokens.size), dtype=np.int32)
            grown[: doc.n] = doc.tokens[: doc.n]
            doc.tokens = grown
        doc.tokens[doc.n: need] = np.asarray(tokens, dtype=np.int32)
        doc.n = need
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

    def clear(self) -> None:
        """Forget everything (``reset_prefix_cache``)."""
        self._doc.fill(-1)
        self._docs.clear()
        self.tokens = 0

    def _index(self, doc_id: int, doc: _Doc, upto: int) -> None:
        """Index the places ``doc.indexed .. upto`` (continuation start j:
        the key is ``tokens[j-m:j]``)."""
        toks = doc.tokens
        mask = self._mask
        scope = doc.scope
        start = max(doc.indexed, 1)
        if upto < start:
            return
        base = max(start - KEY_LENS[0], 0)
        seq = toks[base: upto].tolist()
        for j in range(start, upto + 1):
            for t, m in enumerate(KEY_LENS):
                if j < m:
                    continue
                key = seq[j - m - base: j - base]
                slot = hash((scope, *key)) & mask
                self._doc[t, slot] = doc_id
                self._pos[t, slot] = j
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
        """What followed the longest key (:data:`KEY_LENS`) of
        ``text[:n]``'s suffix in another document of ``scope``: at most
        ``k`` tokens, and the key's length; ``([], 0)`` for none.
        ``own``: the asking request's document (never answered from)."""
        if k <= 0:
            return [], 0
        mask = self._mask
        for t, m in enumerate(KEY_LENS):
            if n < m:
                continue
            key = text[n - m: n].tolist()
            slot = hash((scope, *key)) & mask
            doc_id = int(self._doc[t, slot])
            if doc_id < 0 or doc_id == own:
                continue
            doc = self._docs.get(doc_id)
            if doc is None or doc.scope != scope:
                continue
            j = int(self._pos[t, slot])
            if j > doc.n or doc.tokens[j - m: j].tolist() != key:
                continue
            cont = doc.tokens[j: min(j + k, doc.n)].tolist()
            if cont:
                return cont, m
        return [], 0

    # -- figures -----------------------------------------------------------
    def __len__(self) -> int:
        """Documents held."""
        return len(self._docs)

    def nbytes(self) -> int:
        """Bytes held: the index tables and the documents' arrays."""
        return int(self._doc.nbytes + self._pos.nbytes
                   + sum(d.tokens.nbytes for d in self._docs.values()))
