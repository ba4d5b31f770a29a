"""A drafting step's bonus tokens sampled only where they are used (CPU
platform; patch 15 in :mod:`.patches`).

vLLM 0.32's rejection sampler samples every request's bonus token (the
token after a fully accepted draft, from the row after its last draft
token) with the plain sampler *before* it verifies the drafts. A request
uses its bonus token only if it accepted its whole draft (or had none); at
the first rejected position its token is the recovered one and the bonus
is thrown away. On the CPU the plain sampler's top-p sorts the whole
vocabulary (about 2.9-4.5 ms a row for a 49k vocabulary on the AMX Xeon,
``benchmarks/HISTORY.md``), so a rejected draft pays for a token nobody
reads; sampled drafts are mostly rejected.

:func:`forward` runs the rejection sampler's steps in vLLM's order but
verifies first, with a marker (:data:`PENDING`) in place of every bonus
token, then samples the bonus rows that came out marked, all of them in one
call of vLLM's own sampler on those rows (``predict_bonus_token=True``, its
sampling metadata cut to those rows: :func:`rows_metadata`). A row it
samples is the row vLLM samples; only the rows thrown away are skipped.

For an unseeded request the bonus token is an independent draw from the
row's distribution, whenever it is drawn, so the outputs' distribution is
vLLM's. A seeded request's tokens depend on the order its generator is
drawn in: batches with any seeded request keep vLLM's path, as do batches
where vLLM's row state would not survive the cut (:func:`applies`):
penalties, bad words, allowed token ids, logprobs, an active logits
processor, a thinking budget, greedy requests, draft probabilities.
"""

from __future__ import annotations

from dataclasses import replace

import torch

#: What the verifier is handed as every request's bonus token: where it
#: comes out in the output, that request uses its bonus token (vLLM's
#: placeholder for unused positions is -1).
PENDING = -2


def applies(sm) -> bool:
    """Whether a drafting step with ``SamplingMetadata`` ``sm`` may sample
    its bonus tokens lazily: every request sampled and unseeded, and
    nothing that vLLM's sampler reads by batch row besides the temperature,
    top-k and top-p (so the rows can be cut out of the batch)."""
    if not sm.all_random or sm.generators or sm.max_num_logprobs is not None:
        return False
    if sm.logprob_token_ids or not sm.no_penalties or sm.bad_words_token_ids:
        return False
    if sm.allowed_token_ids_mask is not None:
        return False
    holder = getattr(sm, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return False
    return all(_inactive(p) for p in sm.logitsprocs.all)


def request_applies(params) -> bool:
    """Whether a request with vLLM ``SamplingParams`` ``params`` leaves
    :func:`applies` true for the batches it is in (what the planner reads
    to price a draft's bonus row, ``CostModel.bonus``): sampled, unseeded,
    no logprobs, penalties at their neutral values, and none of the
    per-request lists or processors :func:`applies` rules out. Decided at
    run time by :func:`applies` alone: this only predicts it."""
    if params is None or float(getattr(params, "temperature", 0.0) or 0.0) < 1e-5:
        return False
    if getattr(params, "seed", None) is not None or getattr(params, "logprobs", None) is not None:
        return False
    if getattr(params, "logprob_token_ids", None):
        return False
    neutral = (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
               ("repetition_penalty", 1.0), ("min_p", 0.0), ("min_tokens", 0))
    if any(float(getattr(params, name, value) or value) != value for name, value in neutral):
        return False
    for name in ("bad_words", "allowed_token_ids", "logit_bias", "thinking_token_budget"):
        if getattr(params, name, None):
            return False
    return True


def _inactive(processor) -> bool:
    """vLLM's built-in logits processors with no request using them (they
    index their own per-row state); any other processor counts as active."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    kind = type(processor)
    if kind is MinPLogitsProcessor:
        return not processor.min_p_count
    if kind is LogitBiasLogitsProcessor:
        return not processor.biases
    if kind is MinTokensLogitsProcessor:
        return not processor.min_toks
    return False


def rows_metadata(sm, rows: list[int], batch: int):
    """``sm`` of a ``batch``-request step cut to the rows ``rows`` (only
    for a batch where :func:`applies` holds: the per-row fields left are
    the temperature, top-k, top-p, the penalties' (unused) values and the
    token lists, which vLLM leaves empty where nothing reads them)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors

    index = torch.tensor(rows, dtype=torch.long, device=sm.temperature.device)

    def pick(t):
        return None if t is None else t[index]

    def pick_list(items):
        return items if items is None or len(items) != batch else [items[r] for r in rows]

    return replace(
        sm,
        temperature=pick(sm.temperature), top_p=pick(sm.top_p), top_k=pick(sm.top_k),
        generators={}, prompt_token_ids=pick(sm.prompt_token_ids),
        frequency_penalties=pick(sm.frequency_penalties),
        presence_penalties=pick(sm.presence_penalties),
        repetition_penalties=pick(sm.repetition_penalties),
        output_token_ids=pick_list(sm.output_token_ids),
        spec_token_ids=pick_list(sm.spec_token_ids),
        allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(), logprob_token_ids=None)


def forward(verifier, metadata, logits: torch.Tensor, sm, rs, counts=None):
    """vLLM's ``RejectionSampler.forward`` (``verifier``; ``rs`` its module,
    as patched) for a batch where :func:`applies` holds and the drafts carry
    no probabilities, with the bonus rows sampled after verification and
    only where used. Returns vLLM's ``SamplerOutput`` (no logprobs: none
    were asked for). ``counts``: a :class:`~.cpu_sampling.TopPCounts`
    (``bonus_rows`` / ``bonus_rows_sampled``)."""
    from vllm.v1.outputs import SamplerOutput

    # vLLM's order from here: the target rows in float32 (indexing copied
    # them, so ``logits`` stays as it came: the bonus rows are read from it
    # at the end), its logits processors, temperature and top-k/top-p
    # (deferred to rejection_sample by patch 15 where it can)
    target_logits = logits[metadata.target_logits_indices].to(torch.float32)
    target_logits = verifier.apply_logits_processors(target_logits, sm, metadata)
    target_logits = rs.apply_sampling_constraints(target_logits, metadata.cu_num_draft_tokens,
                                                  sm)
    batch = len(metadata.num_draft_tokens)
    pending = torch.full((batch, 1), PENDING, dtype=torch.int32, device=logits.device)
    output = rs.rejection_sample(
        metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
        metadata.cu_num_draft_tokens, None, target_logits, pending, sm,
        synthetic_mode=False, synthetic_conditional_rates=None,
        use_fp64_gumbel=verifier.use_fp64_gumbel)
    where = (output == PENDING).nonzero()  # [k, 2]: (request, position)
    if counts is not None:
        counts.bonus_rows += batch
        counts.bonus_rows_sampled += int(where.shape[0])
    if where.shape[0]:
        rows = where[:, 0]
        sampled = verifier.sampler(logits=logits[metadata.bonus_logits_indices[rows]],
                                   sampling_metadata=rows_metadata(sm, rows.tolist(), batch),
                                   predict_bonus_token=True).sampled_token_ids
        output[rows, where[:, 1]] = sampled.view(-1).to(output.dtype)
    return SamplerOutput(sampled_token_ids=output, logprobs_tensors=None)
