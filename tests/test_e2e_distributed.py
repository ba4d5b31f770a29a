"""Tensor parallelism with lookahead: TP=2 on this CPU, with vLLM's
multiprocessing executor and with both of its Ray executors (our opt-in CPU fix,
``LOOKAHEAD_RAY_ON_CPU=1``, on a local Ray instance the run starts), against
TP=1 vanilla.

A tiny random Llama (4 heads, 2 KV heads: SmolLM2's 9 heads do not split in
two) on repetitive token-id prompts. Greedy outputs must be identical; every
rank must compute the same drafts and run the same arm at every step (the
tree rows take part in the model's all-reduces, so a disagreement would hang
or corrupt the step), including the planner's timing-driven choices,
which rank 0 broadcasts. Each engine runs in its own process
(``tests/distributed_run.py``): both executors start worker processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_utils import stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

SCRIPT = Path(__file__).with_name("distributed_run.py")
REPO = SCRIPT.parent.parent


#: vLLM's two Ray executors: RayExecutorV2 (the default) and the older
#: RayDistributedExecutor, and the class our fix gives their workers.
RAY_EXECUTORS = {"ray": ("1", "CpuRayWorkerProc"), "ray-v1": ("0", "CpuRayWorkerWrapper")}


def _run(model, spec, tp, backend, tmp_path) -> tuple[dict, str]:
    name = f"{backend}-{tp}-{'la' if spec else 'vanilla'}"
    out, log = tmp_path / f"out-{name}.json", tmp_path / f"log-{name}.txt"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if backend in RAY_EXECUTORS:
        env["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = RAY_EXECUTORS[backend][0]
        backend = "ray"
    # Output to a file, not a pipe: vLLM's worker processes inherit the
    # script's stdout and can outlive its os._exit, so reading a pipe to EOF
    # would wait for them. Their own session lets us kill them all afterwards.
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(model), json.dumps(spec) if spec else "none",
             str(tp), backend, str(out)],
            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=600)
        finally:
            stop_server(proc)  # ends the whole process group, workers included
    text = log.read_text(encoding="utf-8", errors="replace")
    assert rc == 0 and out.exists(), text[-4000:]
    return json.loads(out.read_text()), text


@pytest.fixture(scope="module")
def vanilla_tp1(tiny_model_path, tmp_path_factory):
    return _run(tiny_model_path, None, 1, "none", tmp_path_factory.mktemp("tp"))[0]


@pytest.mark.parametrize("backend,mode", [("mp", "fused"), ("mp", "separate"), ("ray", "fused"),
                                          ("ray-v1", "fused")])
def test_tp2_lookahead_equals_tp1_vanilla(tiny_model_path, tmp_path, vanilla_tp1, backend, mode):
    # The planner on (the default). One case measures the step cost at
    # start-up (every rank must run the same measuring forwards and use rank
    # 0's curve); the Ray cases read a flat curve (tokens free: fused trees
    # run). Separate mode runs the fixed shape, a tree pass every step: its
    # second forward is never free, so the planner rightly skips it on the
    # tiny random model.
    spec = {"method": "lookahead", "mode": mode}
    if (backend, mode) == ("mp", "fused"):
        spec["cost_model"] = "measure"
    elif mode == "separate":
        spec["adaptive"] = False
    else:
        spec["cost_model"] = str(tmp_path / "flat.json")
        Path(spec["cost_model"]).write_text(
            json.dumps({"version": 1, "curve": {"1": [[1, 0.05], [64, 0.05]]}}))
    cost = spec.get("cost_model")
    la, log = _run(tiny_model_path, spec, 2, backend, tmp_path)
    assert la["one"] == vanilla_tp1["one"]
    assert la["batch"] == vanilla_tp1["batch"]
    # Statistics from both ranks: the stats method exists in a worker only if
    # the plugin was loaded there through vLLM's entry point.
    ranks = la["ranks"]
    assert len(ranks) == 2
    same = ("decode_steps", "drafts", "draft_tokens", "accepted_tokens", "arm_steps",
            "shape_steps", "lookahead_passes", "fused_steps", "lookahead_query_tokens",
            "accepted_by_source", "cost_model")
    assert {k: ranks[0][k] for k in same} == {k: ranks[1][k] for k in same}
    assert ranks[0]["accepted_tokens"] > 0
    if cost == "measure":
        assert ranks[0]["cost_model"]["source"] == "measured"
    else:
        assert ranks[0]["arm_steps"]["tree"] > 0
    assert all(r["live_requests"] == 0 for r in ranks)
    if backend in RAY_EXECUTORS:
        # The workers were Ray actors of our CPU worker class.
        assert f"{RAY_EXECUTORS[backend][1]} pid=" in log
        assert "Ray executor enabled on the CPU platform" in log


def test_ray_on_cpu_needs_the_opt_in():
    """Without LOOKAHEAD_RAY_ON_CPU the CPU platform keeps vLLM's answer
    (no Ray), and the fix is reported as not in effect."""
    code = ("import os; os.environ.pop('LOOKAHEAD_RAY_ON_CPU', None)\n"
            "from vllm_lookahead.cpu import ray as ray_cpu\n"
            "from vllm.platforms import current_platform as p\n"
            "print(ray_cpu.enable(), repr(p.ray_device_key))\n"
            "os.environ['LOOKAHEAD_RAY_ON_CPU'] = '1'\n"
            "from vllm.v1.executor import ray_executor_v2 as v2\n"
            "print(ray_cpu.enable(), repr(p.ray_device_key), v2.RayWorkerProc.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["False ''", "True 'vllm_cpu' CpuRayWorkerProc"]
