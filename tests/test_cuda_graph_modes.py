"""The mode lookahead runs in under each of vLLM's ``cudagraph_mode`` values.

No CUDA graph is captured on the CPU, so this holds the contract with vLLM's
graph wrappers (``vllm/compilation/cuda_graph.py``: a forward context whose
runtime mode is NONE calls the model directly, no capture, no replay): fused
mode is kept under every mode, and a step that carries tree rows runs with
the runtime mode NONE, restored afterwards.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from vllm.config import CUDAGraphMode  # noqa: E402

from vllm_lookahead.config import ADDITIONAL_CONFIG_KEY  # noqa: E402


def _proposer(cg_mode, mode="fused"):
    from vllm_lookahead.proposer import LookaheadProposer

    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        additional_config={ADDITIONAL_CONFIG_KEY: {"mode": mode}},
        compilation_config=SimpleNamespace(cudagraph_mode=cg_mode),
        model_config=SimpleNamespace(max_model_len=2048),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
    )
    return LookaheadProposer(cfg)


@pytest.mark.parametrize("cg_mode", list(CUDAGraphMode), ids=lambda m: m.name)
def test_fused_mode_under_every_cudagraph_mode(cg_mode):
    assert _proposer(cg_mode).fused  # no fallback to a second forward
    assert not _proposer(cg_mode, "separate").fused  # the user's choice holds


@pytest.mark.parametrize("runtime", [CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE,
                                     CUDAGraphMode.FULL], ids=lambda m: m.name)
def test_a_step_with_trees_runs_without_graph_replay(runtime):
    from vllm.config import VllmConfig
    from vllm.forward_context import get_forward_context, set_forward_context

    from vllm_lookahead.worker import graphs_off

    seen = []
    with set_forward_context(None, VllmConfig(), num_tokens=8, cudagraph_runtime_mode=runtime):
        with graphs_off():
            seen.append(get_forward_context().cudagraph_runtime_mode)
        after = get_forward_context().cudagraph_runtime_mode
    assert seen == [CUDAGraphMode.NONE]
    assert after == runtime  # the rest of vLLM's step is untouched


def test_graphs_off_outside_a_forward_context_is_a_no_op():
    from vllm_lookahead.worker import graphs_off

    with graphs_off():
        pass
