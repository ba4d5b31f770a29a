"""The parent: one engine process per (model, dtype, method), one after
another or interleaved, with timeouts; their results collected into rows."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from figures import (
    NOISY_OTHER_LOAD,
    add_relative_figures,
    combine_passes,
    pass_label,
    row_key,
    section_figures,
)
from methods import Method
from prompts import _prepare_model, template_schema
from report import _elapsed, _short_error, _write_json_out, machine_info, other_load_now

#: This project's entry in pyproject.toml's [project.entry-points."vllm.general_plugins"].
PLUGIN_NAME = "lookahead"


@dataclass
class RunResult:
    """What one engine process returned, plus how it ended."""

    sections: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Child:
    """A running ``bench.py --child`` process."""

    proc: subprocess.Popen
    tmp: Path
    reader: threading.Thread
    tail: bytearray
    started: float


def _start_child(cfg: dict[str, Any], verbose: bool) -> _Child:
    """Start ``bench.py --child`` for one engine; its stderr (progress bars)
    streams through, its tail is kept for error reports."""
    tmp = Path(tempfile.mkdtemp(prefix="vllm-la-bench-"))
    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Only our vLLM plugin: no other installed general plugin (e.g. a full
    # arctic-inference's, which patches vLLM) may load in an engine.
    env.setdefault("VLLM_PLUGINS", PLUGIN_NAME)
    if cfg.get("checkout"):
        # another version of the plugin, ahead of the installed one
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (cfg["checkout"], env.get("PYTHONPATH")) if p)
    if not verbose:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("PYTHONWARNINGS", "ignore")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    cmd = [sys.executable, str(Path(__file__).resolve().with_name("bench.py")), "--child",
           str(cfg_path), str(tmp / "result.json")]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)
    tail = bytearray()

    def pump() -> None:
        assert proc.stderr is not None
        while chunk := os.read(proc.stderr.fileno(), 4096):
            try:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            tail.extend(chunk)
            del tail[:-8000]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return _Child(proc, tmp, reader, tail, started)


def _kill(child: _Child) -> None:
    try:
        os.killpg(child.proc.pid, signal.SIGKILL)  # the child's own session only
    except ProcessLookupError:
        pass
    child.proc.wait()


def _read_child(child: _Child) -> dict[str, Any]:
    """An ended child's result JSON ({} if none), its folder removed."""
    child.reader.join(timeout=5)
    res_path = child.tmp / "result.json"
    data: dict[str, Any] = {}
    if res_path.exists():
        try:
            data = json.loads(res_path.read_text(encoding="utf-8"))
        except ValueError:
            data = {}
    shutil.rmtree(child.tmp, ignore_errors=True)
    return data


def _engine_result(data: dict[str, Any]) -> RunResult:
    """An engine's sections and other figures from its result JSON (its
    error is the caller's to judge)."""
    return RunResult(sections=data.get("sections", []),
                     info={k: v for k, v in data.items() if k not in ("sections", "error")})


def _finish_child(child: _Child, timed_out: bool, timeout: float | None,
                  data: dict[str, Any] | None = None) -> RunResult:
    """Collect an ended child's result (``timed_out``: it was killed;
    ``data``: its result, already read)."""
    proc = child.proc
    if data is None:
        data = _read_child(child)
    wall = time.perf_counter() - child.started
    res = _engine_result(data)
    res.info["process_wall_s"] = wall
    res.info["returncode"] = proc.returncode
    if hasattr(os, "getloadavg"):
        res.info["load_avg_at_end"] = list(os.getloadavg())
    text_tail = child.tail.decode("utf-8", "replace").replace("\r", "\n")
    # The reason goes last: the table shows an error's last line.
    if timed_out:
        res.error = f"{text_tail[-2000:]}\ntimed out after {timeout:.0f} s"
    elif data.get("error"):
        res.error = data["error"]
    elif proc.returncode != 0:
        res.error = f"{text_tail[-2000:]}\nengine process exited with {proc.returncode}"
    elif not data:
        res.error = "engine process wrote no result"
    return res


def _wait(child: _Child, timeout: float | None) -> bool:
    """Wait for a child process to end; killed (and True) past ``timeout``
    seconds."""
    try:
        child.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(child)
        return True
    except KeyboardInterrupt:
        _kill(child)
        raise
    return False


def _run_child(cfg: dict[str, Any], timeout: float | None, verbose: bool) -> RunResult:
    """One engine process, alone on the machine."""
    child = _start_child(cfg, verbose)
    return _finish_child(child, _wait(child, timeout), timeout)


def _run_interleaved(cfgs: list[dict[str, Any]], timeout: float | None, verbose: bool,
                     total_prompts: int, desc: str) -> list[RunResult]:
    """All engines of one (model, dtype) at once, taking turns batch by
    batch (:class:`Turns`). ``timeout`` applies to the whole group."""
    from tqdm import tqdm

    turn_dir = Path(tempfile.mkdtemp(prefix="vllm-la-turns-"))
    (turn_dir / "turn").write_text("0", encoding="ascii")
    children = []
    for k, cfg in enumerate(cfgs):
        cfg = {**cfg, "turn": {"dir": str(turn_dir), "index": k, "count": len(cfgs)}}
        children.append(_start_child(cfg, verbose))
    bar = tqdm(total=total_prompts * len(cfgs), unit="prompt", desc=desc, file=sys.stderr,
               leave=False, dynamic_ncols=True)
    started = time.perf_counter()
    timed_out = [False] * len(children)
    try:
        while True:
            alive = False
            for k, child in enumerate(children):
                if child.proc.poll() is None:
                    if timeout is not None and time.perf_counter() - started > timeout:
                        timed_out[k] = True
                        _kill(child)
                    else:
                        alive = True
                if child.proc.poll() is not None:
                    (turn_dir / f"done.{k}").touch()  # a dead child's turns pass on
            done = 0
            for k in range(len(children)):
                try:
                    text = (turn_dir / f"progress.{k}").read_text(encoding="ascii")
                    done += sum(int(x) for x in text.split())
                except (OSError, ValueError):
                    pass
            bar.n = done
            bar.refresh()
            if not alive:
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        for child in children:
            _kill(child)
        raise
    finally:
        bar.close()
    results = [_finish_child(c, t, timeout) for c, t in zip(children, timed_out)]
    shutil.rmtree(turn_dir, ignore_errors=True)
    return results


def _run_group(cfgs: list[dict[str, Any]], timeout: float | None,
               verbose: bool) -> list[RunResult]:
    """``--one-process``: all engines of one (model, dtype) in one child
    process, taking turns batch by batch (``child.group_main``). Engines in
    separate processes run at speeds that differ by up to 16% between
    processes of one configuration (an A/A pair, 2-vCPU Xeon); in one
    process that difference is gone. A crash or a timeout costs the whole
    group; peak RSS is the group's."""
    if any(cfg.get("checkout") for cfg in cfgs):
        raise ValueError("--one-process imports one vllm_lookahead: no METHOD@PATH entries")
    child = _start_child({"group": cfgs}, verbose)
    timed_out = _wait(child, timeout)
    data = _read_child(child)
    whole = _finish_child(child, timed_out, timeout, {
        k: v for k, v in data.items() if k != "jobs"})
    jobs = data.get("jobs") or [{} for _ in cfgs]
    results = []
    for job in jobs:
        res = _engine_result(job)
        res.info.update({k: v for k, v in whole.info.items() if k != "peak_rss_mb"})
        res.info["group_peak_rss_mb"] = data.get("peak_rss_mb")
        res.info["one_process"] = True
        res.error = job.get("error") or whole.error
        if not job and not res.error:
            res.error = "engine process wrote no result"
        results.append(res)
    return results


def _rows_for_run(base: dict[str, Any], method: Method, run: RunResult,
                  datasets: Sequence[str], batch_sizes: Sequence[int],
                  outputs: dict[tuple, list[list[int]]]) -> list[dict[str, Any]]:
    rows = []
    by_key = {(s.get("dataset"), s.get("batch_size")): s for s in run.sections}
    for ds in datasets:
        for bs in batch_sizes:
            row: dict[str, Any] = {**base, "dataset": ds, "batch_size": bs,
                                   "method": method.label, "kind": method.kind,
                                   "spec": method.spec}
            section = by_key.get((ds, bs))
            row["peak_rss_mb"] = run.info.get("peak_rss_mb")
            row["engine_start_s"] = run.info.get("engine_start_s")
            if section is None or section.get("error"):
                row["error"] = (section or {}).get("error") or run.error or "no result"
                rows.append(row)
                continue
            row["n_prompts"] = section.get("n_prompts")
            lens = (run.info.get("prompt_tokens") or {}).get(ds)
            if lens:
                row["mean_prompt_tokens"] = sum(lens) / len(lens)
            parts = [(None, section)]
            passes = section.get("passes") or []
            if len(passes) > 1:
                # --repeat: the first pass, and the later ones together
                parts += [(pass_label(1, 1), passes[0]),
                          (pass_label(2, len(passes)), combine_passes(passes[1:]))]
            for label, raw in parts:
                part = dict(row)
                if label is not None:
                    part["pass"] = label
                part.update(section_figures(raw))
                outputs[row_key(part)] = raw.get("outputs") or []
                if label is None and len(passes) > 1:
                    part["passes"] = [
                        {k: v for k, v in section_figures(p).items()
                         if k not in ("lookahead_deltas", "cost_model")}
                        for p in passes]
                rows.append(part)
    return rows


def child_config(args: argparse.Namespace, path: Path | None, dtype: str,
                 method: Method) -> dict[str, Any]:
    """What one engine's child process runs (written to its config JSON)."""
    return {
        "model_path": str(path), "dtype": dtype, "label": method.label,
        "kind": method.kind, "spec": method.spec, "checkout": method.checkout,
        "datasets": args.datasets, "prompts": args.prompts,
        "batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len,
        "kv_cache_bytes": args.kv_cache_mib << 20,
        # vLLM's default is torch.compile; the suite runs eager unless --compile
        "enforce_eager": not args.compile,
        "queue": args.queue,
        "sampling": sampling_settings(args),
        "repeat": getattr(args, "repeat", 1),
        "engine_seed": getattr(args, "engine_seed", 0),
        "structured": bool(getattr(args, "structured", False)),
        "structured_schema": template_schema() if getattr(args, "structured", False) else None,
    }


def sampling_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``--temperature``, ``--top-p``, ``--n``, ``--seed`` (recorded in every
    row and passed to the engines)."""
    return {"temperature": getattr(args, "temperature", 0.0),
            "top_p": getattr(args, "top_p", 1.0),
            "n": getattr(args, "n", 1),
            "seed": getattr(args, "seed", None)}


def run_benchmark(args: argparse.Namespace, methods: list[Method], argv: Sequence[str]) -> dict:
    from tqdm import tqdm

    meta = machine_info(argv)
    meta["args"] = {k: v for k, v in vars(args).items() if k not in ("child", "from_json")}
    busy = other_load_now()
    meta["other_load_at_start"] = busy
    if busy is not None and busy > NOISY_OTHER_LOAD:
        tqdm.write(f"warning: other processes keep {busy:.2f} CPU cores busy; vLLM on CPU "
                   f"is very sensitive to other load, figures may be noisy", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    outputs: dict[tuple, list[list[int]]] = {}
    out_path = Path(args.out)
    started = time.perf_counter()
    total = len(args.models) * len(args.dtypes) * len(methods)
    k = 0
    for model in args.models:
        try:
            path = _prepare_model(model)
            model_error = None
        except Exception as exc:  # missing packages etc.: record, go on
            path, model_error = None, f"{type(exc).__name__}: {exc}"
            tqdm.write(f"error: model {model}: {model_error}", file=sys.stderr)
        for dtype in args.dtypes:
            base = {"model": model, "dtype": dtype, "max_tokens": args.max_tokens,
                    **sampling_settings(args), "repeat": args.repeat,
                    "structured": args.structured}
            cfgs = [child_config(args, path, dtype, method) for method in methods]
            if model_error is not None:
                group = [RunResult(error=model_error) for _ in methods]
            elif getattr(args, "one_process", False):
                k += len(methods)
                tqdm.write(f"== [{k}/{total}] {model} {dtype}: {len(methods)} engines "
                           f"in one process ({_elapsed(time.perf_counter() - started)} "
                           f"so far)", file=sys.stderr)
                group = _run_group(cfgs, args.timeout, args.verbose)
            elif args.interleave and len(methods) > 1:
                k += len(methods)
                tqdm.write(f"== [{k}/{total}] {model} {dtype}: {len(methods)} engines "
                           f"interleaved ({_elapsed(time.perf_counter() - started)} so far)",
                           file=sys.stderr)
                group = _run_interleaved(
                    cfgs, args.timeout, args.verbose,
                    len(args.datasets) * len(args.batch_sizes) * args.prompts * args.repeat,
                    f"{model} {dtype}")
            else:
                group = []
                for method, cfg in zip(methods, cfgs):
                    k += 1
                    tqdm.write(f"== [{k}/{total}] {model} {dtype} {method.label} "
                               f"({_elapsed(time.perf_counter() - started)} so far)",
                               file=sys.stderr)
                    group.append(_run_child(cfg, args.timeout, args.verbose))
            for method, run in zip(methods, group):
                if run.error:
                    tqdm.write(f"   {method.label} failed: {_short_error(run.error, 200)}",
                               file=sys.stderr)
                runs.append({**base, "method": method.label, "kind": method.kind,
                             "spec": method.spec, "error": run.error, **run.info})
                rows.extend(_rows_for_run(base, method, run, args.datasets,
                                          args.batch_sizes, outputs))
            # Checkpoint after every group: a killed run keeps what it has.
            add_relative_figures(rows, outputs)
            meta["wall_s"] = time.perf_counter() - started
            _write_json_out(out_path, {"meta": meta, "runs": runs, "rows": rows})
    meta["wall_s"] = time.perf_counter() - started
    meta["finished"] = _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")
    results = {"meta": meta, "runs": runs, "rows": rows}
    _write_json_out(out_path, results)
    return results
