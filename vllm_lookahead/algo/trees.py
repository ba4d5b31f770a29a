"""A request's lookahead tree for one step: nodes, tokens, positions (numpy only).

Fused, rooted at ``y``, the prediction after the checked draft (it holds iff vLLM samples
``draft + [y]``); in a catch-up or separate mode, at the newest token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_lookahead.attn_mask import TreeLayout, build_tree, fill_tree_tokens, fit_budget


@dataclass
class TreeAsk:
    """The tree a request would like this step."""

    ngram_size: int
    window: int  # window columns (0: none)
    cands: list  # (continuation, count, source), N-1 tokens each
    root: int
    root_pos: int  # the tree reads root_pos cached tokens
    levels: np.ndarray  # int32 [N-1, W] the window
    expect: list = field(default_factory=list)  # fused: draft + [root]
    catch_up: bool = False  # fused: rooted at the newest token, beside vLLM's row


@dataclass
class PlannedTree:
    """A request's tree for a step (``expect``, ``catch_up``: as asked)."""

    layout: TreeLayout
    cands: list  # those it checks (cut to the budget)
    tokens: np.ndarray  # int32 [T]
    positions: np.ndarray  # int64 [T]
    root: int
    root_pos: int
    window: bool  # the window's nodes are in it
    expect: list = field(default_factory=list)
    catch_up: bool = False

    @property
    def num_scheduled(self) -> int | None:
        """Fused: tokens vLLM must schedule (1 + draft); None for a catch-up tree."""
        return None if self.catch_up else len(self.expect)


def plan_trees(asks: list[TreeAsk], max_tree_tokens: int,
               max_model_len: int) -> tuple[list[PlannedTree | None], bool]:
    """Per ask its tree, fitted to ``max_tree_tokens`` together (None: nothing left, or
    past ``max_model_len``), and whether the windows were kept."""
    use_window, cap = fit_budget([(a.ngram_size, a.window, len(a.cands)) for a in asks],
                                 max_tree_tokens)
    return [_build(a, use_window, cap, max_model_len) for a in asks], use_window


def _build(ask: TreeAsk, use_window: bool, cap: int, max_model_len: int) -> PlannedTree | None:
    if cap < 0:
        return None
    n, w, cands = ask.ngram_size, ask.window if use_window else 0, ask.cands[:cap]
    if w == 0 and not cands:
        return None
    layout = build_tree(n, w, len(cands))
    if ask.root_pos + int(layout.depth.max()) >= max_model_len:
        return None
    conts = np.array([c for c, _, _ in cands], dtype=np.int32).reshape(len(cands), n - 1)
    return PlannedTree(
        layout=layout, cands=cands, tokens=fill_tree_tokens(layout, ask.root, ask.levels, conts),
        positions=ask.root_pos + layout.depth.astype(np.int64), root=ask.root,
        root_pos=ask.root_pos, window=w > 0, expect=ask.expect, catch_up=ask.catch_up)
