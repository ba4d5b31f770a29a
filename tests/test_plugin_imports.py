"""The vLLM plugin loads only the runtime package, never the tooling.

vLLM calls :func:`vllm_lookahead.plugin.register` in every process it starts
(entry point group ``vllm.general_plugins``: ``vllm.plugins`` loads the entry
point and calls it with no arguments, needing no vLLM state). Whatever that
imports is paid for in every engine, worker and API server process, so the
offline tooling (:mod:`vllm_lookahead.tools`, :mod:`vllm_lookahead.demo`,
``gguf``) and the benchmark suite must stay out of it.

The check runs in a fresh interpreter: this test process has usually imported
those modules already. It imports vLLM, so it takes a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Modules (and their submodules) the plugin must not import.
FORBIDDEN = ("vllm_lookahead.tools", "vllm_lookahead.demo", "gguf", "benchmarks")

# Runs in the child: import the plugin and register it the way vLLM's plugin
# loader does (``plugin.load()()``), then report what got imported. Modules
# of the benchmark suite are imported by bare name (``bench``, ``methods``,
# ...; tests/conftest.py puts benchmarks/ on sys.path), so they are found
# by file location as well as by name.
CHILD = """
import json, sys
from pathlib import Path

from vllm_lookahead import plugin

plugin.register()
bench_dir = Path(sys.argv[1]).resolve()
from_benchmarks = []
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if path and Path(path).resolve().is_relative_to(bench_dir):
        from_benchmarks.append(name)
print(json.dumps({
    "modules": sorted(sys.modules),
    "from_benchmarks": sorted(from_benchmarks),
    "supported": plugin.is_supported(plugin.vllm_version()),
}))
"""


def _is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_register_does_not_import_tooling() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO / "benchmarks")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    modules = set(report["modules"])

    offending = sorted(
        {m for m in modules if any(_is_under(m, f) for f in FORBIDDEN)}
        | set(report["from_benchmarks"])
    )
    assert not offending, f"register() imported tooling modules: {offending}"

    # Not vacuous: the plugin really ran (and applied its patches when the
    # installed vLLM is supported; otherwise register() only installs a guard).
    expected = {"vllm_lookahead.plugin"}
    if report["supported"]:
        expected.add("vllm_lookahead.patches")
    assert expected <= modules, f"not loaded: {sorted(expected - modules)}"
