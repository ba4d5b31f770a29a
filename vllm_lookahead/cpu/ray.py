"""vLLM's Ray executor on its CPU platform (opt-in: ``LOOKAHEAD_RAY_ON_CPU=1``).

vLLM 0.32's CPU platform has no Ray resource. Each CPU worker reserves
:data:`RAY_CPU_RESOURCE`, which the cluster declares (``ray start
--resources='{"vllm_cpu": 2}'``), and reports no device ids (:mod:`.ray_worker`).
"""

from __future__ import annotations

import importlib.util
import os

from vllm_lookahead.patches.registry import APPLIED, When, declare, on_cpu

#: Environment variable that turns the fix on ("1").
OPT_IN_ENV = "LOOKAHEAD_RAY_ON_CPU"
#: The Ray resource one CPU worker reserves; the cluster must declare it.
RAY_CPU_RESOURCE = "vllm_cpu"


def wanted() -> bool:
    """Opted in, on a CPU platform without Ray support of its own, Ray installed."""
    if os.environ.get(OPT_IN_ENV, "0").strip().lower() not in ("1", "true", "yes"):
        return False
    if not on_cpu() or importlib.util.find_spec("ray") is None:
        return False
    from vllm.platforms import current_platform

    return current_platform.ray_device_key in ("", RAY_CPU_RESOURCE)


def _resource(orig) -> str:
    from vllm.logger import init_logger

    init_logger("vllm." + __name__).info(
        "Ray executor enabled on the CPU platform (%s=1): each worker reserves one %r Ray "
        "resource", OPT_IN_ENV, RAY_CPU_RESOURCE)
    return RAY_CPU_RESOURCE


def _worker(name: str):
    from vllm_lookahead.cpu import ray_worker

    return getattr(ray_worker, name)


RAY = When(f"CPU, opt-in `{OPT_IN_ENV}=1`", wanted)
PATCHES = [
    declare("ray_device_key", "vllm.platforms.cpu:CpuPlatform.ray_device_key", "executor",
            f"The Ray resource a CPU worker reserves: `{RAY_CPU_RESOURCE}`.", RAY, _resource),
    declare("ray_worker_proc", "vllm.v1.executor.ray_executor_v2:RayWorkerProc", "executor",
            "The default Ray executor's worker reports no device ids.", RAY,
            lambda orig: _worker("CpuRayWorkerProc")),
    declare("ray_worker_wrapper", "vllm.v1.executor.ray_executor:RayWorkerWrapper", "executor",
            "`RayDistributedExecutor`'s worker reports no device ids.", RAY,
            lambda orig: _worker("CpuRayWorkerWrapper")),
]


def enable() -> bool:
    """Apply the Ray patches where :func:`wanted`; whether they are in effect."""
    if not wanted():
        return False
    for p in PATCHES:
        if APPLIED.get(p.target) is not p:
            p.apply()
    return True
