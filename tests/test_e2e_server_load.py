"""The OpenAI server with lookahead under concurrent load, bad requests and
clients that hang up (issue 4), end to end.

One lookahead server (``vllm-lookahead serve``, float32, eager, SmolLM2, real
HumanEval and MT-Bench prompts) gets 36 requests at once through the
``openai`` client: completions and chat, streamed and not, greedy and sampled,
``n=2``, stop strings, per-request lookahead settings, varied ``max_tokens``.
Then clients that disconnect mid-stream and malformed requests; after them the
server must still answer exactly and hold no lookahead state. A vanilla
server (started after the lookahead one is stopped: one at a time) answers
the same greedy requests: texts must be identical.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.engine_utils import LOOKAHEAD
from tests.server_utils import SERVED_MODEL_NAME, get_metrics, running_server, server_args

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

N_REQUESTS = 36
#: Lets the test read the workers' lookahead statistics through vLLM's
#: ``POST /collective_rpc`` (a development endpoint; loopback only here).
DEV_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def _requests_spec():
    """(kind, endpoint, text, max_tokens, stream, extra) per request."""
    from vllm_lookahead.tools import load_humaneval, load_mtbench

    code = load_humaneval(12)
    chat = load_mtbench(12)
    specs = []
    for i in range(N_REQUESTS):
        max_tokens = (16, 24, 32, 48)[i % 4]
        text_c, text_m = code[i % len(code)], chat[i % len(chat)]
        kind = i % 6
        if kind == 0:
            specs.append(("greedy", "completions", text_c, max_tokens, False, {}))
        elif kind == 1:
            specs.append(("greedy", "completions", text_c, max_tokens, True, {}))
        elif kind == 2:
            specs.append(("greedy", "chat", text_m, max_tokens, False, {}))
        elif kind == 3:
            specs.append(("greedy", "chat", text_m, max_tokens, True,
                          {"stop": ["\n\n", "."]}))
        elif kind == 4:
            # Per-request settings through vLLM's vllm_xargs (flat keys).
            xargs = ({"lookahead_window_size": 1, "lookahead_guess_set_size": 2}
                     if i % 12 == 4 else {"lookahead_enabled": False})
            specs.append(("greedy", "completions", text_c, max_tokens, False,
                          {"vllm_xargs": xargs, "stop": ["\ndef "]}))
        else:
            specs.append(("sampled", "chat" if i % 12 == 5 else "completions",
                          text_m if i % 12 == 5 else text_c, max_tokens, False,
                          {"n": 2, "temperature": 0.8, "top_p": 0.95}))
    return specs


def _client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", timeout=900, max_retries=0)


def _ask(client, spec, seed: int):
    kind, endpoint, text, max_tokens, stream, extra = spec
    extra = dict(extra)
    common = dict(model=SERVED_MODEL_NAME, max_tokens=max_tokens, seed=seed,
                  temperature=extra.pop("temperature", 0.0))
    body = {}
    if "vllm_xargs" in extra:
        body["vllm_xargs"] = extra.pop("vllm_xargs")
    common.update(extra)
    if endpoint == "completions":
        resp = client.completions.create(prompt=text, stream=stream, extra_body=body, **common)
        if stream:
            return ["".join(c.choices[0].text for c in resp if c.choices)]
        return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    messages = [{"role": "user", "content": text}]
    resp = client.chat.completions.create(messages=messages, stream=stream, extra_body=body,
                                          **common)
    if stream:
        return ["".join(c.choices[0].delta.content or "" for c in resp if c.choices)]
    return [c.message.content for c in sorted(resp.choices, key=lambda c: c.index)]


def _ask_all(base_url, specs):
    client = _client(base_url)
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = [pool.submit(_ask, client, spec, 1000 + i) for i, spec in enumerate(specs)]
        return [f.result() for f in futures]


def _lookahead_stats(base_url) -> dict:
    r = requests.post(f"{base_url}/collective_rpc", json={"method": "lookahead_stats"},
                      timeout=60)
    r.raise_for_status()
    found = [x for x in r.json()["results"] if x]
    assert found, r.text
    return found[0]


def _hang_up_mid_stream(base_url, text: str) -> int:
    """Start a streamed completion, read a few chunks, drop the connection.
    Returns the number of chunks read."""
    body = {"model": SERVED_MODEL_NAME, "prompt": text, "max_tokens": 200,
            "temperature": 0.0, "stream": True}
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True,
                       timeout=300) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                n += 1
                if n >= 3:
                    break
    return n  # leaving the block closes the socket mid-stream


BAD_REQUESTS = [
    # (what, endpoint path, body changes, text expected in the error)
    ("bad per-request lookahead", "completions",
     {"vllm_xargs": {"lookahead_ngram_size": 99}}, "ngram_size"),
    ("unknown per-request lookahead key", "completions",
     {"vllm_xargs": {"lookahead_bogus": 1}}, "bogus"),
    ("absurd max_tokens", "completions", {"max_tokens": 10**9}, "max"),
    ("empty prompt", "completions", {"prompt": ""}, ""),
    ("empty chat", "chat/completions", {"messages": []}, ""),
    ("not JSON", "completions", None, ""),
]


def _bad_request(base_url, endpoint: str, change, text: str):
    url = f"{base_url}/v1/{endpoint}"
    if change is None:
        return requests.post(url, data=b"{not json", timeout=60,
                             headers={"Content-Type": "application/json"})
    body = {"model": SERVED_MODEL_NAME, "max_tokens": 8, "temperature": 0.0}
    if endpoint == "completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    body.update(change)
    return requests.post(url, data=json.dumps(body), timeout=120,
                         headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def specs():
    return _requests_spec()


@pytest.fixture(scope="module")
def lookahead_server_run(smollm2_path, specs):
    out = {}
    with running_server(server_args(smollm2_path, LOOKAHEAD), env=DEV_ENV) as base_url:
        before = get_metrics(base_url, "vllm:spec_decode")
        t0 = time.monotonic()
        out["answers"] = _ask_all(base_url, specs)
        out["load_s"] = time.monotonic() - t0
        out["metrics_before"], out["metrics_after"] = before, get_metrics(
            base_url, "vllm:spec_decode")
        out["stats_after_load"] = _lookahead_stats(base_url)

        # Clients that hang up mid-stream, while others are being served.
        code = specs[0][2]
        with ThreadPoolExecutor(max_workers=6) as pool:
            hangups = [pool.submit(_hang_up_mid_stream, base_url, code) for _ in range(4)]
            normal = [pool.submit(_ask, _client(base_url), specs[i], 1000 + i) for i in (0, 2)]
            out["hangup_chunks"] = [f.result() for f in hangups]
            out["during_hangups"] = [f.result() for f in normal]
        out["bad"] = [(what, _bad_request(base_url, ep, change, code))
                      for what, ep, change, _ in BAD_REQUESTS]
        # Still serving, exactly.
        out["after"] = [_ask(_client(base_url), specs[i], 1000 + i) for i in (0, 2, 3)]
        time.sleep(2)  # aborts of the hung-up streams reach the workers
        out["stats_end"] = _lookahead_stats(base_url)
        out["health"] = requests.get(f"{base_url}/health", timeout=10).status_code
    return out


@pytest.fixture(scope="module")
def vanilla_answers(smollm2_path, specs, lookahead_server_run):  # one server at a time
    greedy = [s for s in specs if s[0] == "greedy"]
    with running_server(server_args(smollm2_path, None)) as base_url:
        answers = _ask_all(base_url, greedy)
    return dict(zip([i for i, s in enumerate(specs) if s[0] == "greedy"], answers))


def test_concurrent_greedy_answers_equal_vanilla(lookahead_server_run, vanilla_answers, specs):
    print(f"{N_REQUESTS} concurrent requests in {lookahead_server_run['load_s']:.0f} s")
    answers = lookahead_server_run["answers"]
    diffs = [(i, specs[i][:2], answers[i], v) for i, v in vanilla_answers.items()
             if answers[i] != v]
    assert not diffs, f"greedy answers differ from vanilla: {diffs[:3]}"
    # Without stop strings every answer has text (with them it may be empty).
    assert all(v[0] for i, v in vanilla_answers.items() if "stop" not in specs[i][5])


def test_sampled_and_n2_requests_complete(lookahead_server_run, specs):
    for spec, answer in zip(specs, lookahead_server_run["answers"]):
        if spec[0] == "sampled":
            assert len(answer) == 2 and all(isinstance(t, str) and t for t in answer), answer
    # each seeded n=2 request's samples were priced in a step of 2: their n
    # crossed from the API server's frontend to the engine's workers
    sampled = sum(spec[0] == "sampled" for spec in specs)
    priced = lookahead_server_run["stats_after_load"]["seeded_by_batch"]
    assert priced.get("2", 0) >= 2 * sampled, priced


def test_spec_decode_metrics_move_under_load(lookahead_server_run):
    before, after = lookahead_server_run["metrics_before"], lookahead_server_run["metrics_after"]
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert after.get(name, 0) > before.get(name, 0), (name, before, after)
    st = lookahead_server_run["stats_after_load"]
    assert st["accepted_tokens"] > 0 and st["fused_steps"] > 0


def test_hung_up_clients_and_bad_requests_do_not_hurt(lookahead_server_run, vanilla_answers,
                                                     specs):
    run = lookahead_server_run
    assert all(n == 3 for n in run["hangup_chunks"])
    # Requests served next to the hang-ups, and after the bad requests, are exact.
    assert run["during_hangups"] == [vanilla_answers[0], vanilla_answers[2]]
    assert run["after"] == [vanilla_answers[0], vanilla_answers[2], vanilla_answers[3]]
    for (what, resp), (_, _, _, text) in zip(run["bad"], BAD_REQUESTS):
        assert 400 <= resp.status_code < 500, (what, resp.status_code, resp.text[:500])
        assert text in resp.text, (what, resp.text[:500])
    assert run["health"] == 200


def test_no_lookahead_state_left(lookahead_server_run):
    st = lookahead_server_run["stats_end"]
    assert st["live_requests"] == 0, st
    assert st["pool_ngrams"] == 0, st
