"""Every change this package makes to vLLM's behaviour, in one place.

Applied by :func:`vllm_lookahead.plugin.register` in every vLLM process, only
on a supported vLLM version. Each patch wraps one vLLM function and leaves
every other method untouched:

1. ``EngineArgs.create_speculative_config``: accept
   ``{"method": "lookahead", ...}``. Our keys are validated into a
   :class:`~vllm_lookahead.config.LookaheadConfig` (clear errors naming the
   field), carried to the workers in ``additional_config["lookahead"]``, and
   vLLM gets ``method="custom_class"`` with our proposer class. This covers
   ``LLM(...)``, ``EngineArgs`` and the server's ``--speculative-config``.
2. ``GPUModelRunner._update_states``: after vLLM updates its batch, tell our
   proposer which requests finished, were aborted or resume after preemption.
3. ``GPUModelRunner.propose_draft_token_ids``: call our proposer with the
   runner itself (it needs the model, the KV cache and the block tables).
   The CPU runner subclasses the GPU runner, so both are covered.
4. ``WorkerBase.lookahead_stats`` (a new method, nothing replaced): lets
   ``LLM.collective_rpc("lookahead_stats")`` fetch the proposer's statistics
   from any executor without pickling a function (vLLM's multi-process
   engine refuses to serialize callables by default).
"""

from __future__ import annotations

import functools

_APPLIED = False


def apply() -> None:
    """Apply all patches (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _patch_engine_args()
    _patch_model_runner()
    _add_worker_stats_method()
    _APPLIED = True


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_lookahead.config import ADDITIONAL_CONFIG_KEY, is_lookahead, split_speculative_config

    orig = EngineArgs.create_speculative_config

    @functools.wraps(orig)
    def create_speculative_config(self, *args, **kwargs):
        spec = self.speculative_config
        if not is_lookahead(spec):
            return orig(self, *args, **kwargs)
        split = split_speculative_config(spec)
        self.additional_config = {
            **(self.additional_config or {}),
            ADDITIONAL_CONFIG_KEY: split.lookahead.to_dict(),
        }
        self.speculative_config = dict(split.vllm_kwargs)
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.speculative_config = spec

    EngineArgs.create_speculative_config = create_speculative_config


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_update = GPUModelRunner._update_states
    orig_propose = GPUModelRunner.propose_draft_token_ids

    def _lookahead(runner):
        from vllm_lookahead.proposer import LookaheadProposer

        drafter = getattr(runner, "drafter", None)
        return drafter if isinstance(drafter, LookaheadProposer) else None

    @functools.wraps(orig_update)
    def _update_states(self, scheduler_output, *args, **kwargs):
        result = orig_update(self, scheduler_output, *args, **kwargs)
        drafter = _lookahead(self)
        if drafter is not None:
            drafter.on_update_states(scheduler_output)
        return result

    @functools.wraps(orig_propose)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafter = _lookahead(self)
        if drafter is None:
            return orig_propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return drafter.propose_for_runner(self, sampled_token_ids)

    GPUModelRunner._update_states = _update_states
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids


#: Name of the worker method added by :func:`_add_worker_stats_method`.
WORKER_STATS_METHOD = "lookahead_stats"


def _add_worker_stats_method() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    from vllm_lookahead.stats import worker_stats

    setattr(WorkerBase, WORKER_STATS_METHOD, worker_stats)
