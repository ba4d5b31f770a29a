"""One engine step's drafts (engine-agnostic): the planner's shape per request.

**fused** (one forward a step): a request drafts the checked chain its last tree left
minus its last token, which roots this step's tree in vLLM's query rows; without a chain
it drafts its lookup beside a *catch-up* tree rooted at its newest token. **separate**: an
extra tree-masked forward checks the candidates; the draft is the best confirmed chain.
"""

from __future__ import annotations

import numpy as np

from vllm_lookahead.algo.drafting import Live, candidates, lookup, read_tree, unchecked_draft
from vllm_lookahead.algo.trees import TreeAsk, plan_trees
from vllm_lookahead.planner.shapes import OFF, RequestView, Shape, draft_p
from vllm_lookahead.planner.siblings import drain_value, end_value, sibling_rows, sibling_weights

#: A catch-up step drafts its lookup while the next token is expected to be
#: accepted at least this often.
CATCH_UP_DRAFT_P = 0.25


class StepDrafter:
    """The drafts of one engine step (``cfg``: the ``LookaheadConfig``;
    ``max_model_len``: no tree node at or past it; ``stats``: the proposer's
    ``LookaheadStats``; ``prior``: unused)."""

    def __init__(self, cfg, fused: bool, max_model_len: int, stats, prior=None) -> None:
        self.cfg = cfg
        self.fused = fused
        self.max_model_len = max_model_len
        self.stats = stats
        self.disable_batch_size = cfg.disable_batch_size or 0
        self.planner = None  # set at warm-up (``adaptive``); None: the full tree
        self.trees = True  # False: the attention backend cannot run trees
        self.memory = None  # the engine's SharedMemory (None: off)

    def run(self, live: list[Live], num_rows: int, num_decoding: int, spec_k: int,
            joined: bool, token_ids: np.ndarray, run_trees,
            closed: bool = False) -> tuple[list, tuple | None]:
        """Per row its draft, and the step as planned (:meth:`_plan`).

        ``live``: the requests decoding with lookahead; ``num_decoding``: rows
        decoding; ``token_ids``: int [rows, >= n_tok]; ``run_trees``:
        ``[(row, PlannedTree)] -> [int [T] argmax per node]`` (separate
        mode); ``spec_k``, ``joined``, ``closed``: unused."""
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        if self.disable_batch_size and num_decoding >= self.disable_batch_size:
            self.stats.steps_off += 1
            for r in live:
                r.state.draft_sources, r.state.lookup = [], []
            live = []
        weights = self._weights(live, num_decoding)
        if self.cfg.prompt_pool:
            for r in live:
                r.state.add_context_ngrams(token_ids[r.i], r.state.settings.ngram_size, r.n_tok)
        trees, planned = self._plan(live, drafts, token_ids, weights)
        if self.fused:
            window_cut = self._fused_plan([t for t in trees if t[0].chain or t[0].room > 0],
                                          drafts, token_ids)
        else:
            window_cut = bool(trees) and self._separate_pass(trees, drafts, token_ids, run_trees)
        self.stats.steps_window_off += window_cut
        for r in live:
            drafts[r.i] = drafts[r.i][: max(r.room, 0)]
            r.state.draft_sources = r.state.draft_sources[: len(drafts[r.i])]
            if drafts[r.i]:
                self.stats.drafts += 1
                self.stats.draft_tokens += len(drafts[r.i])
                kind = r.state.draft_kind = ("checked" if r.state.draft_checked
                                             else r.state.lookup_kind)
                row = self.stats.drafts_by_kind.setdefault(kind, [0, 0, 0])
                row[0] += 1
                row[1] += len(drafts[r.i])
        return drafts, planned

    # -- planning ------------------------------------------------------------
    def _weights(self, everyone: list[Live], batch: int) -> list[float] | None:
        """Per request what a gained token is worth (:func:`~.siblings.sibling_weights`;
        None: all 1), counted in the stats."""
        if (self.planner is None or not self.cfg.parent_latency
                or not any(r.state.group for r in everyone)
                or all(r.state.seeded for r in everyone)):  # seeded: sized from their own text
            return None
        groups, remaining, draws = [], [], []
        for r in everyone:
            st = r.state
            groups.append(st.group)
            remaining.append(None if st.max_tokens is None
                             else st.max_tokens - (r.n_tok - st.num_prompt_tokens))
            # its typical draft: its last lookup's kind, N - 1 tokens
            draws.append((draft_p(st.acc, st.lookup_kind),
                          max(1, min(st.settings.ngram_size - 1, r.room))))
        cost = self.planner.cost
        w = sibling_weights(groups, remaining, lambda k: drain_value(cost, batch, k),
                            lambda k: end_value(cost, batch, k), draws)
        self.stats.sibling_steps += sum(len(rows) for rows in sibling_rows(groups, remaining))
        self.stats.sibling_ahead_steps += sum(x < 1.0 for x in w)
        return w

    def _plan(self, live: list[Live], drafts, token_ids,
              weights: list[float] | None = None) -> tuple[list, tuple | None]:
        """Look up and plan each request; drafts without a tree go into
        ``drafts``. Returns ``(live, window, cands)`` of those with a tree,
        and the step as planned: ``(requests, query tokens per request, any
        tree, drafting requests, verifier seconds as measured, least
        ``(first, next)`` of a drafting request or None)``, None: not planned."""
        if not live:
            return [], None
        planner = self.planner
        planned = None
        for r in live:
            r.state.lookup = lookup(r.state, token_ids[r.i], r.n_tok, r.room,
                                    self.cfg.prompt_pool, self.memory)
        if planner is None:  # adaptive off: the full tree (or the lookup) every step
            shapes = [OFF if r.room <= 0 else Shape("draft", draft=r.room) if not self.trees
                      else Shape("tree", window=r.state.settings.window_size,
                                 cands=r.state.settings.guess_set_size) for r in live]
        else:
            shapes, planned = self._planned(live, token_ids, weights)
        trees = []
        for r, shape in zip(live, shapes):
            self.stats.arm_steps[{"tree": "tree", "draft": "pool", "off": "off"}[shape.kind]] += 1
            if planner is not None:
                label = shape.label()
                self.stats.shape_steps[label] = self.stats.shape_steps.get(label, 0) + 1
            state = r.state
            if shape.kind == "tree":
                trees.append((r, shape.window, shape.cands))
                continue
            state.acc.relax()
            if shape.kind == "off" or r.room <= 0:
                drafts[r.i] = []
                state.draft_sources = []
            elif r.chain:
                drafts[r.i] = r.chain  # checked by the last tree (sources set)
                state.draft_checked = True
            else:
                drafts[r.i] = unchecked_draft(state, shape.draft if planner is not None else r.room,
                                              self.stats)
                if planner is not None and not state.seeded:
                    state.draft_expect = shape.tokens - 1
        return trees, planned

    def _planned(self, live: list[Live], token_ids,
                 weights: list[float] | None) -> tuple[list[Shape], tuple]:
        """The planner's shapes for ``live`` and the step as planned (:meth:`_plan`)."""
        planner, cost, st, batch = self.planner, self.planner.cost, self.stats, len(live)
        kinds = (True, False)
        seen = {k: cost.verify_seen(batch, k) for k in kinds}
        switch = {k: cost.switch(batch, k) for k in kinds}
        # steps are booked less the verification as measured
        measured = {k: cost.verify(batch, k) for k in kinds}
        # bonus rows are cut only where every request allows it
        bonus = (cost.bonus(batch, True) if planner.lazy_verify
                 and all(r.state.lazy_bonus for r in live) else 0.0)
        views = [_request_view(r, token_ids, self.cfg.prompt_pool, self.trees, planner)
                 for r in live]
        for j, (r, v) in enumerate(zip(live, views)):
            sampled = r.state.sampled
            v.verify, v.switch, v.bonus = seen[sampled], switch[sampled], bonus
            v.lazy = planner.lazy_verify and sampled
            if weights is not None:
                v.weight = weights[j]
        if st.catch_up_requests:
            planner.horizon = max((st.fused_trees + st.pass_requests) / st.catch_up_requests, 1.0)
        left_off = planner.left_off
        shapes = planner.plan(views, self.cfg.max_tree_tokens, explore=True)
        st.requests_unpaid += planner.left_off - left_off
        # per drafting request: (measured (first, next), its verification)
        counted = [(measured[r.state.sampled],
                    v.verify_s(sh.draft, v.draft_p(tree=sh.kind == "tree"),
                               measured[r.state.sampled]))
                   for r, v, sh in zip(live, views, shapes) if sh.draft > 0]
        once = max((switch[r.state.sampled] for r, sh in zip(live, shapes) if sh.draft > 0),
                   default=0.0)
        return shapes, (len(live), sum(sh.query for sh in shapes) / len(shapes),
                        any(sh.kind == "tree" for sh in shapes),
                        sum(sh.query > 1 for sh in shapes),
                        sum(seconds for _, seconds in counted) + once,
                        (min(f for (f, _), _ in counted), min(n for (_, n), _ in counted))
                        if counted else None)

    # -- trees ---------------------------------------------------------------
    def _ask(self, r: Live, text: np.ndarray, w: int, g: int, root: int, root_pos: int,
             **fused) -> TreeAsk:
        """Request ``r``'s tree of ``w`` columns and ``g`` candidates of ``text``."""
        return TreeAsk(ngram_size=r.state.settings.ngram_size, window=w,
                       cands=candidates(r.state, text, self.cfg.prompt_pool, self.memory)[:g],
                       root=root, root_pos=root_pos, levels=r.state.window.levels, **fused)

    def _fused_plan(self, trees, drafts, token_ids) -> bool:
        """Plan the trees riding in the next forward, ``(live, window, cands)``
        each, under one budget (a checked chain's last token roots its tree;
        without one, a catch-up tree). Returns whether windows were cut."""
        asks = []
        for r, w, g in trees:
            state, chain = r.state, r.chain
            if chain:
                k = min(len(chain) - 1, r.room)
                drafts[r.i] = chain[:k]
                state.draft_sources = state.draft_sources[:k]
                state.draft_checked = True
                expect = chain[: k + 1]
                text = np.concatenate([token_ids[r.i, : r.n_tok],
                                       np.asarray(expect, token_ids.dtype)])
                asks.append(self._ask(r, text, w, g, expect[-1], r.n_tok + k, expect=expect))
            else:
                drafts[r.i] = unchecked_draft(state, catch_up_draft_len(state, r.room), self.stats)
                text = token_ids[r.i, : r.n_tok]
                asks.append(self._ask(r, text, w, g, int(text[-1]), r.n_tok - 1, catch_up=True))
        if not asks:
            return False
        planned, use_window = plan_trees(asks, self.cfg.max_tree_tokens, self.max_model_len)
        for (r, _, _), tree in zip(trees, planned):
            if tree is not None:
                r.state.plan = tree
                self.stats.catch_up_requests += tree.catch_up
        return not use_window

    def _separate_pass(self, trees, drafts, token_ids, run_trees) -> bool:
        """One extra forward of the ``(live, window, cands)`` trees; a draft is
        the chain its tree confirmed. Returns whether windows were cut."""
        asks = [self._ask(r, token_ids[r.i, : r.n_tok], w, g, int(token_ids[r.i, r.n_tok - 1]),
                          r.n_tok - 1) for r, w, g in trees]
        planned, use_window = plan_trees(asks, self.cfg.max_tree_tokens, self.max_model_len)
        work = []
        for (r, _, _), tree in zip(trees, planned):
            if r.room <= 0:  # counted in the budget, but no draft to check
                continue
            if tree is None:
                drafts[r.i] = unchecked_draft(r.state, r.room, self.stats)
            else:
                work.append((r, tree))
        if work:
            preds = run_trees([(r.i, tree) for r, tree in work])
            self.stats.lookahead_passes += 1
            self.stats.pass_requests += len(work)
            self.stats.lookahead_query_tokens += sum(len(tree.tokens) for _, tree in work)
            for (r, tree), pred in zip(work, preds):
                drafts[r.i] = read_tree(r.state, tree, pred, self.memory)
                r.state.draft_checked = True
        return not use_window


def catch_up_draft_len(state, room: int) -> int:
    """Tokens of its lookup a request drafts in a catch-up step: the most k
    with ``p^k >= CATCH_UP_DRAFT_P``, ``p`` its own acceptance of the kind."""
    if room <= 0 or not state.lookup:
        return 0
    p = state.acc.unchecked_p(state.lookup_kind)
    k, q = 0, p
    while k < min(room, len(state.lookup)) and q >= CATCH_UP_DRAFT_P:
        k += 1
        q *= p
    return k


def _request_view(r: Live, token_ids: np.ndarray, prompt_pool: bool,
                  trees_here: bool = True, planner=None) -> RequestView:
    """A request as the planner sees it (its lookup done); ``planner`` sizes
    a seeded request's draft (:meth:`~.planner.Planner.steady_draft`)."""
    state, s = r.state, r.state.settings
    trees = trees_here and not state.seeded
    g = 0
    if trees:
        # the candidates: the pool's for its root (and perhaps a suffix match)
        root = (r.chain[min(len(r.chain) - 1, r.room)] if r.chain
                else int(token_ids[r.i, r.n_tok - 1]))
        g = state.pool.count(int(root)) + int(prompt_pool)
    fixed = None
    if state.seeded:
        # nothing timed may decide a seeded draft (the same on every run)
        k = min(len(state.lookup), r.room)
        if planner is not None and k > 0:
            k = planner.steady_draft(state.acc, state.lookup_kind, k, state.seeded_batch)
        fixed = Shape("draft", draft=k) if k > 0 else OFF
    return RequestView(
        acc=state.acc, ngram_size=s.ngram_size, window_size=s.window_size,
        guess_set_size=min(g, s.guess_set_size), room=r.room, chain=len(r.chain),
        unchecked=len(state.lookup), lookup_kind=state.lookup_kind, trees=trees,
        fixed=fixed)
