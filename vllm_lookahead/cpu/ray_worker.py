"""Ray worker classes for vLLM's CPU platform (see :mod:`ray_cpu`).

In a module of its own so that Ray is imported only when the fix is wanted;
Ray workers import these classes by reference when they start. Each is
vLLM's own class with one change: a worker that owns no device reports no
device ids (vLLM reads them from Ray's accelerator table, which has no entry
for a custom resource).
"""

from __future__ import annotations

import ray
from vllm.v1.executor.ray_executor_v2 import RayWorkerProc
from vllm.v1.executor.ray_utils import RayWorkerWrapper


def _node_without_devices() -> tuple[str, list[int]]:
    return ray.get_runtime_context().get_node_id(), []


class CpuRayWorkerWrapper(RayWorkerWrapper):  # type: ignore[valid-type, misc]
    """The worker of vLLM's first Ray executor (``RayDistributedExecutor``)."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        return _node_without_devices()


class CpuRayWorkerProc(RayWorkerProc):
    """The worker of vLLM's default Ray executor (``RayExecutorV2``)."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        return _node_without_devices()
