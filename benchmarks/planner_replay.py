"""Replays recorded :meth:`Planner.plan` calls: the same answers, and how long.

``proposer_profile.py --record PATH`` pickles every planning call of a real
engine run (the planner, its request views and arguments before the call;
its shapes and exploration counters after). This runs each call again on a
fresh copy, checks that it returns the same shapes and leaves the same
counters (a change that should not move a plan, such as a faster search,
is checked on real steps this way), and times the calls (no engine, so the
caches are warm: faster than between the model's forwards, but the same
for two versions of the code compared on one machine).

    .venv/bin/python benchmarks/proposer_profile.py --dataset mtbench --n 16 \\
        --prompts 3 --record /tmp/plans.pkl
    .venv/bin/python benchmarks/planner_replay.py /tmp/plans.pkl [--repeat 5]

Exits 1 if any call's answer differs.
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def load(path: str) -> dict:
    return pickle.loads(Path(path).read_bytes())


def replay(record: dict, repeat: int = 1) -> dict:
    """Runs every recorded call ``repeat`` times (a fresh copy each time).
    Returns ``{"calls", "mismatches": [index, ...], "seconds"}`` (the
    seconds of the plan calls alone, summed over the repeats)."""
    counters = record["counters"]
    mismatches: list[int] = []
    seconds = 0.0
    for i, (before, shapes, after) in enumerate(record["calls"]):
        for rep in range(repeat):
            planner, a, k = pickle.loads(before)
            t = time.perf_counter()
            got = planner.plan(*a, **k)
            seconds += time.perf_counter() - t
            if rep == 0:
                same = (tuple(tuple(s) for s in got) == shapes
                        and all(math.isclose(getattr(planner, c), x, rel_tol=1e-9, abs_tol=1e-15)
                                for c, x in zip(counters, after)))
                if not same:
                    mismatches.append(i)
    return {"calls": len(record["calls"]), "mismatches": mismatches, "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("record", help="a file written by proposer_profile.py --record")
    p.add_argument("--repeat", type=int, default=3, help="runs of each call (default 3)")
    args = p.parse_args(argv)
    out = replay(load(args.record), max(args.repeat, 1))
    n, bad = out["calls"], out["mismatches"]
    us = 1e6 * out["seconds"] / max(n * max(args.repeat, 1), 1)
    print(f"{n} Planner.plan calls, {us:.1f} us a call (replayed {args.repeat}x), "
          f"{n - len(bad)} same, {len(bad)} different"
          + (f" (first: call {bad[0]})" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
