"""End-to-end: the demo's command line on a small setting prints its table
and nothing of vLLM's or the plugin's logs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
LOG_LINE = re.compile(r"\bINFO\b|\bWARNING\b|Warning:|\bDEBUG\b|\bERROR\b")


def test_demo_prints_only_its_bar_and_table(smollm2_path, tmp_path) -> None:
    log, results = tmp_path / "demo.log", tmp_path / "demo.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("VLLM_LOGGING_LEVEL", None)  # vLLM's INFO lines on: they must go to the log
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_lookahead.demo", "--dtype", "float32", "--prompts", "1",
         "--max-tokens", "8", "--log", str(log), "--json", str(results)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stream in (proc.stdout, proc.stderr):
        assert not LOG_LINE.search(stream), stream[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("tokens/s") for line in lines)
    assert any(line.startswith("speedup") for line in lines)
    assert "identical to vanilla: HumanEval 1/1, MT-Bench 1/1" in proc.stdout
    assert lines[-1] == f"log: {log}"
    assert "prompt 2/2 (MT-Bench)" in proc.stderr and "6/6" in proc.stderr  # the bar, finished
    assert "INFO" in log.read_text()  # vLLM's log lines went here
    assert json.loads(results.read_text())["identical"] == 2
