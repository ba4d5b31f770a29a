"""vLLM's Ray worker classes for its CPU platform (:mod:`.ray`): a worker that
owns no device reports no device ids. Imported only when wanted (it imports
Ray); Ray workers import these classes by reference."""

from __future__ import annotations

import ray
from vllm.v1.executor.ray_executor_v2 import RayWorkerProc
from vllm.v1.executor.ray_utils import RayWorkerWrapper


def _node_without_devices() -> tuple[str, list[int]]:
    return ray.get_runtime_context().get_node_id(), []


class CpuRayWorkerWrapper(RayWorkerWrapper):  # type: ignore[valid-type, misc]
    """The worker of ``RayDistributedExecutor``."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        return _node_without_devices()


class CpuRayWorkerProc(RayWorkerProc):
    """The worker of ``RayExecutorV2`` (vLLM's default)."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        return _node_without_devices()
