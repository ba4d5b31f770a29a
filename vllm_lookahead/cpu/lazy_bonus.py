"""A drafting step's bonus tokens sampled only where used (CPU; patched in by :mod:`.patches`).

vLLM samples every bonus token before verifying, though a request uses it only after
accepting its whole draft. :func:`forward` verifies first, with :data:`PENDING` bonus
tokens, then samples the pending rows with vLLM's sampler: an unseeded draw, so the
distribution is vLLM's. Other batches keep vLLM's path (:func:`applies`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

#: The bonus token handed to the verifier: where it comes out, the request uses it.
PENDING = -2


def applies(sm) -> bool:
    """Whether a step's ``SamplingMetadata`` lets its bonus tokens be sampled lazily:
    all sampled and unseeded, nothing read by row but temperature, top-k, top-p."""
    holder = getattr(sm, "thinking_budget_state_holder", None)
    return (sm.all_random and not sm.generators and sm.max_num_logprobs is None
            and not sm.logprob_token_ids and sm.no_penalties and not sm.bad_words_token_ids
            and sm.allowed_token_ids_mask is None
            and (holder is None or not holder.has_tracked_requests())
            and all(_inactive(p) for p in sm.logitsprocs.all))


def request_applies(params) -> bool:
    """Whether a request's ``SamplingParams`` leave :func:`applies` true (the
    planner's prediction; :func:`applies` decides at run time)."""
    if params is None or float(getattr(params, "temperature", 0.0) or 0.0) < 1e-5:
        return False
    neutral = (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
               ("repetition_penalty", 1.0), ("min_p", 0.0), ("min_tokens", 0))
    unset = ("seed", "logprobs")
    empty = ("logprob_token_ids", "bad_words", "allowed_token_ids", "logit_bias",
             "thinking_token_budget")
    return (all(float(getattr(params, name, value) or value) == value for name, value in neutral)
            and all(getattr(params, name, None) is None for name in unset)
            and not any(getattr(params, name, None) for name in empty))


def _inactive(processor) -> bool:
    """A built-in vLLM logits processor no request uses (others count as active)."""
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    used = {MinPLogitsProcessor: "min_p_count", LogitBiasLogitsProcessor: "biases",
            MinTokensLogitsProcessor: "min_toks"}.get(type(processor))
    return used is not None and not getattr(processor, used)


def rows_metadata(sm, rows: list[int], batch: int):
    """``sm`` of a ``batch``-request step (where :func:`applies`) cut to ``rows``."""
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


def forward(verifier, metadata, logits: torch.Tensor, sm):
    """vLLM's ``RejectionSampler.forward`` (``verifier``) where :func:`applies` and no
    draft probabilities come, the bonus rows sampled last, only where used."""
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.v1.outputs import SamplerOutput

    from vllm_lookahead.cpu.sampling import COUNTS

    # vLLM's steps as patched; the indexing copies, so ``logits`` keeps the bonus rows
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
    COUNTS.bonus_rows += batch
    COUNTS.bonus_rows_sampled += int(where.shape[0])
    if where.shape[0]:
        rows = where[:, 0]
        sampled = verifier.sampler(logits=logits[metadata.bonus_logits_indices[rows]],
                                   sampling_metadata=rows_metadata(sm, rows.tolist(), batch),
                                   predict_bonus_token=True).sampled_token_ids
        output[rows, where[:, 1]] = sampled.view(-1).to(output.dtype)
    return SamplerOutput(sampled_token_ids=output, logprobs_tensors=None)
