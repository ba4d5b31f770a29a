"""Tests for benchmarks/bench.py and its modules: the pure parts (no engine
is started)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"

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
    assert fig["share"] == {"window": None, "prompt": None, "memory": None, "model": None}
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
    la_before = {"accepted_by_source": {"window": 5, "prompt": 5, "memory": 0, "model": 0},
                 "proposer_time_s": 1.0, "lookahead_passes": 10, "decode_steps": 30,
                 "generated_tokens": 40, "step_compression": 1.33, "pool_ngrams": 7}
    la_after = {"accepted_by_source": {"window": 35, "prompt": 15, "memory": 0, "model": 10},
                "proposer_time_s": 1.5, "lookahead_passes": 60, "decode_steps": 80,
                "generated_tokens": 160, "step_compression": 2.0, "pool_ngrams": 50}
    raw = {"kind": "lookahead", "output_tokens": 120, "elapsed_s": 3.0,
           "metrics_before": _metrics(0, 0, 0, 0), "metrics_after": _metrics(60, 30, 80, 50),
           "la_before": la_before, "la_after": la_after}
    fig = figures.section_figures(raw)
    assert fig["step_compression"] == pytest.approx(2.0)  # 120 / (120 - 60)
    assert fig["la_step_compression"] == pytest.approx(120 / 50)
    assert fig["share"] == pytest.approx({"window": 0.6, "prompt": 0.2, "memory": 0.0,
                                          "model": 0.2})
    assert fig["proposer_ms_per_step"] == pytest.approx(10.0)  # 0.5 s over 50 engine steps
    assert fig["forwards_per_step"] == pytest.approx(2.0)  # separate mode: a pass per step
    assert fig["tokens_per_forward"] == pytest.approx(1.0)
    deltas = fig["lookahead_deltas"]
    assert deltas["decode_steps"] == 50
    assert "drafts_by_kind" not in fig or fig["drafts_by_kind"] == {}
    la_before["drafts_by_kind"] = {"pool": [4, 12, 1]}
    la_after["drafts_by_kind"] = {"pool": [4, 12, 1], "suffix4+": [10, 40, 30]}
    assert figures.section_figures(raw)["drafts_by_kind"] == {"suffix4+": [10, 40, 30]}
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
    for cell in ("26.0", "1.30", "2.40", "3.10", "93", "25/25/0/50", "4.2", "1.00", "1700", "7/8"):
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


# --------------------------------------------------------------------------
# The README's result tables (report.py --readme)
# --------------------------------------------------------------------------


def test_readme_tables_equal_what_report_builds_from_the_kept_results() -> None:
    """The README's tables are report.py's, from the committed files: they
    cannot drift (rebuild with ``python benchmarks/report.py --readme --write``)."""
    readme = (BENCH_DIR.parent / "README.md").read_text(encoding="utf-8")
    assert report.readme_section(readme) == report.readme_tables()
    for _, names in report.README_RESULTS:
        for name in names:
            assert f"(benchmarks/results/{name}.json)" in readme


def test_readme_tables_from_a_results_file(tmp_path: Path) -> None:
    results = _fake_results()
    results["meta"]["git_commit"] = "0123456789abcdef"
    for row in results["rows"]:
        row.update(temperature=0.8, top_p=0.95, n=4, seed=None)
        if row["method"] == "la:4,5,5":
            row["method"] = "la"  # the README's lookahead column: the defaults' entry
    results["rows"].append({**results["rows"][1], "pass": "1", "ratio": 9.0})  # --repeat
    (tmp_path / "run.json").write_text(json.dumps(results))
    text = report.readme_tables(tmp_path, [("Test CPU", ["run"])])
    lines = text.splitlines()
    assert lines[0] == report.README_HEADER and lines[1].count("---") == 10
    link = "[0123456](benchmarks/results/run.json)"
    # batch 1 before batch 4, HumanEval before MT-Bench; ngram failed, no suffix row
    assert lines[2:6] == [
        f"| Test CPU | SmolLM2-135M | bf16 | {bs} x 4 samples | {ds} (8) | T 0.8, top-p 0.95 "
        f"| 1.30 (2.40) | - | - | {link} |"
        for bs, ds in ((1, "HumanEval"), (1, "MT-Bench"), (4, "HumanEval"), (4, "MT-Bench"))]
    assert lines[6:] == [""] and text.endswith(" |\n\n")  # a blank line after the table


def test_readme_sampling_text() -> None:
    assert report._readme_sampling({"temperature": 0.0}) == "greedy"
    assert report._readme_sampling({"temperature": 0.8, "top_p": 0.95, "seed": 3,
                                    "structured": True, "repeat": 2}) == \
        "T 0.8, top-p 0.95, seeded, JSON schema, asked 2x"


def test_write_readme_rewrites_only_between_the_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{report.BEGIN}\nstale\n{report.END}\ntail\n")
    assert report.write_readme(readme) is True
    text = readme.read_text()
    assert text.startswith(f"head\n{report.BEGIN}\n") and text.endswith(f"{report.END}\ntail\n")
    assert report.readme_section(text) == report.readme_tables()
    assert report.write_readme(readme) is False
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="results:begin"):
        report.write_readme(readme)


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


def test_a_turn_waits_for_the_previous_engines_spin(tmp_path, monkeypatch):
    """A turn handed on by another process starts timing settle_s after it
    was passed (that engine's OpenMP threads still spin); one a process
    passes to itself (the others done) does not wait."""
    monkeypatch.setenv("KMP_BLOCKTIME", "100")
    assert child.Turns.settle_s() == pytest.approx(0.15)
    monkeypatch.setenv("KMP_BLOCKTIME", "infinite")
    assert child.Turns.settle_s() == pytest.approx(0.25)
    monkeypatch.setenv("KMP_BLOCKTIME", "100")
    (tmp_path / "turn").write_text("0")
    a = child.Turns({"dir": str(tmp_path), "index": 0, "count": 2})
    b = child.Turns({"dir": str(tmp_path), "index": 1, "count": 2})
    a.ready(), b.ready()
    a.acquire()
    a.release()
    t0 = time.monotonic()
    b.acquire()
    assert time.monotonic() - t0 >= 0.14
    b.finish()
    t0 = time.monotonic()
    a.acquire()  # passed on by 1 as it finished: still 1's spin
    assert time.monotonic() - t0 >= 0.14
    a.release()  # 1 is done: the turn comes back to 0 itself
    t0 = time.monotonic()
    a.acquire()
    assert time.monotonic() - t0 < 0.1


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


# --------------------------------------------------------------------------
# Issue 21: suffix decoding, shared memory flags, sampling, --repeat,
# the template set and --structured
# --------------------------------------------------------------------------


def test_suffix_specs() -> None:
    assert methods.parse_method("suffix") == methods.Method(
        "suffix", "suffix", {"method": "suffix"})  # vLLM's defaults
    assert methods.parse_method("suffix:8").spec == {"method": "suffix",
                                                    "num_speculative_tokens": 8}
    assert methods.parse_method("suffix:nomem").spec == {
        "method": "suffix", "suffix_decoding_max_cached_requests": 0}
    assert methods.parse_method("suffix:nocache").spec[
        "suffix_decoding_max_cached_requests"] == 0
    spec = methods.parse_method("suffix:k=8,depth=32,cached=100,factor=2.5,prob=0.2").spec
    assert spec == {"method": "suffix", "num_speculative_tokens": 8,
                    "suffix_decoding_max_tree_depth": 32,
                    "suffix_decoding_max_cached_requests": 100,
                    "suffix_decoding_max_spec_factor": 2.5,
                    "suffix_decoding_min_token_prob": 0.2}
    spec = methods.parse_method("suffix:12,max_tree_depth=16,min_token_prob=0.3").spec
    assert spec == {"method": "suffix", "num_speculative_tokens": 12,
                    "suffix_decoding_max_tree_depth": 16,
                    "suffix_decoding_min_token_prob": 0.3}
    # full SpeculativeConfig keys pass through
    assert methods.parse_method("suffix:suffix_decoding_max_tree_depth=8").spec[
        "suffix_decoding_max_tree_depth"] == 8
    parsed = methods.parse_methods(["suffix", "la", "vanilla", "suffix:nomem"])
    assert [m.label for m in parsed] == ["vanilla", "suffix", "la", "suffix:nomem"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("suffix:abc", "expected K"),
        ("suffix:4,8", "expected K"),
        ("suffix:8,k=4", "given twice"),
        ("suffix:depth=8,max_tree_depth=9", "given twice"),
        ("suffix:nomem,nocache", "given twice"),
        ("suffix:nomem,cached=5", "given twice"),
        ("suffix:4,,5", "empty item"),
        ("suffixx", "unknown method"),
    ],
)
def test_bad_suffix_specs(text: str, message: str) -> None:
    with pytest.raises(methods.MethodSpecError, match=message):
        methods.parse_method(text)


def test_shared_memory_flags() -> None:
    assert methods.parse_method("la:mem").spec == {"method": "lookahead",
                                                  "shared_memory": True}
    assert methods.parse_method("la:4,5,5,nomem").spec == {
        "method": "lookahead", "ngram_size": 4, "window_size": 5, "guess_set_size": 5,
        "prompt_pool": True, "shared_memory": False}
    with pytest.raises(methods.MethodSpecError, match="given twice"):
        methods.parse_method("la:mem,nomem")
    with pytest.raises(methods.MethodSpecError, match="given twice"):
        methods.parse_method("la:nomem,shared_memory=true")
    assert methods.parse_method("la:noparent").spec == {"method": "lookahead",
                                                       "parent_latency": False}
    assert methods.parse_method("la:parent").spec == {"method": "lookahead",
                                                     "parent_latency": True}


def test_unavailable_suffix_is_skipped_with_a_line(capsys) -> None:
    parsed = methods.parse_methods(["vanilla", "suffix", "suffix:nomem", "ngram"])
    kept = bench.drop_unavailable_suffix(parsed, reason=lambda: "ModuleNotFoundError: x")
    assert [m.label for m in kept] == ["vanilla", "ngram"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "skipping suffix suffix:nomem" in err and "setup_suffix.sh" in err
    assert bench.drop_unavailable_suffix(parsed, reason=lambda: None) == parsed
    # no suffix entry: availability is not even asked
    plain = methods.parse_methods(["vanilla", "ngram"])
    assert bench.drop_unavailable_suffix(plain, reason=lambda: 1 / 0) == plain
    assert methods.suffix_unavailable() is None or isinstance(methods.suffix_unavailable(), str)


def test_defaults_vanilla_ngram_suffix_and_lookahead_on_qwen_coder_taking_turns() -> None:
    args = bench.build_parser().parse_args([])
    assert args.models == ["qwen-coder"]
    assert args.interleave and not args.one_process
    assert [m.kind for m in methods.parse_methods(args.methods)] == [
        "vanilla", "ngram", "suffix", "lookahead"]


def test_bench_and_demo_scripts_are_valid_bash() -> None:
    import subprocess

    for name in ("bench.sh", "demo.sh", "cpu_env.sh", "setup.sh"):
        script = BENCH_DIR.parent / "scripts" / name
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, name
    # bench.sh prepares the default model itself, with the tools' command line
    assert "-m vllm_lookahead.tools qwen-coder" in (
        BENCH_DIR.parent / "scripts" / "bench.sh").read_text()


def test_sampling_defaults_are_greedy_single_unseeded() -> None:
    args = bench.build_parser().parse_args([])
    assert (args.temperature, args.top_p, args.n, args.seed, args.repeat, args.structured) == (
        0.0, 1.0, 1, None, 1, False)
    assert args.datasets == ["humaneval", "mtbench"]  # template only when asked
    assert bench.check_sampling_args(args) is None
    import engines

    cfg = engines.child_config(args, Path("/m"), "bfloat16", methods.parse_method("vanilla"))
    assert cfg["sampling"] == {"temperature": 0.0, "top_p": 1.0, "n": 1, "seed": None}
    assert cfg["repeat"] == 1 and cfg["structured"] is False
    assert cfg["structured_schema"] is None
    # the child's request: as before (greedy, max_tokens only)
    assert child.sampling_kwargs(cfg, 5) == {"temperature": 0.0, "max_tokens": 128}
    assert child.structured_for(cfg, "template") is None


def test_sampling_options_reach_the_requests() -> None:
    import engines

    args = bench.build_parser().parse_args(
        ["--temperature", "0.8", "--top-p", "0.95", "--n", "3", "--seed", "10",
         "--repeat", "2", "--datasets", "template", "--structured", "--max-tokens", "16"])
    assert bench.check_sampling_args(args) is None
    cfg = engines.child_config(args, Path("/m"), "bfloat16", methods.parse_method("suffix"))
    assert cfg["sampling"] == {"temperature": 0.8, "top_p": 0.95, "n": 3, "seed": 10}
    assert cfg["repeat"] == 2 and cfg["structured"] is True
    assert child.sampling_kwargs(cfg, 0) == {"temperature": 0.8, "top_p": 0.95, "n": 3,
                                             "seed": 10, "max_tokens": 16}
    # seed = base + n * prompt index: the n samples (seed+0..n-1) never overlap
    assert [child.sampling_kwargs(cfg, i)["seed"] for i in range(3)] == [10, 13, 16]
    assert child.structured_for(cfg, "template") == cfg["structured_schema"]
    assert child.structured_for(cfg, "mtbench") is None
    title = report._plot_title({"args": vars(args)})
    assert "T 0.8, top-p 0.95, n 3, seed 10, repeat 2, structured JSON, 16 new tokens" in title
    assert cfg["engine_seed"] == 0
    args = bench.build_parser().parse_args(["--engine-seed", "7"])
    cfg = engines.child_config(args, Path("/m"), "bfloat16", methods.parse_method("la"))
    assert cfg["engine_seed"] == 7


def test_combine_takes_geometric_means_over_runs(tmp_path, capsys) -> None:
    import combine

    def run(seed, ratios, tokens):
        rows = []
        for ds in ("humaneval", "mtbench"):
            for m, r in ratios.items():
                rows.append({"model": "smollm2", "dtype": "bfloat16", "dataset": ds,
                             "batch_size": 1, "temperature": 0.8, "top_p": 0.95, "n": 4,
                             "seed": None, "repeat": 1, "structured": False, "method": m,
                             "ratio": r, "step_compression": 1.0 + (r > 1),
                             "output_tokens": tokens})
        rows.append({**rows[-1], "method": "broken", "ratio": None, "error": "boom"})
        return {"meta": {"args": {"engine_seed": seed}}, "rows": rows}

    files = []
    for seed, (r, tok) in enumerate([(0.5, 900), (2.0, 1000)]):
        f = tmp_path / f"s{seed}.json"
        f.write_text(json.dumps(run(seed, {"vanilla": 1.0, "la": r}, tok)))
        files.append(str(f))
    out = tmp_path / "c.json"
    assert combine.main(files + ["--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dataset"], r["method"]) for r in rows] == [
        ("humaneval", "vanilla"), ("humaneval", "la"), ("mtbench", "vanilla"), ("mtbench", "la")]
    la = rows[1]
    assert la["runs"] == 2 and la["engine_seeds"] == [0, 1]
    assert la["ratio"] == pytest.approx(1.0)  # sqrt(0.5 * 2)
    assert la["ratio_se"] == pytest.approx(math.log(4) / math.sqrt(2) / math.sqrt(2))
    assert la["output_tokens"] == 950 and la["step_compression"] == 1.5
    assert "la " in capsys.readouterr().out
    # --repeat rows (all passes, pass 1, pass 2) stay apart
    res = run(0, {"vanilla": 1.0, "la": 1.5}, 900)
    res["rows"] = [dict(r, **{"pass": p}) for r in res["rows"] if r.get("ratio")
                   for p in (None, "1", "2")]
    assert len(combine.combine([res, res])) == 12


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "-0.1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in"),
        (["--top-p", "1.5"], "--top-p must be in"),
        (["--n", "0"], "--n must be >= 1"),
        (["--n", "2"], "needs --temperature > 0"),
        (["--temperature", "0.5", "--seed", "-1"], "--seed must be >= 0"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--structured"], "add --datasets template"),
        (["--structured", "--datasets", "mtbench"], "add --datasets template"),
    ],
)
def test_cli_rejects_bad_sampling_options(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(["--methods", "vanilla", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_template_prompts_are_real_and_all_different() -> None:
    import prompts
    from vllm_lookahead.tools import AssetMissingError, load_humaneval, load_mtbench

    try:
        texts = prompts.template_texts(20)
        code, questions = load_humaneval(), load_mtbench()
    except AssetMissingError as exc:
        pytest.skip(f"prompt packages missing: {exc}")
    assert len(texts) == 20 and len(set(texts)) == 20
    head, _, _ = prompts.TEMPLATE_INSTRUCTION.partition("{input}")
    for i, text in enumerate(texts):
        assert text.startswith(head)  # one fixed instruction
        inner = text[len(head):].rsplit("\n>>>", 1)[0]
        source = code if i % 2 == 0 else questions  # one of each in turn
        assert inner == source[i // 2].strip("\n"), i
    for field in prompts.TEMPLATE_FIELDS:
        assert f'"{field}"' in head
    # past MT-Bench's 80 questions HumanEval fills in: all 244 different
    everything = prompts.template_texts(300)
    assert len(everything) == len(code) + len(questions) == len(set(everything))


def test_template_schema_is_a_valid_json_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import prompts

    schema = prompts.template_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert json.loads(prompts.template_schema_json()) == schema
    assert 4 <= len(schema["required"]) <= 6
    good = {"topic": "lists", "kind": "code", "language": "Python", "difficulty": "easy",
            "summary": "Check whether two numbers are close."}
    jsonschema.validate(good, schema)
    for bad in ({k: v for k, v in good.items() if k != "summary"},
                {**good, "extra": 1}, {**good, "difficulty": "trivial"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_request_steps_from_vllm_latency_histograms() -> None:
    """Request-steps counted by vLLM's per-step latency histograms: S stays
    right where a request's end cuts off a long draft vLLM had counted as
    accepted."""
    def metrics(accepted, drafts, draft_tokens, steps, ttft, itl):
        return {**_metrics(accepted, drafts, draft_tokens, steps),
                figures.M_TTFT: ttft, figures.M_ITL: itl}

    raw = {"kind": "suffix", "output_tokens": 64, "elapsed_s": 2.0,
           "metrics_before": metrics(0, 0, 0, 0, 0, 0),
           "metrics_after": metrics(56, 19, 83, 27, 2, 25)}
    fig = figures.section_figures(raw)
    assert fig["request_steps"] == 27
    assert fig["step_compression"] == pytest.approx(64 / 27)
    assert fig["accepted_cut"] == 56 - (64 - 27)
    assert fig["forwards_per_step"] == 1.0
    vanilla = {"kind": "vanilla", "output_tokens": 10, "elapsed_s": 1.0,
               "metrics_before": {figures.M_TTFT: 1, figures.M_ITL: 5},
               "metrics_after": {figures.M_TTFT: 2, figures.M_ITL: 14}}
    fig = figures.section_figures(vanilla)
    assert fig["request_steps"] == 10 and fig["step_compression"] == 1.0
    assert fig["accepted_cut"] == 0


def _pass_raw(tokens, accepted, seconds, before, outputs):
    after = {k: v + d for (k, v), d in zip(before.items(), (accepted, 10, 20, 5))}
    return {"kind": "suffix", "output_tokens": tokens, "elapsed_s": seconds, "cpu_s": seconds,
            "machine_cpu_s": seconds, "full_batch": None, "outputs": outputs,
            "metrics_before": before, "metrics_after": after,
            "la_before": None, "la_after": None}


def test_repeat_passes_give_pass_rows_and_per_pass_ratios() -> None:
    import engines

    p1 = _pass_raw(40, 10, 4.0, _metrics(0, 0, 0, 0), [[1, 2], [3]])
    p2 = _pass_raw(40, 20, 2.0, p1["metrics_after"], [[1, 2], [3]])
    p3 = _pass_raw(40, 30, 1.0, p2["metrics_after"], [[1, 2], [4]])
    both = figures.combine_passes([p2, p3])
    assert both["output_tokens"] == 80 and both["elapsed_s"] == 3.0
    assert both["metrics_before"] is p2["metrics_before"]
    assert both["metrics_after"] is p3["metrics_after"]
    assert both["outputs"] == [[1, 2], [3], [1, 2], [4]]
    assert figures.section_figures(both)["accepted_tokens"] == 50
    assert figures.pass_label(1, 1) == "1" and figures.pass_label(2, 5) == "2-5"

    def run(passes, kind):
        section = {"dataset": "template", "batch_size": 1, "n_prompts": 2, "kind": kind,
                   **{k: v for k, v in figures.combine_passes(passes).items() if k != "kind"},
                   "passes": passes}
        return engines.RunResult(sections=[section])

    base = {"model": "m", "dtype": "bfloat16", "max_tokens": 20, "temperature": 0.8,
            "top_p": 1.0, "n": 1, "seed": 3, "repeat": 3, "structured": False}
    outputs: dict = {}
    van = [dict(p, kind="vanilla", metrics_before={}, metrics_after={})
           for p in (p1, p2, p3)]
    van[0]["elapsed_s"] = van[1]["elapsed_s"] = van[2]["elapsed_s"] = 4.0
    rows = engines._rows_for_run(base, methods.parse_method("vanilla"), run(van, "vanilla"),
                                 ["template"], [1], outputs)
    rows += engines._rows_for_run(base, methods.parse_method("suffix"),
                                  run([p1, p2, p3], "suffix"), ["template"], [1], outputs)
    assert [(r["method"], r.get("pass")) for r in rows] == [
        ("vanilla", None), ("vanilla", "1"), ("vanilla", "2-3"),
        ("suffix", None), ("suffix", "1"), ("suffix", "2-3")]
    figures.add_relative_figures(rows, outputs)
    by = {(r["method"], r.get("pass")): r for r in rows}
    assert by[("suffix", None)]["ratio"] == pytest.approx((120 / 7) / (120 / 12))
    assert by[("suffix", "1")]["ratio"] == pytest.approx(1.0)
    assert by[("suffix", "2-3")]["ratio"] == pytest.approx((80 / 3) / (80 / 8))
    assert by[("suffix", "2-3")]["accepted_tokens"] == 50
    assert len(by[("suffix", None)]["passes"]) == 3
    text = report.render_table(rows)
    lines = text.splitlines()
    assert lines[0] == ("== m bfloat16 | template | batch size 1, 2 prompts x 20 tokens"
                        " | T 0.8, seed 3, repeat 3")
    assert [ln.split()[0:2] for ln in lines[2:]] == [
        ["vanilla", "10.0"], ["pass", "1"], ["pass", "2-3"],
        ["suffix", "17.1"], ["pass", "1"], ["pass", "2-3"]]
    assert report.sampling_text({"temperature": 0.0, "n": 1, "repeat": 1}) == "greedy"
    assert report.sampling_text({}) == ""  # results from before these settings


def test_queue_counts_every_sample_of_n() -> None:
    from types import SimpleNamespace

    class FakeEngine:
        """Each request has n samples; a step's outputs carry the samples
        that moved (vLLM's cumulative outputs of parallel sampling)."""

        def __init__(self, n, lengths):
            self.n, self.lengths, self.live = n, lengths, {}

        def add_request(self, request_id, prompt, params):
            self.live[request_id] = [prompt, [0] * self.n]
            return request_id

        def step(self):
            outs = []
            for rid, (prompt, done) in list(self.live.items()):
                moved = []
                for k in range(self.n):
                    if done[k] < self.lengths[prompt] + k:
                        done[k] += 1
                        moved.append(SimpleNamespace(index=k, token_ids=[prompt] * done[k]))
                finished = all(d == self.lengths[prompt] + k for k, d in enumerate(done))
                if finished:
                    del self.live[rid]
                outs.append(SimpleNamespace(request_id=rid, finished=finished, outputs=moved))
            return outs

    full: dict = {}
    out = child.generate_queued(FakeEngine(2, {"a": 2, "b": 1}), ["a", "b"], [None, None],
                                2, full)
    assert out == [["a"] * 2, ["a"] * 3, ["b"], ["b"] * 2]  # prompt-major, by sample index
    # both requests live for two steps: 2 + 2 tokens, then 2 + 1 (b ends);
    # a's last sample token comes in the drain
    assert full["tokens"] == 7 and full["steps"] == 2


def test_engines_keep_other_vllm_plugins_out() -> None:
    import tomllib

    import engines

    data = tomllib.loads((BENCH_DIR.parent / "pyproject.toml").read_text())
    assert engines.PLUGIN_NAME in data["project"]["entry-points"]["vllm.general_plugins"]


def test_setup_suffix_script_is_valid_bash() -> None:
    import subprocess

    script = BENCH_DIR.parent / "scripts" / "setup_suffix.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "arctic-inference==" in text and "--no-deps" in text
    assert "dist-info" in text  # never installs arctic-inference's own metadata / plugin


def test_cpu_env_never_ends_a_strict_script(tmp_path) -> None:
    """``scripts/cpu_env.sh`` is sourced by the demo and the benchmark under
    ``set -euo pipefail``: its ``ldconfig | awk`` must read to the end (an
    awk that exits at the first match ended ldconfig with SIGPIPE and the
    script with it, about 4% of runs here). Sourced 200 times in one strict
    shell: every time it comes back, and the preload it sets is the same."""
    import subprocess

    env_sh = BENCH_DIR.parent / "scripts" / "cpu_env.sh"
    script = (f'set -euo pipefail; VENV="{tmp_path}"; first=""\n'
              f'for i in $(seq 200); do unset LD_PRELOAD; source "{env_sh}"\n'
              '  [ -z "$first" ] && first="${LD_PRELOAD:-none}"\n'
              '  [ "${LD_PRELOAD:-none}" = "$first" ] || exit 3; done; echo "ok $first"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ok "), (out.returncode, out.stderr)


def test_method_from_another_checkout(tmp_path) -> None:
    """``...@PATH``: the engine imports vllm_lookahead from PATH (another
    checkout), to compare two versions interleaved; the spec is the
    method's without the suffix."""
    import engines

    pkg = tmp_path / "old" / "vllm_lookahead"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    m = methods.parse_method(f"la:4,5,5,nopool@{tmp_path / 'old'}")
    assert m.kind == "lookahead" and m.checkout == str((tmp_path / "old").resolve())
    assert m.spec == methods.parse_method("la:4,5,5,nopool").spec
    assert methods.parse_method("la:4,5,5").checkout is None
    with pytest.raises(methods.MethodSpecError, match="no vllm_lookahead"):
        methods.parse_method(f"la@{tmp_path}")
    with pytest.raises(methods.MethodSpecError, match="without a folder"):
        methods.parse_method("la@")
    args = bench.build_parser().parse_args([])
    assert engines.child_config(args, Path("/m"), "float32", m)["checkout"] == m.checkout
    # both versions in one run: the labels differ
    assert len(methods.parse_methods(["la", f"la@{tmp_path / 'old'}"])) == 2


# --------------------------------------------------------------------------
# --one-process: the engines of a group in one process; A/A copies (#TAG)
# --------------------------------------------------------------------------

def test_a_tagged_method_is_another_engine_of_the_same_configuration() -> None:
    copy = methods.parse_method("vanilla#2")
    assert (copy.label, copy.kind, copy.spec) == ("vanilla#2", "vanilla", None)
    assert methods.parse_method("la:4,5,5,nomem#b").spec == \
        methods.parse_method("la:4,5,5,nomem").spec
    for bad in ("vanilla#", "#2", "vanilla# "):
        with pytest.raises(methods.MethodSpecError, match="'#' needs"):
            methods.parse_method(bad)
    # the untagged vanilla is listed first (the reference), whatever the order given
    assert [m.label for m in methods.parse_methods(["la", "vanilla#2", "vanilla"])] == \
        ["vanilla", "vanilla#2", "la"]


def test_the_reference_is_the_first_vanilla_row() -> None:
    base = dict(model="m", dtype="d", dataset="x", batch_size=1)
    rows = [dict(base, method="vanilla", kind="vanilla", tokens_per_s=10.0),
            dict(base, method="vanilla#2", kind="vanilla", tokens_per_s=11.0),
            dict(base, method="la", kind="lookahead", tokens_per_s=12.0)]
    outputs = {figures.row_key(rows[0]): [[1, 2]], figures.row_key(rows[1]): [[1, 3]],
               figures.row_key(rows[2]): [[1, 2]]}
    figures.add_relative_figures(rows, outputs)
    assert [r["ratio"] for r in rows] == pytest.approx([1.0, 1.1, 1.2])
    assert [r["reference"] for r in rows] == [True, False, False]
    assert rows[1]["match"] == [0, 1] and rows[2]["match"] == [1, 1]
    table = report.render_table(rows)
    copy_line = next(line for line in table.splitlines() if line.startswith("vanilla#2"))
    assert copy_line.split()[-1] == "0/1"  # compared with the reference, not "ref"


def test_one_process_takes_no_other_checkout(tmp_path, capsys) -> None:
    pkg = tmp_path / "old" / "vllm_lookahead"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    with pytest.raises(SystemExit):
        bench.main(["--one-process", "--methods", "vanilla", f"la@{tmp_path / 'old'}"])
    assert "--one-process imports one vllm_lookahead" in capsys.readouterr().err
    assert "engines in one process" in report._plot_title(
        {"args": vars(bench.build_parser().parse_args(["--one-process"]))})


def test_queued_turns_yield_where_the_turn_passes() -> None:
    """The queue as a generator: one yield per turn passed on (a request
    joining after turn_s), the outputs its return value."""
    from types import SimpleNamespace

    class OneStepEngine:  # every request finishes on the step after it joins
        def __init__(self):
            self.live = []

        def add_request(self, request_id, prompt, params):
            self.live.append((request_id, prompt))
            return request_id

        def step(self):
            outs = [SimpleNamespace(request_id=r, finished=True,
                                    outputs=[SimpleNamespace(token_ids=[p])])
                    for r, p in self.live]
            self.live = []
            return outs

    work = child.queued_turns(OneStepEngine(), list("abcd"), None, 1,
                              hold=contextlib.nullcontext, turn_s=0.0)
    turns = 0
    while True:
        try:
            next(work)
            turns += 1
        except StopIteration as stop:
            assert stop.value == [["a"], ["b"], ["c"], ["d"]]
            break
    assert turns == 3  # b, c and d each joined on a new turn
    assert child.generate_queued(OneStepEngine(), list("ab"), None, 1, hold=contextlib.nullcontext,
                                 turn_s=0.0) == [["a"], ["b"]]


def test_engines_in_one_process_take_turns_round_robin(tmp_path, monkeypatch) -> None:
    """group_main: engines built one after another, then one turn each in
    order; an engine that fails to start or breaks mid-way is reported and
    the others go on; each turn runs between its engine's enter and leave."""
    log = []

    def start(self):
        log.append(("start", self.cfg["label"]))
        if self.cfg["label"] == "broken":
            raise RuntimeError("no engine")
        self.llm = object()

    def work(self):
        for turn in range(self.cfg["turns"]):
            if self.cfg["label"] == "dies" and turn == 1:
                raise RuntimeError("mid-way")
            log.append(("turn", self.cfg["label"], turn))
            self.result["sections"].append(turn)
            yield

    class Isolation:
        def started(self, job):
            log.append(("started", job.cfg["label"]))

        def enter(self, job):
            log.append(("enter", job.cfg["label"]))

        def leave(self, job):
            log.append(("leave", job.cfg["label"]))

    monkeypatch.setattr(child.EngineJob, "start", start)
    monkeypatch.setattr(child.EngineJob, "work", work)
    monkeypatch.setattr(child, "EngineIsolation", Isolation)
    cfgs = [dict(label=label, turns=turns, datasets=["x"], batch_sizes=[1], prompts=turns)
            for label, turns in (("a", 2), ("broken", 2), ("dies", 3), ("b", 3))]
    result = child.group_main(cfgs, tmp_path / "result.json")
    assert [e for e in log if e[0] in ("start", "started")] == [
        ("start", "a"), ("started", "a"), ("start", "broken"), ("start", "dies"),
        ("started", "dies"), ("start", "b"), ("started", "b")]
    turns = [e[1:] for e in log if e[0] == "turn"]
    assert turns == [("a", 0), ("dies", 0), ("b", 0), ("a", 1), ("b", 1), ("b", 2)]
    for k, entry in enumerate(log):  # every turn inside its engine's enter/leave
        if entry[0] == "turn":
            assert log[k - 1] == ("enter", entry[1]) and log[k + 1] == ("leave", entry[1])
    jobs = result["jobs"]
    assert result["error"] is None and jobs[0]["sections"] == [0, 1]
    assert "no engine" in jobs[1]["error"] and "mid-way" in jobs[2]["error"]
    assert jobs[3]["error"] is None and jobs[3]["sections"] == [0, 1, 2]


# --------------------------------------------------------------------------
# step_breakdown.py (pure parts)
# --------------------------------------------------------------------------

def _steps(batch, drafting, draft_tokens, ms, n):
    return [dict(batch=batch, drafting=drafting, draft_tokens=draft_tokens, prepare=0.0005,
                 forward=ms * 0.6e-3, sampler=ms * 0.3e-3, **{"proposer+": ms * 0.1e-3},
                 step=ms * 1e-3) for _ in range(n)]


def test_step_breakdown_groups_and_fits_what_a_draft_adds():
    import step_breakdown as sb

    # 30 ms plain; each drafting request adds 5 ms and each draft token 1 ms
    steps = (_steps(4, 0, 0, 30.0, 20) + _steps(4, 1, 2, 37.0, 6) + _steps(4, 1, 4, 39.0, 6)
             + _steps(4, 2, 4, 44.0, 4) + _steps(4, 4, 8, 58.0, 2) + _steps(2, 0, 0, 25.0, 3))
    got = sb.summarize(steps)
    assert list(got["groups"]) == ["2/0", "4/0", "4/1", "4/2", "4/3+"]
    g = got["groups"]["4/1"]
    assert g["steps"] == 12 and g["draft_tokens"] == 3.0
    assert g["ms"]["step"] == pytest.approx(38.0) and g["ms"]["forward"] == pytest.approx(22.8)
    fit = got["fit"]
    assert fit["batch"] == 4 and fit["steps"] == 38
    assert fit["ms"] == pytest.approx([30.0, 5.0, 1.0], abs=1e-6)
    # two stalled steps move no median, so not the fit either
    stalled = sb.summarize(steps + _steps(4, 0, 0, 500.0, 2))["fit"]
    assert stalled["ms"] == pytest.approx([30.0, 5.0, 1.0], abs=1e-6)
    # no draft at all: nothing to fit
    assert sb.summarize(_steps(4, 0, 0, 30.0, 20))["fit"] is None
    assert sb.summarize([]) == {"groups": {}, "fit": None}
    # steps with lookahead trees are a group of their own, out of the fit
    trees = [dict(s, tree_tokens=13) for s in _steps(4, 1, 2, 90.0, 5)]
    got = sb.summarize(steps + trees)
    assert got["groups"]["4/1t"]["steps"] == 5 and got["groups"]["4/1"]["steps"] == 12
    assert got["fit"]["steps"] == 38 and got["fit"]["ms"] == pytest.approx([30.0, 5.0, 1.0], abs=1e-6)
    # each part fitted apart: where a draft's cost lands
    parts = sb.summarize(steps)["fit"]["parts_ms"]
    assert parts["forward"] == pytest.approx([18.0, 3.0, 0.6], abs=1e-6)
    assert parts["sampler"] == pytest.approx([9.0, 1.5, 0.3], abs=1e-6)
    assert parts["other"] == pytest.approx([-0.5, 0.0, 0.0], abs=1e-6)
    # a method that drafts at every step leaves its no-draft steps to the
    # stalls (the first step of each generate call): left out, not fitted
    drafting = [s for s in steps if s["batch"] == 4 and s["drafting"]]
    got = sb.summarize(drafting + _steps(4, 0, 0, 380.0, 3))
    assert got["groups"]["4/0"]["steps"] == 3
    assert got["fit"]["steps"] == len(drafting)
    assert got["fit"]["ms"] == pytest.approx([30.0, 5.0, 1.0], abs=1e-6)


def test_step_breakdown_methods():
    import step_breakdown as sb

    assert sb.spec_of("vanilla") is None
    assert sb.spec_of("ngram")["method"] == "ngram"
    assert sb.spec_of("la") == {"method": "lookahead"}
    assert sb.spec_of("la:parent") == methods.parse_method("la:parent").spec  # bench.py's entries
    with pytest.raises(SystemExit, match="bench.py's only"):
        sb.spec_of(f"la@{BENCH_DIR.parent}")  # a checkout that exists
    assert sb.spec_of('{"method": "lookahead", "parent_latency": true}')["parent_latency"] is True
    with pytest.raises(SystemExit, match="not vanilla"):
        sb.spec_of('{"ngram_size": 4}')
    with pytest.raises(SystemExit, match="lookahed"):
        sb.spec_of("lookahed")


# --------------------------------------------------------------------------
# replay_drafts.py (no engine: the replay of given samples)
# --------------------------------------------------------------------------
def test_replay_scores_the_matching_prefix():
    import replay_drafts

    assert replay_drafts.accepted_len([5, 6, 7], [5, 6, 9, 7]) == 2
    assert replay_drafts.accepted_len([5], [4]) == 0
    assert replay_drafts.accepted_len([], [1, 2]) == 0


def test_replay_lookahead_memory_drafts_an_earlier_requests_text():
    """A second request repeats the first one's answer: with the shared
    memory it drafts the earlier text; without, its own text (which never
    repeats here) gives nothing. Siblings in lockstep with the same text do
    not help each other: a place is indexed once ``delay`` tokens follow
    it, and a sibling never has them before the asking sample."""
    import replay_drafts

    prompt = list(range(1000, 1030))
    text = list(range(2000, 2040))  # no repeats: own-text lookups find nothing
    again = [{"prompt": prompt, "samples": [text]}, {"prompt": prompt, "samples": [text]}]
    own = replay_drafts.replay(again, replay_drafts.LookaheadDrafter(False))
    shared = replay_drafts.replay(again, replay_drafts.LookaheadDrafter(True))
    assert own["positions"] == shared["positions"] == 2 * (len(text) - 1)
    assert own["accepted"] == 0
    # the repeat drafts 4 tokens (N) of the first answer at every position
    assert shared["accepted"] >= len(text) - 8
    assert 0 < shared["rate"] <= 1.0
    lockstep = [{"prompt": prompt, "samples": [text, list(text)]}]
    assert replay_drafts.replay(lockstep, replay_drafts.LookaheadDrafter(True))["accepted"] == 0


def test_decode_moves_each_sample_by_its_accepted_draft_plus_one():
    """``--steps``: a sample moves on by the accepted prefix plus the
    verifier's token, so an oracle drafting K tokens takes about K + 1
    tokens a step, and nothing drafted one token a step; the first token
    (the prefill's) never drafts."""
    import replay_drafts

    text = list(range(2000, 2021))  # 21 tokens

    class Oracle:
        def __init__(self, k):
            self.k = k

        def start(self, rid, prompt):
            self.n = len(prompt)

        def feed(self, rid, token):
            pass

        def draft(self, rid, seen):
            at = len(seen) - self.n
            return text[at: at + self.k]

        def stop(self, rid):
            pass

    items = [{"prompt": [1, 2, 3], "samples": [text]}]
    none = replay_drafts.decode(items, Oracle(0))
    assert none["steps"] == none["tokens"] == len(text) and none["S"] == 1.0
    four = replay_drafts.decode(items, Oracle(4))
    # 1 (prefill) + 4 steps of 5 tokens
    assert four["tokens"] == len(text) and four["steps"] == 5
    assert four["accepted"] == 16 and four["drafted"] == 4
    assert four["S"] == pytest.approx(len(text) / 5)


def test_replay_counts_lookahead_drafts_by_kind():
    """The repeat's drafts come from the memory's 12-token key, one place
    each (the first answer): ``memory12``, first tokens right; the kind
    table prints them."""
    import replay_drafts

    prompt = list(range(1000, 1030))
    text = list(range(2000, 2040))
    again = [{"prompt": prompt, "samples": [text]}, {"prompt": prompt, "samples": [text]}]
    r = replay_drafts.replay(again, replay_drafts.LookaheadDrafter(True))
    kinds = r["by_kind"]
    assert sum(k["drafts"] for k in kinds.values()) == r["drafted"]
    assert kinds["memory12"]["drafts"] >= len(text) - 16 and kinds["memory12"]["first"] == 1.0
    table = replay_drafts._kind_table({"set": {"lookahead": r}})
    assert "memory12" in table and table.count("\n") == len(kinds)
    # a drafter without kinds (suffix's) gives none
    assert "by_kind" not in replay_drafts.replay(
        [{"prompt": prompt, "samples": [text]}], type("D", (), {
            "start": lambda *a: None, "feed": lambda *a: None, "stop": lambda *a: None,
            "draft": lambda self, rid, t: [1]})())


def test_replay_suffix_drafter_when_installed():
    import replay_drafts

    pytest.importorskip("arctic_inference.suffix_decoding")
    prompt = list(range(1000, 1030))
    text = list(range(2000, 2040))
    items = [{"prompt": prompt, "samples": [text]}, {"prompt": prompt, "samples": [text]}]
    r = replay_drafts.replay(items, replay_drafts.SuffixDrafter(4))
    # the second request repeats the first, which the global tree holds
    assert r["accepted"] >= len(text) - 8


# ---------------------------------------------------------------------------
# proposer_profile.py (no engine: the timers and what they wrap)

def test_proposer_profile_timers_count_and_pass_through():
    import types

    import proposer_profile

    def double(x):
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    owner, importer = types.SimpleNamespace(f=double), types.SimpleNamespace(f=double)
    timers = proposer_profile.Timers()
    timers.wrap(owner, "f", "double", also=(importer,))
    assert owner.f(3) == 6 and importer.f(4) == 8
    with pytest.raises(ValueError, match="negative"):
        owner.f(-1)
    assert timers.calls["double"] == 3 and timers.seconds["double"] > 0
    timers.clear()
    assert not timers.calls and not timers.seconds


def test_proposer_profile_parts_are_the_packages():
    """Every part it times exists, and each module listed as importing a
    function by name holds that same function (else its calls go untimed)."""
    import proposer_profile

    got = proposer_profile.targets()
    assert len(got) == len(proposer_profile.PARTS)
    assert len({label for _, _, label, _ in got}) == len(got)
    for owner, name, _, also in got:
        assert callable(getattr(owner, name))
        for module in also:
            assert getattr(module, name) is getattr(owner, name), (module.__name__, name)


# proposer_profile.py --record and planner_replay.py (no engine)
def _recorded_plans(tmp_path, monkeypatch):
    """Plans of a synthetic planner recorded as proposer_profile --record
    records them (a few steps of varied requests, explore on), the file's
    path."""
    import random

    import proposer_profile
    import vllm_lookahead.planner.planner as planner_mod
    from vllm_lookahead.planner.acceptance import AcceptancePrior, RequestAcceptance
    from vllm_lookahead.planner.cost_model import CostCurve, CostModel

    monkeypatch.setattr(planner_mod.Planner, "plan", planner_mod.Planner.plan)  # restored after
    recorder = proposer_profile.Recorder()
    recorder.install()
    curve = CostCurve({b: [(t, 0.02 * (1 + 0.01 * (b * t - 1))) for t in (1, 2, 4, 8, 16, 32)]
                       for b in (1, 2, 4, 8)},
                      {"sampled": {1: (0.0004, 0.0003, 0.0), 8: (0.0005, 0.0003, 0.0, 0.001)}})
    planner = planner_mod.Planner(CostModel(curve))
    rng = random.Random(5)
    prior = AcceptancePrior(max_cands=3)
    for step in range(12):
        views = []
        for _ in range(rng.randint(1, 6)):
            acc = RequestAcceptance(prior)
            for kind in acc.unchecked:
                acc.unchecked[kind].hits = rng.uniform(0, 8)
            acc.tree_cands = [rng.uniform(0.2, 2.5) for _ in range(3)]
            acc.checked.hits = rng.uniform(0, 20)
            views.append(planner_mod.RequestView(
                acc=acc, ngram_size=4, window_size=3, guess_set_size=rng.randint(0, 3),
                room=4, chain=rng.choice([0, 0, 3]), unchecked=rng.randint(0, 4),
                verify=(0.0004, 0.0003), switch=0.001 * (step % 2)))
        planner.plan(views, explore=True)
    path = tmp_path / "plans.pkl"
    recorder.save(str(path))
    assert len(recorder.calls) == 12
    return path


def test_planner_replay_gets_the_recorded_answers(tmp_path, monkeypatch, capsys):
    import planner_replay

    path = _recorded_plans(tmp_path, monkeypatch)
    out = planner_replay.replay(planner_replay.load(str(path)), repeat=2)
    assert out["calls"] == 12 and out["mismatches"] == [] and out["seconds"] > 0
    assert planner_replay.main([str(path), "--repeat", "1"]) == 0
    assert "12 same, 0 different" in capsys.readouterr().out


def test_planner_replay_finds_a_changed_plan(tmp_path, monkeypatch, capsys):
    """A planner that answers otherwise is caught (the check can fail)."""
    import planner_replay
    import vllm_lookahead.planner.planner as planner_mod

    path = _recorded_plans(tmp_path, monkeypatch)
    plan = planner_mod.Planner.plan
    monkeypatch.setattr(planner_mod.Planner, "plan",
                        lambda self, views, *a, **k: [planner_mod.OFF] * len(views)
                        if len(views) > 3 else plan(self, views, *a, **k))
    out = planner_replay.replay(planner_replay.load(str(path)))
    assert out["mismatches"]
    assert planner_replay.main([str(path), "--repeat", "1"]) == 1
    assert "different (first: call" in capsys.readouterr().out


def test_step_fit_recovers_a_draft_price_and_differencing_drops_a_drift():
    """step_fit.py on synthetic booked steps: q and r as set, with a step
    cost that grows within each prompt (the context) and a draft count
    that grows with it, which the plain fit takes for the drafts' price
    and the differenced and per-prompt fits do not."""
    import random

    import step_fit

    rng = random.Random(5)
    rows = []
    for p in range(8):
        for s in range(60):
            m = min(16, rng.randint(0, 4) + s // 10)  # drafts more as the prompt goes on
            v = m + rng.randint(0, m)
            ms = 60 + 0.5 * s + 0.5 * v + 1.0 * m + rng.gauss(0, 1.0)
            rows.append({"prompt": p, "step": s, "batch": 16, "tokens": 1 + v / 16,
                         "seconds": ms / 1e3, "tree": False, "drafting": m,
                         "verify_least": None})
    got = step_fit.fits(rows, 16)
    for name in ("+step", "+prompt", "diff"):
        assert got[name]["q"] == pytest.approx(0.5, abs=0.15), name
        assert got[name]["r"] == pytest.approx(1.0, abs=0.25), name
        assert got[name]["se_q+r"] < 0.2
    assert got["plain"]["q+r"] > 1.5 + 0.3  # the drift read as a draft's price
    assert step_fit.fits(rows, 8) == {}  # no step of that bucket


def test_planned_vs_seen_reads_sampled_lookahead_rows(tmp_path):
    import planned_vs_seen

    def row(ds, planned, seen, t=0.8):
        return {"dataset": ds, "temperature": t,
                "lookahead_deltas": {"planned_gain": planned, "planned_gain_seen": seen}}

    good = tmp_path / "a.json"
    good.write_text(json.dumps({"rows": [
        row("template", 100, 120), row("template", 200, 180), row("humaneval", 100, 105),
        row("mtbench", 10, 30),  # too few planned tokens: left out
        row("mtbench", 100, 300, t=0.0),  # greedy: left out
        {"dataset": "mtbench", "method": "vanilla"}]}))
    (tmp_path / "b.json").write_text("[1, 2]")  # not a results file
    (tmp_path / "c.json").write_text("{not json")
    got = planned_vs_seen.ratios([str(p) for p in sorted(tmp_path.iterdir())])
    assert sorted(got["template"]) == [0.9, 1.2] and got["other"] == [1.05]
    s = planned_vs_seen.summary(got["template"])
    assert s["rows"] == 2 and s["below_1"] == 1 and s["min"] == 0.9 and s["max"] == 1.2
    assert planned_vs_seen.summary([]) == {"rows": 0}
    out = tmp_path / "s.json"
    planned_vs_seen.main([str(good), "--json", str(out)])
    assert json.loads(out.read_text())["other"]["median"] == 1.05
