"""One engine step's drafts: which request runs what, in either mode.

Engine-agnostic (no vLLM): :class:`StepDrafter` takes the step's decoding
requests (:class:`~vllm_lookahead.algo.drafting.Live`, their state up to date)
and the batch's token array and returns one draft per row; the trees of a
separate pass run through a callable that :mod:`.proposer` supplies. Per
request logic is in :mod:`.drafting`, trees are built in :mod:`.trees`,
shapes are chosen by :mod:`.planner`. Two modes
(``LookaheadConfig.mode``):

**fused** (default, one target forward per step). At the end of step t each
request has a *checked chain*: tokens the model itself predicted to follow
its text, the last being its argmax after the others. The draft is the chain
minus its last token ``y``; the tree of step t+1 is planned rooted at ``y``,
right after the draft (see :class:`~vllm_lookahead.algo.trees.PlannedTree`): the
Jacobi window and the pool's candidates for ``y``. In step t+1 the worker
appends the tree to vLLM's own query tokens, so it reads the request's KV
cache -- the draft included -- plus its tree ancestors. After vLLM's
rejection sampler, if it sampled exactly ``draft + [y]``:

1. the newest window level comes from the argmax at the window's last level;
   its W column n-grams go into the pool and the window shifts;
2. the next checked chain is the candidate the argmax chain confirms
   furthest (then most often seen, then newest) plus the argmax after it.

Otherwise (first step, or a miss) the request re-anchors in its next step,
with no extra forward: its draft is the pool's unchecked guess and a
*catch-up* tree rooted at its newest token -- the token vLLM's own rows of
the step start with -- rides beside them, reading the cache before that
token. Its checked chain holds for the step after as far as vLLM sampled
along it. Without any tree (the token budget) the draft is the pool's
unchecked guess.

**separate** (two forwards per step). After sampling, one extra tree-masked
forward rooted at the newest token (not cached yet) checks every candidate;
the draft is the best confirmed prefix plus the argmax after it.

Either way vLLM's rejection sampler verifies the draft exactly: the draft
only decides how many tokens one step can gain, never which tokens come out.

Planning (``adaptive``, default): every step a
:class:`~vllm_lookahead.planner.planner.Planner` picks each request's shape -- no
draft, a draft of k tokens, or a tree of w <= W columns and g <= G
candidates -- for the most expected tokens per second, from the step cost
measured at start-up (:mod:`.warmup`, corrected from the steps seen) and the
request's measured acceptance (:mod:`.acceptance`). Seeded sampled requests
are planned from their text alone. ``max_tree_tokens`` caps the tree tokens
of a step; with ``disable_batch_size`` requests decoding or more, a step
runs with no tree and no draft.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import numpy as np

from vllm_lookahead.algo.drafting import Live, candidates, lookup, read_tree, unchecked_draft
from vllm_lookahead.planner.planner import (
    OFF,
    RequestView,
    Shape,
    draft_p,
    sibling_rows,
    sibling_weights,
)
from vllm_lookahead.algo.trees import TreeAsk, plan_trees


#: The parent of every request of a ``closed`` batch (:meth:`StepDrafter._weights`).
_WHOLE_BATCH = object()


class _HeldWeight(NamedTuple):
    """One request's weight as held (:meth:`StepDrafter._step_weights`)."""

    state: weakref.ref  # its state, by weak reference
    weight: float
    planned: bool  # planned for its parent
    n_tok: int  # its tokens when taken


class _HeldWeights(NamedTuple):
    """The last weights taken (:meth:`StepDrafter._step_weights`)."""

    key: tuple  # (batch size, closed, requests)
    age: int  # steps since taken
    by_state: dict  # id(request state) -> _HeldWeight


class StepDrafter:
    """The drafts of one engine step for the batch's decoding requests.

    Args:
        cfg: the engine's :class:`~vllm_lookahead.config.LookaheadConfig`.
        fused: fused mode (else separate).
        max_model_len: no tree node may sit at this position or beyond.
        stats: the proposer's :class:`~vllm_lookahead.stats.LookaheadStats`.
        prior: the engine's :class:`~vllm_lookahead.planner.acceptance.AcceptancePrior`.
    """

    def __init__(self, cfg, fused: bool, max_model_len: int, stats, prior) -> None:
        self.cfg = cfg
        self.fused = fused
        self.max_model_len = max_model_len
        self.stats = stats
        self.disable_batch_size = cfg.disable_batch_size or 0
        #: Planner (``adaptive``), set at warm-up; None: the full tree every step.
        self.planner = None
        #: Whether trees may run (False where the engine's attention backend
        #: cannot serve the lookahead branch: prompt-lookup drafts only).
        self.trees = True
        #: The engine's shared memory (:class:`~vllm_lookahead.algo.memory.
        #: SharedMemory`; None: ``shared_memory`` off).
        self.memory = None
        #: The last weights taken (:meth:`_step_weights`; None where
        #: :meth:`_weights` gave None).
        self._held_weights: _HeldWeights | None = None

    #: Steps a request's weight (:meth:`_weights`) is used for before it is
    #: taken again, where the batch keeps its requests and no request has
    #: gained more than :attr:`WEIGHTS_SLACK` tokens beyond one a step
    #: since (:meth:`_step_weights`): the end-share integral costs 0.3-0.5
    #: ms a step (numpy calls on a few hundred floats), a third of the
    #: proposer's time at 4 samples, and the samples' distances to their
    #: ends move only by the drafts they accept.
    WEIGHTS_EVERY = 4
    #: Accepted draft tokens a request may gain (over the held steps) with
    #: its weight held; taken again at once where one gains more (it moved
    #: against its siblings). At 0 (held only while no draft is accepted)
    #: the weights were taken again in 86% of the steps of 16 samples of
    #: MT-Bench prompts on the AMX Xeon, at 2 in 44%.
    WEIGHTS_SLACK = 2

    def run(self, live: list[Live], num_rows: int, num_decoding: int, spec_k: int,
            joined: bool, token_ids: np.ndarray, run_trees,
            closed: bool = False) -> tuple[list, tuple | None]:
        """Drafts for the step.

        Args:
            live: the requests that decode with lookahead on.
            num_rows: rows of the batch; num_decoding: rows that decode
                (lookahead on or not).
            spec_k: longest draft vLLM takes at this batch size.
            joined: whether a request decodes for the first time.
            token_ids: int [rows, >= n_tok] the batch's tokens.
            run_trees: ``[(row, PlannedTree)] -> [int [T] argmax per node]``,
                one tree-masked forward (separate pass).
            closed: plan the batch for its end (``batch_end``: nothing
                waits for its slots, every row decodes with lookahead).

        Returns:
            ``(drafts, planned)``: per row its draft (token ids); the step as
            planned, ``(requests, query tokens per request, any tree,
            requests with more than one query token, seconds of vLLM's
            verification of its drafts as measured (``Planner.verify``), the
            least ``(first, next)`` of it of a drafting request's kind or
            None)``, to time it (None: not planned).
        """
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        if self.disable_batch_size and num_decoding >= self.disable_batch_size:
            self.stats.steps_off += 1
            for r in live:
                r.state.draft_sources, r.state.lookup = [], []
            live = []
        by_row, planned_rows = self._step_weights(live, num_decoding, closed)
        if self.cfg.prompt_pool:
            for r in live:
                r.state.add_context_ngrams(token_ids[r.i], r.state.settings.ngram_size, r.n_tok)
        weights = None
        if by_row is not None and live:
            weights = [by_row[r.i] for r in live]
            self.stats.sibling_steps += sum(r.i in planned_rows for r in live)
            self.stats.sibling_ahead_steps += sum(x < 1.0 for x in weights)
        trees, planned = self._plan(live, drafts, token_ids, weights=weights)
        window_cut = False  # the budget left a tree's window out (counted once a step)
        if self.fused:
            # Tree requests without a checked chain (first step, or the last
            # tree missed) re-anchor in this very step: a catch-up tree
            # rooted at their newest token rides beside vLLM's row of it,
            # their draft the unchecked lookup meanwhile.
            trees = [t for t in trees if t[0].chain or t[0].room > 0]
            window_cut |= self._fused_plan(trees, drafts, token_ids)
        elif trees:
            window_cut = self._separate_pass(trees, drafts, token_ids, run_trees)
        self.stats.steps_window_off += window_cut
        for r in live:
            drafts[r.i] = drafts[r.i][: max(r.room, 0)]
            r.state.draft_sources = r.state.draft_sources[: len(drafts[r.i])]
            if drafts[r.i]:
                self.stats.drafts += 1
                self.stats.draft_tokens += len(drafts[r.i])
                kind = "checked" if r.state.draft_checked else r.state.lookup_kind
                r.state.draft_kind = kind
                row = self.stats.drafts_by_kind.setdefault(kind, [0, 0, 0])
                row[0] += 1
                row[1] += len(drafts[r.i])
        return drafts, planned

    # -- planning ------------------------------------------------------------
    def _step_weights(self, everyone: list[Live], batch: int,
                      closed: bool) -> tuple[dict[int, float] | None, set[int]]:
        """:meth:`_weights` (other than its None), held for up to
        :attr:`WEIGHTS_EVERY` steps while the batch keeps its requests, its
        size and ``closed`` and no request gained more than
        :attr:`WEIGHTS_SLACK` tokens beyond one a step since they were
        taken (accepted drafts move the samples' distances to their ends);
        taken again otherwise. Counted in steps and tokens, never in time:
        the same on every run."""
        key = (batch, closed, len(everyone))
        held = self._held_weights
        if held is not None and held.key == key and held.age + 1 < self.WEIGHTS_EVERY:
            age, by_state = held.age + 1, held.by_state
            slack = self.WEIGHTS_SLACK
            rows = []
            for r in everyone:
                got = by_state.get(id(r.state))
                if (got is None or got.state() is not r.state
                        or not age <= r.n_tok - got.n_tok <= age + slack):
                    break
                rows.append(got)
            else:
                self._held_weights = _HeldWeights(key, age, by_state)
                return ({r.i: got.weight for r, got in zip(everyone, rows)},
                        {r.i for r, got in zip(everyone, rows) if got.planned})
        by_row, planned = self._weights(everyone, batch, closed)
        # None (no siblings, not closed) is its cheap path: nothing to hold.
        # The states by weak reference: a finished request's state is freed
        # with it (the soak test counts what the package keeps)
        self._held_weights = None if by_row is None else _HeldWeights(
            key, 0, {id(r.state): _HeldWeight(weakref.ref(r.state), by_row[r.i],
                                              r.i in planned, r.n_tok)
                     for r in everyone})
        return by_row, planned

    def _weights(self, everyone: list[Live], batch: int,
                 closed: bool = False) -> tuple[dict[int, float] | None, set[int]]:
        """Per request of ``everyone`` (by batch row), what a token it gains
        is worth (:func:`~vllm_lookahead.planner.planner.sibling_weights` over the
        samples of one parent decoding this step; None: all 1), and the
        rows planned for their parent. ``closed`` (``batch_end``): the
        whole batch is one parent, where every request has an output cap."""
        closed = (closed and len(everyone) > 1
                  and all(r.state.max_tokens is not None for r in everyone))
        if self.planner is None or not everyone or not closed and (
                not self.cfg.parent_latency or not any(r.state.group for r in everyone)):
            return None, set()
        if all(r.state.seeded for r in everyone):
            # their drafts are sized from their own text (steady_draft),
            # never by a weight (0.2 ms a step at 4 seeded samples)
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
        w = sibling_weights(groups, remaining, lambda k: self.planner.drain_value(batch, k),
                            lambda k: self.planner.end_value(batch, k), draws)
        planned = {everyone[j].i for rows in sibling_rows(groups, remaining) for j in rows}
        return {r.i: x for r, x in zip(everyone, w)}, planned

    def _plan(self, live: list[Live], drafts, token_ids,
              others: int = 0, weights: list[float] | None = None) -> tuple[list, tuple | None]:
        """Each live request's shape this step (``others``: more requests
        in the step, off; ``weights``: per request, what a token it gains is
        worth, :meth:`_weights`). Drafts without a tree go into ``drafts``.
        Returns the requests that get a tree, as ``(live, window columns,
        candidates)``, and the step as planned (planner only, else None)."""
        if not live:
            return [], None
        fixed = self.planner is None  # adaptive off: the full tree every step
        views = []
        verify, measured, bonus, switch = {}, {}, 0.0, {}
        if not fixed:
            batch = len(live) + max(others, 0)
            verify = {k: self.planner.verify_seen(batch, k) for k in (True, False)}
            # what the step pays once where any request drafts
            switch = {k: self.planner.switch(batch, k) for k in (True, False)}
            # the steps are booked less the verification as measured (the
            # plane learns what the steps undo of it: verify_seen)
            measured = {k: self.planner.verify(batch, k) for k in (True, False)}
            # vLLM's rows cut to the bonus rows used (patch 15) only where
            # every request of the step allows it (lazy_bonus.applies)
            if all(r.state.lazy_bonus for r in live):
                bonus = self.planner.bonus(batch)
        for j, r in enumerate(live):
            r.state.lookup = lookup(r.state, token_ids[r.i], r.n_tok, r.room,
                                    self.cfg.prompt_pool, self.memory)
            if not fixed:
                views.append(_request_view(r, token_ids, self.cfg.prompt_pool, self.trees,
                                           self.planner))
                views[-1].verify = verify[r.state.sampled]
                views[-1].switch = switch[r.state.sampled]
                views[-1].lazy = self.planner.lazy_verify and r.state.sampled
                views[-1].bonus = bonus
                if weights is not None:
                    views[-1].weight = weights[j]
        planned = None
        if fixed and self.trees:
            shapes = [Shape("tree", window=r.state.settings.window_size,
                            cands=r.state.settings.guess_set_size) if r.room > 0 else OFF
                      for r in live]
        elif fixed:  # no trees here: the lookup's draft every step
            shapes = [Shape("draft", draft=r.room) if r.room > 0 else OFF for r in live]
        else:
            st = self.stats
            if st.catch_up_requests:
                runs = st.fused_trees + st.pass_requests
                self.planner.horizon = max(runs / st.catch_up_requests, 1.0)
            left_off = self.planner.left_off
            shapes = self.planner.plan(views, self.cfg.max_tree_tokens, others, explore=True)
            self.stats.requests_unpaid += self.planner.left_off - left_off
            q = sum(sh.query for sh in shapes) / len(shapes)
            # (measured (first, next), the verification the plan priced
            # with them: the rows expected, less the bonus row expected
            # saved) of each drafting request
            counted = []
            for r, v, sh in zip(live, views, shapes):
                if sh.draft > 0:
                    pair = measured[r.state.sampled]
                    p = v.draft_p(tree=sh.kind == "tree")
                    counted.append((pair, v.verify_s(sh.draft, p, pair)))
            once = max((switch[r.state.sampled] for r, sh in zip(live, shapes) if sh.draft > 0),
                       default=0.0)
            planned = (len(live), q, any(sh.kind == "tree" for sh in shapes),
                       sum(sh.query > 1 for sh in shapes),
                       sum(seconds for _, seconds in counted) + once,
                       (min(f for (f, _), _ in counted), min(n for (_, n), _ in counted))
                       if counted else None)
        trees = []
        for r, shape in zip(live, shapes):
            arm = {"tree": "tree", "draft": "pool", "off": "off"}[shape.kind]
            self.stats.arm_steps[arm] += 1
            if not fixed:
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
                drafts[r.i] = r.chain  # checked by this step's tree (sources set)
                state.draft_checked = True
            else:
                drafts[r.i] = unchecked_draft(state, shape.draft if not fixed else r.room,
                                              self.stats)
                if not fixed and not state.seeded:
                    state.draft_expect = shape.tokens - 1
        return trees, planned

    # -- trees ---------------------------------------------------------------
    def _fused_plan(self, trees, drafts, token_ids) -> bool:
        """The trees that ride in the next forward (``trees``: ``(live,
        window columns, candidates)``), all under one token budget.

        A request with a checked chain drafts the chain but its last
        token, the tree's root (``drafts[i]``; ``state.plan`` the tree, if
        one fits). One without gets a catch-up tree rooted at its newest
        token and drafts as much of its unchecked lookup as
        :func:`catch_up_draft_len` says. Returns whether the token budget
        left the windows out."""
        asks, rows = [], []
        for r, w, g in trees:
            state, chain = r.state, r.chain
            if chain:
                # All but the chain's last token is the draft; the last (the
                # model's prediction after the draft) roots the tree.
                k = min(len(chain) - 1, r.room)
                drafts[r.i] = chain[:k]
                state.draft_sources = state.draft_sources[:k]
                state.draft_checked = True
                expect = chain[: k + 1]
                text = np.concatenate([token_ids[r.i, : r.n_tok],
                                       np.asarray(expect, token_ids.dtype)])
                root, root_pos, catch_up = expect[-1], r.n_tok + k, False
            else:
                k = catch_up_draft_len(state, r.room)
                drafts[r.i] = unchecked_draft(state, k, self.stats)
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
        token; ``drafts[i]`` becomes its checked chain (without a tree: the
        lookup's unchecked guess). Returns
        whether the token budget left the windows out.

        ``trees``: ``(live, window columns, candidates)`` per request."""
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
                continue
            work.append((r, tree))
        if not work:
            return not use_window
        preds = run_trees([(r.i, tree) for r, tree in work])
        self.stats.lookahead_passes += 1
        self.stats.pass_requests += len(work)
        self.stats.lookahead_query_tokens += sum(len(tree.tokens) for _, tree in work)
        for (r, tree), pred in zip(work, preds):
            drafts[r.i] = read_tree(r.state, tree, pred, self.memory)
            r.state.draft_checked = True
        return not use_window


#: A catch-up step drafts the unchecked lookup's tokens while the next one
#: is expected to be accepted at least this often.
CATCH_UP_DRAFT_P = 0.25


def catch_up_draft_len(state, room: int) -> int:
    """How much of its unchecked lookup a request drafts in a catch-up step:
    the first k tokens, k the longest with ``p^k >= CATCH_UP_DRAFT_P``, p
    its measured per-token acceptance of this kind of lookup (learnt from
    its text alone: the same on every run). Sampling at a high temperature
    accepts few unchecked tokens: then none, and the tree checks its
    chain for the next step."""
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
    ``trees_here``: whether the engine can run trees at all; ``planner``
    prices a seeded request's draft (:meth:`Planner.steady_draft`)."""
    state, s = r.state, r.state.settings
    trees = trees_here and not state.seeded
    g = 0
    if trees:
        # candidates the tree could check: the pool's for its root
        # (plus, with the prompt pool, perhaps a suffix match)
        root = (r.chain[min(len(r.chain) - 1, r.room)] if r.chain
                else int(token_ids[r.i, r.n_tok - 1]))
        g = state.pool.count(int(root)) + int(prompt_pool)
    seeded_shape = None
    if state.seeded:
        # Nothing that decides a seeded request's draft may depend on
        # timing: its own text (prompt lookup, never a tree or the shared
        # memory), the acceptance learnt from it, and the cost curve the
        # engine had before it started, in a step of the batch fixed when
        # it started (``RequestState.seeded_batch``).
        k = min(len(state.lookup), r.room)
        if planner is not None and k > 0:
            k = planner.steady_draft(state.acc, state.lookup_kind, k, state.seeded_batch)
        seeded_shape = Shape("draft", draft=k) if k > 0 else OFF
    return RequestView(
        acc=state.acc, ngram_size=s.ngram_size, window_size=s.window_size,
        guess_set_size=min(g, s.guess_set_size), room=r.room, chain=len(r.chain),
        unchecked=len(state.lookup), lookup_kind=state.lookup_kind, trees=trees,
        fixed=seeded_shape)
