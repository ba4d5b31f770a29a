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

Load: ``max_tree_tokens`` caps the tree tokens of a step (windows are left out
first, then candidates); with ``disable_batch_size`` requests decoding or
more, a step runs with no tree and no draft. Below that, with ``adaptive``,
a :class:`~vllm_lookahead.gate.PayoffGate` picks each step's arm from
measured tokens/s: the tree, the pool's guess alone, or nothing.
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
from vllm_lookahead.gate import ARMS, PayoffGate
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


class LookaheadProposer:
    """Lookahead decoding drafter (one per worker, on the last PP rank)."""

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
        self.disable_batch_size = self.cfg.disable_batch_size
        if self.disable_batch_size is None:
            from vllm.platforms import current_platform

            from vllm_lookahead.config import CPU_DISABLE_BATCH_SIZE

            self.disable_batch_size = CPU_DISABLE_BATCH_SIZE if current_platform.is_cpu() else 0
        self.num_spec_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.states: dict[str, RequestState] = {}
        self.stats = LookaheadStats()
        self.worker = None  # LookaheadWorker, bound on the first step
        #: req id -> tokens scheduled this step (set by on_update_states).
        self._scheduled: dict[str, int] = {}
        self._spec_k: int | None = None
        #: fused: req id -> (PlannedTree, argmax of its appended nodes).
        self._fused_out: dict[str, tuple[PlannedTree, np.ndarray]] = {}
        #: Pay-off gate (``adaptive``), and the step it chose an arm for last:
        #: (decoding requests, arm, start time).
        self.gate = None
        if self.cfg.adaptive:
            tp = vllm_config.parallel_config.tensor_parallel_size
            self.gate = PayoffGate(agree=_rank0_choice if tp > 1 else None)
        self._last_arm: tuple[int, str, float] | None = None
        #: Whether the step being run has no new or resumed request.
        self._clean = False
        off = (f"off from {self.disable_batch_size} decoding requests"
               if self.disable_batch_size else "on at every batch size")
        logger.info("Lookahead decoding: %s, draft length %d, %s",
                    self.cfg, self.num_spec_tokens, off)

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
        if self.worker is None:
            from vllm_lookahead.worker import LookaheadWorker

            self.worker = LookaheadWorker(runner)
        batch = runner.input_batch
        num_tokens = batch.num_tokens_no_spec
        token_ids = batch.token_ids_cpu
        cfg = self.cfg
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        fused_out, self._fused_out = self._fused_out, {}
        spec_k = self.num_spec_tokens
        if self._spec_k is not None:
            spec_k = min(spec_k, int(self._spec_k))

        # Requests that decode this step, with their state up to date.
        live = []  # (batch index, state, num tokens, room)
        num_decoding = step_tokens = 0
        clean = self._clean
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                clean = False  # still prefilling
                continue
            num_decoding += 1
            step_tokens += len(sampled)
            req_id = batch.req_ids[i]
            n_tok = int(num_tokens[i])
            state = self.states.get(req_id)
            if state is None:
                state = self._new_state(runner, req_id, token_ids[i], n_tok)
            self._account(state, len(sampled), n_tok)
            state.plan = None
            if not state.settings.enabled:
                continue
            if self.fused:
                out = fused_out.get(req_id)
                if out is not None:
                    drafts[i] = self._harvest(state, out[0], out[1], sampled)
            room = min(spec_k, self.max_model_len - n_tok - 1)
            live.append((i, state, n_tok, room))

        arm = self._choose_arm(t0, num_decoding, step_tokens, clean, bool(live))
        self.stats.arm_steps[arm] += bool(live)
        if arm == "off":
            # No tree, no draft. The prompt pool catches up when lookahead
            # runs again (it is filled incrementally).
            for _, state, _, _ in live:
                state.draft_sources = []
            live = []
            drafts = [[] for _ in sampled_token_ids]
        if cfg.prompt_pool:
            for i, state, n_tok, _ in live:
                state.add_context_ngrams(token_ids[i], state.settings.ngram_size, n_tok)
        if arm == "pool":
            # The checked chain if the last tree gave one, else the pool's guess.
            for i, state, n_tok, room in live:
                if not drafts[i] and room > 0:
                    drafts[i] = self._unchecked(state, token_ids[i], n_tok, room)
        elif self.fused:
            # A catch-up pass for requests without a checked chain (first
            # step, or last tree missed): their next draft is checked again.
            rescue = [r for r in live if not drafts[r[0]] and r[3] > 0]
            if rescue:
                self.stats.catch_up_requests += len(rescue)
                self._separate_pass(rescue, drafts, token_ids, unchecked=False)
            self._fused_plan(live, drafts, token_ids)
        else:
            self._separate_pass(live, drafts, token_ids)
        for i, state, _, room in live:
            drafts[i] = drafts[i][: max(room, 0)]
            state.draft_sources = state.draft_sources[: len(drafts[i])]
            if drafts[i]:
                self.stats.drafts += 1
                self.stats.draft_tokens += len(drafts[i])
        self.stats.live_requests = len(self.states)
        self.stats.proposer_time_s += time.perf_counter() - t0
        return drafts

    def _choose_arm(self, t0: float, num_decoding: int, step_tokens: int, clean: bool,
                    any_live: bool) -> str:
        """How this step runs: "tree", "pool" or "off" (see :mod:`.gate`).

        Books the step that just ran (started at the last call, ``t0`` now)
        with the gate first, if it was chosen by the gate and had no
        prefill."""
        last, self._last_arm = self._last_arm, None
        if self.gate is not None and last is not None and clean and step_tokens:
            self.gate.record(last[0], last[1], step_tokens, t0 - last[2])
        if not any_live:
            return "off"
        if self.disable_batch_size and num_decoding >= self.disable_batch_size:
            self.stats.steps_off += 1
            return "off"
        if self.gate is None:
            return "tree"
        arm = self.gate.decide(num_decoding)
        self._last_arm = (num_decoding, arm, t0)
        return arm

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

    def _fused_plan(self, live, chains, token_ids) -> None:
        """Turn each request's checked chain into its draft and plan its
        tree for the next step (``chains[i]`` is replaced by the draft)."""
        wanted = []
        for i, state, n_tok, room in live:
            chain = chains[i]
            if not chain or room <= 0:
                # No checked chain (no tree fitted the budget): the pool's
                # guess, unchecked, and no tree.
                chains[i] = self._unchecked(state, token_ids[i], n_tok, room) if room > 0 else []
                continue
            # All but the chain's last token is the draft; the last (the
            # model's prediction after the draft) roots the tree.
            k = min(len(chain) - 1, room)
            chains[i] = chain[:k]
            state.draft_sources = state.draft_sources[:k]
            s = state.settings
            text = np.concatenate([token_ids[i, :n_tok], np.asarray(chain[: k + 1], token_ids.dtype)])
            cands = self._candidates(state, text)
            wanted.append((s.ngram_size, s.window_size, len(cands), i, state, n_tok + k,
                           chain[: k + 1], cands))
        use_window, cap = fit_budget(
            [w[:3] for w in wanted], self.cfg.max_tree_tokens, with_root=True
        )
        if not use_window:
            self.stats.steps_window_off += 1
        if cap < 0:
            return
        for n, w, g, i, state, root_pos, expect, cands in wanted:
            w = w if use_window else 0
            cands = cands[:cap]
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
    def _separate_pass(self, live, drafts, token_ids, unchecked: bool = True) -> None:
        """One extra tree-masked forward rooted at each request's newest
        token; ``drafts[i]`` becomes its checked chain (without a tree: the
        pool's unchecked guess if ``unchecked``, else nothing)."""
        from vllm_lookahead.worker import TreeRequest

        wanted = []
        for i, state, n_tok, room in live:
            x = int(token_ids[i, n_tok - 1])
            s = state.settings
            cands = self._candidates(state, token_ids[i, :n_tok])
            wanted.append((s.ngram_size, s.window_size, len(cands), x, cands))
        use_window, cap = fit_budget(
            [(n, w, g) for n, w, g, _, _ in wanted], self.cfg.max_tree_tokens, with_root=True
        )
        if not use_window:
            self.stats.steps_window_off += 1
        trees, work = [], []
        for (i, state, n_tok, room), (n, w, g, x, cands) in zip(live, wanted):
            if room <= 0:
                continue
            if cap < 0:
                drafts[i] = self._unchecked(state, token_ids[i], n_tok, room) if unchecked else []
                continue
            w = w if use_window else 0
            cands = cands[:cap]
            layout = build_tree(n, w, len(cands))
            p = n_tok - 1
            if p + int(layout.depth.max()) >= self.max_model_len:
                drafts[i] = self._unchecked(state, token_ids[i], n_tok, room) if unchecked else []
                continue
            toks = fill_tree_tokens(layout, x, state.window.levels, _cand_array(cands, n))
            trees.append(
                TreeRequest(
                    tokens=toks,
                    positions=p + layout.depth.astype(np.int64),
                    mask=layout.mask,
                    context_len=p,
                    batch_index=i,
                )
            )
            work.append((i, state, layout, cands, x, w > 0))
        if not trees:
            return
        preds = self.worker.run(trees)
        self.stats.lookahead_passes += 1
        self.stats.pass_requests += len(trees)
        self.stats.lookahead_query_tokens += sum(len(t.tokens) for t in trees)
        for (i, state, layout, cands, x, window), pred in zip(work, preds):
            if window:
                self._jacobi_step(state, layout, x, pred)
            drafts[i] = self._best_confirmed(state, layout, cands, pred)

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

    def _unchecked(self, state: RequestState, tokens: np.ndarray, n_tok: int,
                   room: int) -> list[int]:
        """A draft without a check by the model: the continuation of the
        text's longest earlier-seen suffix (2-4 tokens, prompt pool on), else
        the pool's most often seen (then newest) continuation of the newest
        token."""
        draft = []
        if self.cfg.prompt_pool:
            draft = suffix_lookup(tokens, n_tok, min(room, state.settings.ngram_size))
            state.draft_sources = [SOURCE_PROMPT] * len(draft)
        if not draft:
            cands = state.pool.get(int(tokens[n_tok - 1]))[: state.settings.guess_set_size]
            best = choose_candidate([0] * len(cands), [c for _, c, _ in cands])
            if best < 0:
                state.draft_sources = []
                return []
            cont, _, source = cands[best]
            draft = list(cont)
            state.draft_sources = [source] * len(draft)
        self.stats.unchecked_drafts += 1
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
        )
        self.states[req_id] = state
        return state

    def _account(self, state: RequestState, num_sampled: int, num_tokens: int) -> None:
        """Book last step's draft outcome: ``num_sampled - 1`` draft tokens
        were accepted (the last sampled token is the verifier's own). Tokens
        past ``max_tokens`` (which vLLM's scheduler drops) are not counted as
        generated; tokens past a stop string or EOS in the final step are."""
        st = self.stats
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
        state.draft_sources = []

    def get_stats(self) -> dict:
        self.stats.live_requests = len(self.states)
        self.stats.pool_ngrams = sum(len(s.pool) for s in self.states.values())
        d = self.stats.to_dict()
        d["config"] = self.cfg.to_dict()
        d["mode"] = "fused" if self.fused else "separate"
        d["disable_batch_size"] = self.disable_batch_size
        d["gate"] = self.gate.snapshot() if self.gate is not None else None
        return d


def _rank0_choice(arm: str) -> str:
    """Tensor rank 0's arm, on every rank (the gate's ``agree`` hook)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return group.broadcast_object(arm, src=0)


def _cand_array(cands, ngram_size: int) -> np.ndarray:
    return np.array([c for c, _, _ in cands], dtype=np.int32).reshape(len(cands), ngram_size - 1)
