"""Patches of vLLM's model runner and worker: our proposer's hooks, the fused
forward, the warm-up, steps without drafts on the plain sampler."""

from __future__ import annotations

import functools

from vllm_lookahead.patches.registry import CPU, wraps

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"  # the CPU runner's base too


def _lookahead(runner):
    """The runner's drafter if it is our proposer, else None."""
    from vllm_lookahead.proposer import LookaheadProposer

    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, LookaheadProposer) else None


@wraps(f"{RUNNER}._update_states", "model runner",
       "Tells our proposer which requests finished, were aborted or resume after preemption.")
def forget_finished_requests(orig, self, scheduler_output, *args, **kwargs):
    result = orig(self, scheduler_output, *args, **kwargs)
    drafter = _lookahead(self)
    if drafter is not None:
        drafter.on_update_states(scheduler_output)
    return result


@wraps(f"{RUNNER}.propose_draft_token_ids", "model runner",
       "Calls our proposer with the runner (it needs the model, KV cache and block tables).")
def propose_with_runner(orig, self, scheduler_output, sampled_token_ids, *args, **kwargs):
    drafter = _lookahead(self)
    if drafter is None:
        return orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
    self._draft_probs = None
    self._draft_prob_req_ids = None
    return drafter.propose_for_runner(self, sampled_token_ids)


@wraps(f"{RUNNER}._model_forward", "model runner",
       "Fused mode: the step's lookahead tree rides in vLLM's own model call (vLLM gets its "
       "rows back); installs the logits hook on the model instance (`install_logits_hook`).")
def fused_forward(orig, self, input_ids=None, positions=None, **kwargs):
    drafter = _lookahead(self)
    if drafter is None or input_ids is None:
        return orig(self, input_ids=input_ids, positions=positions, **kwargs)
    if drafter.worker is not None:
        install_logits_hook(self.model, drafter)
    return drafter.model_forward(self, functools.partial(orig, self), input_ids, positions,
                                 **kwargs)


@wraps(f"{RUNNER}._sample", "model runner",
       "A step in which no request drafts samples with vLLM's plain sampler, as without "
       "speculation (vLLM runs its rejection sampler over zero drafts); not with async "
       "scheduling. Every speculative method.")
def plain_sampler_without_drafts(orig, self, logits, spec_decode_metadata):
    if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
            and not self.use_async_scheduling):
        self.lookahead_plain_samples = getattr(self, "lookahead_plain_samples", 0) + 1
        spec_decode_metadata = None
    return orig(self, logits, spec_decode_metadata)


WARM_UP_DOC = ("After vLLM's warm-up our proposer wraps the attention layers and sets up "
               "the step-cost model, so the first request does not pay for it.")


@wraps("vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model", "worker", WARM_UP_DOC,
       CPU, name="warm_up_cpu")
@wraps("vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model", "worker", WARM_UP_DOC)
def warm_up(orig, self, *args, **kwargs):
    result = orig(self, *args, **kwargs)
    runner = getattr(self, "model_runner", None)
    drafter = _lookahead(runner)
    if drafter is not None:
        drafter.warm_up(runner)
    return result


def install_logits_hook(model, owner) -> None:
    """Wrap the model instance's ``compute_logits`` once (not in the registry): the
    ``owner.take_extra_rows()`` [k, hidden] ride after vLLM's rows, their logits go to
    ``owner.put_extra_logits`` (None where not gathered)."""
    orig = model.compute_logits
    if getattr(orig, "_lookahead_hook", False):
        return

    def compute_logits(hidden_states, *args, **kwargs):
        extra = owner.take_extra_rows()
        if extra is None:
            return orig(hidden_states, *args, **kwargs)
        import torch

        n = hidden_states.shape[0]
        logits = orig(torch.cat([hidden_states, extra.to(hidden_states.dtype)]), *args, **kwargs)
        owner.put_extra_logits(None if logits is None else logits[n:])
        return None if logits is None else logits[:n]

    compute_logits._lookahead_hook = True
    model.compute_logits = compute_logits
