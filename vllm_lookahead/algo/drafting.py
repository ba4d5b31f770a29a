"""One request's step (numpy only): its state built, the outcome booked, the unchecked
lookup, a tree's candidates, a tree that ran read. ``planner/step.py`` decides who runs what.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_lookahead.attn_mask import TreeLayout
from vllm_lookahead.algo.state import (SOURCE_MEMORY, SOURCE_MODEL, SOURCE_PROMPT,
                                       SOURCE_WINDOW, JacobiWindow, NGramPool, RequestState,
                                       choose_candidate, request_seed, suffix_lookup)
from vllm_lookahead.algo.trees import PlannedTree
from vllm_lookahead.planner.acceptance import (AcceptancePrior, RequestAcceptance, match_kind,
                                               pool_kind)


@dataclass
class Live:
    """A request decoding this step."""

    i: int  # batch row
    state: RequestState
    n_tok: int  # its tokens (the newest one not cached yet)
    room: int  # longest draft vLLM takes now
    chain: list  # fused: the checked chain its last tree left ([]: none)


#: A seeded request's own prior acceptance of its lookups (not the engine's).
SEEDED_PRIOR_P = 0.25
#: Longest own-text match where lookups run past N (suffix decoding's depth).
LONG_MATCH = 24


def new_state(settings, tokens: np.ndarray, n_tok: int, num_prompt_tokens: int,
              max_tokens: int | None, seeded: bool, seed: int,
              prior: AcceptancePrior) -> RequestState:
    """A request's state when it first decodes, its window drawn from its prompt."""
    prompt = tokens[: max(min(num_prompt_tokens, n_tok), 1)]
    window = JacobiWindow.random_init(
        settings.ngram_size, settings.window_size, prompt, request_seed(seed, prompt))
    if seeded:
        prior = AcceptancePrior(max_cands=settings.guess_set_size, p_unchecked=SEEDED_PRIOR_P)
    return RequestState(window=window, pool=NGramPool(settings.guess_set_size),
                        num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
                        settings=settings, acc=RequestAcceptance(prior), seeded=seeded)


def account(state: RequestState, stats, sampled: list[int], num_tokens: int) -> None:
    """Book last step's draft into ``stats``; learn the acceptance of its checked draft
    and lookup. ``sampled``: the tokens vLLM sampled; ``num_tokens``: the request's."""
    n = len(sampled)
    stats.decode_steps += 1
    useful = n
    if state.max_tokens is not None:
        before = num_tokens - n - state.num_prompt_tokens  # vLLM drops tokens past the cap
        useful = max(0, min(n, state.max_tokens - before))
    stats.generated_tokens += useful
    sources = state.draft_sources
    accepted = min(n - 1, len(sources))
    stats.accepted_tokens += accepted
    for src in sources[:accepted]:
        stats.accepted_by_source[src] += 1
    if sources:
        row = stats.drafts_by_kind.get(state.draft_kind)
        if row is not None:
            row[2] += accepted
        if state.draft_checked:
            state.acc.observe_checked(len(sources), accepted)
        if state.draft_expect is not None:
            stats.planned_gain += state.draft_expect
            stats.planned_gain_seen += accepted
            state.acc.prior.calibrate(state.draft_expect, accepted)
    state.acc.observe_unchecked(state.lookup, sampled, state.lookup_kind)
    state.draft_sources, state.lookup, state.draft_checked = [], [], False
    state.draft_expect = None


def lookup(state: RequestState, tokens: np.ndarray, n_tok: int, room: int,
           prompt_pool: bool, memory=None) -> list[int]:
    """The unchecked draft of ``tokens[:n_tok]`` (at most ``room``, N without room, and
    ``max(N, lookup_len)``): what followed its longest earlier suffix, own text or the
    ``memory``'s, whichever longer; else the pool's most seen continuation of the newest
    token, the memory's followers or n-grams. Sets ``lookup_sources`` and ``lookup_kind``."""
    n = state.settings.ngram_size
    k = min(room if room > 0 else n, max(n, state.settings.lookup_len))
    draft, source, matched, agree = [], SOURCE_PROMPT, 0, ""
    if prompt_pool:  # (the cuts to max(n, match) only bite where k > n)
        draft, matched, agree = state.text_index.vote(tokens, n_tok, k,
                                                      max_len=LONG_MATCH if k > n else 4)
        draft = draft[: max(n, matched)]
    state.lookup_kind = f"{match_kind('suffix', matched)}{agree}" if draft else "pool"
    reads = memory is not None and state.memory_reads
    if reads:
        mem, m, agree = memory.lookup(state.memory_scope, state.memory_doc, tokens, n_tok, k,
                                      longer_than=matched)
        if mem:
            draft, source = mem[: max(n, m)], SOURCE_MEMORY
            state.lookup_kind = f"{match_kind('memory', m)}{agree}"
    if not draft:
        newest = int(tokens[n_tok - 1])
        cands = state.pool.get(newest)[: state.settings.guess_set_size]
        if cands:
            counts = [c for _, c, _ in cands]
            best = choose_candidate([0] * len(cands), counts)
            draft, source = list(cands[best][0])[:k], cands[best][2]
            state.lookup_kind = pool_kind(counts, best)
        elif reads:  # what followed the token elsewhere, else another window's n-gram
            found = memory.followers(state.memory_scope, newest)
            if found:
                state.lookup_kind = "memory1"
            found = found or memory.ngrams(state.memory_scope, newest)
            draft, source = (list(found[0])[:k] if found else []), SOURCE_MEMORY
    state.lookup_sources = [source] * len(draft)
    return draft


def unchecked_draft(state: RequestState, k: int, stats) -> list[int]:
    """The first ``k`` tokens of this step's lookup as its draft."""
    draft = state.lookup[:k]
    state.draft_sources = state.lookup_sources[: len(draft)]
    state.draft_checked = False
    stats.unchecked_drafts += bool(draft)
    return draft


def candidates(state: RequestState, text: np.ndarray, prompt_pool: bool,
               memory=None) -> list:
    """The ``(continuation, count, source)`` candidates (N-1 tokens, at most G) of a tree
    rooted at ``text[-1]``: the own text's and memory's continuations where new, the
    pool's, then the memory's window n-grams."""
    g, n = state.settings.guess_set_size, state.settings.ngram_size
    cands = state.pool.get(int(text[-1]))[:g]
    reads = memory is not None and state.memory_reads
    lead = []
    if prompt_pool:
        lead.append((tuple(suffix_lookup(text, len(text), n - 1)), SOURCE_PROMPT))
    if reads:
        mem = memory.lookup(state.memory_scope, state.memory_doc, text, len(text), n - 1)[0]
        lead.append((tuple(mem), SOURCE_MEMORY))
    for cont, source in lead:
        if len(cont) == n - 1 and all(c != cont for c, _, _ in cands):
            cands = [(cont, 1, source)] + cands[: g - 1]
    if reads and len(cands) < g:
        for cont in memory.ngrams(state.memory_scope, int(text[-1])):
            if len(cands) >= g:
                break
            if len(cont) == n - 1 and all(c != cont for c, _, _ in cands):
                cands.append((cont, 1, SOURCE_MEMORY))
    return cands


def jacobi_step(state: RequestState, layout: TreeLayout, root: int, pred: np.ndarray,
                memory=None) -> None:
    """Harvest the window's n-grams into the pool (and ``memory``), then shift it.
    ``pred``: int [T] the argmax at every node."""
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
    """A tree's checked chain: the best candidate prefix the argmax confirms, then
    the argmax after it. Learns the tree's acceptance; sets ``draft_sources``."""
    matches = []
    for c, (cont, _, _) in enumerate(cands):
        nodes, m, expect = layout.cand_index[c], 0, int(pred[0])
        while m < len(cont) and cont[m] == expect:
            expect = int(pred[nodes[m]])
            m += 1
        matches.append(m)
    state.acc.observe_tree(matches, [src == SOURCE_WINDOW for _, _, src in cands],
                           layout.window_size / max(state.window.w, 1))
    best = choose_candidate(matches, [count for _, count, _ in cands])
    if best >= 0 and matches[best] > 0:
        m = matches[best]
        cont, _, source = cands[best]
        draft, sources = list(cont[:m]), [source] * m
        draft.append(int(pred[layout.cand_index[best][m - 1]]))
    else:
        draft, sources = [int(pred[0])], []
    state.draft_sources = sources + [SOURCE_MODEL]
    return draft


def read_tree(state: RequestState, tree: PlannedTree, pred: np.ndarray,
              memory=None) -> list[int]:
    """The window's harvest (if the tree carried it), then the checked chain."""
    if tree.window:
        jacobi_step(state, tree.layout, tree.root, pred, memory)
    return best_confirmed(state, tree.layout, tree.cands, pred)


def harvest(state: RequestState, plan: PlannedTree, pred: np.ndarray,
            sampled: list[int], memory=None) -> list[int]:
    """Fused: the checked chain of this step's tree ([] where vLLM did not sample
    ``plan.expect``); a catch-up tree's, past the sampled tokens it runs along."""
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
