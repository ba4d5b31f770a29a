"""The OpenAI-compatible server with lookahead decoding, end to end.

A real ``api_server`` process (float32, eager, SmolLM2-135M-Instruct) with
lookahead (started as the project card says: ``--speculative-model
"[lookahead]"``, the settings in ``--speculative-config``), then a vanilla
one -- one after the other, never both at once -- answer the same greedy
requests (completions and chat, streamed and not): the texts must be
identical, and the lookahead server's ``/metrics`` must count drafts and
accepted tokens. Bad lookahead settings must stop the server at start-up
with a message naming the setting.
"""

from __future__ import annotations

import time

import pytest

from tests.engine_utils import LOOKAHEAD
from tests.server_utils import (
    SERVED_MODEL_NAME,
    get_metrics,
    run_server_to_exit,
    running_server,
    server_args,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

#: (endpoint, input, max_tokens, stream)
REQUESTS = [
    ("completions", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", 64, False),
    ("completions", "The three largest cities in France are", 24, False),
    ("completions", "import numpy as np\n\ndef softmax(x):\n", 48, True),
    ("chat", "Write a haiku about the sea.", 40, False),
    ("chat", "Explain what a hash table is in two sentences.", 80, False),
    ("chat", "List the planets of the solar system, one per line.", 56, True),
]


def _client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", timeout=180, max_retries=0)


def _ask(client, endpoint: str, text: str, max_tokens: int, stream: bool) -> str:
    common = dict(model=SERVED_MODEL_NAME, max_tokens=max_tokens, temperature=0.0, seed=0)
    if endpoint == "completions":
        resp = client.completions.create(prompt=text, stream=stream, **common)
        if stream:
            return "".join(c.choices[0].text for c in resp if c.choices)
        return resp.choices[0].text
    messages = [{"role": "user", "content": text}]
    resp = client.chat.completions.create(messages=messages, stream=stream, **common)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in resp if c.choices)
    return resp.choices[0].message.content


def _serve_and_ask(model, speculative_config, extra=()) -> dict:
    with running_server(server_args(model, speculative_config, extra)) as base_url:
        client = _client(base_url)
        t0 = time.monotonic()
        texts = [_ask(client, *req) for req in REQUESTS]
        return {
            "texts": texts,
            "metrics": get_metrics(base_url, "vllm:"),
            "startup_s": base_url.proc.startup_s,
            "requests_s": time.monotonic() - t0,
        }


@pytest.fixture(scope="module")
def lookahead_run(smollm2_path):
    # The project card's spelling: lookahead chosen by --speculative-model,
    # its settings (N, W, G, ...) in --speculative-config.
    settings = {k: v for k, v in LOOKAHEAD.items() if k != "method"}
    return _serve_and_ask(smollm2_path, settings, ["--speculative-model", "[lookahead]"])


@pytest.fixture(scope="module")
def vanilla_run(smollm2_path, lookahead_run):  # after lookahead: one server at a time
    return _serve_and_ask(smollm2_path, None)


def test_greedy_text_equals_vanilla(lookahead_run, vanilla_run):
    print(
        f"startup: lookahead {lookahead_run['startup_s']:.0f} s, "
        f"vanilla {vanilla_run['startup_s']:.0f} s; requests: lookahead "
        f"{lookahead_run['requests_s']:.1f} s, vanilla {vanilla_run['requests_s']:.1f} s"
    )
    for text in vanilla_run["texts"]:
        assert text and text.strip(), "vanilla server returned an empty answer"
    diffs = [
        (i, req[:2], la, va)
        for i, (req, la, va) in enumerate(zip(REQUESTS, lookahead_run["texts"], vanilla_run["texts"]))
        if la != va
    ]
    assert not diffs, f"lookahead text differs from vanilla: {diffs}"


def test_spec_decode_metrics(lookahead_run, vanilla_run):
    m = lookahead_run["metrics"]
    print({k: v for k, v in m.items() if k.startswith("vllm:spec_decode")})
    assert m.get("vllm:spec_decode_num_drafts_total", 0) > 0, m
    assert m.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, m
    assert m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]
    # Without speculation vLLM counts no drafts.
    assert vanilla_run["metrics"].get("vllm:spec_decode_num_drafts_total", 0) == 0


@pytest.mark.parametrize(
    "config, name",
    [
        ({"method": "lookahead", "ngram_size": 1}, "ngram_size"),
        ({"method": "lookahead", "bogus": 1}, "bogus"),
    ],
    ids=["ngram_size_out_of_range", "unknown_key"],
)
def test_bad_config_fails_at_startup(smollm2_path, config, name):
    result = run_server_to_exit(server_args(smollm2_path, config), timeout=240)
    assert result.returncode is not None, "server with a bad config did not exit"
    assert result.returncode != 0
    assert "LookaheadConfigError" in result.stderr, result.stderr[-3000:]
    assert name in result.stderr, result.stderr[-3000:]
