"""A request's lookahead tree for one step: its nodes, tokens and positions.

Pure (numpy only). :func:`plan_trees` is the one place trees are built, in
both modes:

* **fused**: rooted at ``y``, the last token of the checked chain (the
  model's prediction after the draft), at the position right after the
  draft; the tree rides in the next step's forward and holds iff vLLM
  samples :attr:`PlannedTree.expect` (``draft + [y]``).
* **separate pass**: rooted at the request's newest token (not cached
  yet); the tree runs in an extra forward right away;
* **fused catch-up** (a request without a checked chain: its first step,
  or a miss): rooted at the newest token too, but riding in the step's own
  forward beside vLLM's row of that token.

Either way the step's trees are fitted to ``max_tree_tokens``
(:func:`~vllm_lookahead.attn_mask.fit_budget`: all windows go first, then
candidates one by one, then the trees) and a tree whose deepest node would
reach ``max_model_len`` is left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_lookahead.attn_mask import TreeLayout, build_tree, fill_tree_tokens, fit_budget


@dataclass
class TreeAsk:
    """The tree one request would like this step.

    Attributes:
        ngram_size: the request's N.
        window: window columns wanted (0: none).
        cands: the root's candidates, at most g, as ``(continuation, count,
            source)`` with N-1 token continuations
            (:func:`~vllm_lookahead.algo.drafting.candidates`).
        root: the root token; root_pos: its position (the tree reads
            ``root_pos`` cached tokens).
        levels: int32 [N-1, W] the request's Jacobi window levels.
        expect: fused mode: ``draft + [root]`` ([] for a separate pass or
            a catch-up tree).
        catch_up: fused mode: the tree is rooted at the request's newest
            token, which vLLM's own rows of the same step carry too (a
            request without a checked chain re-anchors in its next step).
    """

    ngram_size: int
    window: int
    cands: list
    root: int
    root_pos: int
    levels: np.ndarray
    expect: list = field(default_factory=list)
    catch_up: bool = False


@dataclass
class PlannedTree:
    """A request's tree for a step (either mode).

    Fused mode: last step's checked chain ended in the model's own
    prediction ``y`` of the token after the draft. The tree's root is ``y``,
    right after the draft (a query node: not cached); it is valid iff vLLM
    samples exactly ``draft + [y]``, which with greedy decoding is certain.
    Separate pass: the root is the request's newest token.

    Attributes:
        layout: tree layout (node 0 is the root).
        cands: the candidates of the root it checks, as the pool returned
            them (cut to the step's budget).
        tokens, positions: int32 / int64 [T] node tokens and positions.
        root: the root token.
        root_pos: position of the root; the tree reads ``root_pos`` cached
            tokens.
        window: whether the window's nodes are in the tree.
        expect: fused mode: ``draft + [y]`` ([] for a separate pass).
        catch_up: fused mode: rooted at the newest token, which vLLM's rows
            of the same step start with (any draft after it); the tree
            reads the ``root_pos`` tokens before it, never this step's
            draft, and its checked chain holds for the next step as far as
            vLLM sampled along it.
    """

    layout: TreeLayout
    cands: list
    tokens: np.ndarray
    positions: np.ndarray
    root: int
    root_pos: int
    window: bool
    expect: list = field(default_factory=list)
    catch_up: bool = False

    @property
    def num_scheduled(self) -> int | None:
        """Fused mode: tokens vLLM must schedule for the request (1 +
        draft); None for a catch-up tree (any count: its root is the first)."""
        return None if self.catch_up else len(self.expect)


def plan_trees(asks: list[TreeAsk], max_tree_tokens: int,
               max_model_len: int) -> tuple[list[PlannedTree | None], bool]:
    """The trees of one step's requests, fitted together.

    Every ask counts toward ``max_tree_tokens`` (0 = no limit; the root is
    one of each tree's tokens). A request gets no tree (None) where the
    budget leaves it neither window nor candidates, or where its deepest
    node would sit at ``max_model_len`` or beyond.

    Returns:
        ``(trees, use_window)``: per ask its tree or None; False where the
        budget left every window out this step.
    """
    use_window, cap = fit_budget(
        [(a.ngram_size, a.window, len(a.cands)) for a in asks], max_tree_tokens, with_root=True
    )
    return [_build(a, use_window, cap, max_model_len) for a in asks], use_window


def _build(ask: TreeAsk, use_window: bool, cap: int, max_model_len: int) -> PlannedTree | None:
    """One request's tree under the step's budget (``cap`` < 0: no tree fits)."""
    if cap < 0:
        return None
    n = ask.ngram_size
    w = ask.window if use_window else 0
    cands = ask.cands[:cap]
    if w == 0 and not cands:
        return None
    layout = build_tree(n, w, len(cands))
    if ask.root_pos + int(layout.depth.max()) >= max_model_len:
        return None
    return PlannedTree(
        layout=layout,
        cands=cands,
        tokens=fill_tree_tokens(layout, ask.root, ask.levels, cand_array(cands, n)),
        positions=ask.root_pos + layout.depth.astype(np.int64),
        root=ask.root,
        root_pos=ask.root_pos,
        window=w > 0,
        expect=ask.expect,
        catch_up=ask.catch_up,
    )


def cand_array(cands, ngram_size: int) -> np.ndarray:
    """int32 [g, N-1] the continuations of ``(continuation, count, source)``
    candidates."""
    return np.array([c for c, _, _ in cands], dtype=np.int32).reshape(len(cands), ngram_size - 1)
