"""Per-request drafting: what one request's lookahead state does in a step.

Pure logic over :class:`~vllm_lookahead.algo.state.RequestState` (numpy only, no
vLLM): building a request's state, booking a step's outcome, the Jacobi
window's harvest (where the window and the pool change), the candidates a
tree checks and the chain it confirms, and the unchecked draft (prompt
lookup, then the pool). A request's tree is built in :mod:`.trees`; which
request runs what is decided in :mod:`.step` (shapes by :mod:`.planner`);
vLLM's side is :mod:`.proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_lookahead.planner.acceptance import AcceptancePrior, RequestAcceptance, match_kind, pool_kind
from vllm_lookahead.attn_mask import TreeLayout
from vllm_lookahead.algo.state import (
    SOURCE_MEMORY,
    SOURCE_MODEL,
    SOURCE_PROMPT,
    SOURCE_WINDOW,
    MIN_PROB,
    JacobiWindow,
    NGramPool,
    RequestState,
    choose_candidate,
    request_seed,
    suffix_lookup,
)
from vllm_lookahead.algo.trees import PlannedTree


@dataclass
class Live:
    """A request decoding this step."""

    i: int  # batch index (row of the step's token array)
    state: RequestState
    n_tok: int  # tokens of the request (the newest one not cached yet)
    room: int  # longest draft vLLM takes now
    chain: list  # fused: the checked chain the tree of this step left ([]: none)


#: A seeded request's own prior per-token acceptance of its lookups: it
#: assumes little until its own text shows more (the engine's running mean,
#: which other requests move, may not decide its drafts).
SEEDED_PRIOR_P = 0.25

#: Longest match of the request's own text a lookup looks for where
#: lookups run past N (``lookup_len``; suffix decoding's tree depth is 24).
LONG_MATCH = 24


def new_state(settings, tokens: np.ndarray, n_tok: int, num_prompt_tokens: int,
              max_tokens: int | None, seeded: bool, seed: int, prior) -> RequestState:
    """A request's state when it first decodes.

    Args:
        settings: its :class:`~vllm_lookahead.config.RequestSettings`.
        tokens: int [>= n_tok] its tokens; ``n_tok`` of them are valid.
        num_prompt_tokens: its prompt length (the window is initialised
            from the prompt's tokens, at least one).
        max_tokens: its output cap (``SamplingParams.max_tokens``), if any.
        seeded: a sampled request with its own seed (planned from its text:
            its acceptance starts from a fresh prior of its own, not the
            engine's, which other requests move).
        seed: the engine's base seed (``LookaheadConfig.seed``).
        prior: the engine's :class:`~vllm_lookahead.planner.acceptance.AcceptancePrior`.
    """
    prompt = tokens[: max(min(num_prompt_tokens, n_tok), 1)]
    window = JacobiWindow.random_init(
        settings.ngram_size, settings.window_size, prompt, request_seed(seed, prompt)
    )
    return RequestState(
        window=window,
        pool=NGramPool(settings.guess_set_size),
        num_prompt_tokens=num_prompt_tokens,
        max_tokens=max_tokens,
        settings=settings,
        acc=RequestAcceptance(AcceptancePrior(max_cands=settings.guess_set_size,
                                              p_unchecked=SEEDED_PRIOR_P)
                              if seeded else prior),
        seeded=seeded,
    )


def account(state: RequestState, stats, sampled: list[int], num_tokens: int) -> None:
    """Book last step's draft outcome into ``stats`` (a
    :class:`~vllm_lookahead.stats.LookaheadStats`): ``len(sampled) - 1``
    draft tokens were accepted (the last sampled token is the verifier's
    own), and learn the acceptance of checked drafts and of the unchecked
    lookup (from the text, whatever was drafted). Tokens past ``max_tokens``
    (which vLLM's scheduler drops) are not counted as generated; tokens past
    a stop string or EOS in the final step are. ``num_tokens``: the
    request's tokens, the sampled ones included."""
    st = stats
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
    row = st.drafts_by_kind.get(state.draft_kind) if state.draft_sources else None
    if row is not None:
        row[2] += accepted
    if state.draft_checked and state.draft_sources:
        state.acc.observe_checked(len(state.draft_sources), accepted)
    if state.draft_expect is not None and state.draft_sources:
        st.planned_gain += state.draft_expect
        st.planned_gain_seen += accepted
        state.acc.prior.calibrate(state.draft_expect, accepted)
    state.acc.observe_unchecked(state.lookup, sampled, state.lookup_kind)
    state.draft_sources, state.lookup, state.draft_checked = [], [], False
    state.draft_expect = None


def lookup(state: RequestState, tokens: np.ndarray, n_tok: int, room: int,
           prompt_pool: bool, memory=None) -> list[int]:
    """The unchecked draft of the request's text now (at most ``room`` and
    ``max(N, lookup_len)`` tokens, or N when there is no room, to keep
    learning its acceptance):
    the continuation of the text's longest earlier-seen suffix (2-4 tokens,
    ``prompt_pool`` on; its newest 16 places vote, :func:`~vllm_lookahead.
    state.vote_draft`), unless the engine's shared ``memory``
    (:class:`~vllm_lookahead.algo.memory.SharedMemory`) matches a longer one in
    other requests' text (12, 6, 3 or 2 tokens: its own text wins ties). Where
    lookups run past N (``lookup_len`` and ``room`` above N) the text's
    suffix may be up to :data:`LONG_MATCH` tokens long, and a match's
    continuation is cut to ``max(N, the match's length)``; else
    the pool's most often seen (then newest) continuation of the newest
    token; without one, what followed that token last in the memory's text
    (kind ``"memory1"``), else the newest n-gram another request's window
    produced for it.
    ``tokens``: int [>= n_tok] the request's tokens. Sets
    ``state.lookup_sources`` and ``state.lookup_kind`` (the source, the
    key's length and the places' agreement on the first token,
    :func:`~vllm_lookahead.algo.state.agreement`: ``"suffix3+"``,
    ``"memory6-"``, ``"suffix16"``, ..., ``"memory1"``, ``"pool"`` or
    ``"poolsplit"``, :func:`~vllm_lookahead.planner.acceptance.pool_kind`;
    :func:`~vllm_lookahead.planner.acceptance.match_kind`)."""
    n = state.settings.ngram_size
    k = min(room if room > 0 else n, max(n, state.settings.lookup_len))
    # Past N, a match's continuation runs as far as the match is long
    # (suffix decoding's rule, its spec factor 1): a long match predicts a
    # long copy, a short one a phrase.
    long = k > n
    draft, source, matched = [], SOURCE_PROMPT, 0
    agree = ""
    if prompt_pool:
        draft, matched, agree = state.text_index.vote(tokens, n_tok, k, min_prob=MIN_PROB,
                                                      max_len=LONG_MATCH if long else 4)
        if long:
            draft = draft[:max(n, matched)]
    state.lookup_kind = f"{match_kind('suffix', matched)}{agree}" if draft else "pool"
    if memory is not None and state.memory_reads:
        mem, m, agree = memory.lookup_vote(state.memory_scope, state.memory_doc, tokens, n_tok, k,
                                           longer_than=matched)
        if mem and m > matched:
            if long:
                mem = mem[:max(n, m)]
            draft, source = mem, SOURCE_MEMORY
            state.lookup_kind = f"{match_kind('memory', m)}{agree}"
    if not draft:
        newest = int(tokens[n_tok - 1])
        cands = state.pool.get(newest)[: state.settings.guess_set_size]
        if not cands and memory is not None and state.memory_reads:
            # no n-gram of its own: what followed the token in other
            # requests' text, newest first (kind memory1), else what
            # another request's window produced for it
            cands = [(c, 1, SOURCE_MEMORY)
                     for c in memory.followers(state.memory_scope, newest)[:1]]
            if cands:
                state.lookup_kind = "memory1"
            else:
                cands = [(c, 1, SOURCE_MEMORY)
                         for c in memory.ngrams(state.memory_scope, newest)[:1]]
        counts = [c for _, c, _ in cands]
        best = choose_candidate([0] * len(cands), counts)
        if best >= 0:
            cont, _, source = cands[best]
            draft = list(cont)[:k]
            if state.lookup_kind == "pool":
                state.lookup_kind = pool_kind(counts, best)
    state.lookup_sources = [source] * len(draft)
    return draft


def unchecked_draft(state: RequestState, k: int, stats) -> list[int]:
    """Draft the first ``k`` tokens of the request's unchecked lookup
    (``state.lookup``); counts ``stats.unchecked_drafts``."""
    draft = state.lookup[:k]
    state.draft_sources = state.lookup_sources[: len(draft)]
    state.draft_checked = False
    stats.unchecked_drafts += bool(draft)
    return draft


def candidates(state: RequestState, text: np.ndarray, prompt_pool: bool,
               memory=None) -> list:
    """The candidates a tree rooted at ``text[-1]`` checks, as
    ``(continuation, count, source)`` (continuations N-1 tokens): the
    pool's for that token (newest first, at most G), led by the
    continuation of the text's longest earlier-seen 2-4 token suffix when
    ``prompt_pool`` is on and it is new, and before it the shared
    ``memory``'s continuation when new (then at most G in all); where
    fewer than G, the n-grams other requests' Jacobi windows produced for
    the root (the memory's harvest), newest first.
    ``text``: int [n] the request's text up to and with the root."""
    g, n = state.settings.guess_set_size, state.settings.ngram_size
    cands = state.pool.get(int(text[-1]))[:g]
    lead = []
    if prompt_pool:
        lead.append((tuple(suffix_lookup(text, len(text), n - 1)), SOURCE_PROMPT))
    if memory is not None and state.memory_reads:
        mem, _ = memory.lookup(state.memory_scope, state.memory_doc, text, len(text), n - 1)
        lead.append((tuple(mem), SOURCE_MEMORY))
    for cont, source in lead:
        if len(cont) == n - 1 and all(c != cont for c, _, _ in cands):
            cands = [(cont, 1, source)] + cands[: g - 1]
    if memory is not None and state.memory_reads and len(cands) < g:
        # room left: n-grams other requests' windows produced for the root
        for cont in memory.ngrams(state.memory_scope, int(text[-1])):
            if len(cands) >= g:
                break
            if len(cont) == n - 1 and all(c != cont for c, _, _ in cands):
                cands.append((cont, 1, SOURCE_MEMORY))
    return cands


def jacobi_step(state: RequestState, layout: TreeLayout, root: int, pred: np.ndarray,
                memory=None) -> None:
    """Harvest the window's column n-grams into the pool (and the shared
    ``memory``, if the request feeds it), then shift.

    ``pred``: int [T] the model's argmax at every node of a tree with the
    window's nodes (``layout``) rooted at token ``root``."""
    window = state.window
    new = pred[layout.newest_level]
    if window.warm:
        shared = memory is not None and state.memory_doc is not None
        for key, cont in window.columns(root, new):
            state.pool.add(key, cont, SOURCE_WINDOW)
            if shared:
                memory.add_ngram(state.memory_scope, key, cont)
    window.shift(new)


def best_confirmed(state: RequestState, layout: TreeLayout, cands,
                   pred: np.ndarray) -> list[int]:
    """The checked chain of a tree: the candidate with the longest prefix
    the argmax chain confirms (``pred[0]`` is the argmax after the root,
    ``pred[node]`` the argmax after ``node``), then the most often seen,
    then the newest; plus the argmax after it. At least one token. Learns
    the tree's acceptance and sets ``state.draft_sources``."""
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
                           layout.window_size / max(state.window.w, 1))
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


def read_tree(state: RequestState, tree: PlannedTree, pred: np.ndarray,
              memory=None) -> list[int]:
    """What a tree that ran tells: the window's harvest (if its nodes were
    in the tree; fed to the shared ``memory`` too), then the checked chain
    (:func:`best_confirmed`).
    ``pred``: int [T] the model's argmax at every node of ``tree``."""
    if tree.window:
        jacobi_step(state, tree.layout, tree.root, pred, memory)
    return best_confirmed(state, tree.layout, tree.cands, pred)


def harvest(state: RequestState, plan: PlannedTree, pred: np.ndarray,
            sampled: list[int], memory=None) -> list[int]:
    """Fused mode: the checked chain from the tree that rode in this step's
    forward: tokens known to follow the sampled text (greedy: exactly), the
    last one the model's own prediction; [] if the tree rested on text vLLM
    did not produce (``sampled != plan.expect``).

    A catch-up tree (rooted at the token vLLM's rows started with) is read
    whatever vLLM sampled; its chain holds as far as vLLM sampled along
    it: what is left after the sampled tokens (greedy: after the one token
    vLLM sampled without a draft)."""
    if plan.catch_up:
        chain = read_tree(state, plan, pred, memory)
        k = len(sampled)
        if len(chain) <= k or list(chain[:k]) != list(sampled):
            state.draft_sources = []
            return []
        state.draft_sources = state.draft_sources[k:]
        return chain[k:]
    if list(sampled) != plan.expect:
        return []
    return read_tree(state, plan, pred, memory)
