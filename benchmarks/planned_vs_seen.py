"""How well the planner's expected gains matched what the verifier accepted,
over saved benchmark results.

Every lookahead row of ``bench.py`` records ``planned_gain`` (the draft
tokens the planner expected its unchecked drafts to get accepted, after the
engine's calibration) and ``planned_gain_seen`` (what the verifier
accepted of them). This reads every results JSON given (default: all of
``benchmarks/results/``) and prints, per set (the template set apart from
the others), the distribution of seen / planned over the sampled rows with
at least ``--least`` planned tokens. A ratio above 1 is gain the planner
did not expect (it drafted less than would have paid); below 1 it expected
too much.

    python3 benchmarks/planned_vs_seen.py [FILES ...] [--least 50] [--json OUT]
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path


def ratios(paths: list[str], least: float = 50.0) -> dict[str, list[float]]:
    """Seen / planned per sampled lookahead row of ``paths``, by set
    (``"template"`` and ``"other"``). Files that are not bench.py results
    are skipped."""
    out: dict[str, list[float]] = {"template": [], "other": []}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            continue
        for row in data["rows"]:
            stats = row.get("lookahead_deltas") or {}
            planned, seen = stats.get("planned_gain"), stats.get("planned_gain_seen")
            if not planned or planned < least or not (row.get("temperature") or 0) > 0:
                continue
            out["template" if row.get("dataset") == "template" else "other"].append(seen / planned)
    return out


def summary(values: list[float]) -> dict:
    """Count, quartiles, extremes and rows below 1 of ``values``."""
    v = sorted(values)
    if not v:
        return {"rows": 0}

    def q(p: float) -> float:
        return v[int(p * (len(v) - 1))]

    return {"rows": len(v), "min": v[0], "q25": q(0.25), "median": q(0.5), "q75": q(0.75),
            "max": v[-1], "below_1": sum(x < 1 for x in v)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="results JSON (default: benchmarks/results/*.json)")
    p.add_argument("--least", type=float, default=50.0,
                   help="rows with fewer planned tokens are left out (default 50)")
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    files = args.files or sorted(glob.glob(str(Path(__file__).parent / "results" / "*.json")))
    got = {k: summary(v) for k, v in ratios(files, args.least).items()}
    print(f"{'set':9s} {'rows':>5s} {'min':>5s} {'q25':>5s} {'median':>6s} {'q75':>5s} "
          f"{'max':>5s} {'below 1':>8s}")
    for k, s in got.items():
        if s["rows"]:
            print(f"{k:9s} {s['rows']:5d} {s['min']:5.2f} {s['q25']:5.2f} {s['median']:6.2f} "
                  f"{s['q75']:5.2f} {s['max']:5.2f} {s['below_1']:8d}")
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
