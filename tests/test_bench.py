"""Tests for benchmarks/bench.py and its modules: the pure parts (no engine
is started)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH_DIR) not in sys.path:  # the suite's modules import each other by name
    sys.path.insert(0, str(BENCH_DIR))

import bench  # noqa: E402
import child  # noqa: E402
import figures  # noqa: E402
import methods  # noqa: E402
import plot  # noqa: E402
import report  # noqa: E402


# --------------------------------------------------------------------------
# Method specs
# --------------------------------------------------------------------------


def test_vanilla_and_ngram_specs() -> None:
    assert methods.parse_method("vanilla") == methods.Method("vanilla", "vanilla", None)
    ngram = methods.parse_method("ngram")
    assert ngram.kind == "ngram"
    assert ngram.spec == {"method": "ngram", "num_speculative_tokens": 4,
                          "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert methods.parse_method("ngram:6").spec["num_speculative_tokens"] == 6
    spec = methods.parse_method("ngram:k=3,max=5,min=3").spec
    assert (spec["num_speculative_tokens"], spec["prompt_lookup_max"],
            spec["prompt_lookup_min"]) == (3, 5, 3)
    # Only max given, below the default min: min follows it.
    assert methods.parse_method("ngram:max=1").spec["prompt_lookup_min"] == 1
    # Any other SpeculativeConfig key passes through.
    assert methods.parse_method("ngram:rejection_sample_method=standard").spec[
        "rejection_sample_method"] == "standard"


def test_lookahead_specs() -> None:
    assert methods.parse_method("la:4,5,5").spec == {
        "method": "lookahead", "ngram_size": 4, "window_size": 5, "guess_set_size": 5,
        "prompt_pool": True,
    }
    assert methods.parse_method("la:4,5,5,nopool").spec["prompt_pool"] is False
    assert methods.parse_method("la:4,5,5,separate").spec["mode"] == "separate"
    assert methods.parse_method("lookahead:5,7,7,fused").spec["mode"] == "fused"
    spec = methods.parse_method(
        "la:4,5,5,mode=separate,max_tree_tokens=64,x=1.5,y=abc,z=false").spec
    assert spec["mode"] == "separate"
    assert spec["max_tree_tokens"] == 64
    assert (spec["x"], spec["y"], spec["z"]) == (1.5, "abc", False)
    assert methods.parse_method("la:3").spec == {"method": "lookahead", "ngram_size": 3,
                                               "prompt_pool": True}
    assert methods.parse_method("la").spec == {"method": "lookahead"}  # plugin defaults
    assert methods.parse_method(" la:4,5,5 ").label == "la:4,5,5"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("foo", "unknown method"),
        ("vanilla:2", "no options"),
        ("la:4,5,5,6", "at most N,W,G"),
        ("la:4,x", "not a number"),
        ("la:4,,5", "empty item"),
        ("la:4,ngram_size=5", "given twice"),
        ("la:4,5,5,nopool,prompt_pool=true", "given twice"),
        ("ngram:3,k=4", "given twice"),
        ("ngram:abc", "expected K"),
        ("la:=3", "empty key"),
    ],
)
def test_bad_method_specs(text: str, message: str) -> None:
    with pytest.raises(methods.MethodSpecError, match=message):
        methods.parse_method(text)


def test_parse_methods_puts_vanilla_first_and_rejects_duplicates() -> None:
    parsed = methods.parse_methods(["la:4,5,5", "ngram", "vanilla", "la:5,7,7"])
    assert [m.label for m in parsed] == ["vanilla", "la:4,5,5", "ngram", "la:5,7,7"]
    with pytest.raises(methods.MethodSpecError, match="twice"):
        methods.parse_methods(["la:4,5,5", "la:4,5,5"])


def test_cli_rejects_bad_method(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(["--methods", "vanilla", "la:1,x"])
    assert info.value.code == 2
    assert "not a number" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Figures: S, acceptance, sources, ratio, matches
# --------------------------------------------------------------------------


def _metrics(accepted=0, drafts=0, draft_tokens=0, steps=0):
    return {figures.M_ACCEPTED: accepted, figures.M_DRAFTS: drafts,
            figures.M_DRAFT_TOKENS: draft_tokens, figures.M_ITERATIONS: steps}


def test_step_compression_from_vllm_counters() -> None:
    raw = {
        "kind": "ngram", "output_tokens": 120, "elapsed_s": 4.0, "cpu_s": 3.9,
        "machine_cpu_s": 5.9,
        "metrics_before": _metrics(10, 5, 20, 100),
        "metrics_after": _metrics(10 + 40, 5 + 20, 20 + 64, 100 + 80),
    }
    fig = figures.section_figures(raw)
    assert fig["tokens_per_s"] == 30.0
    assert fig["accepted_tokens"] == 40
    assert fig["request_steps"] == 80  # 120 tokens - 40 accepted draft tokens
    assert fig["step_compression"] == pytest.approx(1.5)
    assert fig["mean_accepted_len"] == pytest.approx(1 + 40 / 20)
    assert fig["acceptance_rate"] == pytest.approx(40 / 64)
    assert fig["forwards_per_step"] == 1.0
    assert fig["proposer_ms_per_step"] is None
    assert fig["share"] == {"window": None, "prompt": None, "model": None}
    assert fig["cpu_share"] == pytest.approx(3.9 / 4.0)
    assert fig["other_load"] == pytest.approx(0.5)  # 2 s of others' CPU time over 4 s


def test_vanilla_has_no_spec_metrics() -> None:
    raw = {"kind": "vanilla", "output_tokens": 64, "elapsed_s": 2.0,
           "metrics_before": {figures.M_ITERATIONS: 3}, "metrics_after": {figures.M_ITERATIONS: 70}}
    fig = figures.section_figures(raw)
    assert fig["step_compression"] == 1.0
    assert fig["request_steps"] == 64
    assert fig["mean_accepted_len"] is None and fig["acceptance_rate"] is None
    assert fig["engine_steps"] == 67


def test_lookahead_stats_deltas() -> None:
    la_before = {"accepted_by_source": {"window": 5, "prompt": 5, "model": 0},
                 "proposer_time_s": 1.0, "lookahead_passes": 10, "decode_steps": 30,
                 "generated_tokens": 40, "step_compression": 1.33, "pool_ngrams": 7}
    la_after = {"accepted_by_source": {"window": 35, "prompt": 15, "model": 10},
                "proposer_time_s": 1.5, "lookahead_passes": 60, "decode_steps": 80,
                "generated_tokens": 160, "step_compression": 2.0, "pool_ngrams": 50}
    raw = {"kind": "lookahead", "output_tokens": 120, "elapsed_s": 3.0,
           "metrics_before": _metrics(0, 0, 0, 0), "metrics_after": _metrics(60, 30, 80, 50),
           "la_before": la_before, "la_after": la_after}
    fig = figures.section_figures(raw)
    assert fig["step_compression"] == pytest.approx(2.0)  # 120 / (120 - 60)
    assert fig["la_step_compression"] == pytest.approx(120 / 50)
    assert fig["share"] == pytest.approx({"window": 0.6, "prompt": 0.2, "model": 0.2})
    assert fig["proposer_ms_per_step"] == pytest.approx(10.0)  # 0.5 s over 50 engine steps
    assert fig["forwards_per_step"] == pytest.approx(2.0)  # separate mode: a pass per step
    assert fig["tokens_per_forward"] == pytest.approx(1.0)
    deltas = fig["lookahead_deltas"]
    assert deltas["decode_steps"] == 50
    assert "step_compression" not in deltas and "pool_ngrams" not in deltas


def test_lookahead_missing_fields_give_none() -> None:
    raw = {"kind": "lookahead", "output_tokens": 10, "elapsed_s": 1.0,
           "metrics_before": {}, "metrics_after": {},
           "la_before": {"accepted_by_source": {}}, "la_after": {"accepted_by_source": {}}}
    fig = figures.section_figures(raw)
    for key in ("step_compression", "mean_accepted_len", "acceptance_rate",
                "proposer_ms_per_step", "forwards_per_step"):
        assert fig[key] is None, key
    assert fig["share"]["window"] is None
    assert report._fmt("share", fig["share"]) == "-"
    assert report._fmt("forwards_per_step", None) == "-"


def test_ratio_and_match_against_vanilla_of_same_group() -> None:
    def row(method, kind, tps, dataset="humaneval", bs=1, **extra):
        return {"model": "m", "dtype": "bfloat16", "dataset": dataset, "batch_size": bs,
                "method": method, "kind": kind, "tokens_per_s": tps, **extra}

    rows = [row("vanilla", "vanilla", 20.0), row("la", "lookahead", 30.0),
            row("vanilla", "vanilla", 50.0, bs=4), row("la", "lookahead", 40.0, bs=4),
            row("la", "lookahead", 10.0, dataset="mtbench"),
            row("ngram", "ngram", None, error="boom")]
    outputs = {
        figures.row_key(rows[0]): [[1, 2, 3], [4, 5]],
        figures.row_key(rows[1]): [[1, 2, 3], [4, 6, 7]],
        figures.row_key(rows[2]): [[1, 2], [4, 5]],
        figures.row_key(rows[3]): [[1, 2], [4, 5]],
    }
    figures.add_relative_figures(rows, outputs)
    assert rows[0]["ratio"] == 1.0
    assert rows[1]["ratio"] == pytest.approx(1.5)
    assert rows[1]["match"] == [1, 2] and rows[1]["first_diff"] == [None, 1]
    assert rows[3]["ratio"] == pytest.approx(0.8)  # against the bs=4 vanilla
    assert rows[3]["match"] == [2, 2] and rows[3]["first_diff"] is None
    assert rows[4]["ratio"] is None and rows[4]["match"] is None  # no vanilla for mtbench
    assert rows[5]["ratio"] is None


def test_match_helpers() -> None:
    assert figures.match_count([[1], [2]], [[1], [3]]) == (1, 2)
    assert figures.match_count([[1]], [[1], [2]]) is None
    assert figures.first_differences([[1, 2], [1]], [[1, 2, 3], [1]]) == [2, None]


# --------------------------------------------------------------------------
# Table and plot from a fake results file
# --------------------------------------------------------------------------


def _fake_results() -> dict:
    rows = []
    for dataset in ("humaneval", "mtbench"):
        for bs in (1, 4):
            common = {"model": "smollm2", "dtype": "bfloat16", "dataset": dataset,
                      "batch_size": bs, "n_prompts": 8, "max_tokens": 128,
                      "peak_rss_mb": 1700.0, "forwards_per_step": 1.0}
            rows.append({**common, "method": "vanilla", "kind": "vanilla",
                         "tokens_per_s": 20.0 * bs, "ratio": 1.0, "step_compression": 1.0,
                         "share": {"window": None, "prompt": None, "model": None},
                         "match": [8, 8], "other_load": 0.01})
            rows.append({**common, "method": "la:4,5,5", "kind": "lookahead",
                         "tokens_per_s": 26.0 * bs, "ratio": 1.3, "step_compression": 2.4,
                         "mean_accepted_len": 3.1, "acceptance_rate": 0.93,
                         "share": {"window": 0.25, "prompt": 0.25, "model": 0.5},
                         "proposer_ms_per_step": 4.2, "match": [7, 8], "other_load": 0.02})
            rows.append({**common, "method": "ngram", "kind": "ngram",
                         "error": "Traceback ...\nRuntimeError: engine died"})
    meta = {"date": "2026-11-22T04:00:00+00:00", "cpu": "Test CPU", "cpus": 2,
            "vllm": "0.32.0", "args": {"max_tokens": 128}, "wall_s": 61.0}
    return {"meta": meta, "runs": [], "rows": rows}


def test_render_table() -> None:
    text = report.render_table(_fake_results()["rows"])
    assert text.count("== smollm2 bfloat16") == 4
    assert "== smollm2 bfloat16 | mtbench | batch size 4, 8 prompts x 128 tokens" in text
    la_line = next(line for line in text.splitlines() if line.startswith("la:4,5,5"))
    for cell in ("26.0", "1.30", "2.40", "3.10", "93", "25/25/50", "4.2", "1.00", "1700", "7/8"):
        assert cell in la_line.split(), (cell, la_line)
    vanilla_line = next(line for line in text.splitlines() if line.startswith("vanilla"))
    assert vanilla_line.split()[-1] == "ref"
    ngram_line = next(line for line in text.splitlines() if line.startswith("ngram"))
    assert "error" in ngram_line and "RuntimeError: engine died" in ngram_line


def test_noisy_rows_flagged(capsys) -> None:
    results = _fake_results()
    results["rows"][1]["other_load"] = 0.9
    report.report(results, None)
    out = capsys.readouterr().out
    assert "warning: 1 of 12 rows" in out and "la:4,5,5 (0.90 cores)" in out


def test_machine_busy_is_monotonic() -> None:
    first = report.machine_busy_s()
    if first is None:
        pytest.skip("no /proc/stat")
    sum(i * i for i in range(200_000))  # burn a little CPU
    assert report.machine_busy_s() >= first


def test_render_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = plot.render_plot(_fake_results()["rows"], tmp_path / "sub" / "plot.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_from_json_renders_table_and_plot(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    src = tmp_path / "run.json"
    src.write_text(json.dumps(_fake_results()))
    assert bench.main(["--from-json", str(src)]) == 0
    out = capsys.readouterr().out
    assert "Test CPU" in out and "total wall time 1m01s" in out
    assert "la:4,5,5" in out
    assert (tmp_path / "run.png").is_file()
    assert bench.main(["--from-json", str(src), "--plot", str(tmp_path / "other.png")]) == 0
    assert (tmp_path / "other.png").is_file()


def test_machine_info() -> None:
    info = report.machine_info(["bench.py", "--prompts", "2"])
    assert info["command"] == "bench.py --prompts 2"
    assert info["cpus"] >= 1
    for key in ("date", "cpu", "torch", "vllm", "python"):
        assert key in info


def test_fixed_flag_and_arm_share_column():
    assert methods.parse_method("la:4,3,3,fixed").spec["adaptive"] is False
    assert methods.parse_method("la:adaptive").spec == {"method": "lookahead", "adaptive": True}
    assert report._fmt("arm_share", {"tree": 0.5, "pool": 0.25, "off": 0.25}) == "50/25/25"
    assert report._fmt("arm_share", None) == "-"


def test_turns_are_round_robin_and_skip_dead_processes(tmp_path):
    import threading

    (tmp_path / "turn").write_text("0")
    order, lock = [], threading.Lock()

    def worker(k, units):
        turns = child.Turns({"dir": str(tmp_path), "index": k, "count": 4})
        turns.ready()
        for _ in range(units):
            turns.acquire()
            with lock:
                order.append(k)
            turns.release()
        turns.finish()

    (tmp_path / "done.2").touch()  # process 2 died before it was ready
    threads = [threading.Thread(target=worker, args=(k, 3 if k != 1 else 1))
               for k in (0, 1, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    # 0, 1, 3 in turn; once 1 is done, 0 and 3 alternate.
    assert order == [0, 1, 3, 0, 3, 0, 3]


def test_engines_start_one_at_a_time(tmp_path):
    """Lookahead measures its step cost as its engine starts: no other
    engine of the group may load or warm up meanwhile."""
    import threading

    inside, most, lock = [0], [0], threading.Lock()

    def start(k):
        with child.Turns({"dir": str(tmp_path), "index": k, "count": 3}).starting():
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=start, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert most[0] == 1


def test_compile_flag_reaches_the_engine_config_and_the_title() -> None:
    import engines

    method = methods.parse_method("la")
    for argv, eager in (([], True), (["--compile"], False)):
        args = bench.build_parser().parse_args(argv)
        cfg = engines.child_config(args, Path("/m"), "float32", method)
        assert cfg["enforce_eager"] is eager
        assert cfg["spec"] == method.spec and cfg["dtype"] == "float32"
        title = report._plot_title({"args": vars(args)})
        assert title.endswith("compiled" if not eager else "eager")


def test_queue_keeps_the_batch_full_and_returns_outputs_in_order() -> None:
    """``--queue``: never more than ``running`` requests live, a new one
    joins on the step after one finishes, and the outputs come back in the
    prompts' order whatever order the requests finish in."""
    from types import SimpleNamespace

    class FakeEngine:
        def __init__(self, lengths):
            self.lengths = lengths  # prompt -> steps it runs
            self.live: dict[str, list] = {}
            self.max_live = 0
            self.steps = 0

        def add_request(self, request_id, prompt, params):
            internal = request_id + "-x"  # vLLM may rename a request
            self.live[internal] = [prompt, 0]
            self.max_live = max(self.max_live, len(self.live))
            return internal

        def step(self):  # every live request's output so far, as vLLM's
            self.steps += 1
            outs = []
            for rid, st in list(self.live.items()):
                st[1] += 1
                done = st[1] == self.lengths[st[0]]
                if done:
                    del self.live[rid]
                outs.append(SimpleNamespace(
                    request_id=rid, finished=done,
                    outputs=[SimpleNamespace(token_ids=(st[0],) * st[1])]))
            return outs

    lengths = {"a": 5, "b": 1, "c": 1, "d": 1, "e": 2}
    eng = FakeEngine(lengths)
    out = child.generate_queued(eng, list("abcde"), None, 2)
    assert out == [["a"] * 5, ["b"], ["c"], ["d"], ["e"] * 2]
    assert eng.max_live == 2
    # a runs 5 steps; b, c, d, e share the other slot one after another
    # (1+1+1+2); run to the end in batches of 2 they would take 5 + 1 + 2 = 8
    assert eng.steps == 5
    # the steps run with the batch full are counted apart from the drain:
    # a and b, then a and c, then c alone for its last two steps
    full: dict = {}
    out = child.generate_queued(FakeEngine({"a": 2, "b": 1, "c": 4}), list("abc"), None, 2, full)
    assert sum(map(len, out)) == 7
    assert full["steps"] == 2 and full["tokens"] == 4 and full["seconds"] > 0
    # interleaved: the steps run inside the turn (hold), let go after
    # turn_s seconds of steps where a request joins (its step has a prefill,
    # which lookahead's step timer leaves out), the others in flight
    holds, depth = [], [0]

    @contextlib.contextmanager
    def hold():
        assert depth[0] == 0  # never nested
        depth[0] += 1
        holds.append(eng.steps)
        yield
        depth[0] -= 1

    eng = FakeEngine(lengths)
    out = child.generate_queued(eng, list("abcde"), None, 2, hold=hold, turn_s=0.0)
    assert out == [["a"] * 5, ["b"], ["c"], ["d"], ["e"] * 2] and depth[0] == 0
    assert holds == [0, 1, 2, 3]  # c, d, e join after steps 1, 2, 3
    holds.clear()
    eng = FakeEngine(lengths)
    child.generate_queued(eng, list("abcde"), None, 2, hold=hold, turn_s=None)
    assert holds == [0] and depth[0] == 0  # one turn for the whole queue
    args = bench.build_parser().parse_args(["--queue"])
    import engines

    assert engines.child_config(args, Path("/m"), "float32",
                                methods.parse_method("vanilla"))["queue"] is True
    assert "queue" in report._plot_title({"args": vars(args)})
