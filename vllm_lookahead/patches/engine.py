"""Patches of vLLM's engine and scheduler: what reaches our workers (a request's
scope, the waiting requests) and the worker methods the engine calls."""

from __future__ import annotations

from vllm_lookahead.config import ADDITIONAL_CONFIG_KEY
from vllm_lookahead.patches.registry import ALWAYS, declare, replaces, wraps
from vllm_lookahead.stats import WORKER_STATS_METHOD, worker_drafter, worker_stats

WORKER = "vllm.v1.worker.worker_base:WorkerBase"
#: The worker method that clears the shared memory (a ``collective_rpc`` name).
CLEAR_MEMORY_METHOD = "lookahead_clear_memory"


def _runs_lookahead(vllm_config) -> bool:
    return ADDITIONAL_CONFIG_KEY in (vllm_config.additional_config or {})


declare(WORKER_STATS_METHOD, f"{WORKER}.{WORKER_STATS_METHOD}", "worker",
        "New method: `LLM.collective_rpc(\"lookahead_stats\")` fetches the proposer's "
        "statistics from any executor (no pickled function).", ALWAYS, lambda orig: worker_stats)


@replaces(f"{WORKER}.{CLEAR_MEMORY_METHOD}", "worker",
          "New method: clears the proposer's shared memory (called on `reset_prefix_cache`).")
def lookahead_clear_memory(worker) -> bool:
    clear = getattr(worker_drafter(worker), "clear_memory", None)
    return bool(clear()) if clear is not None else False


@wraps("vllm.v1.engine.input_processor:InputProcessor.process_inputs", "requests",
       "Writes a request's memory scope (a digest of its `cache_salt`) and its n into its own "
       "copy of `extra_args`, the only way they reach the workers.")
def request_scope(orig, self, *args, **kwargs):
    from vllm_lookahead.algo.memory import SCOPE_KEY, scope_of
    from vllm_lookahead.algo.state import SAMPLES_KEY

    request = orig(self, *args, **kwargs)
    params = getattr(request, "sampling_params", None)
    if params is not None and _runs_lookahead(self.vllm_config):
        # The request's own copy (vLLM clones the caller's parameters).
        params.extra_args = {**(params.extra_args or {}),
                             SCOPE_KEY: scope_of(getattr(request, "cache_salt", None)),
                             SAMPLES_KEY: int(getattr(params, "n", 1) or 1)}
    return request


@wraps("vllm.v1.engine.core:EngineCore.reset_prefix_cache", "engine",
       "When vLLM's reset succeeds, clears the shared memory on every worker.")
def clear_memory_on_reset(orig, self, *args, **kwargs):
    ok = orig(self, *args, **kwargs)
    if ok and _runs_lookahead(self.vllm_config):
        self.model_executor.collective_rpc(CLEAR_MEMORY_METHOD)
    return ok
