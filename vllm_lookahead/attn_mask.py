"""Tree layout of one lookahead step (N, window W, g candidates), rooted at x, position p.

Nodes: 0 the root; ``1 .. W-1`` level 0 (with the root the trunk ``B0``); W nodes
``B_l[0..W-1]`` per level ``l = 1 .. N-2``; N-1 per candidate. Parents: ``B0[j] -> B0[j-1]``,
``B_l[j] -> B_{l-1}[j]``, ``cand_c[0] -> x``, ``cand_c[k] -> cand_c[k-1]``. A node sees its
ancestors and itself, at position ``p + depth``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TreeLayout:
    """The read-only layout of one (N, W, g); T nodes."""

    ngram_size: int
    window_size: int
    num_candidates: int
    parents: np.ndarray  # int32 [T], -1 for the root
    depth: np.ndarray  # int32 [T], position offset from the root
    mask: np.ndarray  # bool [T, T]: mask[i, j] iff j is i or an ancestor of i
    level_index: np.ndarray  # int32 [N-1, W]: node of B_l[j] (row 0: the trunk)
    cand_index: np.ndarray  # int32 [g, N-1]: node of candidate c's k-th token

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    @property
    def newest_level(self) -> np.ndarray:
        """int32 [W] the nodes whose argmax is the next Jacobi level."""
        return self.level_index[-1]

    @functools.cached_property
    def read_nodes(self) -> np.ndarray:
        """int64, sorted: the nodes whose argmax is read (root, newest level, candidates)."""
        nodes = np.concatenate([[0], self.newest_level.ravel(), self.cand_index.ravel()])
        out = np.unique(nodes.astype(np.int64))
        out.setflags(write=False)
        return out


def tree_size(ngram_size: int, window_size: int, num_candidates: int) -> int:
    """Number of nodes of ``build_tree(...)`` of the same sizes."""
    levels = ngram_size - 1
    return levels * (window_size + num_candidates) if window_size else 1 + levels * num_candidates


@functools.lru_cache(maxsize=256)
def build_tree(ngram_size: int, window_size: int, num_candidates: int) -> TreeLayout:
    """The layout for N = ngram_size, W = window_size and g candidates (cached)."""
    n, w, g = ngram_size, window_size, num_candidates
    if n < 2 or w < 0 or g < 0:
        raise ValueError(f"invalid tree size N={n}, W={w}, g={g}")
    levels, total = n - 1, tree_size(n, w, g)
    parents = np.full(total, -1, dtype=np.int32)
    depth = np.zeros(total, dtype=np.int32)
    level_index = np.zeros((levels, w), dtype=np.int32)
    cand_index = np.zeros((g, levels), dtype=np.int32)
    level_index[0] = np.arange(w)  # the trunk
    parents[:w] = np.arange(w) - 1
    depth[:w] = np.arange(w)
    nxt = max(w, 1)
    for lvl in range(1, levels if w else 1):
        for j in range(w):
            level_index[lvl, j], parents[nxt], depth[nxt] = nxt, level_index[lvl - 1, j], lvl + j
            nxt += 1
    for c in range(g):
        for k in range(levels):
            parent = cand_index[c, k - 1] if k else 0
            cand_index[c, k], parents[nxt], depth[nxt] = nxt, parent, k + 1
            nxt += 1
    mask = np.eye(total, dtype=bool)
    for i in range(1, total):  # a parent precedes its children
        mask[i] |= mask[parents[i]]
    for arr in (parents, depth, mask, level_index, cand_index):
        arr.setflags(write=False)
    return TreeLayout(n, w, g, parents, depth, mask, level_index, cand_index)


def fill_tree_tokens(layout: TreeLayout, root: int, levels: np.ndarray,
                     candidates: np.ndarray) -> np.ndarray:
    """int32 [T] node tokens: ``root``, the window's [N-1, >= W] ``levels``, the
    [g, N-1] ``candidates``."""
    toks = np.empty(layout.num_nodes, dtype=np.int32)
    w = layout.window_size
    toks[0] = root
    if w:
        toks[1:w] = levels[0, : w - 1]
        toks[w : layout.level_index[-1, -1] + 1] = levels[1:, :w].reshape(-1)
    if layout.num_candidates:
        toks[layout.cand_index[0, 0] :] = candidates.reshape(-1)
    return toks


def fit_budget(trees: list[tuple[int, int, int]], budget: int) -> tuple[bool, int]:
    """``(use_window, max_candidates)`` (-1: none fit) that fit a step's ``(N, W, g)``
    trees to ``budget`` nodes (0: no limit): windows out first, then fewer candidates."""

    def total(use_window: bool, cap: int) -> int:
        return sum(tree_size(n, w if use_window else 0, min(g, cap)) for n, w, g in trees)

    most = max((g for _, _, g in trees), default=0)
    if budget <= 0 or total(True, most) <= budget:
        return True, most
    for cap in range(most, 0, -1):
        if total(False, cap) <= budget:
            return False, cap
    return False, -1
