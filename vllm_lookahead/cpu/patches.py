"""Patches of vLLM on its CPU platform: two bug fixes lossless sampling needs (always
on), and the faster sampler and verifier of :mod:`.sampling` and :mod:`.lazy_bonus` for
every speculative method (``VLLM_LOOKAHEAD_CPU_SAMPLER=0`` keeps vLLM's).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_lookahead.cpu import lazy_bonus
from vllm_lookahead.cpu import sampling as cpu_sampling
from vllm_lookahead.patches.registry import CPU, CPU_SAMPLER, replaces, wraps

RS = "vllm.v1.sample.rejection_sampler"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


@replaces("vllm.utils.cpu_triton_utils:_expand_kernel_impl", "sampler",
          "Bug fix (always on): vLLM's CPU `expand_kernel` never writes its output, so draft "
          "positions read uninitialised temperature/top-k/top-p (any speculative method).", CPU)
def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                       MAX_NUM_TOKENS=None) -> None:
    """Request r's value (``replace_from`` -> ``replace_to``) into ``output`` for each
    of its tokens ``[cu[r-1], cu[r])``."""
    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, replace_to, input_val)
    total = int(cu[-1]) if cu.numel() else 0
    output[:total] = torch.repeat_interleave(vals, counts).to(output.dtype)


def _expand(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """vLLM's ``expand_batch_to_tokens`` without its Triton dispatcher."""
    out = x.new_empty(num_tokens)
    expand_kernel_impl(out, x, cu_num_tokens, replace_from, replace_to)
    return out


@wraps(f"{RUNNER}._prepare_inputs", "model runner",
       "Bug fix (always on), with the next: saves the state of each seeded request whose "
       "token this step discards (a chunked prompt).", CPU)
def save_seeded_generators(orig, self, *args, **kwargs):
    out = orig(self, *args, **kwargs)
    gens, n = self.input_batch.generators, self.input_batch.num_reqs
    self._lookahead_saved_generators = {
        int(i): gens[int(i)].get_state()
        for i in np.nonzero(self.discard_request_mask.np[:n])[0] if int(i) in gens} if gens else {}
    return out


@wraps(f"{RUNNER}._bookkeeping_sync", "model runner",
       "Bug fix (always on): vLLM rewinds a discarded token's generator with `set_offset`, "
       "which CPU generators lack (the engine dies); the saved state is put back instead.", CPU)
def rewind_seeded_generators(orig, self, *args, **kwargs):
    saved = getattr(self, "_lookahead_saved_generators", None)
    self._lookahead_saved_generators = None
    gens = self.input_batch.generators
    real = {i: gens[i] for i in saved or () if i in gens}
    for i, gen in real.items():  # vLLM calls gen.set_offset(gen.get_offset() - 4)
        gens[i] = SimpleNamespace(get_offset=lambda: 0,
                                  set_offset=lambda _, g=gen, s=saved[i]: g.set_state(s))
    try:
        return orig(self, *args, **kwargs)
    finally:
        gens.update(real)


@wraps(f"{RS}:apply_top_k_top_p", "sampler",
       "Draft rows' top-p from the row's 256 largest logits, not a sort of the vocabulary; "
       "a row that could differ from vLLM's sort goes to vLLM's.", CPU_SAMPLER)
def top_p_from_window(orig, logits, k, p, ties=None):
    if p is None:
        return orig(logits, k, p)
    return cpu_sampling.top_k_top_p_rows(logits, k, p, orig, ties=ties)


@replaces(f"{RS}:sample_recovered_tokens", "sampler",
          "The recovered tokens' noise drawn for drafting requests only, unseeded ones only "
          "where their target probability is above 0.", CPU_SAMPLER)
def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                            draft_token_ids, draft_probs, target_probs, sampling_metadata,
                            device, use_fp64_gumbel=False):
    import vllm.v1.sample.rejection_sampler as rs

    inv_q = cpu_sampling.recovered_inv_q(num_draft_tokens, target_probs,
                                         sampling_metadata.generators,
                                         torch.float64 if use_fp64_gumbel else torch.float32,
                                         device)
    recovered = torch.empty_like(draft_token_ids)
    rs._sample_recovered_tokens(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                target_probs, inv_q, max_spec_len=max_spec_len)
    return recovered


#: The draft rows whose top-k/top-p ``defer_top_k_top_p`` left to ``verify_until_rejection``.
_DEFERRED: dict = {}


@wraps(f"{RS}:apply_sampling_constraints", "sampler",
       "Sampled requests without draft probabilities or logprobs: divides by the "
       "temperature and leaves top-k/top-p to the next patch.", CPU_SAMPLER)
def defer_top_k_top_p(orig, logits, cu_num_draft_tokens, sm):
    import vllm.v1.sample.rejection_sampler as rs

    _DEFERRED.clear()
    if sm.all_greedy or sm.max_num_logprobs is not None or (sm.top_k is None
                                                            and sm.top_p is None):
        return orig(logits, cu_num_draft_tokens, sm)
    n = logits.shape[0]
    logits.div_(_expand(sm.temperature, cu_num_draft_tokens, n, rs.GREEDY_TEMPERATURE,
                        1).unsqueeze(-1))
    top_k = None if sm.top_k is None else _expand(sm.top_k, cu_num_draft_tokens, n)
    top_p = None if sm.top_p is None else _expand(sm.top_p, cu_num_draft_tokens, n)
    _DEFERRED["rows"] = (logits, top_k, top_p)
    return logits


@wraps(f"{RS}:rejection_sample", "sampler",
       "Verifies sampled requests' drafts position by position, computing a row only while "
       "its request accepted every token before it (`verify_sampled_rows`).", CPU_SAMPLER)
def verify_until_rejection(orig, draft_token_ids, num_draft_tokens, max_spec_len,
                           cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids,
                           sm, synthetic_mode=False, synthetic_conditional_rates=None,
                           use_fp64_gumbel=False):
    import vllm.v1.sample.rejection_sampler as rs

    held = _DEFERRED.pop("rows", None)
    if held is not None and held[0] is not target_logits:
        held = None  # not the logits this step's constraints deferred
    if held is not None and (draft_probs is not None or synthetic_mode):
        target_logits = rs.apply_top_k_top_p(target_logits, held[1], held[2])  # every row
        held = None
    if held is None:
        return orig(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                    draft_probs, target_logits, bonus_token_ids, sm,
                    synthetic_mode=synthetic_mode,
                    synthetic_conditional_rates=synthetic_conditional_rates,
                    use_fp64_gumbel=use_fp64_gumbel)
    output = torch.full((len(num_draft_tokens), max_spec_len + 1), rs.PLACEHOLDER_TOKEN_ID,
                        dtype=torch.int32, device=target_logits.device)
    is_greedy = sm.temperature == rs.GREEDY_TEMPERATURE
    uniform = rs.generate_uniform_probs(draft_token_ids.shape[0], num_draft_tokens,
                                        sm.generators, target_logits.device)
    if not sm.all_random:  # greedy requests as vLLM (top-k/top-p keep a row's argmax)
        rs._rejection_greedy_sample(output, cu_num_draft_tokens, draft_token_ids,
                                    target_logits.argmax(dim=-1), bonus_token_ids,
                                    is_greedy, max_spec_len, uniform, None)
    cpu_sampling.verify_sampled_rows(
        output, draft_token_ids, num_draft_tokens, target_logits, held[1], held[2],
        bonus_token_ids, uniform, None if sm.all_random else is_greedy, sm.generators,
        rs.apply_top_k_top_p, torch.float64 if use_fp64_gumbel else torch.float32)
    return output


@wraps(f"{RS}:RejectionSampler.forward", "sampler",
       "Unseeded sampled batches without per-row extras (`lazy_bonus.applies`): the bonus "
       "tokens sampled after verification, only where used.", CPU_SAMPLER)
def lazy_bonus_tokens(orig, self, metadata, draft_probs, logits, sampling_metadata):
    if draft_probs is not None or self.synthetic_mode or not lazy_bonus.applies(
            sampling_metadata):
        return orig(self, metadata, draft_probs, logits, sampling_metadata)
    return lazy_bonus.forward(self, metadata, logits, sampling_metadata)
