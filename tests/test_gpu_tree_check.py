"""benchmarks/gpu_tree_check.py, the GPU layouts' check, on the CPU.

(a) its correctness checks pass here;
(b) the per-layer cache views it builds by hand, for every layout, are
    exactly vLLM's own (``create_kv_cache_views``): same shape, strides and
    place in the shared buffer; so what it checks on a GPU without vLLM is
    what a CUDA engine hands the branch;
(c) it runs where vLLM cannot be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"

import gpu_tree_check as gtc  # noqa: E402


def test_checks_pass_on_cpu():
    with torch.inference_mode():
        checks = gtc.run_checks(torch.device("cpu"))
    failed = [c for c in checks if not c["passed"]]
    assert not failed, failed
    kinds = {c["check"] for c in checks}
    assert {"probe", "gather"} <= kinds
    assert sum(k.startswith("tree") for k in kinds) == len(gtc.TREE_CASES)
    assert {(c["layout"], c["dtype"]) for c in checks} == {
        (lay, dt) for lay in gtc.LAYOUTS for dt in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hand_built_views_are_vllms(dtype):
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert gtc.LAYOUTS == {lay.name: lay.value for lay in KVCacheLayout}
    spec = kvi.FullAttentionSpec(block_size=gtc.BS, num_kv_heads=gtc.KVH, head_size=gtc.HD,
                                 dtype=dtype)
    numel = gtc.LAYERS * gtc.NB * gtc.KVH * gtc.BS * 2 * gtc.HD
    buffer = torch.zeros(numel, dtype=dtype)
    assert buffer.numel() * buffer.element_size() == gtc.LAYERS * gtc.NB * spec.page_size_bytes
    for layout in KVCacheLayout:
        # as tests/test_kv_layouts.py's gpu_views, over the same bytes
        layer_stride, block_stride, *_ = kvi.compute_layout_strides(spec, gtc.NB, gtc.LAYERS,
                                                                    layout)
        tensor = kvi.KVCacheTensor(size=numel * buffer.element_size(),
                                   layers=[f"l{i}" for i in range(gtc.LAYERS)],
                                   layer_stride=layer_stride, block_stride=block_stride)
        theirs = kvi.create_kv_cache_views(buffer.view(torch.int8), spec, gtc.NB, layout, tensor)
        ours = gtc.layer_views(buffer, gtc.LAYOUTS[layout.name], gtc.LAYERS, gtc.NB, gtc.KVH,
                               gtc.BS, gtc.HD)
        assert len(ours) == len(theirs) == gtc.LAYERS
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype == dtype
            assert a.shape == b.shape, layout
            assert a.stride() == b.stride(), layout
            assert a.storage_offset() == b.storage_offset(), layout
            assert a.data_ptr() == b.data_ptr(), layout


def test_runs_without_vllm(tmp_path):
    """A ``vllm`` package that cannot be imported first on the path: the
    script stubs what the worker imports and passes."""
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("no vLLM here")\n')
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "gpu_tree_check.py"), "--device", "cpu", "--no-time",
         "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_tree_check.json").read_text())
    assert report["passed"] and not report["vllm_importable"]
    assert report["timing"] == []
    assert all(c["passed"] for c in report["checks"])


def test_step_cost_rows_reach_the_report(tmp_path):
    """``--step-cost``: a decoder layer's plain and tree steps, timed part by
    part, in the JSON (on the CPU, the smallest shapes of the run)."""
    assert gtc.main(["--device", "cpu", "--out", str(tmp_path), "--batches", "1",
                     "--contexts", "16", "--iters", "1", "--step-cost"]) == 0
    report = json.loads((tmp_path / "gpu_tree_check.json").read_text())
    (row,) = report["step_cost"]
    assert (row["batch"], row["context"], row["tree_rows"]) == (1, 16, 18)
    parts = row["linear_tree_ms"] + row["decode_ms"] + row["tree_attention_ms"]
    assert row["tree_step_ms"] == pytest.approx(parts)
    assert row["plain_step_ms"] == pytest.approx(row["linear_plain_ms"] + row["decode_ms"])
