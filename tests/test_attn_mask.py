"""Unit tests of the lookahead tree layout (vllm_lookahead.attn_mask).

Every expectation is derived from the documented semantics (module docstring
and LOOKAHEAD.md "The algorithm in one step"), not from the implementation.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_lookahead.attn_mask import build_tree, fill_tree_tokens, fit_budget, tree_size

# (N, W, g): edge cases (N=2, W=1, g=0; W=0 = Jacobi branch off) and the
# paper's recommended (5, 15, 15).
SIZES = [
    (2, 0, 0),
    (2, 0, 2),
    (4, 0, 3),
    (2, 1, 0),
    (2, 1, 1),
    (2, 4, 0),
    (2, 3, 2),
    (3, 1, 0),
    (3, 1, 2),
    (3, 3, 0),
    (4, 5, 3),
    (4, 1, 4),
    (5, 15, 15),
    (6, 2, 1),
    (7, 4, 5),
]


def _expected_nodes(n, w, g):
    """Documented node order as a list of (kind, a, b):
    ("B", l, j) for B_l[j] (l = 0 is the trunk, B0[0] is the root) and
    ("C", c, k) for candidate c's k-th token. With W = 0 the tree is the
    root ("R") plus the candidate chains."""
    nodes = [("B", 0, j) for j in range(w)] if w else [("R", 0, 0)]
    for lvl in range(1, n - 1):
        nodes += [("B", lvl, j) for j in range(w)]
    for c in range(g):
        nodes += [("C", c, k) for k in range(n - 1)]
    return nodes


def _ancestors(parents, i):
    out = []
    j = int(parents[i])
    seen = 0
    while j >= 0:
        out.append(j)
        j = int(parents[j])
        seen += 1
        assert seen <= len(parents), "cycle in parents"
    return out


@pytest.mark.parametrize("n,w,g", SIZES)
def test_node_count_and_shapes(n, w, g):
    lay = build_tree(n, w, g)
    t = (n - 1) * (w + g) if w else 1 + (n - 1) * g
    assert lay.num_nodes == t
    assert lay.parents.shape == (t,)
    assert lay.depth.shape == (t,)
    assert lay.mask.shape == (t, t)
    assert lay.mask.dtype == np.bool_
    assert lay.level_index.shape == (n - 1, w)
    assert lay.cand_index.shape == (g, n - 1)
    assert (lay.ngram_size, lay.window_size, lay.num_candidates) == (n, w, g)


@pytest.mark.parametrize("n,w,g", SIZES)
def test_index_tables_follow_documented_order(n, w, g):
    lay = build_tree(n, w, g)
    nodes = _expected_nodes(n, w, g)
    assert len(nodes) == lay.num_nodes
    for idx, (kind, a, b) in enumerate(nodes):
        if kind == "B":
            assert lay.level_index[a, b] == idx
        elif kind == "C":
            assert lay.cand_index[a, b] == idx
    # every node is listed exactly once in level_index + cand_index (+ the
    # root when W = 0, which has no level)
    all_idx = [0] if w == 0 else []
    all_idx += lay.level_index.ravel().tolist() + lay.cand_index.ravel().tolist()
    assert sorted(all_idx) == list(range(lay.num_nodes))
    if w:
        assert lay.level_index[0, 0] == 0  # the root
    np.testing.assert_array_equal(lay.newest_level, lay.level_index[n - 2])


@pytest.mark.parametrize("n,w,g", SIZES)
def test_parents_as_documented(n, w, g):
    lay = build_tree(n, w, g)
    li, ci, par = lay.level_index, lay.cand_index, lay.parents
    # trunk chain: B0[0] is the root, B0[j] -> B0[j-1]
    assert par[0] == -1
    for j in range(1, w):
        assert par[li[0, j]] == li[0, j - 1]
    # B_l[j] -> B_{l-1}[j] (same column, one level down)
    for lvl in range(1, n - 1):
        for j in range(w):
            assert par[li[lvl, j]] == li[lvl - 1, j]
    # candidate chains rooted at node 0
    for c in range(g):
        assert par[ci[c, 0]] == 0
        for k in range(1, n - 1):
            assert par[ci[c, k]] == ci[c, k - 1]
    # exactly one root
    assert int((par == -1).sum()) == 1


@pytest.mark.parametrize("n,w,g", SIZES)
def test_depth(n, w, g):
    lay = build_tree(n, w, g)
    par, depth = lay.parents, lay.depth
    assert depth[0] == 0
    for i in range(1, lay.num_nodes):
        assert depth[i] == depth[par[i]] + 1
        assert depth[i] == len(_ancestors(par, i))
    # documented positions: B_l[j] at p + l + j, candidate token k at p + k + 1
    for lvl in range(n - 1):
        for j in range(w):
            assert depth[lay.level_index[lvl, j]] == lvl + j
    for c in range(g):
        for k in range(n - 1):
            assert depth[lay.cand_index[c, k]] == k + 1


@pytest.mark.parametrize("n,w,g", SIZES)
def test_mask_is_self_plus_ancestors(n, w, g):
    lay = build_tree(n, w, g)
    t = lay.num_nodes
    for i in range(t):
        expected = {i, *_ancestors(lay.parents, i)}
        assert set(np.nonzero(lay.mask[i])[0].tolist()) == expected, i
    # parents precede children, so the mask is lower-triangular with a full diagonal
    assert all(lay.parents[i] < i for i in range(t))
    assert not np.triu(lay.mask, k=1).any()
    assert lay.mask.diagonal().all()
    # row sums = depth + 1 (a node sees its whole chain back to the root)
    np.testing.assert_array_equal(lay.mask.sum(1), lay.depth + 1)


def test_mask_semantics_from_algorithm_doc():
    """LOOKAHEAD.md: B0[j] sees B0[0..j]; B_l[j] sees B0[0..j] plus
    B_1[j]..B_l[j]; candidate token k sees x and the candidate's tokens 0..k."""
    n, w, g = 5, 6, 3
    lay = build_tree(n, w, g)
    li, ci = lay.level_index, lay.cand_index
    for lvl in range(n - 1):
        for j in range(w):
            want = {int(li[0, jj]) for jj in range(j + 1)}
            want |= {int(li[ll, j]) for ll in range(1, lvl + 1)}
            assert set(np.nonzero(lay.mask[li[lvl, j]])[0].tolist()) == want
    for c in range(g):
        for k in range(n - 1):
            want = {0} | {int(ci[c, kk]) for kk in range(k + 1)}
            assert set(np.nonzero(lay.mask[ci[c, k]])[0].tolist()) == want


@pytest.mark.parametrize("n,w,g", SIZES)
def test_fill_tree_tokens(n, w, g):
    lay = build_tree(n, w, g)
    rng = np.random.default_rng(n * 1000 + w * 10 + g)
    # distinct tokens so every misplacement is visible
    pool = rng.permutation(100_000)[: 1 + (n - 1) * w + g * (n - 1)] + 1
    root = int(pool[0])
    levels = pool[1 : 1 + (n - 1) * w].reshape(n - 1, w).astype(np.int32)
    cands = pool[1 + (n - 1) * w :].reshape(g, n - 1).astype(np.int32)
    toks = fill_tree_tokens(lay, root, levels, cands)
    assert toks.shape == (lay.num_nodes,)
    assert toks.dtype == np.int32
    assert toks[0] == root
    for j in range(1, w):  # trunk B0 = [x, L0[0..W-2]]
        assert toks[lay.level_index[0, j]] == levels[0, j - 1]
    for lvl in range(1, n - 1):
        for j in range(w):
            assert toks[lay.level_index[lvl, j]] == levels[lvl, j]
    for c in range(g):
        for k in range(n - 1):
            assert toks[lay.cand_index[c, k]] == cands[c, k]
    if w:
        # the unused last column of L0 never appears in the tree
        assert levels[0, w - 1] not in set(toks.tolist())


@pytest.mark.parametrize(
    "n,w,g", [(1, 5, 3), (0, 5, 3), (-1, 1, 0), (4, -1, 3), (4, -2, 0), (4, 5, -1), (2, 0, -1)]
)
def test_build_tree_rejects_invalid_sizes(n, w, g):
    with pytest.raises(ValueError):
        build_tree(n, w, g)


def test_build_tree_cached_and_read_only():
    a = build_tree(4, 5, 3)
    assert build_tree(4, 5, 3) is a
    for arr in (a.parents, a.depth, a.mask, a.level_index, a.cand_index):
        with pytest.raises(ValueError):
            arr[...] = 0


@pytest.mark.parametrize("n,w,g", [(2, 0, 1), (2, 3, 0), (4, 5, 5), (5, 0, 7), (6, 1, 2)])
def test_tree_size_matches_layout(n, w, g):
    assert tree_size(n, w, g) == build_tree(n, w, g).num_nodes


def test_fit_budget_no_limit_or_fits():
    trees = [(4, 5, 5), (4, 5, 3)]
    assert fit_budget(trees, 0) == (True, 5)
    full = tree_size(4, 5, 5) + tree_size(4, 5, 3)
    assert fit_budget(trees, full) == (True, 5)


def test_fit_budget_drops_windows_then_candidates_then_trees():
    trees = [(4, 5, 5), (4, 5, 5)]
    full = 2 * tree_size(4, 5, 5)  # 60
    use_w, cap = fit_budget(trees, full - 1)
    assert (use_w, cap) == (False, 5)  # windows out: 2 * (1 + 15) = 32
    use_w, cap = fit_budget(trees, 31)
    assert not use_w and cap == 4 and 2 * tree_size(4, 0, 4) <= 31 < 2 * tree_size(4, 0, 5)
    assert fit_budget(trees, 2 * tree_size(4, 0, 1)) == (False, 1)
    assert fit_budget(trees, 2 * tree_size(4, 0, 1) - 1) == (False, -1)


@pytest.mark.parametrize("budget", [1, 7, 20, 33, 64, 100])
def test_fit_budget_result_fits(budget):
    trees = [(4, 5, 5), (3, 2, 4), (5, 7, 1)]
    use_w, cap = fit_budget(trees, budget)
    if cap >= 0:
        used = sum(tree_size(n, w if use_w else 0, min(g, cap)) for n, w, g in trees)
        assert used <= budget
    else:
        assert sum(tree_size(n, 0, min(g, 1)) for n, w, g in trees) > budget
