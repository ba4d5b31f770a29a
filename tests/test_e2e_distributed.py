"""Tensor parallelism with lookahead: TP=2 on this CPU, with vLLM's
multiprocessing executor, against TP=1 vanilla.

A tiny random Llama (4 heads, 2 KV heads: SmolLM2's 9 heads do not split in
two) on repetitive token-id prompts. Greedy outputs must be identical; every
rank must compute the same drafts and run the same arm at every step (the
tree rows take part in the model's all-reduces, so a disagreement would hang
or corrupt the step), including the planner's timing-driven choices,
which rank 0 broadcasts. Each engine runs in its own process
(``tests/distributed_run.py``): the executor starts worker processes.
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


def _run(model, spec, tp, backend, tmp_path) -> tuple[dict, str]:
    name = f"{backend}-{tp}-{'la' if spec else 'vanilla'}"
    out, log = tmp_path / f"out-{name}.json", tmp_path / f"log-{name}.txt"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
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


@pytest.mark.parametrize("backend,mode", [("mp", "fused"), ("mp", "separate")])
def test_tp2_lookahead_equals_tp1_vanilla(tiny_model_path, tmp_path, vanilla_tp1, backend, mode):
    # The planner on (the default). One case measures the step cost at
    # start-up (every rank must run the same measuring forwards and use rank
    # 0's curve). Separate mode runs the fixed shape, a tree pass every step: its
    # second forward is never free, so the planner rightly skips it on the
    # tiny random model.
    spec = {"method": "lookahead", "mode": mode}
    if mode == "fused":
        spec["cost_model"] = "measure"
    else:
        spec["adaptive"] = False
    cost = spec.get("cost_model")
    la, _ = _run(tiny_model_path, spec, 2, backend, tmp_path)
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
