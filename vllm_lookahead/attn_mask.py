"""Tree layout of one lookahead step: parents, position offsets and the mask.

One step queries a tree rooted at ``x``, the last accepted token (position
``p``, its KV not yet cached). Node order, for ngram size N, window W and
``g`` candidates (``g`` may be below the configured G when the pool has fewer):

* node 0: the root ``x``;
* nodes ``1 .. W-1``: Jacobi level 0, ``L0[0..W-2]``. Together with the root
  they form the trunk ``B0 = [x, L0[0], ..., L0[W-2]]``;
* then for each level ``l = 1 .. N-2``, ``W`` nodes ``B_l[0..W-1]``;
* then for each candidate ``c = 0 .. g-1``, ``N-1`` nodes ``cand_c[0..N-2]``.

Parents: ``B0[j] -> B0[j-1]``, ``B_1[j] -> B0[j]``, ``B_l[j] -> B_{l-1}[j]``,
``cand_c[0] -> x``, ``cand_c[k] -> cand_c[k-1]``. Every node sees exactly its
ancestors and itself; its position is ``p + depth``. Total nodes:
``(N-1) * (W + g)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TreeLayout:
    """Static layout for one (N, W, g).

    Attributes (T = number of nodes):
        parents: int32 [T], parent node index, -1 for the root.
            With W = 0 (Jacobi branch off) the tree is the root plus the
            candidate chains, ``1 + (N-1) * g`` nodes.
        depth: int32 [T], position offset from the root.
        mask: bool [T, T], ``mask[i, j]`` is True iff j is i or an ancestor of i.
        level_index: int32 [N-1, W], node of ``B_l[j]`` (row 0 is the trunk
            ``B0``, so ``level_index[0, 0] == 0``, the root).
        cand_index: int32 [g, N-1], node of candidate c's k-th token.
    """

    ngram_size: int
    window_size: int
    num_candidates: int
    parents: np.ndarray
    depth: np.ndarray
    mask: np.ndarray
    level_index: np.ndarray
    cand_index: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    @property
    def newest_level(self) -> np.ndarray:
        """Nodes whose argmax forms the next Jacobi level: int32 [W]."""
        return self.level_index[-1]

    @functools.cached_property
    def read_nodes(self) -> np.ndarray:
        """The nodes whose argmax a step reads (int64, sorted): the root,
        the newest Jacobi level and every candidate token. The window's
        older levels only feed their descendants' attention: their logits
        are never computed."""
        nodes = np.concatenate([[0], self.newest_level.ravel(), self.cand_index.ravel()])
        out = np.unique(nodes.astype(np.int64))
        out.setflags(write=False)
        return out


@functools.lru_cache(maxsize=256)
def build_tree(ngram_size: int, window_size: int, num_candidates: int) -> TreeLayout:
    """Build (and cache) the layout for N=ngram_size, W=window_size, g candidates."""
    n, w, g = ngram_size, window_size, num_candidates
    if n < 2 or w < 0 or g < 0:
        raise ValueError(f"invalid tree size N={n}, W={w}, g={g}")
    levels = n - 1
    # W = 0: no Jacobi branch, the root alone carries the candidates.
    total = levels * (w + g) if w else 1 + levels * g
    parents = np.full(total, -1, dtype=np.int32)
    depth = np.zeros(total, dtype=np.int32)
    level_index = np.zeros((levels, w), dtype=np.int32)
    cand_index = np.zeros((g, levels), dtype=np.int32)

    # Trunk B0: node j for j in 0..W-1.
    for j in range(w):
        level_index[0, j] = j
        parents[j] = j - 1  # -1 for the root
        depth[j] = j
    nxt = max(w, 1)
    for lvl in range(1, levels if w else 1):
        for j in range(w):
            node = nxt
            nxt += 1
            level_index[lvl, j] = node
            parents[node] = level_index[lvl - 1, j]
            depth[node] = lvl + j
    for c in range(g):
        for k in range(levels):
            node = nxt
            nxt += 1
            cand_index[c, k] = node
            parents[node] = 0 if k == 0 else cand_index[c, k - 1]
            depth[node] = k + 1
    assert nxt == total

    mask = np.zeros((total, total), dtype=bool)
    for i in range(total):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    for arr in (parents, depth, mask, level_index, cand_index):
        arr.setflags(write=False)
    return TreeLayout(n, w, g, parents, depth, mask, level_index, cand_index)


def fill_tree_tokens(
    layout: TreeLayout,
    root: int,
    levels: np.ndarray,
    candidates: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Token id of every node.

    Args:
        root: the last accepted token ``x``.
        levels: int [N-1, W]; row 0 holds ``L0`` in columns 0..W-2 (the last
            column is ignored), rows 1.. hold ``L_1 .. L_{N-2}``. A tree of
            w < W columns takes the first w.
        candidates: int [g, N-1], candidate continuations of ``x``.
        out: optional int32 [T] buffer.
    Returns:
        int32 [T] token ids in node order.
    """
    t = layout.num_nodes
    toks = out if out is not None else np.empty(t, dtype=np.int32)
    w = layout.window_size
    toks[0] = root
    if w:  # the window's first w columns (w <= W)
        toks[1:w] = levels[0, : w - 1]
        toks[w : layout.level_index[-1, -1] + 1] = levels[1:, :w].reshape(-1)
    if layout.num_candidates:
        toks[layout.cand_index[0, 0] :] = candidates.reshape(-1)
    return toks


def tree_size(ngram_size: int, window_size: int, num_candidates: int) -> int:
    """Number of nodes of ``build_tree(ngram_size, window_size, num_candidates)``."""
    levels = ngram_size - 1
    if window_size:
        return levels * (window_size + num_candidates)
    return 1 + levels * num_candidates


def fit_budget(
    trees: list[tuple[int, int, int]], budget: int, with_root: bool = True
) -> tuple[bool, int]:
    """Shrink one step's trees to at most ``budget`` query tokens in all.

    Args:
        trees: per request ``(N, W, g)`` it would like to run.
        budget: most tree tokens the step may add (0 = no limit).
        with_root: whether the root node counts as one of the tree's query
            tokens (it does in both modes: a separate pass runs it, a fused
            tree appends it after vLLM's draft); False leaves it out.
    Returns:
        ``(use_window, max_candidates)``: keep every request's window, or
        leave all windows out of this step; check at most ``max_candidates``
        candidates per request. ``max_candidates == -1`` means no tree at all
        fits (run no tree this step). Order of giving up: windows first, then
        candidates one by one, then the tree.
    """
    drop = 0 if with_root else 1

    def total(use_window: bool, cap: int) -> int:
        return sum(
            max(tree_size(n, w if use_window else 0, min(g, cap)) - drop, 0)
            for n, w, g in trees
        )

    most = max((g for _, _, g in trees), default=0)
    if budget <= 0 or total(True, most) <= budget:
        return True, most
    for cap in range(most, 0, -1):
        if total(False, cap) <= budget:
            return False, cap
    return False, -1
