"""The lookahead proposer vLLM instantiates for ``method="lookahead"``: maps
vLLM's runner and scheduler output onto the engine-agnostic drafting
(:mod:`.planner.step`, :mod:`.algo.drafting`) and back, for the hooks
:mod:`.patches` calls, and times the steps for the planner's cost model."""

from __future__ import annotations

import time

import numpy as np

from vllm.logger import init_logger

import vllm_lookahead.cpu.lazy_bonus as lazy_bonus
from vllm_lookahead.algo.drafting import Live, account, harvest, new_state
from vllm_lookahead.algo.memory import SCOPE_KEY, SharedMemory
from vllm_lookahead.algo.state import SAMPLES_KEY, RequestState, sibling_group
from vllm_lookahead.algo.trees import PlannedTree
from vllm_lookahead.config import (ADDITIONAL_CONFIG_KEY, LookaheadConfig,
                                   LookaheadConfigError, RequestSettings, request_settings)
from vllm_lookahead.planner.acceptance import AcceptancePrior
from vllm_lookahead.planner.planner import Planner
from vllm_lookahead.planner.step import StepDrafter
from vllm_lookahead.stats import LookaheadStats

logger = init_logger("vllm." + __name__)  # under "vllm": vLLM configures that logger


class LookaheadProposer:
    """Lookahead decoding drafter (one per worker, on the last PP rank)."""

    def __init__(self, vllm_config) -> None:
        self.cfg = cfg = LookaheadConfig.from_dict(
            (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}))
        self.fused = cfg.mode == "fused"
        graphs = getattr(getattr(vllm_config.compilation_config, "cudagraph_mode", None),
                         "name", "NONE")
        if self.fused and graphs != "NONE":
            logger.info("Lookahead: cudagraph_mode=%s: steps that carry trees run without CUDA "
                        "graph replay; steps without trees replay vLLM's graphs", graphs)
        #: max tokens of one forward (vLLM's compiled shapes end there)
        self.max_step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.num_spec_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.states: dict[str, RequestState] = {}
        self.stats = LookaheadStats()
        self.prior = AcceptancePrior(max_cands=cfg.guess_set_size)
        self.step = StepDrafter(cfg, self.fused, self.max_model_len, self.stats, self.prior)
        self.memory = self.step.memory = (
            SharedMemory(cfg.memory_tokens, delay=cfg.ngram_size) if cfg.shared_memory else None)
        self.worker = None  # LookaheadWorker, made at warm-up
        self.trees_unsupported: str | None = None  # why the trees cannot run here
        # this step (on_update_states): tokens scheduled per request, vLLM's draft length,
        # no new or resumed request
        self._scheduled: dict[str, int] = {}
        self._spec_k = self.num_spec_tokens
        self._clean = False
        #: fused: req id -> (its tree, its index in the worker's fused_preds)
        self._fused_out: dict[str, tuple[PlannedTree, int]] = {}
        tp = vllm_config.parallel_config.tensor_parallel_size
        self._agree = _rank0_choice if tp > 1 else None  # rank 0's value on every TP rank
        self._timer = StepTimer(self._agree)
        how = "planned per step" if cfg.adaptive else "fixed tree"
        if self.step.disable_batch_size:
            how += f", off from {self.step.disable_batch_size} decoding requests"
        logger.info("Lookahead decoding: %s, draft length %d, %s", cfg, self.num_spec_tokens, how)

    def load_model(self, model) -> None:
        """Nothing to load: lookahead drafts with the target model itself."""

    def propose(self, *args, **kwargs) -> list[list[int]]:
        raise RuntimeError("LookaheadProposer.propose() is called through vllm_lookahead."
                           "patches (is the plugin loaded? check `VLLM_PLUGINS`)")

    def warm_up(self, runner) -> None:
        """Once the KV cache exists: wrap the attention layers, set up the planner."""
        if self.worker is None and self.step.trees:
            from vllm_lookahead.worker import LookaheadWorker, TreesUnsupported

            try:
                self.worker = LookaheadWorker(runner)
            except TreesUnsupported as e:  # no crash: prompt-lookup drafts still pay
                logger.warning("Lookahead: the lookahead branch cannot run on this engine: %s. "
                               "Drafting from prompt lookup only (no Jacobi window, no trees)%s.",
                               e, ", planned per step" if self.cfg.adaptive else "")
                self.step.trees = False
                self.trees_unsupported = str(e)
        if self.cfg.adaptive and self.step.planner is None:
            import vllm_lookahead.cpu.sampling as cpu_sampling
            from vllm_lookahead.branch.warmup import build_cost_model

            # without trees nothing can time them: an assumed curve, corrected
            setting = self.cfg.cost_model if self.worker is not None else "off"
            cost = build_cost_model(setting, runner, self.worker, self._agree)
            cost.learn_plain = self.cfg.learn_step_cost
            planner = self.step.planner = Planner(cost, fused=self.fused)
            planner.lazy_verify = cpu_sampling.LAZY_VERIFY

    def on_update_states(self, scheduler_output) -> None:
        """Forget finished and aborted requests, and preempted ones that
        resume (rebuilt from their tokens on their next step)."""
        resumed = getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ()
        for req_id in (*scheduler_output.finished_req_ids, *resumed):
            state = self.states.pop(req_id, None)
            if state is not None and state.memory_doc is not None:
                self.memory.close(state.memory_doc)
        self._scheduled = scheduler_output.num_scheduled_tokens
        self._clean = not scheduler_output.scheduled_new_reqs and not resumed
        k = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        self._spec_k = self.num_spec_tokens if k is None else min(self.num_spec_tokens, int(k))

    def model_forward(self, runner, forward, input_ids, positions, **kwargs):
        """The runner's model call: in fused mode the planned trees of the
        requests scheduled as planned ride along, within vLLM's token budget."""
        self._fused_out = {}
        if not self.fused or self.worker is None or kwargs.get("inputs_embeds") is not None:
            return forward(input_ids=input_ids, positions=positions, **kwargs)
        index = runner.input_batch.req_id_to_index
        computed = runner.input_batch.num_computed_tokens_cpu
        room = self.max_step_tokens - int(input_ids.shape[0])
        rows = []
        for req_id, state in self.states.items():
            plan, state.plan = state.plan, None
            if plan is None:
                continue
            i, n = index.get(req_id), self._scheduled.get(req_id)
            # vLLM must feed exactly the planned draft, the root right after
            # it (a catch-up tree: rooted at the first token vLLM feeds)
            if plan.catch_up:
                ok = i is not None and n and int(computed[i]) == plan.root_pos
            else:
                ok = (i is not None and n == plan.num_scheduled
                      and int(computed[i]) + n == plan.root_pos)
            if not ok or len(plan.tokens) > room:
                self.stats.trees_dropped += 1
                continue
            room -= len(plan.tokens)
            self._fused_out[req_id] = (plan, len(rows))  # its index in fused_preds
            rows.append((i, plan))
        if not rows:
            return forward(input_ids=input_ids, positions=positions, **kwargs)
        trees = _tree_requests(rows)
        hidden = self.worker.fused_forward(forward, trees, input_ids, positions, **kwargs)
        self.stats.lookahead_query_tokens += sum(len(t.tokens) for t in trees)
        self.stats.fused_trees += len(trees)
        self.stats.fused_steps += 1
        return hidden

    def take_extra_rows(self):  # patch 12 (installed with a worker): its logits call
        return self.worker.take_extra_rows()

    def put_extra_logits(self, logits) -> None:
        self.worker.put_extra_logits(logits)

    def propose_for_runner(self, runner, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Drafts for every row of the runner's batch."""
        t0 = time.perf_counter()
        self.warm_up(runner)  # where vLLM's warm-up did not
        batch, spec_k = runner.input_batch, self._spec_k
        token_ids = batch.token_ids_cpu
        fused_out, self._fused_out = self._fused_out, {}
        live: list[Live] = []
        num_decoding, clean, joined = 0, self._clean, False
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                clean = False  # still prefilling
                continue
            num_decoding += 1
            req_id = batch.req_ids[i]
            n_tok = int(batch.num_tokens_no_spec[i])
            state = self.states.get(req_id)
            if state is None:
                state = self._new_state(runner, req_id, token_ids[i], n_tok)
                joined = True
            account(state, self.stats, sampled, n_tok)
            if state.memory_doc is not None:
                self.memory.extend(state.memory_doc, token_ids[i, state.memory_upto:n_tok])
                state.memory_upto = n_tok
            state.plan = None
            if not state.settings.enabled:
                continue
            out = fused_out.get(req_id)
            chain = [] if out is None else harvest(
                state, out[0], self.worker.fused_preds()[out[1]], sampled, self.memory)
            live.append(Live(i, state, n_tok, min(spec_k, self.max_model_len - n_tok - 1), chain))
        self._timer.book(self.step.planner, t0, clean, len(live))
        drafts, planned = self.step.run(  # separate mode's trees: worker.run
            live, len(sampled_token_ids), num_decoding, spec_k, joined, token_ids,
            lambda rows: self.worker.run(_tree_requests(rows)))
        self.stats.live_requests = len(self.states)
        t1 = time.perf_counter()
        self.stats.proposer_time_s += t1 - t0
        self._timer.planned(planned, t1)
        return drafts

    def get_stats(self) -> dict:
        self.stats.live_requests = len(self.states)
        self.stats.pool_ngrams = sum(len(s.pool) for s in self.states.values())
        planner, mem = self.step.planner, self.memory
        return {
            **self.stats.to_dict(), "config": self.cfg.to_dict(),
            "mode": "fused" if self.fused else "separate",
            "trees_unsupported": self.trees_unsupported,
            "kv_page_layouts": getattr(self.worker, "layouts", None),
            "disable_batch_size": self.step.disable_batch_size,
            "cost_model": planner.cost.snapshot() if planner is not None else None,
            "explored_trees": planner.explored if planner is not None else 0,
            "acceptance_prior": self.prior.snapshot(),
            "shared_memory": None if mem is None else {
                "documents": len(mem), "tokens": mem.tokens, "capacity_tokens": mem.capacity,
                "bytes": mem.nbytes(), "evicted_documents": mem.evicted,
                "harvested_ngrams": mem.harvested}}

    def clear_memory(self) -> bool:
        """Forget the shared memory (vLLM's ``reset_prefix_cache``, patch 13)."""
        if self.memory is not None:
            self.memory.clear()
        return self.memory is not None

    def _new_state(self, runner, req_id: str, tokens: np.ndarray, n_tok: int) -> RequestState:
        """A request's state from vLLM's request: prompt length, sampling
        parameters and its lookahead settings."""
        req = runner.requests.get(req_id)
        n_prompt = req.num_prompt_tokens if req is not None else n_tok
        params = getattr(req, "sampling_params", None)
        extra = getattr(params, "extra_args", None)
        try:
            settings = request_settings(extra, self.cfg)
        except LookaheadConfigError as e:  # validated by the frontend; be safe
            logger.warning("Lookahead: request %s: %s; lookahead off for it", req_id, e)
            settings = RequestSettings(enabled=False)
        sampled = float(getattr(params, "temperature", 0.0) or 0.0) >= 1e-5
        # a seeded request samples the same tokens every run: nothing that
        # decides its drafts may depend on timing or on other requests
        seeded = sampled and getattr(params, "seed", None) is not None
        state = new_state(settings, tokens, n_tok, n_prompt, getattr(params, "max_tokens", None),
                          seeded, self.cfg.seed, self.prior)
        state.group, state.sampled = sibling_group(req_id), sampled
        state.lazy_bonus = lazy_bonus.request_applies(params)
        if seeded:
            state.seeded_batch = seeded_batch(params, self.cfg.seeded_batch,
                                              runner.vllm_config.scheduler_config.max_num_seqs)
            key = str(state.seeded_batch)
            self.stats.seeded_by_batch[key] = self.stats.seeded_by_batch.get(key, 0) + 1
        if self.memory is not None and settings.enabled and settings.shared_memory:
            state.memory_scope = int((extra or {}).get(SCOPE_KEY, 0) or 0)
            state.memory_upto = min(n_prompt, n_tok)
            state.memory_doc = self.memory.open(state.memory_scope, tokens[:state.memory_upto])
            state.memory_reads = not seeded
        self.states[req_id] = state
        return state



class StepTimer:
    """Books the engine's steps into the planner's cost model: a step runs
    from the end of one proposer call (its drafts planned) to the next's start."""

    AGREE_EVERY = 32  # steps between two agreements of the TP ranks' corrections

    def __init__(self, agree) -> None:
        self.agree = agree  # rank 0's value on every TP rank (None: one rank)
        #: the last step as planned (``StepDrafter.run``'s ``planned``), then its end
        self.last: tuple | None = None
        self.calls = 0

    def book(self, planner: Planner | None, now: float, clean: bool, num_live: int) -> None:
        """Book the step that just ran if it ran as planned (as many requests,
        no prefill), less the verification its plan counted (at most half)."""
        if planner is None:
            return
        cost, last = planner.cost, self.last
        if last is not None and clean and last[0] == num_live:
            took = now - last[6]
            cost.observe(last[0], last[1], max(took - last[4], took / 2), tree=last[2],
                         drafting=last[3], verify_least=last[5])
        self.calls += 1
        if self.calls % self.AGREE_EVERY == 0:
            local = cost.local_factors()
            cost.agreed(self.agree(local) if self.agree is not None else local)

    def planned(self, planned: tuple | None, end: float) -> None:
        """The step just planned (None: not timed) and its proposer call's end."""
        self.last = (*planned, end) if planned is not None else None


def _tree_requests(rows: list[tuple[int, PlannedTree]]) -> list:
    from vllm_lookahead.worker import TreeRequest

    return [TreeRequest(tokens=tree.tokens, positions=tree.positions, mask=tree.layout.mask,
                        context_len=tree.root_pos, batch_index=i, read=tree.layout.read_nodes)
            for i, tree in rows]


def _rank0_choice(obj):
    """Tensor rank 0's ``obj`` on every rank (TP ranks must plan alike)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().broadcast_object(obj, src=0)


def seeded_batch(params, least: int, max_num_seqs: int) -> int:
    """The batch a seeded request's draft is priced in: its parent's n
    (``SAMPLES_KEY``) or ``least``, whichever is larger, at most ``max_num_seqs``."""
    try:
        n = int((getattr(params, "extra_args", None) or {}).get(SAMPLES_KEY, 1) or 1)
    except (TypeError, ValueError):
        n = 1
    return max(1, min(max(n, int(least or 0)), int(max_num_seqs or 1)))
