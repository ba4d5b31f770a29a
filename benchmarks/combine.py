"""Combine several benchmark runs: per row, the geometric mean of the ratio
to vanilla over the runs, its standard error, and the runs' step compression
and output tokens.

One interleaved run compares the methods on the same prompts, but with
sampling each method draws its own samples: their lengths differ (a sample
that ends early leaves its batch smaller, and a ratio of tokens per second
moves with it), and with one engine seed every run draws the same ones
again. Runs with different ``--engine-seed`` average that out::

    for s in 1 2 3 4 5; do
        bash scripts/bench.sh ... --engine-seed $s --out runs/seed$s.json
    done
    .venv/bin/python benchmarks/combine.py runs/seed*.json [--json combined.json]

Rows are matched by model, dtype, dataset, batch size, sampling, pass
(``--repeat``) and method;
a row missing from a run (an error) is left out of that run's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: What makes two runs' rows the same row.
ROW_KEY = ("model", "dtype", "dataset", "batch_size", "temperature", "top_p", "n", "seed",
           "repeat", "structured", "pass", "method")


def _key(row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in ROW_KEY)


def geometric(values: Sequence[float]) -> tuple[float, float]:
    """Geometric mean of positive ``values`` and its standard error (from
    the logs' spread; 0 for one value)."""
    logs = [math.log(v) for v in values]
    mean = math.exp(statistics.fmean(logs))
    if len(logs) < 2:
        return mean, 0.0
    return mean, mean * statistics.stdev(logs) / math.sqrt(len(logs))


def combine(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One combined row per row key, in the order first seen: ``ratio`` and
    ``ratio_se`` (geometric), ``step_compression`` and ``output_tokens``
    (arithmetic means), ``runs`` (how many runs had the row), the runs'
    ratios and engine seeds."""
    rows: dict[tuple, dict[str, Any]] = {}
    for res in results:
        seed = ((res.get("meta") or {}).get("args") or {}).get("engine_seed", 0)
        for r in res.get("rows", []):
            if r.get("ratio") is None or r.get("error"):
                continue
            c = rows.setdefault(_key(r), {**{k: r.get(k) for k in ROW_KEY},
                                          "ratios": [], "S": [], "tokens": [], "engine_seeds": []})
            c["ratios"].append(float(r["ratio"]))
            c["S"].append(float(r.get("step_compression") or 1.0))
            c["tokens"].append(int(r.get("output_tokens") or 0))
            c["engine_seeds"].append(seed)
    out = []
    # grouped by everything but the method (the groups and methods in the
    # order first seen)
    groups: dict[tuple, list] = {}
    for key, c in rows.items():
        groups.setdefault(key[:-1], []).append(c)
    for c in (c for g in groups.values() for c in g):
        ratio, se = geometric(c["ratios"])
        out.append({**c, "runs": len(c["ratios"]), "ratio": ratio, "ratio_se": se,
                    "step_compression": statistics.fmean(c["S"]),
                    "output_tokens": statistics.fmean(c["tokens"])})
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = []
    group = None
    for r in rows:
        g = tuple(r[k] for k in ROW_KEY[:-1])
        if g != group:
            group = g
            lines.append("")
            part = f" | pass {r['pass']}" if r.get("pass") else ""
            lines.append(f"== {r['model']} {r['dtype']} | {r['dataset']} | batch {r['batch_size']}"
                         f" | n {r['n'] or 1} | T {r['temperature'] or 0:g}{part}")
            lines.append(f"{'method':<16} {'runs':>4} {'ratio':>6} {'+-se':>6} {'S':>6}"
                         f" {'tokens':>7}  ratios")
        lines.append(f"{r['method']:<16} {r['runs']:>4} {r['ratio']:>6.3f} {r['ratio_se']:>6.3f}"
                     f" {r['step_compression']:>6.2f} {r['output_tokens']:>7.0f}  "
                     + " ".join(f"{x:.2f}" for x in r["ratios"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="result JSON files of bench.py")
    p.add_argument("--json", default=None, help="write the combined rows here")
    args = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in args.results]
    rows = combine(results)
    if not rows:
        print("no rows with a ratio in these files", file=sys.stderr)
        return 1
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"files": list(args.results), "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
