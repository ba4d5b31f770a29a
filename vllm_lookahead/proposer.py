"""The lookahead proposer vLLM instantiates for ``method="lookahead"``.

Per request it keeps a :class:`~vllm_lookahead.state.RequestState` (Jacobi
window, n-gram pool, per-request settings). Two modes (``LookaheadConfig.mode``):

**fused** (default, one target forward per step). At the end of step t each
request has a *checked chain*: tokens the model itself predicted to follow
its text, the last being its argmax after the others. The draft is the chain
minus its last token ``y``; the proposer plans the tree of step t+1 rooted at
``y``, right after the draft (see :class:`PlannedTree`): the Jacobi window and
the pool's candidates for ``y``. In step t+1 the worker appends the tree to
vLLM's own query tokens (:meth:`model_forward`), so it reads the request's KV
cache -- the draft included -- plus its tree ancestors. After vLLM's
rejection sampler, if it sampled exactly ``draft + [y]``:

1. the newest window level comes from the argmax at the window's last level;
   its W column n-grams go into the pool and the window shifts;
2. the next checked chain is the candidate the argmax chain confirms
   furthest (then most often seen, then newest) plus the argmax after it.

Otherwise (first step, or a miss) a catch-up pass -- the separate pass below,
for those requests only -- gives them a checked chain again. Without any tree
(the token budget) the draft is the pool's unchecked guess.

**separate** (two forwards per step). After sampling, one extra tree-masked
forward rooted at the newest token (not cached yet) checks every candidate;
the draft is the best confirmed prefix plus the argmax after it.

Either way vLLM's rejection sampler verifies the draft exactly: the draft
only decides how many tokens one step can gain, never which tokens come out.

Planning (``adaptive``, default): every step a
:class:`~vllm_lookahead.planner.Planner` picks each request's shape -- no
draft, a draft of k tokens, or a tree of w <= W columns and g <= G
candidates -- for the most expected tokens per second, from the step cost
measured at start-up (:mod:`.warmup`, corrected from the steps seen) and the
request's measured acceptance (:mod:`.acceptance`). Seeded sampled requests
are planned from their text alone. ``max_tree_tokens`` caps the tree tokens
of a step; with ``disable_batch_size`` requests decoding or more, a step
runs with no tree and no draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from vllm.logger import init_logger

from vllm_lookahead.attn_mask import TreeLayout, build_tree, fill_tree_tokens, fit_budget
from vllm_lookahead.config import (
    ADDITIONAL_CONFIG_KEY,
    LookaheadConfig,
    LookaheadConfigError,
    RequestSettings,
    request_settings,
)
from vllm_lookahead.acceptance import AcceptancePrior, RequestAcceptance
from vllm_lookahead.planner import OFF, BestCase, Planner, RequestView, Shape
from vllm_lookahead.state import (
    SOURCE_MODEL,
    SOURCE_PROMPT,
    SOURCE_WINDOW,
    JacobiWindow,
    NGramPool,
    RequestState,
    choose_candidate,
    request_seed,
    suffix_lookup,
    suffix_match,
)
from vllm_lookahead.stats import LookaheadStats

logger = init_logger("vllm." + __name__)  # under "vllm": vLLM configures that logger


@dataclass
class PlannedTree:
    """A request's tree for its next step (fused mode).

    Last step's checked chain ended in the model's own prediction ``y`` of the
    token after the draft. The tree's root is ``y``, right after the draft (a
    query node: not cached); it is valid iff vLLM samples exactly
    ``draft + [y]``, which with greedy decoding is certain.

    Attributes:
        num_scheduled: tokens vLLM must schedule for the request (1 + draft).
        root_pos: position of ``y``; the tree reads ``root_pos`` cached tokens.
        expect: ``draft + [y]``.
        layout: tree layout (node 0 is ``y``).
        cands: the candidates of ``y``, as the pool returned them.
        tokens, positions: int32 / int64 [T] node tokens and positions.
        window: whether the window's nodes are in the tree.
    """

    num_scheduled: int
    root_pos: int
    expect: list
    layout: TreeLayout
    cands: list
    tokens: np.ndarray
    positions: np.ndarray
    window: bool


@dataclass
class _Live:
    """A request decoding this step (proposer-internal)."""

    i: int  # batch index
    state: RequestState
    n_tok: int  # tokens of the request (the newest one not cached yet)
    room: int  # longest draft vLLM takes now
    chain: list  # fused: the checked chain the tree of this step left ([]: none)


class LookaheadProposer:
    """Lookahead decoding drafter (one per worker, on the last PP rank)."""

    #: Steps between two agreements of the cost correction (TP ranks).
    AGREE_EVERY = 32
    #: Steps between two full planning steps of a quiet batch (one whose
    #: drafts cannot pay at its size): those keep the acceptance learnt.
    REFRESH = 16

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        self.cfg = LookaheadConfig.from_dict(
            (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
        )
        self.fused = self.cfg.mode == "fused"
        cg_mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
        if self.fused and cg_mode is not None and str(getattr(cg_mode, "name", cg_mode)) != "NONE":
            logger.warning(
                "Lookahead: fused mode appends a varying number of tree tokens to "
                "each forward, which CUDA graphs (cudagraph_mode=%s) cannot replay; "
                "using mode='separate'. Set enforce_eager=True for the fused mode.",
                cg_mode,
            )
            self.fused = False
        self.disable_batch_size = self.cfg.disable_batch_size or 0
        self.num_spec_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.states: dict[str, RequestState] = {}
        self.stats = LookaheadStats()
        self.worker = None  # LookaheadWorker, bound at warm-up or on the first step
        #: req id -> tokens scheduled this step (set by on_update_states).
        self._scheduled: dict[str, int] = {}
        self._spec_k: int | None = None
        #: fused: req id -> (PlannedTree, argmax of its appended nodes).
        self._fused_out: dict[str, tuple[PlannedTree, np.ndarray]] = {}
        tp = vllm_config.parallel_config.tensor_parallel_size
        #: rank 0's value on every tensor-parallel rank (None: one rank).
        self._agree = _rank0_choice if tp > 1 else None
        #: Planner (``adaptive``); its cost model is set up at warm-up.
        self.planner: Planner | None = None
        self.prior = AcceptancePrior(max_cands=self.cfg.guess_set_size)
        #: The last planned step: (decoding requests, query tokens per
        #: request, whether it had trees, end of its proposer call), to time it.
        self._last_step: tuple[int, float, bool, float] | None = None
        self._calls = 0
        #: Whether the step being run has no new or resumed request.
        self._clean = False
        #: Quiet batches: the bound of the batch's requests (taken at the
        #: last full step), steps since, and (batch size, whether any
        #: draft could pay) for the bound.
        self._best: BestCase | None = None
        self._since_full = 0
        self._pays: tuple[int, bool] | None = None
        how = "planned per step" if self.cfg.adaptive else "fixed tree"
        if self.disable_batch_size:
            how += f", off from {self.disable_batch_size} decoding requests"
        logger.info("Lookahead decoding: %s, draft length %d, %s",
                    self.cfg, self.num_spec_tokens, how)

    # -- vLLM's custom proposer interface ---------------------------------
    def load_model(self, model) -> None:
        """Nothing to load: lookahead drafts with the target model itself."""

    def propose(self, *args, **kwargs) -> list[list[int]]:
        raise RuntimeError(
            "LookaheadProposer.propose() needs the model runner; it is called "
            "through vllm_lookahead.patches (is the vllm_lookahead plugin "
            "loaded? check `VLLM_PLUGINS`)"
        )

    # -- hooks called by vllm_lookahead.patches ---------------------------
    def warm_up(self, runner) -> None:
        """After vLLM's warm-up (the KV cache exists): wrap the attention
        layers and set up the planner's cost model (measured, cached, from
        a file or assumed: ``cost_model``)."""
        if self.worker is None:
            from vllm_lookahead.worker import LookaheadWorker

            self.worker = LookaheadWorker(runner)
        if self.cfg.adaptive and self.planner is None:
            from vllm_lookahead.warmup import build_cost_model

            cost = build_cost_model(self.cfg.cost_model, runner, self.worker, self._agree)
            self.planner = Planner(cost, fused=self.fused)

    def on_update_states(self, scheduler_output) -> None:
        """Free finished/aborted requests; forget preempted ones that resume
        (they are rebuilt from their tokens on their next step)."""
        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
        resumed = getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ())
        for req_id in resumed or ():
            self.states.pop(req_id, None)
        self._scheduled = scheduler_output.num_scheduled_tokens
        self._clean = not scheduler_output.scheduled_new_reqs and not resumed
        # vLLM's per-batch-size draft length (num_speculative_tokens_per_batch_size).
        self._spec_k = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)

    def model_forward(self, runner, forward, input_ids, positions, **kwargs):
        """The runner's model call of a step (fused mode): append the planned
        trees of the requests scheduled as planned, run, keep their argmax."""
        self._fused_out = {}
        if not self.fused or self.worker is None or kwargs.get("inputs_embeds") is not None:
            return forward(input_ids=input_ids, positions=positions, **kwargs)
        from vllm_lookahead.worker import TreeRequest

        batch = runner.input_batch
        index = batch.req_id_to_index
        computed = batch.num_computed_tokens_cpu
        trees, plans = [], []
        for req_id, state in self.states.items():
            plan = state.plan
            if plan is None:
                continue
            state.plan = None
            i = index.get(req_id)
            # vLLM must feed exactly the planned draft, the tree's root
            # following its last token.
            if (
                i is None
                or self._scheduled.get(req_id) != plan.num_scheduled
                or int(computed[i]) + plan.num_scheduled != plan.root_pos
            ):
                self.stats.trees_dropped += 1
                continue
            trees.append(
                TreeRequest(
                    tokens=plan.tokens,
                    positions=plan.positions,
                    mask=plan.layout.mask,
                    context_len=plan.root_pos,
                    batch_index=i,
                )
            )
            plans.append((req_id, plan))
        if not trees:
            return forward(input_ids=input_ids, positions=positions, **kwargs)
        hidden, preds = self.worker.fused_forward(forward, trees, input_ids, positions, **kwargs)
        self.stats.lookahead_query_tokens += sum(len(t.tokens) for t in trees)
        self.stats.fused_trees += len(trees)
        self.stats.fused_steps += 1
        self._fused_out = {req_id: (plan, pred) for (req_id, plan), pred in zip(plans, preds)}
        return hidden

    def propose_for_runner(self, runner, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Drafts for every request of the runner's batch (batch order)."""
        t0 = time.perf_counter()
        if self.worker is None or (self.cfg.adaptive and self.planner is None):
            self.warm_up(runner)
        batch = runner.input_batch
        num_tokens = batch.num_tokens_no_spec
        token_ids = batch.token_ids_cpu
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        fused_out, self._fused_out = self._fused_out, {}
        spec_k = self.num_spec_tokens
        if self._spec_k is not None:
            spec_k = min(spec_k, int(self._spec_k))

        # Requests that decode this step, with their state up to date.
        live: list[_Live] = []
        num_decoding = 0
        clean = self._clean
        joined = False
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                clean = False  # still prefilling
                continue
            num_decoding += 1
            req_id = batch.req_ids[i]
            n_tok = int(num_tokens[i])
            state = self.states.get(req_id)
            if state is None:
                state = self._new_state(runner, req_id, token_ids[i], n_tok)
                joined = True
            self._account(state, sampled, n_tok)
            state.plan = None
            if not state.settings.enabled:
                continue
            chain = []
            if self.fused:
                out = fused_out.get(req_id)
                if out is not None:
                    chain = self._harvest(state, out[0], out[1], sampled)
            room = min(spec_k, self.max_model_len - n_tok - 1)
            live.append(_Live(i, state, n_tok, room, chain))
        self._time_last_step(t0, clean, len(live))

        if self.disable_batch_size and num_decoding >= self.disable_batch_size:
            self.stats.steps_off += 1
            for r in live:
                r.state.draft_sources, r.state.lookup = [], []
            live = []
        everyone, live = live, self._not_quiet(live, spec_k, joined)
        if self.cfg.prompt_pool:
            for r in live:
                r.state.add_context_ngrams(token_ids[r.i], r.state.settings.ngram_size, r.n_tok)
        trees = self._plan_step(live, drafts, token_ids)
        if self.fused:
            # A catch-up pass for tree requests without a checked chain
            # (first step, or last tree missed): their next draft is checked.
            rescue = [(r, w, g) for r, w, g in trees if not r.chain and r.room > 0]
            if rescue:
                self.stats.catch_up_requests += len(rescue)
                self._separate_pass(rescue, drafts, token_ids, unchecked=False)
                for r, _, _ in rescue:
                    r.chain = drafts[r.i]
                    if not r.chain:  # no tree fitted: the unchecked lookup
                        self._unchecked(r, drafts, r.room)
            self._fused_plan([t for t in trees if t[0].chain], drafts, token_ids)
        elif trees:
            self._separate_pass(trees, drafts, token_ids)
        for r in live:
            drafts[r.i] = drafts[r.i][: max(r.room, 0)]
            r.state.draft_sources = r.state.draft_sources[: len(drafts[r.i])]
            if drafts[r.i]:
                self.stats.drafts += 1
                self.stats.draft_tokens += len(drafts[r.i])
        if len(live) < len(everyone):  # a quiet step: time it as planned
            q = 1 + sum(len(drafts[r.i]) for r in live) / len(everyone)
            self._last_step = (len(everyone), q, False, 0.0)
        self.stats.live_requests = len(self.states)
        t1 = time.perf_counter()
        self.stats.proposer_time_s += t1 - t0
        if self._last_step is not None:
            self._last_step = (*self._last_step[:3], t1)
        return drafts

    # -- planning ------------------------------------------------------------
    def _plan_step(self, live: list[_Live], drafts, token_ids) -> list:
        """Each live request's shape this step. Drafts without a tree go
        into ``drafts``; returns the requests that get a tree, as
        ``(live, window columns, candidates)``."""
        self._last_step = None
        if not live:
            return []
        fixed = self.planner is None  # adaptive off: the full tree every step
        views = []
        for r in live:
            state, s = r.state, r.state.settings
            state.lookup = self._lookup(state, token_ids[r.i], r.n_tok, r.room)
            if fixed:
                continue
            trees = not state.seeded
            g = 0
            if trees:
                # candidates the tree could check: the pool's for its root
                # (plus, with the prompt pool, perhaps a suffix match)
                root = (r.chain[min(len(r.chain) - 1, r.room)] if r.chain
                        else int(token_ids[r.i, r.n_tok - 1]))
                g = state.pool.count(int(root)) + int(self.cfg.prompt_pool)
            seeded_shape = None
            if state.seeded:
                # Nothing that decides a seeded request's draft may depend on
                # timing: its text alone (prompt lookup), never a tree.
                k = min(len(state.lookup), r.room)
                seeded_shape = Shape("draft", draft=k) if k > 0 else OFF
            views.append(RequestView(
                acc=state.acc, ngram_size=s.ngram_size, window_size=s.window_size,
                guess_set_size=min(g, s.guess_set_size), room=r.room, chain=len(r.chain),
                unchecked=len(state.lookup), lookup_kind=state.lookup_kind, trees=trees,
                fixed=seeded_shape))
        if fixed:
            shapes = [Shape("tree", window=r.state.settings.window_size,
                            cands=r.state.settings.guess_set_size) if r.room > 0 else OFF
                      for r in live]
        else:
            st = self.stats
            if st.catch_up_requests:
                runs = st.fused_trees + st.pass_requests
                self.planner.horizon = max(runs / st.catch_up_requests, 1.0)
            shapes = self.planner.plan(views, self.cfg.max_tree_tokens)
            q = sum(sh.query for sh in shapes) / len(shapes)
            self._last_step = (len(live), q, any(sh.kind == "tree" for sh in shapes), 0.0)
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
                self._unchecked(r, drafts, shape.draft if not fixed else r.room)
        return trees

    def _not_quiet(self, live: list[_Live], spec_k: int, joined: bool) -> list[_Live]:
        """The requests that need this step's per-request work.

        Where the planner would plan every request off whatever its lookup
        found (the bound of :meth:`Planner.any_pays` over the batch's
        acceptance estimates, taken at the last full step), the requests
        are left out: no lookup, no pool update (caught up later), no
        planning, no relaxing of their tree estimates. Seeded requests are
        never left out (their drafts depend on their text alone). The full
        path runs every :attr:`REFRESH` steps, when a request joins, and
        after a tree, which keeps the estimates and the bound current.
        """
        if self.planner is None or not live:
            return live
        self._since_full += 1
        if (joined or self._best is None or self._since_full >= self.REFRESH
                or any(r.chain for r in live)):
            self._since_full = 0
            free = [r for r in live if not r.state.seeded]
            self._best = BestCase.of([_bound_view(r, spec_k) for r in free], self.prior) \
                if free else None
            self._pays = None
            return live
        b = len(live)
        if self._pays is None or self._pays[0] != b:
            self._pays = (b, self.planner.any_pays(b, self._best))
        if self._pays[1]:
            return live
        self.stats.steps_quiet += 1
        keep = []
        for r in live:
            if r.state.seeded:
                keep.append(r)
                continue
            r.state.draft_sources, r.state.lookup = [], []
        n_off = len(live) - len(keep)
        self.stats.arm_steps["off"] += n_off
        self.stats.shape_steps["off"] = self.stats.shape_steps.get("off", 0) + n_off
        return keep

    def _unchecked(self, r: _Live, drafts, k: int) -> None:
        """Draft the first ``k`` tokens of the request's unchecked lookup."""
        state = r.state
        drafts[r.i] = state.lookup[:k]
        state.draft_sources = state.lookup_sources[: len(drafts[r.i])]
        state.draft_checked = False
        self.stats.unchecked_drafts += bool(drafts[r.i])

    def _time_last_step(self, now: float, clean: bool, num_live: int) -> None:
        """Book the step that just ran with the cost model (the forward,
        sampling and scheduling: from the end of the last proposer call to
        now), and agree on the correction every ``AGREE_EVERY`` calls."""
        if self.planner is None:
            return
        cost = self.planner.cost
        last = self._last_step
        if last is not None and clean and last[0] == num_live:
            cost.observe(last[0], last[1], now - last[3], tree=last[2])
        self._calls += 1
        if self._calls % self.AGREE_EVERY == 0:
            local = cost.local_factors()
            cost.agreed(self._agree(local) if self._agree is not None else local)

    # -- fused mode ----------------------------------------------------------
    def _harvest(self, state: RequestState, plan: PlannedTree, pred: np.ndarray,
                 sampled: list[int]) -> list[int]:
        """The checked chain from the tree that rode in this step's forward:
        tokens known to follow the sampled text (greedy: exactly), the last
        one the model's own prediction; [] if the tree rested on text vLLM
        did not produce."""
        if list(sampled) != plan.expect:
            return []
        if plan.window:
            self._jacobi_step(state, plan.layout, plan.expect[-1], pred)
        return self._best_confirmed(state, plan.layout, plan.cands, pred)

    def _fused_plan(self, trees, chains, token_ids) -> None:
        """Turn each tree request's checked chain into its draft and plan
        its tree for the next step (``chains[i]`` becomes the draft)."""
        wanted = []
        for r, w, g in trees:
            i, state, n_tok, room = r.i, r.state, r.n_tok, r.room
            chain = r.chain
            # All but the chain's last token is the draft; the last (the
            # model's prediction after the draft) roots the tree.
            k = min(len(chain) - 1, room)
            chains[i] = chain[:k]
            state.draft_sources = state.draft_sources[:k]
            state.draft_checked = True
            text = np.concatenate([token_ids[i, :n_tok], np.asarray(chain[: k + 1], token_ids.dtype)])
            cands = self._candidates(state, text)[:g]
            wanted.append((state.settings.ngram_size, w, len(cands), state, n_tok + k,
                           chain[: k + 1], cands))
        if not wanted:
            return
        use_window, cap = fit_budget(
            [x[:3] for x in wanted], self.cfg.max_tree_tokens, with_root=True
        )
        if not use_window:
            self.stats.steps_window_off += 1
        if cap < 0:
            return
        for n, w, g, state, root_pos, expect, cands in wanted:
            w = w if use_window else 0
            cands = cands[:cap]
            if w == 0 and not cands:
                continue
            layout = build_tree(n, w, len(cands))
            if root_pos + int(layout.depth.max()) >= self.max_model_len:
                continue
            toks = fill_tree_tokens(layout, expect[-1], state.window.levels, _cand_array(cands, n))
            state.plan = PlannedTree(
                num_scheduled=len(expect),
                root_pos=root_pos,
                expect=expect,
                layout=layout,
                cands=cands,
                tokens=toks,
                positions=root_pos + layout.depth.astype(np.int64),
                window=w > 0,
            )

    # -- separate mode -------------------------------------------------------
    def _separate_pass(self, trees, drafts, token_ids, unchecked: bool = True) -> None:
        """One extra tree-masked forward rooted at each request's newest
        token; ``drafts[i]`` becomes its checked chain (without a tree: the
        lookup's unchecked guess if ``unchecked``, else nothing).

        ``trees``: ``(live, window columns, candidates)`` per request."""
        from vllm_lookahead.worker import TreeRequest

        wanted = []
        for r, w, g in trees:
            x = int(token_ids[r.i, r.n_tok - 1])
            cands = self._candidates(r.state, token_ids[r.i, : r.n_tok])[:g]
            wanted.append((r.state.settings.ngram_size, w, len(cands), x, cands))
        use_window, cap = fit_budget(
            [(n, w, g) for n, w, g, _, _ in wanted], self.cfg.max_tree_tokens, with_root=True
        )
        if not use_window:
            self.stats.steps_window_off += 1
        reqs, work = [], []
        for (r, _, _), (n, w, g, x, cands) in zip(trees, wanted):
            i, state = r.i, r.state
            if r.room <= 0:
                continue
            w = w if use_window else 0
            cands = cands[: max(cap, 0)]
            p = r.n_tok - 1
            layout = build_tree(n, w, len(cands)) if cap >= 0 and (w or cands) else None
            if layout is None or p + int(layout.depth.max()) >= self.max_model_len:
                if unchecked:
                    self._unchecked(r, drafts, r.room)
                else:
                    drafts[i] = []
                continue
            toks = fill_tree_tokens(layout, x, state.window.levels, _cand_array(cands, n))
            reqs.append(
                TreeRequest(
                    tokens=toks,
                    positions=p + layout.depth.astype(np.int64),
                    mask=layout.mask,
                    context_len=p,
                    batch_index=i,
                )
            )
            work.append((i, state, layout, cands, x, w > 0))
        if not reqs:
            return
        preds = self.worker.run(reqs)
        self.stats.lookahead_passes += 1
        self.stats.pass_requests += len(reqs)
        self.stats.lookahead_query_tokens += sum(len(t.tokens) for t in reqs)
        for (i, state, layout, cands, x, window), pred in zip(work, preds):
            if window:
                self._jacobi_step(state, layout, x, pred)
            drafts[i] = self._best_confirmed(state, layout, cands, pred)
            state.draft_checked = True

    # -- shared internals -----------------------------------------------------
    def _candidates(self, state: RequestState, text: np.ndarray) -> list:
        """The candidates a tree rooted at ``text[-1]`` checks: the pool's
        for that token (newest first, at most G), led by the continuation of
        the text's longest earlier-seen 2-4 token suffix when the prompt pool
        is on and it is new (then at most G in all)."""
        g, n = state.settings.guess_set_size, state.settings.ngram_size
        cands = state.pool.get(int(text[-1]))[:g]
        if self.cfg.prompt_pool:
            cont = tuple(suffix_lookup(text, len(text), n - 1))
            if len(cont) == n - 1 and all(c != cont for c, _, _ in cands):
                cands = [(cont, 1, SOURCE_PROMPT)] + cands[: g - 1]
        return cands

    def _jacobi_step(self, state: RequestState, layout: TreeLayout, root: int,
                     pred: np.ndarray) -> None:
        """Harvest the window's column n-grams into the pool, then shift."""
        window = state.window
        new = pred[layout.newest_level]
        if window.warm:
            for key, cont in window.columns(root, new):
                state.pool.add(key, cont, SOURCE_WINDOW)
        window.shift(new)

    def _best_confirmed(self, state: RequestState, layout: TreeLayout, cands,
                        pred: np.ndarray) -> list[int]:
        """The checked chain of a tree: the candidate with the longest prefix
        the argmax chain confirms (``pred[0]`` is the argmax after the root,
        ``pred[node]`` the argmax after ``node``), then the most often seen,
        then the newest; plus the argmax after it. At least one token."""
        matches, counts = [], []
        for c, (cont, count, _) in enumerate(cands):
            nodes = layout.cand_index[c]
            m = 0
            expect = int(pred[0])
            while m < len(cont) and cont[m] == expect:
                expect = int(pred[nodes[m]])
                m += 1
            matches.append(m)
            counts.append(count)
        state.acc.observe_tree(matches, [src == SOURCE_WINDOW for _, _, src in cands],
                               layout.window_size > 0)
        best = choose_candidate(matches, counts)
        if best >= 0 and matches[best] > 0:
            m = matches[best]
            cont, _, source = cands[best]
            draft = list(cont[:m])
            sources = [source] * m
            draft.append(int(pred[layout.cand_index[best][m - 1]]))
        else:
            draft, sources = [int(pred[0])], []
        sources.append(SOURCE_MODEL)
        state.draft_sources = sources
        return draft

    def _lookup(self, state: RequestState, tokens: np.ndarray, n_tok: int,
                room: int) -> list[int]:
        """The unchecked draft of the request's text now (at most ``room``
        tokens, or N when there is no room, to keep learning its
        acceptance): the continuation of the text's longest earlier-seen
        suffix (2-4 tokens, prompt pool on), else the pool's most often seen
        (then newest) continuation of the newest token. Sets
        ``state.lookup_sources``."""
        k = room if room > 0 else state.settings.ngram_size
        draft, source, matched = [], SOURCE_PROMPT, 0
        if self.cfg.prompt_pool:
            draft, matched = suffix_match(tokens, n_tok, min(k, state.settings.ngram_size))
        state.lookup_kind = f"suffix{matched}" if draft else "pool"
        if not draft:
            cands = state.pool.get(int(tokens[n_tok - 1]))[: state.settings.guess_set_size]
            best = choose_candidate([0] * len(cands), [c for _, c, _ in cands])
            if best >= 0:
                cont, _, source = cands[best]
                draft = list(cont)[:k]
        state.lookup_sources = [source] * len(draft)
        return draft

    def _new_state(self, runner, req_id: str, tokens: np.ndarray, n_tok: int) -> RequestState:
        cfg = self.cfg
        req = runner.requests.get(req_id)
        n_prompt = req.num_prompt_tokens if req is not None else n_tok
        params = getattr(req, "sampling_params", None)
        try:
            settings = request_settings(getattr(params, "extra_args", None), cfg)
        except LookaheadConfigError as e:  # validated by the frontend; be safe
            logger.warning("Lookahead: request %s: %s; lookahead off for it", req_id, e)
            settings = RequestSettings(enabled=False)
        prompt = tokens[: max(min(n_prompt, n_tok), 1)]
        window = JacobiWindow.random_init(
            settings.ngram_size, settings.window_size, prompt, request_seed(cfg.seed, prompt)
        )
        state = RequestState(
            window=window,
            pool=NGramPool(settings.guess_set_size),
            num_prompt_tokens=n_prompt,
            max_tokens=getattr(params, "max_tokens", None),
            settings=settings,
            acc=RequestAcceptance(self.prior),
            seeded=_seeded_sampling(params),
        )
        self.states[req_id] = state
        return state

    def _account(self, state: RequestState, sampled: list[int], num_tokens: int) -> None:
        """Book last step's draft outcome: ``len(sampled) - 1`` draft tokens
        were accepted (the last sampled token is the verifier's own), and
        learn the acceptance of checked drafts and of the unchecked lookup
        (from the text, whatever was drafted). Tokens past ``max_tokens``
        (which vLLM's scheduler drops) are not counted as generated; tokens
        past a stop string or EOS in the final step are."""
        st = self.stats
        num_sampled = len(sampled)
        st.decode_steps += 1
        useful = num_sampled
        if state.max_tokens is not None:
            before = num_tokens - num_sampled - state.num_prompt_tokens
            useful = max(0, min(num_sampled, state.max_tokens - before))
        st.generated_tokens += useful
        accepted = min(num_sampled - 1, len(state.draft_sources))
        st.accepted_tokens += accepted
        for src in state.draft_sources[:accepted]:
            st.accepted_by_source[src] += 1
        if state.draft_checked and state.draft_sources:
            state.acc.observe_checked(len(state.draft_sources), accepted)
        if state.lookup:
            state.acc.observe_unchecked(state.lookup, sampled, state.lookup_kind)
        state.draft_sources, state.lookup, state.draft_checked = [], [], False

    def get_stats(self) -> dict:
        self.stats.live_requests = len(self.states)
        self.stats.pool_ngrams = sum(len(s.pool) for s in self.states.values())
        d = self.stats.to_dict()
        d["config"] = self.cfg.to_dict()
        d["mode"] = "fused" if self.fused else "separate"
        d["disable_batch_size"] = self.disable_batch_size
        d["cost_model"] = self.planner.cost.snapshot() if self.planner is not None else None
        d["acceptance_prior"] = self.prior.snapshot()
        return d


def _bound_view(r: _Live, spec_k: int) -> RequestView:
    """A request as :meth:`BestCase.of` sees it: its settings' upper bounds
    (not this step's pool or room), so the bound holds for later steps."""
    s = r.state.settings
    return RequestView(acc=r.state.acc, ngram_size=s.ngram_size, window_size=s.window_size,
                       guess_set_size=s.guess_set_size, room=max(spec_k, r.room),
                       trees=not r.state.seeded)


def _rank0_choice(obj):
    """Tensor rank 0's ``obj`` on every rank (cost curve, measuring wishes,
    cost corrections: tensor-parallel ranks must plan alike)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return group.broadcast_object(obj, src=0)


def _seeded_sampling(params) -> bool:
    """A sampled request with its own seed: vLLM gives it the same tokens
    at every run, so nothing that decides its drafts may depend on timing."""
    if params is None or getattr(params, "seed", None) is None:
        return False
    return float(getattr(params, "temperature", 0.0) or 0.0) >= 1e-5


def _cand_array(cands, ngram_size: int) -> np.ndarray:
    return np.array([c for c, _, _ in cands], dtype=np.int32).reshape(len(cands), ngram_size - 1)
