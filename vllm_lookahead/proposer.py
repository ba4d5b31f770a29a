"""The lookahead proposer vLLM instantiates for ``method="lookahead"``.

Per request it keeps a :class:`~vllm_lookahead.state.RequestState` (Jacobi
window and n-gram pool). Each engine step, after vLLM sampled:

1. for every decoding request, ``x`` = its newest token (position ``p``, KV
   not cached yet); the pool's candidates for ``x`` (at most G);
2. one batched tree-masked forward of the target model (``worker.py``) over
   every request's tree: root ``x``, the Jacobi window, the candidates;
3. per request: the argmax at the newest window level is the next level; the
   W column n-grams go into the pool; the window shifts one Jacobi step;
4. the draft: each candidate is checked against the pass's argmax chain; the
   one with the longest confirmed prefix wins (ties: most often seen, then
   newest); the draft is that prefix plus the pass's prediction of the token
   after it. vLLM's rejection sampler then verifies the draft exactly: the
   draft only decides how many tokens one step can gain, never which tokens
   come out.
"""

from __future__ import annotations

import time

import numpy as np

from vllm.logger import init_logger

from vllm_lookahead.attn_mask import build_tree, fill_tree_tokens
from vllm_lookahead.config import ADDITIONAL_CONFIG_KEY, LookaheadConfig
from vllm_lookahead.state import (
    SOURCE_MODEL,
    SOURCE_WINDOW,
    JacobiWindow,
    NGramPool,
    RequestState,
    choose_candidate,
    request_seed,
)
from vllm_lookahead.stats import LookaheadStats

logger = init_logger(__name__)


class LookaheadProposer:
    """Lookahead decoding drafter (one per worker, on the last PP rank)."""

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        self.cfg = LookaheadConfig.from_dict(
            (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
        )
        self.num_spec_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.states: dict[str, RequestState] = {}
        self.stats = LookaheadStats()
        self.worker = None  # LookaheadWorker, bound on the first step
        logger.info("Lookahead decoding: %s, draft length %d", self.cfg, self.num_spec_tokens)

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
        work = []  # (batch index, state, layout, candidates, counts, sources, num_tokens)
        from vllm_lookahead.worker import TreeRequest

        trees = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue  # still prefilling
            req_id = batch.req_ids[i]
            n_tok = int(num_tokens[i])
            state = self.states.get(req_id)
            if state is None:
                state = self._new_state(runner, req_id, token_ids[i], n_tok)
            self._account(state, len(sampled), n_tok)
            if cfg.prompt_pool:
                state.add_context_ngrams(token_ids[i], cfg.ngram_size, n_tok)
            room = min(self.num_spec_tokens, self.max_model_len - n_tok - 1)
            if room <= 0:
                state.draft_sources = []
                continue
            x = int(token_ids[i, n_tok - 1])
            cands = state.pool.get(x)[: cfg.guess_set_size]
            layout = build_tree(cfg.ngram_size, cfg.window_size, len(cands))
            cand_arr = np.array([c for c, _, _ in cands], dtype=np.int32).reshape(
                len(cands), cfg.ngram_size - 1
            )
            toks = fill_tree_tokens(layout, x, state.window.levels, cand_arr)
            p = n_tok - 1
            trees.append(
                TreeRequest(
                    tokens=toks,
                    positions=p + layout.depth.astype(np.int64),
                    mask=layout.mask,
                    context_len=p,
                    batch_index=i,
                )
            )
            work.append((i, state, layout, cands, room, x))

        if trees:
            preds = self.worker.run(trees)
            self.stats.lookahead_passes += 1
            self.stats.lookahead_query_tokens += sum(len(t.tokens) for t in trees)
            for (i, state, layout, cands, room, x), pred in zip(work, preds):
                drafts[i] = self._update(state, layout, cands, room, x, pred)

        self.stats.live_requests = len(self.states)
        self.stats.proposer_time_s += time.perf_counter() - t0
        return drafts

    # -- internals ---------------------------------------------------------
    def _new_state(self, runner, req_id: str, tokens: np.ndarray, n_tok: int) -> RequestState:
        cfg = self.cfg
        req = runner.requests.get(req_id)
        n_prompt = req.num_prompt_tokens if req is not None else n_tok
        params = getattr(req, "sampling_params", None)
        prompt = tokens[: max(min(n_prompt, n_tok), 1)]
        window = JacobiWindow.random_init(
            cfg.ngram_size, cfg.window_size, prompt, request_seed(cfg.seed, prompt)
        )
        state = RequestState(
            window=window,
            pool=NGramPool(cfg.guess_set_size),
            num_prompt_tokens=n_prompt,
            max_tokens=getattr(params, "max_tokens", None),
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

    def _update(self, state: RequestState, layout, cands, room: int, x: int, pred: np.ndarray) -> list[int]:
        cfg = self.cfg
        window = state.window
        if cfg.window_size:
            # Jacobi step: harvest the columns' n-grams, then shift.
            new = pred[layout.newest_level]
            if window.warm:
                for key, cont in window.columns(x, new):
                    state.pool.add(key, cont, SOURCE_WINDOW)
            window.shift(new)
        # Check every candidate against the pass's argmax chain.
        root_pred = int(pred[0])
        matches, counts = [], []
        for c, (cont, count, _) in enumerate(cands):
            nodes = layout.cand_index[c]
            m = 0
            expect = root_pred
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
            nxt = int(pred[layout.cand_index[best][m - 1]])
        else:
            draft, sources, nxt = [], [], root_pred
        draft.append(nxt)
        sources.append(SOURCE_MODEL)
        draft, sources = draft[:room], sources[:room]
        state.draft_sources = sources
        st = self.stats
        st.drafts += 1
        st.draft_tokens += len(draft)
        return draft

    def get_stats(self) -> dict:
        self.stats.live_requests = len(self.states)
        self.stats.pool_ngrams = sum(len(s.pool) for s in self.states.values())
        d = self.stats.to_dict()
        d["config"] = self.cfg.to_dict()
        return d
