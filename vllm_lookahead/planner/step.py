"""One engine step's drafts: which request runs what, in either mode.

:class:`StepDrafter` takes the step's decoding requests and the batch's tokens
and returns one draft per row (engine-agnostic, no vLLM). **fused** (one
forward a step): a request drafts the checked chain its last tree left minus
its last token, which roots this step's tree, appended to vLLM's query rows;
without a chain it drafts its unchecked lookup beside a *catch-up* tree rooted
at its newest token. **separate**: one extra tree-masked forward checks the
candidates and the draft is the best confirmed chain. Either way vLLM's
rejection sampler verifies the draft, so it decides only how many tokens a
step gains. The :class:`~.planner.Planner` picks each request's shape.
"""

from __future__ import annotations

import numpy as np

from vllm_lookahead.algo.drafting import Live, candidates, lookup, read_tree, unchecked_draft
from vllm_lookahead.algo.trees import TreeAsk, plan_trees
from vllm_lookahead.planner.shapes import OFF, RequestView, Shape, draft_p
from vllm_lookahead.planner.siblings import drain_value, end_value, sibling_rows, sibling_weights

#: The parent of every request of a ``closed`` batch (:meth:`StepDrafter._weights`).
_WHOLE_BATCH = object()
#: A catch-up step drafts its lookup while the next token is expected to be
#: accepted at least this often.
CATCH_UP_DRAFT_P = 0.25


class StepDrafter:
    """The drafts of one engine step for the batch's decoding requests.

    Args:
        cfg: the engine's :class:`~vllm_lookahead.config.LookaheadConfig`.
        fused: fused mode (else separate).
        max_model_len: no tree node may sit at this position or beyond.
        stats: the proposer's :class:`~vllm_lookahead.stats.LookaheadStats`.
        prior: the engine's ``AcceptancePrior`` (unused here).
    """

    def __init__(self, cfg, fused: bool, max_model_len: int, stats, prior=None) -> None:
        self.cfg = cfg
        self.fused = fused
        self.max_model_len = max_model_len
        self.stats = stats
        self.disable_batch_size = cfg.disable_batch_size or 0
        #: Planner (``adaptive``), set at warm-up; None: the full tree every step.
        self.planner = None
        #: Whether trees may run (False: the attention backend cannot).
        self.trees = True
        #: The engine's ``SharedMemory`` (None: ``shared_memory`` off).
        self.memory = None

    def run(self, live: list[Live], num_rows: int, num_decoding: int, spec_k: int,
            joined: bool, token_ids: np.ndarray, run_trees,
            closed: bool = False) -> tuple[list, tuple | None]:
        """Drafts for the step.

        Args:
            live: the requests that decode with lookahead on.
            num_rows: rows of the batch; num_decoding: rows that decode.
            spec_k, joined: vLLM's longest draft now, whether a request
                joined (unused here).
            token_ids: int [rows, >= n_tok] the batch's tokens.
            run_trees: ``[(row, PlannedTree)] -> [int [T] argmax per node]``,
                one tree-masked forward (separate mode).
            closed: plan the batch for its end (``batch_end``).

        Returns:
            per row its draft (token ids), and the step as planned,
            ``(requests, query tokens per request, any tree, requests with
            more than one query token, verifier seconds as measured, the
            least ``(first, next)`` of a drafting request or None)`` (None:
            not planned).
        """
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        if self.disable_batch_size and num_decoding >= self.disable_batch_size:
            self.stats.steps_off += 1
            for r in live:
                r.state.draft_sources, r.state.lookup = [], []
            live = []
        by_row, planned_rows = self._weights(live, num_decoding, closed)
        if self.cfg.prompt_pool:
            for r in live:
                r.state.add_context_ngrams(token_ids[r.i], r.state.settings.ngram_size, r.n_tok)
        weights = None
        if by_row is not None and live:
            weights = [by_row[r.i] for r in live]
            self.stats.sibling_steps += sum(r.i in planned_rows for r in live)
            self.stats.sibling_ahead_steps += sum(x < 1.0 for x in weights)
        trees, planned = self._plan(live, drafts, token_ids, weights=weights)
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
    def _weights(self, everyone: list[Live], batch: int,
                 closed: bool = False) -> tuple[dict[int, float] | None, set[int]]:
        """Per request (by row) what a gained token is worth
        (:func:`~.siblings.sibling_weights` over the samples of a parent;
        None: all 1), and the rows planned for their parent. ``closed``: the
        whole batch is one parent, where every request has an output cap."""
        closed = (closed and len(everyone) > 1
                  and all(r.state.max_tokens is not None for r in everyone))
        if self.planner is None or not everyone or not closed and (
                not self.cfg.parent_latency or not any(r.state.group for r in everyone)):
            return None, set()
        if all(r.state.seeded for r in everyone):  # sized from their own text
            return None, set()
        groups, remaining, draws = [], [], []
        for r in everyone:
            st = r.state
            groups.append(_WHOLE_BATCH if closed else st.group)
            remaining.append(None if st.max_tokens is None
                             else st.max_tokens - (r.n_tok - st.num_prompt_tokens))
            # its typical draft: its last lookup's kind, N - 1 tokens
            draws.append((draft_p(st.acc, st.lookup_kind),
                          max(1, min(st.settings.ngram_size - 1, r.room))))
        cost = self.planner.cost
        w = sibling_weights(groups, remaining, lambda k: drain_value(cost, batch, k),
                            lambda k: end_value(cost, batch, k), draws)
        planned = {everyone[j].i for rows in sibling_rows(groups, remaining) for j in rows}
        return {r.i: x for r, x in zip(everyone, w)}, planned

    def _plan(self, live: list[Live], drafts, token_ids,
              weights: list[float] | None = None) -> tuple[list, tuple | None]:
        """Look up and plan each live request (``weights``: what a gained
        token is worth, :meth:`_weights`); drafts without a tree go into
        ``drafts``. Returns ``(live, window, cands)`` of the requests that
        get a tree, and the step as planned (:meth:`run`)."""
        if not live:
            return [], None
        planner = self.planner
        views, planned = [], None
        for r in live:
            r.state.lookup = lookup(r.state, token_ids[r.i], r.n_tok, r.room,
                                    self.cfg.prompt_pool, self.memory)
        if planner is None:  # adaptive off: the full tree (or the lookup) every step
            shapes = [OFF if r.room <= 0 else Shape("draft", draft=r.room) if not self.trees
                      else Shape("tree", window=r.state.settings.window_size,
                                 cands=r.state.settings.guess_set_size) for r in live]
        else:
            batch = len(live)
            kinds = (True, False)
            verify = {k: planner.verify_seen(batch, k) for k in kinds}
            switch = {k: planner.switch(batch, k) for k in kinds}
            # steps are booked less the verification as measured (verify_seen
            # learns what they undo of it)
            measured = {k: planner.verify(batch, k) for k in kinds}
            # bonus rows are cut only where every request allows it
            bonus = planner.bonus(batch) if all(r.state.lazy_bonus for r in live) else 0.0
            for j, r in enumerate(live):
                v = _request_view(r, token_ids, self.cfg.prompt_pool, self.trees, planner)
                sampled = r.state.sampled
                v.verify, v.switch, v.bonus = verify[sampled], switch[sampled], bonus
                v.lazy = planner.lazy_verify and sampled
                if weights is not None:
                    v.weight = weights[j]
                views.append(v)
            st = self.stats
            if st.catch_up_requests:
                planner.horizon = max((st.fused_trees + st.pass_requests)
                                      / st.catch_up_requests, 1.0)
            left_off = planner.left_off
            shapes = planner.plan(views, self.cfg.max_tree_tokens, explore=True)
            st.requests_unpaid += planner.left_off - left_off
            # per drafting request: (measured (first, next), its verification
            # as priced with them)
            counted = [(measured[r.state.sampled],
                        v.verify_s(sh.draft, v.draft_p(tree=sh.kind == "tree"),
                                   measured[r.state.sampled]))
                       for r, v, sh in zip(live, views, shapes) if sh.draft > 0]
            once = max((switch[r.state.sampled] for r, sh in zip(live, shapes) if sh.draft > 0),
                       default=0.0)
            planned = (len(live), sum(sh.query for sh in shapes) / len(shapes),
                       any(sh.kind == "tree" for sh in shapes),
                       sum(sh.query > 1 for sh in shapes),
                       sum(seconds for _, seconds in counted) + once,
                       (min(f for (f, _), _ in counted), min(n for (_, n), _ in counted))
                       if counted else None)
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

    # -- trees ---------------------------------------------------------------
    def _fused_plan(self, trees, drafts, token_ids) -> bool:
        """Plan the trees that ride in the next forward, ``(live, window,
        cands)`` each, under one token budget: a request with a checked chain
        drafts it but its last token, the tree's root; one without drafts
        :func:`catch_up_draft_len` of its lookup beside a catch-up tree rooted
        at its newest token. Returns whether the budget left the windows out."""
        asks, rows = [], []
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
                root, root_pos, catch_up = expect[-1], r.n_tok + k, False
            else:
                drafts[r.i] = unchecked_draft(state, catch_up_draft_len(state, r.room), self.stats)
                text = token_ids[r.i, : r.n_tok]
                expect, root, root_pos, catch_up = [], int(text[-1]), r.n_tok - 1, True
            asks.append(TreeAsk(
                ngram_size=state.settings.ngram_size, window=w,
                cands=candidates(state, text, self.cfg.prompt_pool, self.memory)[:g],
                root=root, root_pos=root_pos, levels=state.window.levels,
                expect=expect, catch_up=catch_up))
            rows.append(r)
        if not asks:
            return False
        planned, use_window = plan_trees(asks, self.cfg.max_tree_tokens, self.max_model_len)
        for r, tree in zip(rows, planned):
            if tree is not None:
                r.state.plan = tree
                self.stats.catch_up_requests += tree.catch_up
        return not use_window

    def _separate_pass(self, trees, drafts, token_ids, run_trees) -> bool:
        """One extra tree-masked forward rooted at each request's newest
        token (``trees``: ``(live, window, cands)``); its draft is the chain
        the tree confirmed (no tree: its lookup). Returns whether the budget
        left the windows out."""
        asks = []
        for r, w, g in trees:
            text = token_ids[r.i, : r.n_tok]
            asks.append(TreeAsk(
                ngram_size=r.state.settings.ngram_size, window=w,
                cands=candidates(r.state, text, self.cfg.prompt_pool, self.memory)[:g],
                root=int(text[-1]), root_pos=r.n_tok - 1, levels=r.state.window.levels))
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
    """How much of its lookup a request drafts in a catch-up step: the
    longest k with ``p^k >= CATCH_UP_DRAFT_P``, p its own acceptance of the
    lookup's kind (learnt from its text alone: the same on every run)."""
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
    """A request as the planner sees it this step (its lookup done);
    ``trees_here``: the engine can run trees; ``planner`` sizes a seeded
    request's draft (:meth:`~.planner.Planner.steady_draft`)."""
    state, s = r.state, r.state.settings
    trees = trees_here and not state.seeded
    g = 0
    if trees:
        # the candidates the tree could check: the pool's for its root
        # (plus, with the prompt pool, perhaps a suffix match)
        root = (r.chain[min(len(r.chain) - 1, r.room)] if r.chain
                else int(token_ids[r.i, r.n_tok - 1]))
        g = state.pool.count(int(root)) + int(prompt_pool)
    fixed = None
    if state.seeded:
        # Nothing timed may decide a seeded draft: its text, what it learnt
        # from it, and the start-up curve in a batch fixed at its start.
        k = min(len(state.lookup), r.room)
        if planner is not None and k > 0:
            k = planner.steady_draft(state.acc, state.lookup_kind, k, state.seeded_batch)
        fixed = Shape("draft", draft=k) if k > 0 else OFF
    return RequestView(
        acc=state.acc, ngram_size=s.ngram_size, window_size=s.window_size,
        guess_set_size=min(g, s.guess_set_size), room=r.room, chain=len(r.chain),
        unchecked=len(state.lookup), lookup_kind=state.lookup_kind, trees=trees,
        fixed=fixed)
