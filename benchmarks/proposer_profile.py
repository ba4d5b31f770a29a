"""Where lookahead's proposer spends its time, inside a running engine.

Runs one lookahead engine in this process (eager, vLLM's in-process engine)
on real prompts, one request of ``--n`` samples at a time, with a timer
around each part of the proposer's step (``LookaheadProposer.
propose_for_runner`` and what it calls: the planning, the lookups, the
shared memory's writes, the samples' weights, ...), and prints per part its
milliseconds per proposer call and microseconds per call of the part.
Parts nest (``step.run`` holds ``_plan``, which holds ``lookup`` and
``planner.plan``), so the column does not add up.

The same Python and numpy code runs several times slower between the
model's forwards than in a loop on its own (the forward evicts the caches):
time it here, not in a microbenchmark. The timers add about a microsecond
a call.

    .venv/bin/python benchmarks/proposer_profile.py --dataset mtbench --n 16 --prompts 3
        [--speculative-config '{"learn_step_cost": true}'] [--out profile.json]

Preload tcmalloc and libiomp5 as the benchmarks do (``scripts/bench.sh``
sets them; by hand: ``LD_PRELOAD=...``), and run nothing else beside it.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import pickle
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="mtbench", choices=["humaneval", "mtbench", "template"])
    p.add_argument("--n", type=int, default=16, help="samples per request (batched)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=7, help="engine seed")
    p.add_argument("--request-seed", type=int, default=None, metavar="BASE",
                   help="seeded sampling: prompt i gets seed BASE + n*i, as bench.py's "
                        "--seed (default: unseeded)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="lookahead settings added to {\"method\": \"lookahead\"}")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    p.add_argument("--record", default=None, metavar="PATH",
                   help="also pickle every Planner.plan call (its planner, views and "
                        "arguments before, its shapes and the planner's counters after) "
                        "to PATH, for benchmarks/planner_replay.py (the table's times "
                        "then include the recording)")
    p.add_argument("--steps", default=None, metavar="PATH",
                   help="also write every step the cost model books (CostModel.observe's "
                        "arguments, with the prompt it belongs to and its step in that "
                        "prompt) to PATH as JSON, for benchmarks/step_fit.py")
    p.add_argument("--stats", action="store_true",
                   help="also print the proposer's step counters (get_lookahead_stats: "
                        "quiet steps, requests left out, drafts by kind)")
    return p.parse_args(argv)


class Timers:
    """Seconds and calls per part, gathered by wrapped functions."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str, label: str, also=()) -> None:
        """Replace ``owner.name`` with a timed copy labelled ``label``; the
        modules in ``also`` that imported the same function get it too."""
        f = getattr(owner, name)
        seconds, calls = self.seconds, self.calls

        @functools.wraps(f)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - t
                calls[label] += 1

        setattr(owner, name, timed)
        for mod in also:
            if getattr(mod, name, None) is f:
                setattr(mod, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


#: What is timed: ``(module, class or None, function, label, modules that
#: imported the function by name)``, in ``vllm_lookahead``.
PARTS = (
    ("proposer", "LookaheadProposer", "propose_for_runner", "proposer (all)", ()),
    ("proposer", "StepTimer", "book", "StepTimer.book", ()),
    ("planner.step", "StepDrafter", "run", "step.run", ()),
    ("planner.step", "StepDrafter", "_weights", "samples' weights taken", ()),
    ("planner.step", "StepDrafter", "_plan", "_plan", ()),
    ("planner.step", "StepDrafter", "_fused_plan", "_fused_plan", ()),
    ("planner.planner", "Planner", "plan", "Planner.plan", ()),
    ("algo.memory", "SharedMemory", "extend", "SharedMemory.extend", ()),
    ("algo.memory", "SharedMemory", "lookup", "SharedMemory.lookup", ()),
    ("algo.state", "RequestState", "add_context_ngrams", "add_context_ngrams", ()),
    ("algo.state", "TextIndex", "vote", "TextIndex.vote", ()),
    ("algo.drafting", None, "account", "account", ("proposer",)),
    ("algo.drafting", None, "harvest", "harvest", ("proposer",)),
    ("algo.drafting", None, "lookup", "lookup", ("planner.step",)),
    ("algo.drafting", None, "unchecked_draft", "unchecked_draft", ("planner.step",)),
    ("planner.step", None, "_request_view", "_request_view", ()),
    ("planner.step", None, "sibling_weights", "sibling_weights", ()),
)


#: The counters ``--stats`` prints (of ``get_lookahead_stats``).
STAT_KEYS = ("decode_steps", "steps_quiet", "requests_quiet", "requests_unpaid", "drafts",
             "draft_tokens", "accepted_tokens", "drafts_by_kind", "arm_steps",
             "shape_steps", "acceptance_prior")


def targets() -> list[tuple]:
    """:data:`PARTS` resolved: ``(owner, function name, label, also)``
    (an AttributeError names a part the package no longer has)."""
    import importlib

    def mod(name):
        return importlib.import_module(f"vllm_lookahead.{name}")

    out = []
    for module, cls, name, label, also in PARTS:
        owner = mod(module) if cls is None else getattr(mod(module), cls)
        getattr(owner, name)
        out.append((owner, name, label, tuple(mod(m) for m in also)))
    return out


def install(timers: Timers) -> None:
    """Wrap the proposer's parts (:data:`PARTS`)."""
    for owner, name, label, also in targets():
        timers.wrap(owner, name, label, also=also)


class Recorder:
    """Pickles each :meth:`Planner.plan` call as it runs: ``(planner, args,
    kwargs)`` before it (the views are in ``args``), and its shapes and the
    planner's exploration counters after (:data:`PLAN_COUNTERS`), so that
    ``planner_replay.py`` can run the same calls again and check it gets
    the same answers."""

    #: The planner's attributes a plan call moves besides its answer.
    PLAN_COUNTERS = ("planned_s", "explore_s", "explored", "_turn")

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, tuple, tuple]] = []

    def install(self) -> None:
        import vllm_lookahead.planner.planner as planner_mod
        plan, calls, counters = planner_mod.Planner.plan, self.calls, self.PLAN_COUNTERS

        @functools.wraps(plan)
        def recorded(planner, *a, **k):
            before = pickle.dumps((planner, a, k))
            shapes = plan(planner, *a, **k)
            calls.append((before, tuple(tuple(s) for s in shapes),
                          tuple(getattr(planner, c) for c in counters)))
            return shapes

        planner_mod.Planner.plan = recorded

    def save(self, path: str) -> None:
        Path(path).write_bytes(pickle.dumps({"counters": self.PLAN_COUNTERS,
                                             "calls": self.calls}))


class StepLog:
    """Every step the cost model books (:meth:`CostModel.observe`'s
    arguments), tagged with the prompt being generated (:attr:`prompt`, set
    by the caller) and the step's index within it: what
    ``benchmarks/step_fit.py`` refits offline."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.prompt = -1
        self._since = 0

    def next_prompt(self) -> None:
        self.prompt += 1
        self._since = 0

    def install(self) -> None:
        import vllm_lookahead.planner.cost_model as cost_model
        observe, rows, log = cost_model.CostModel.observe, self.rows, self

        @functools.wraps(observe)
        def logged(model, batch, tokens, seconds, tree=True, drafting=None,
                   verify_least=None):
            rows.append({"prompt": log.prompt, "step": log._since, "batch": int(batch),
                         "tokens": float(tokens), "seconds": float(seconds),
                         "tree": bool(tree), "drafting": drafting,
                         "verify_least": list(verify_least) if verify_least else None})
            log._since += 1
            return observe(model, batch, tokens, seconds, tree=tree, drafting=drafting,
                           verify_least=verify_least)

        cost_model.CostModel.observe = logged

    def save(self, path: str, meta: dict) -> None:
        Path(path).write_text(json.dumps({"machine": meta, "steps": self.rows}))


def main(argv=None) -> int:
    args = _parse(argv)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from prompts import _load_prompts, _prepare_model, _warmup_prompts
    from report import machine_info

    timers = Timers()
    install(timers)
    recorder = None
    if args.record:
        recorder = Recorder()
        recorder.install()
    steplog = None
    if args.steps:
        steplog = StepLog()
        steplog.install()
    path = _prepare_model("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _load_prompts(args.dataset, args.prompts, tok)
    spec = {"method": "lookahead"}
    if args.speculative_config:
        spec.update(json.loads(args.speculative_config))
    llm = LLM(str(path), dtype=args.dtype, speculative_config=spec, enforce_eager=True,
              max_model_len=2048, max_num_seqs=args.n, kv_cache_memory_bytes=512 << 20,
              seed=args.seed)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in _warmup_prompts(1, tok)],
                 SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    timers.clear()
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                        max_tokens=args.max_tokens, n=args.n)
    start, tokens = time.perf_counter(), 0
    for i, p in enumerate(prompts):
        if steplog is not None:
            steplog.next_prompt()
        if args.request_seed is not None:
            sp = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                max_tokens=args.max_tokens, n=args.n,
                                seed=args.request_seed + args.n * i)
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        tokens += sum(len(o.token_ids) for o in out[0].outputs)
    wall = time.perf_counter() - start
    if recorder is not None:
        recorder.save(args.record)
        print(f"recorded {len(recorder.calls)} Planner.plan calls: {args.record}")
    steps = max(timers.calls["proposer (all)"], 1)
    rows = [{"part": k, "ms_per_step": 1e3 * v / steps, "calls": timers.calls[k],
             "us_per_call": 1e6 * v / max(timers.calls[k], 1)}
            for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1])]
    meta = machine_info(sys.argv)
    cpu = meta.get("cpu")
    if steplog is not None:
        from vllm_lookahead import get_lookahead_stats
        meta = dict(meta, cost_model=get_lookahead_stats(llm).get("cost_model"))
        steplog.save(args.steps, meta)
        print(f"{len(steplog.rows)} booked steps: {args.steps}")
    print(f"{cpu}; {args.dataset}, n={args.n}, {args.prompts} prompts: {tokens} tokens in "
          f"{wall:.1f} s, {steps} proposer calls ({1e3 * wall / steps:.1f} ms a call apart)")
    print(f"{'part':34s} {'ms/step':>8s} {'calls':>7s} {'us/call':>9s}")
    for r in rows:
        print(f"{r['part']:34s} {r['ms_per_step']:8.3f} {r['calls']:7d} {r['us_per_call']:9.1f}")
    stats = None
    if args.stats:
        from vllm_lookahead import get_lookahead_stats
        stats = get_lookahead_stats(llm)
        for key in STAT_KEYS:
            if key in stats:
                print(f"{key}: {stats[key]}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "machine": meta, "args": vars(args), "wall_s": wall, "tokens": tokens,
            "proposer_calls": steps, "parts": rows,
            "stats": {k: stats[k] for k in STAT_KEYS if k in stats} if stats else None},
            indent=1))
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
