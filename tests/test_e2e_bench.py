"""End-to-end: ``bench.py --one-process`` builds its engines in one process
and keeps what they would otherwise share apart (their vLLM metrics and
their random streams)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def test_engines_in_one_process_keep_their_own_metrics_and_random_streams(
        smollm2_path, tmp_path) -> None:
    """Sampled, unseeded: an A/A copy of vanilla (``vanilla#2``) in the same
    process draws exactly what the first vanilla draws (each engine gets its
    own random stream back for its turns; shared, the copy would draw where
    the other engines left the stream). Each engine's rows read its own
    vLLM counters: vanilla's request-steps are its output tokens (one token
    a step), while the registry would otherwise hold only the last engine's
    (``ngram``'s)."""
    out = tmp_path / "one.json"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--one-process", "--datasets", "mtbench",
         "--prompts", "2", "--max-tokens", "24", "--batch-sizes", "1",
         "--temperature", "1.0", "--methods", "vanilla", "ngram:4,min=1", "vanilla#2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert all(run.get("one_process") for run in results["runs"])
    rows = {row["method"]: row for row in results["rows"]}
    assert set(rows) == {"vanilla", "vanilla#2", "ngram:4,min=1"}
    assert not any(row.get("error") for row in rows.values())
    copy = rows["vanilla#2"]
    assert copy["reference"] is False and rows["vanilla"]["reference"] is True
    assert copy["match"] == [2, 2], copy.get("first_diff")
    for label in ("vanilla", "vanilla#2"):
        row = rows[label]
        assert row["output_tokens"] > 0
        assert row["request_steps"] == row["output_tokens"]
        assert not row.get("drafts")
    ngram = rows["ngram:4,min=1"]
    assert ngram["drafts"] > 0  # so a vanilla row reading ngram's counters would show drafts
