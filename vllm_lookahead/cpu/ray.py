"""vLLM's Ray executor on its CPU platform (opt-in; patch 9 in :mod:`patches`).

vLLM 0.32 refuses ``distributed_executor_backend="ray"`` on the CPU build:
the CPU platform has no ``ray_device_key`` (the Ray resource a worker
reserves), so ``initialize_ray_cluster`` raises ``current platform cpu does
not support ray``. Two things are missing, both small:

- a Ray resource for one CPU worker. Ray does not let an actor ask for
  ``"CPU"`` through ``resources=`` (vLLM's non-GPU path does exactly that),
  so CPU workers reserve a custom resource, :data:`RAY_CPU_RESOURCE`, which
  the Ray cluster declares: ``ray start --head --resources='{"vllm_cpu": 2}'``
  or ``ray.init(resources={"vllm_cpu": 2})``, one unit per worker the node
  hosts;
- the worker's device ids: vLLM's Ray worker reads its ids from Ray's
  accelerator table, which knows GPUs and other accelerators but no custom
  resource. A CPU worker has no device id, so the worker classes of both of
  vLLM's Ray executors (``RayExecutorV2``, the default, and
  ``RayDistributedExecutor``) are swapped for subclasses in
  :mod:`~vllm_lookahead.cpu.ray_worker` that answer with none.

Opt in with ``LOOKAHEAD_RAY_ON_CPU=1`` in the environment of the process
that creates the engine. Without it, or on a platform that already supports
Ray, nothing changes. Ray is imported only then. The workers need
nothing: Ray imports the wrapper class from its module by reference.
"""

from __future__ import annotations

import os

#: Environment variable that turns the fix on ("1").
OPT_IN_ENV = "LOOKAHEAD_RAY_ON_CPU"
#: The Ray resource one CPU worker reserves; the cluster must declare it.
RAY_CPU_RESOURCE = "vllm_cpu"


def wanted() -> bool:
    return os.environ.get(OPT_IN_ENV, "0").strip().lower() in ("1", "true", "yes")


def enable() -> bool:
    """Let vLLM's Ray executor place workers on the CPU platform.

    Returns whether the fix is in effect in this process.
    """
    if not wanted():
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    if current_platform.ray_device_key not in ("", RAY_CPU_RESOURCE):
        return False  # a CPU platform that supports Ray on its own
    try:
        from vllm_lookahead.cpu.ray_worker import CpuRayWorkerProc, CpuRayWorkerWrapper
    except ImportError:  # Ray is not installed: vLLM reports that itself
        return False
    from vllm.v1.executor import ray_executor, ray_executor_v2

    type(current_platform).ray_device_key = RAY_CPU_RESOURCE
    ray_executor.RayWorkerWrapper = CpuRayWorkerWrapper
    ray_executor_v2.RayWorkerProc = CpuRayWorkerProc
    return True
