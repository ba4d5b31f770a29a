"""Refit the cost model's plain plane offline, from the steps an engine booked.

Reads what ``proposer_profile.py --steps PATH`` wrote (every
:meth:`CostModel.observe` call of a run: requests, query tokens per request,
drafting requests, seconds less the verification, with the prompt and the
step within it) and fits, for the steps without trees of one batch bucket,
the plane the engine learns, ``seconds = a + p*u + q*v + r*m`` (``u``:
requests past the bucket, ``v``: draft tokens, ``m``: drafting requests),
several ways, by ordinary least squares, with standard errors:

* ``plain``: as the engine does (bar its forgetting and priors);
* ``+step``: with the step's index within its prompt as one more feature
  (the context grows as a prompt is generated, and with it a step's cost;
  the engine's height follows it ~20 steps late, its slopes not at all);
* ``+prompt``: one height per prompt, and the step index;
* ``diff``: consecutive steps of one prompt, differenced (whatever moves
  slowly -- the context, the machine's speed -- drops out);

over all prompts and over each half of them apart (a fit that reads the
same in both halves is one the planner can trust). ``q+r`` is a one-token
draft's price, the one most drafts pay. Prints a table; ``--json`` writes it.

    .venv/bin/python benchmarks/step_fit.py /tmp/steps.json [--bucket 16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from vllm_lookahead.planner.cost_model import bucket_of
from vllm_lookahead.planner.fit import plane_features


def features(row: dict, bucket: int) -> tuple[float, float, float]:
    """``(u, v, m)`` of a booked step, as the engine's plane takes them."""
    return plane_features(row["batch"], bucket, row["tokens"], row["drafting"])


def ols(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Coefficients, their covariance (columns that never vary, bar a
    constant, are dropped: NaN) and the residuals' standard deviation."""
    keep = [j for j in range(x.shape[1]) if np.ptp(x[:, j]) > 0 or np.all(x[:, j] == 1)]
    xs = x[:, keep]
    coef, *_ = np.linalg.lstsq(xs, y, rcond=None)
    resid = y - xs @ coef
    s2 = float(resid @ resid) / max(len(y) - len(keep), 1)
    cov_k = s2 * np.linalg.pinv(xs.T @ xs)
    full = np.full(x.shape[1], np.nan)
    cov = np.full((x.shape[1], x.shape[1]), np.nan)
    full[keep] = coef
    cov[np.ix_(keep, keep)] = cov_k
    return full, cov, float(np.sqrt(s2))


def fits(rows: list[dict], bucket: int) -> dict:
    """Every fit of the module doc over ``rows`` (steps without trees of
    ``bucket``): ``{name: {"q", "r", "q+r", "se_q", "se_r", "se_q+r", "steps"}}``
    in milliseconds."""
    rows = [r for r in rows if not r["tree"] and bucket_of(r["batch"]) == bucket
            and r["prompt"] >= 0]
    out = {}
    if len(rows) < 8:
        return out
    f = np.array([features(r, bucket) for r in rows], dtype=float)
    y = 1e3 * np.array([r["seconds"] for r in rows])
    step = np.array([r["step"] for r in rows], dtype=float)
    prompts = sorted({r["prompt"] for r in rows})
    pid = np.array([prompts.index(r["prompt"]) for r in rows])
    one = np.ones((len(rows), 1))
    designs = {
        "plain": np.hstack([one, f]),
        "+step": np.hstack([one, f, step[:, None]]),
        "+prompt": np.hstack([f, step[:, None],
                              (pid[:, None] == np.arange(len(prompts))[None]).astype(float)]),
    }
    for name, x in designs.items():
        iq = 2 if name != "+prompt" else 1  # after the constant and u
        out[name] = _summary(x, y, iq, iq + 1, len(rows))
    # consecutive steps of one prompt
    same = (pid[1:] == pid[:-1]) & (step[1:] == step[:-1] + 1)
    if same.sum() >= 8:
        dx, dy = (f[1:] - f[:-1])[same], (y[1:] - y[:-1])[same]
        out["diff"] = _summary(dx, dy, 1, 2, int(same.sum()))
    return out


def _summary(x, y, iq, ir, n) -> dict:
    coef, cov, resid = ols(x, y)
    return {"steps": n, "q": float(coef[iq]), "r": float(coef[ir]),
            "q+r": float(coef[iq] + coef[ir]),
            "se_q": float(np.sqrt(cov[iq, iq])), "se_r": float(np.sqrt(cov[ir, ir])),
            "se_q+r": float(np.sqrt(max(cov[iq, iq] + cov[ir, ir] + 2 * cov[iq, ir], 0))),
            "resid_ms": resid}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps", nargs="+", help="proposer_profile.py --steps files")
    p.add_argument("--bucket", type=int, default=16)
    p.add_argument("--json", default=None, help="write the fits here")
    args = p.parse_args(argv)
    result = {}
    print(f"{'file':28s} {'part':6s} {'fit':8s} {'steps':>5s} {'q ms':>12s} "
          f"{'r ms':>12s} {'q+r ms':>12s} {'resid':>6s}")
    for path in args.steps:
        d = json.loads(Path(path).read_text())
        rows = d["steps"]
        prompts = sorted({r["prompt"] for r in rows if r["prompt"] >= 0})
        half = prompts[len(prompts) // 2] if len(prompts) > 1 else None
        parts = {"all": rows}
        if half is not None:
            parts["first"] = [r for r in rows if r["prompt"] < half]
            parts["second"] = [r for r in rows if r["prompt"] >= half]
        result[path] = {"machine": d.get("machine"), "fits": {}}
        for part, sub in parts.items():
            got = fits(sub, args.bucket)
            result[path]["fits"][part] = got
            for name, s in got.items():
                print(f"{Path(path).name[:28]:28s} {part:6s} {name:8s} {s['steps']:5d} "
                      f"{s['q']:6.2f}+-{s['se_q']:4.2f} {s['r']:6.2f}+-{s['se_r']:4.2f} "
                      f"{s['q+r']:6.2f}+-{s['se_q+r']:4.2f} {s['resid_ms']:6.1f}")
        cm = (d.get("machine") or {}).get("cost_model") or {}
        plane = (cm.get("correction") or {}).get(f"{args.bucket}:plain_ms")
        if plane:
            print(f"{'':28s} the engine's own plane at the end (a, p, q, r ms): {plane}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
