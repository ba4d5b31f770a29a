"""Where a step's time goes inside vLLM's runner, by how many requests draft.

Runs each method (vanilla, vLLM's ``ngram``, lookahead) in its own process
on real prompts, one request of ``--n`` samples at a time, and times each
engine step inside vLLM's model runner:

* ``prepare``: ``_prepare_inputs`` (vLLM's batch tensors, the drafts'
  metadata);
* ``forward``: ``_model_forward`` (the model; with lookahead's fused mode,
  any tree rows too);
* ``sampler``: ``_sample`` (vLLM's sampler, or with drafts its rejection
  sampler: the bonus rows through the plain sampler, the draft rows
  verified);
* ``proposer+``: the rest of ``sample_tokens`` (the method's proposer and
  vLLM's bookkeeping);
* ``other``: the rest of the step (the logits, vLLM's metadata);
* ``step``: from the start of ``execute_model`` to the end of
  ``sample_tokens``.

Steps are grouped by batch size and by requests with a draft (0, 1, 2,
3+), a ``t`` marking lookahead steps with trees in their forward; the table
shows each group's medians. A fit of the step over the
most common batch size, ``step = a + r * drafting requests + t * draft
tokens`` (stalls left out), says what a draft adds, to the step and part by
part (the forward, vLLM's sampler, the rest). The methods run one after the other
(``--rounds`` alternates their order), so the machine's drift is not
cancelled as in ``bench.py``: compare groups within a method, and methods
only where their plain steps agree.

    .venv/bin/python benchmarks/step_breakdown.py --n 4 --dataset mtbench \\
        [--methods vanilla ngram la] [--prompts 4] [--temperature 0.8]

Prints the table and writes ``benchmarks/results/step_breakdown.json`` and a
plot next to it (``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PARTS = ("prepare", "forward", "sampler", "proposer+", "other", "step")
#: Runner methods timed (part name -> GPUModelRunner attribute).
TIMED = {"prepare": "_prepare_inputs", "forward": "_model_forward", "sampler": "_sample"}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["vanilla", "ngram", "la"],
                   help="bench.py method entries (vanilla, ngram, suffix, la, la:parent, ...) "
                        "or a JSON speculative_config")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dataset", default="mtbench", choices=["humaneval", "mtbench", "template"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="samples per request (batched)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every method, in alternating order")
    p.add_argument("--out", default="benchmarks/results/step_breakdown.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def spec_of(method: str) -> dict | None:
    """The ``speculative_config`` of a method: a ``bench.py`` method entry
    (``methods.parse_method``: vanilla, ngram, suffix, la and its flags;
    None for vanilla) or a JSON ``speculative_config``."""
    if method.lstrip().startswith("{"):
        try:
            spec = json.loads(method)
        except ValueError:
            spec = None
        if not isinstance(spec, dict) or "method" not in spec:
            raise SystemExit(f"--methods: {method!r} is not vanilla, ngram, la or a JSON config")
        return spec
    from methods import MethodSpecError, parse_method

    try:
        parsed = parse_method(method)
    except MethodSpecError as exc:
        raise SystemExit(f"--methods: {exc}") from None
    if parsed.checkout is not None:
        raise SystemExit(f"--methods: {method!r}: another checkout (@PATH) is bench.py's only")
    return parsed.spec


def group_of(step: dict) -> tuple[int, str]:
    """A step's group: (batch size, requests with a draft as 0, 1, 2, 3+,
    then ``t`` for a step with lookahead trees in its forward)."""
    d = step["drafting"]
    return step["batch"], (str(d) if d < 3 else "3+") + ("t" if step.get("tree_tokens") else "")


#: Parts fitted apart (``fit["parts_ms"]``): where a draft's cost lands.
FIT_PARTS = ("forward", "sampler", "other", "step")
#: A step more than this many times its batch size's median step is a stall
#: (the first step of a ``generate`` call, a pause of the process), left out
#: of the fit: a group of stalls alone (a method that drafts at every step
#: leaves its no-draft group to the first steps) set the fit's height and
#: slopes to nonsense (stop 55: 160 ms + -12 ms per drafting request).
STALL_FACTOR = 3.0


def summarize(steps: list[dict]) -> dict:
    """Per group (``"batch/drafting"``): steps, mean draft tokens, and the
    median milliseconds of each part; ``fit``: at the most common batch
    size, ``[a, r, t]`` ms of ``step = a + r * drafting requests + t *
    draft tokens``, least squares over the median step of each (drafting
    requests, draft tokens) seen among the steps without trees, weighted by
    its steps (a few stalled steps do not move it, and steps over
    :data:`STALL_FACTOR` times the batch's median step are left out; None
    with under 8 steps or no draft), and ``parts_ms``: the same fit of each
    of :data:`FIT_PARTS` (``other``: the step less the timed parts), so
    that what a draft adds to the forward and what it saves of vLLM's
    sampler (a rejected draft's bonus row, patch 15) read apart."""
    import numpy as np

    # the step less its timed parts, once for the groups and the fit
    steps = [dict(s, other=s["step"] - sum(s[p] for p in PARTS[:4])) for s in steps]
    groups: dict[tuple, list[dict]] = {}
    for s in steps:
        groups.setdefault(group_of(s), []).append(s)
    out = {}
    for (b, d), members in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out[f"{b}/{d}"] = dict(
            batch=b, drafting=d, steps=len(members),
            draft_tokens=float(np.mean([m["draft_tokens"] for m in members])),
            ms={p: float(1e3 * np.median([m[p] for m in members])) for p in PARTS})
    fit = None
    if steps:
        sizes = [s["batch"] for s in steps]
        top = max(set(sizes), key=sizes.count)
        at = [s for s in steps if s["batch"] == top and not s.get("tree_tokens")]
        if at:
            limit = STALL_FACTOR * float(np.median([s["step"] for s in at]))
            at = [s for s in at if s["step"] <= limit]
        cells: dict[tuple, list[dict]] = {}
        for s in at:
            cells.setdefault((s["drafting"], s["draft_tokens"]), []).append(s)
        if len(at) >= 8 and any(d for d, _ in cells):
            keys = sorted(cells)
            w = np.sqrt([len(cells[k]) for k in keys])
            x = np.array([[1.0, d, t] for d, t in keys]) * w[:, None]

            def coef(part: str) -> list[float]:
                y = np.array([np.median([s[part] for s in cells[k]]) for k in keys]) * w
                return [float(1e3 * c) for c in np.linalg.lstsq(x, y, rcond=None)[0]]

            parts = {p: coef(p) for p in FIT_PARTS}
            fit = dict(batch=top, steps=len(at), ms=parts["step"], parts_ms=parts)
    return dict(groups=out, fit=fit)


def _child(args) -> None:
    """One method in this process: time every step, write the steps."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(Path(__file__).parent))
    from prompts import _load_prompts, _prepare_model
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as R

    cur: dict = {}
    steps: list[dict] = []

    def timed(part, fn):
        def run(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                cur[part] = cur.get(part, 0.0) + time.perf_counter() - t0
        return run

    for part, name in TIMED.items():
        setattr(R, name, timed(part, getattr(R, name)))
    execute, sample = R.execute_model, R.sample_tokens

    def execute_model(self, so, *a, **k):
        cur.clear()
        drafts = [v for v in so.scheduled_spec_decode_tokens.values() if v]
        stats = getattr(getattr(self, "drafter", None), "stats", None)
        cur.update(t0=time.perf_counter(), batch=len(so.num_scheduled_tokens), stats=stats,
                   trees0=getattr(stats, "lookahead_query_tokens", 0),
                   drafting=len(drafts), draft_tokens=sum(len(v) for v in drafts))
        return execute(self, so, *a, **k)

    def sample_tokens(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return sample(self, *a, **k)
        finally:
            t1 = time.perf_counter()
            if "t0" in cur and "forward" in cur:  # a decoding step (not a dummy run)
                row = {p: cur.get(p, 0.0) for p in TIMED}
                row["proposer+"] = max(t1 - t0 - row["sampler"], 0.0)
                row["step"] = t1 - cur["t0"]
                row.update(batch=cur["batch"], drafting=cur["drafting"],
                           draft_tokens=cur["draft_tokens"],
                           tree_tokens=getattr(cur["stats"], "lookahead_query_tokens", 0)
                           - cur["trees0"])
                steps.append(row)
            cur.clear()

    R.execute_model, R.sample_tokens = execute_model, sample_tokens
    spec = spec_of(args.child)
    path = str(_prepare_model(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _load_prompts(args.dataset, args.prompts, tok)
    llm = LLM(path, dtype=args.dtype, speculative_config=spec, enforce_eager=True,
              max_model_len=2048, max_num_seqs=max(args.n, 1), seed=1,
              kv_cache_memory_bytes=1 << 30)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])],
                 SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    steps.clear()
    params = SamplingParams(temperature=args.temperature,
                            top_p=args.top_p if args.temperature > 0 else 1.0,
                            max_tokens=args.max_tokens, n=args.n)
    t0 = time.perf_counter()
    for p in prompts:
        llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
    print(json.dumps(dict(elapsed_s=time.perf_counter() - t0, steps=steps)))


def _table(results: dict) -> str:
    lines = ["%-12s %-9s %6s %7s " % ("method", "b/drafts", "steps", "d.tok")
             + " ".join("%10s" % p for p in PARTS)]
    for method, res in results.items():
        for key, g in res["summary"]["groups"].items():
            if g["steps"] < 2:
                continue
            lines.append("%-12s %-9s %6d %7.1f " % (method[:12], key, g["steps"], g["draft_tokens"])
                         + " ".join("%10.2f" % g["ms"][p] for p in PARTS))
        fit = res["summary"]["fit"]
        if fit:
            a, r, t = fit["ms"]
            lines.append(f"{'':12s} fit at batch {fit['batch']}: step {a:.2f} ms + {r:.2f} ms "
                         f"per drafting request + {t:.2f} ms per draft token ({fit['steps']} steps)")
            parts = fit["parts_ms"]
            lines.append(f"{'':12s}   of which (per drafting request, per draft token): "
                         + ", ".join(f"{p} {parts[p][1]:+.2f} {parts[p][2]:+.2f}"
                                     for p in FIT_PARTS if p != "step"))
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(m, k, g) for m, res in results.items()
            for k, g in res["summary"]["groups"].items() if g["steps"] >= 2]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(bars) + 2), 4))
    bottom = [0.0] * len(bars)
    for part in PARTS[:-1]:
        vals = [g["ms"][part] for _, _, g in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(range(len(bars)), [g["ms"]["step"] for _, _, g in bars], "k_", markersize=18,
            label="step (median)")
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([f"{m}\n{k}" for m, k, _ in bars], fontsize=7)
    ax.set_ylabel("ms (medians)")
    ax.set_title("step time by part, per batch size / requests drafting")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.child is not None:
        _child(args)
        return
    for m in args.methods:
        spec_of(m)  # a bad method fails before any engine starts
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from report import save_results

    results: dict = {m: {"steps": [], "elapsed_s": 0.0} for m in args.methods}
    order = list(args.methods)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x, **_):
            return x
    runs = [(r, m) for r in range(args.rounds)
            for m in (order if r % 2 == 0 else order[::-1])]
    base = [a for a in (sys.argv[1:] if argv is None else argv)]
    for _, method in tqdm(runs, desc="engines"):
        cmd = [sys.executable, __file__, *base, "--child", method]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{method}: engine failed\n{proc.stderr[-3000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        results[method]["steps"] += got["steps"]
        results[method]["elapsed_s"] += got["elapsed_s"]
    for res in results.values():
        res["summary"] = summarize(res["steps"])
    print(_table(results))
    save_results(args.out, {k: v for k, v in vars(args).items() if k != "child"}, results,
                 _plot, sys.argv if argv is None else ["step_breakdown.py", *argv])


if __name__ == "__main__":
    main()
