"""The child process (``bench.py --child CONFIG RESULT``): one engine over
every (dataset, batch size), alone or taking turns with the other engines of
its group."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from vllm_lookahead.planner.cost_model import machine_busy_s

from figures import combine_passes, section_figures
from prompts import _load_prompts, _warmup_prompts
from report import _fmt, _short_error, _write_json


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


def generate_queued(engine, prompts: list, params, running: int,
                    full: dict | None = None, hold=None,
                    turn_s: float | None = None) -> list[list[int]]:
    """Outputs of ``prompts`` fed through ``engine`` (vLLM's ``LLMEngine``)
    from a queue, ``running`` requests at a time: a request joins as soon as
    another finishes, as on a server under load (``--queue``;
    ``LLM.generate`` of ``running`` prompts instead waits for the slowest).
    ``params``: one ``SamplingParams`` for all, or a list, one per prompt.
    Returns the token ids per sample, in the prompts' order (a prompt's
    ``n`` samples in a row, by their index; one per prompt with n = 1).

    ``full``: adds up ``tokens``, ``seconds`` and ``steps`` of the engine
    steps that ran with the batch full (``running`` requests), leaving out
    the drain at the end, when the queue is empty and the batch shrinks: a
    server under steady load never drains, and a finite set drains longest
    where requests finish at different steps (with speculation).

    ``hold() -> context manager``: the engine steps run inside it (the
    benchmark's turn, timed); with ``turn_s`` it is let go and taken again
    at the first request to join after ``turn_s`` seconds of steps, the
    others staying in flight meanwhile, so interleaved engines take short
    turns through their queues.
    """
    return drain(queued_turns(engine, prompts, params, running, full, hold, turn_s))


def drain(work):
    """Run the generator ``work`` to its end, ignoring what it yields; its
    return value."""
    while True:
        try:
            next(work)
        except StopIteration as stop:
            return stop.value


def queued_turns(engine, prompts: list, params, running: int,
                 full: dict | None = None, hold=None, turn_s: float | None = None):
    """:func:`generate_queued` as a generator: it yields each time it lets
    ``hold`` go after ``turn_s`` seconds (an engine of ``--one-process``
    gives the next engine its turn there) and returns the outputs."""
    index: dict[str, int] = {}
    outputs: list[list[list[int]] | None] = [None] * len(prompts)
    seen: dict[tuple[str, int], int] = {}
    latest: dict[str, dict[int, list[int]]] = {}
    queue = list(range(len(prompts)))[::-1]
    live = 0
    with contextlib.ExitStack() as held:
        turn_start = None
        while queue or live:
            if (turn_start is not None and turn_s is not None and queue and live < running
                    and time.perf_counter() - turn_start >= turn_s):
                # The turn passes on where a request joins: the wait falls
                # in a step with a prefill, which lookahead's own step
                # timer (its cost model) leaves out.
                held.close()
                turn_start = None
                yield  # the turn passes on (one process: the next engine's)
            if hold is not None and turn_start is None:
                held.enter_context(hold())
                turn_start = time.perf_counter()
            while queue and live < running:
                i = queue.pop()
                given = f"bench-queue-{next(_QUEUE_IDS)}"
                index[given] = i
                p = params[i] if isinstance(params, list) else params
                index[engine.add_request(given, prompts[i], p)] = i
                live += 1
            was_full = live == running
            t0 = time.perf_counter()
            step = engine.step()
            took = time.perf_counter() - t0
            new = 0
            for out in step:
                # cumulative outputs; with n > 1 each carries the samples
                # (by index) that moved this step
                mine = latest.setdefault(out.request_id, {})
                for completion in out.outputs:
                    k = getattr(completion, "index", 0)
                    n = len(completion.token_ids)
                    new += n - seen.get((out.request_id, k), 0)
                    seen[(out.request_id, k)] = n
                    mine[k] = list(completion.token_ids)
                if out.finished:
                    outputs[index[out.request_id]] = [mine[k] for k in sorted(mine)]
                    del latest[out.request_id]
                    live -= 1
            if full is not None and was_full:
                full["tokens"] = full.get("tokens", 0) + new
                full["seconds"] = full.get("seconds", 0.0) + took
                full["steps"] = full.get("steps", 0) + 1
    return [sample for samples in outputs for sample in samples]  # type: ignore[union-attr]


def sampling_kwargs(cfg: dict[str, Any], prompt_index: int) -> dict[str, Any]:
    """``SamplingParams`` keywords of the request for prompt ``prompt_index``
    of a set: ``--temperature``, ``--top-p``, ``--n``, ``--max-tokens`` and,
    with ``--seed``, seed = base + n * prompt index (vLLM gives a request's
    n samples seed + 0..n-1, so no two samples of a set share a seed; a
    prompt keeps its seed in every pass of ``--repeat`` and every engine).
    Defaults: greedy, n = 1, unseeded."""
    sampling = cfg.get("sampling") or {}
    n = int(sampling.get("n", 1))
    kwargs: dict[str, Any] = {"temperature": float(sampling.get("temperature", 0.0)),
                              "max_tokens": cfg["max_tokens"]}
    if kwargs["temperature"] > 0:
        kwargs["top_p"] = float(sampling.get("top_p", 1.0))
    if n != 1:
        kwargs["n"] = n
    if sampling.get("seed") is not None:
        kwargs["seed"] = int(sampling["seed"]) + n * prompt_index
    return kwargs


def structured_for(cfg: dict[str, Any], dataset: str) -> dict | None:
    """The JSON schema the set's outputs are held to (``--structured``:
    the template set only), or None."""
    if cfg.get("structured") and dataset == "template":
        return cfg.get("structured_schema")
    return None


def make_params(cfg: dict[str, Any], dataset: str, count: int) -> list:
    """One ``SamplingParams`` per prompt of the set (its own seed and its
    own structured-output object: vLLM writes the backend it picks into
    it)."""
    from vllm import SamplingParams

    schema = structured_for(cfg, dataset)
    params = []
    for i in range(count):
        kwargs = sampling_kwargs(cfg, i)
        if schema is not None:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(json=schema)
        params.append(SamplingParams(**kwargs))
    return params


class Meter:
    """Wall, own CPU and machine-wide busy seconds of the timed stretches
    of one section (the turns' work, not the waits between them)."""

    def __init__(self) -> None:
        self.elapsed = self.cpu_s = 0.0
        self.machine_s: float | None = 0.0

    @contextlib.contextmanager
    def timing(self):
        c0, m0, t0 = time.process_time(), machine_busy_s(), time.perf_counter()
        try:
            yield
        finally:
            self.elapsed += time.perf_counter() - t0
            self.cpu_s += time.process_time() - c0
            m1 = machine_busy_s()
            self.machine_s = (None if self.machine_s is None or m0 is None or m1 is None
                              else self.machine_s + m1 - m0)


@contextlib.contextmanager
def _turn(turns: "Turns | None", meter: Meter):
    """This process's turn (if interleaved), timed by ``meter``."""
    if turns is not None:
        turns.acquire()
    try:
        with meter.timing():
            yield
    finally:
        if turns is not None:
            turns.release()


#: --queue: seconds of engine steps per turn (the requests stay in flight
#: between turns).
QUEUE_TURN_S = 3.0


_QUEUE_IDS = itertools.count()


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

    @staticmethod
    def settle_s() -> float:
        """Seconds a turn waits after another process's turn ended before
        anything is timed: that engine's OpenMP threads go on spinning after
        its last parallel region (Intel OpenMP's ``KMP_BLOCKTIME``, 200 ms
        unless set; vLLM sets 5 only for its own multi-process CPU workers,
        not for an engine of one process), and a turn that starts at once
        shares the cores with them. Measured on a 2-vCPU Xeon: every
        method's engine burns 0.2 s of CPU in the 0.3 s after its
        ``generate`` returns, then about nothing."""
        try:
            block_ms = float(os.environ.get("KMP_BLOCKTIME", "200"))
        except ValueError:  # "infinite" or junk: the default's wait
            block_ms = 200.0
        return min(max(block_ms, 0.0), 1000.0) / 1e3 + 0.05

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

    @contextlib.contextmanager
    def _lock(self, name: str = "lock"):
        """An exclusive lock of the group's processes. ``"lock"``: reading
        the turn and passing it on is one step (without it a process could
        pass on a turn it read before it had moved on)."""
        with open(self.dir / name, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def starting(self):
        """Engines start (load, warm up) one at a time: lookahead measures
        its step cost curve as it warms up, and measured while other engines
        load on the same cores it comes out wrong (level where it should
        rise) and the planner prices drafts at nothing. A process that dies
        holding it lets go (the lock is the open file's)."""
        return self._lock("start")

    def _pass_if_held_by(self, k: int) -> None:
        with self._lock():
            if self._current() == k:
                self._pass_from(k)

    def _pass_from(self, k: int) -> None:
        for step in range(1, self.count + 1):
            nxt = (k + step) % self.count
            if not self._done(nxt):
                break
        tmp = self.dir / f"turn.{self.index}.tmp"
        tmp.write_text(f"{k} {time.time()!r}", encoding="ascii")
        os.replace(tmp, self.dir / "passed")  # who passed it on, and when
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
                break
            if self._done(k):  # its holder is gone: pass the turn on
                self._pass_if_held_by(k)
            time.sleep(self.POLL_S)
        # the turn before this one was another process's: let its spin end
        try:
            who, when = (self.dir / "passed").read_text(encoding="ascii").split()
            wait = float(when) + self.settle_s() - time.time()
            if int(who) != self.index and wait > 0:
                time.sleep(wait)
        except (OSError, ValueError):
            pass

    def release(self) -> None:
        self._pass_if_held_by(self.index)

    def finish(self) -> None:
        (self.dir / f"done.{self.index}").touch()
        self._pass_if_held_by(self.index)


class EngineJob:
    """One engine's part of the benchmark.

    :meth:`start` builds the engine and warms it up; :meth:`work` runs every
    (dataset, batch size) as a generator that yields after each turn (a
    batch of prompts, or ``QUEUE_TURN_S`` of a queue), so engines built in
    one process (``--one-process``, :func:`group_main`) take turns from one
    loop. An engine in a process of its own drains it (:func:`child_main`),
    taking its turns through :class:`Turns` when interleaved.

    ``progress(count)``: called with the prompts of each turn done.
    ``checkpoint()``: called after each section (partial results are kept).
    """

    def __init__(self, cfg: dict[str, Any], turns: Turns | None = None,
                 in_group: bool = False) -> None:
        self.cfg = cfg
        self.turns = turns
        self.in_group = in_group
        self.result: dict[str, Any] = {"sections": [], "error": None}
        self.llm = None
        self.prompts: dict[str, list[list[int]]] = {}
        self.progress = lambda count: None
        self.checkpoint = lambda: None
        self._stats_fn = None
        if cfg.get("checkout"):
            import vllm_lookahead

            # the plugin this engine imported (a ``...@PATH`` method: PATH's)
            self.result["plugin_path"] = str(
                Path(vllm_lookahead.__file__).resolve().parent)

    @property
    def interleaved(self) -> bool:
        return self.turns is not None or self.in_group

    def planned_prompts(self) -> int:
        cfg = self.cfg
        return (len(cfg["datasets"]) * len(cfg["batch_sizes"]) * cfg["prompts"]
                * max(1, int(cfg.get("repeat", 1))))

    def start(self) -> None:
        """Load the prompts, build the engine (one at a time with the other
        engines of an interleaved group) and warm it up."""
        cfg, result, turns = self.cfg, self.result, self.turns
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
        prompts = {ds: _load_prompts(ds, cfg["prompts"], tokenizer) for ds in cfg["datasets"]}
        self.prompts = prompts
        result["prompt_tokens"] = {ds: [len(p) for p in ps] for ds, ps in prompts.items()}

        # one engine starts at a time (Turns.starting)
        with turns.starting() if turns is not None else contextlib.nullcontext():
            started = time.perf_counter()
            llm = LLM(
                cfg["model_path"],
                dtype=cfg["dtype"],
                speculative_config=cfg["spec"],
                enforce_eager=cfg.get("enforce_eager", True),
                max_model_len=cfg["max_model_len"],
                # a request with n samples is n sequences, run batched
                max_num_seqs=max(cfg["batch_sizes"]) * int((cfg.get("sampling") or {}).get("n", 1)),
                kv_cache_memory_bytes=cfg["kv_cache_bytes"],
                seed=int(cfg.get("engine_seed", 0)),
                disable_log_stats=False,
            )
            self.llm = llm
            result["engine_start_s"] = time.perf_counter() - started
            longest = max((len(ps) for ps in prompts.values()), default=0)
            if longest:
                # warm-up: one short generate, batched up to the largest
                # batch, of prompts outside every set (a method that
                # remembers across requests learns nothing of a set
                # before it is timed); with --structured once more under
                # the schema (its grammar compiled before timing)
                count = max(1, min(max(cfg["batch_sizes"]), longest))
                warm = [TokensPrompt(prompt_token_ids=p)
                        for p in _warmup_prompts(count, tokenizer)]
                llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
                schema = structured_for(cfg, "template") if "template" in prompts else None
                if schema is not None:
                    from vllm.sampling_params import StructuredOutputsParams

                    llm.generate(warm[:1], SamplingParams(
                        temperature=0.0, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(json=schema)),
                        use_tqdm=False)

        if cfg["kind"] == "lookahead":
            from vllm_lookahead import get_lookahead_stats

            self._stats_fn = get_lookahead_stats
        result["config_seen"] = None
        after_warm = self.la_stats()
        if after_warm is not None:
            result["config_seen"] = after_warm.get("config")

    def la_stats(self) -> dict | None:
        if self._stats_fn is None:
            return None
        try:
            return self._stats_fn(self.llm)
        except Exception as exc:  # stats must never break the benchmark
            self.result.setdefault("warnings", []).append(f"lookahead stats: {exc!r}")
            return None

    def work(self):
        """Every (dataset, batch size) section, ``--repeat`` passes each; a
        generator that yields after every turn."""
        from tqdm import tqdm
        from vllm.inputs import TokensPrompt

        cfg, result, turns, llm = self.cfg, self.result, self.turns, self.llm
        kind = cfg["kind"]
        repeat = max(1, int(cfg.get("repeat", 1)))
        queued = bool(cfg.get("queue"))
        for ds in cfg["datasets"]:
            token_lists = self.prompts[ds]
            for bs in cfg["batch_sizes"]:
                section: dict[str, Any] = {"dataset": ds, "batch_size": bs,
                                           "n_prompts": len(token_lists), "kind": kind,
                                           "queue": queued}
                try:
                    bar = tqdm(total=len(token_lists) * repeat, unit="prompt", leave=False,
                               desc=f"{cfg['label']} {ds} bs={bs}", file=sys.stderr,
                               dynamic_ncols=True, disable=self.interleaved)
                    passes: list[dict[str, Any]] = []
                    done_tokens, done_s = 0, 0.0
                    # --repeat: the set again, after the previous pass ends
                    for _ in range(repeat):
                        raw: dict[str, Any] = {"kind": kind}
                        # fresh per pass: vLLM writes into a request's params
                        params = make_params(cfg, ds, len(token_lists))
                        metrics_before, la_before = _metric_values(llm), self.la_stats()
                        outputs: list[list[int]] = []
                        meter = Meter()
                        full: dict | None = {} if queued else None
                        # --queue: the whole set through one queue, in turns of
                        # QUEUE_TURN_S; else a turn per batch of bs prompts
                        chunk = len(token_lists) if queued else bs
                        for i in range(0, len(token_lists), chunk):
                            batch = [TokensPrompt(prompt_token_ids=p)
                                     for p in token_lists[i:i + chunk]]
                            batch_params = params[i:i + chunk]
                            if queued:
                                outs = yield from queued_turns(
                                    llm.llm_engine, batch, batch_params, bs, full,
                                    hold=lambda: _turn(turns, meter),
                                    turn_s=QUEUE_TURN_S if self.interleaved else None)
                            else:
                                with _turn(turns, meter):
                                    outs = [list(c.token_ids)
                                            for o in llm.generate(batch, batch_params,
                                                                  use_tqdm=False)
                                            for c in sorted(o.outputs, key=lambda c: c.index)]
                            self.progress(len(batch))
                            outputs.extend(outs)
                            bar.update(len(batch))
                            so_far_s = meter.elapsed + done_s
                            if so_far_s > 0:
                                so_far = sum(map(len, outputs)) + done_tokens
                                bar.set_postfix_str(f"{so_far / so_far_s:.1f} tok/s",
                                                    refresh=False)
                            if not queued:
                                yield  # the turn passes on
                        raw.update(
                            # every sample's tokens (n per prompt)
                            output_tokens=sum(map(len, outputs)),
                            elapsed_s=meter.elapsed,
                            full_batch=full,
                            cpu_s=meter.cpu_s,
                            machine_cpu_s=meter.machine_s,
                            outputs=outputs,
                            metrics_before=metrics_before,
                            metrics_after=_metric_values(llm),
                            la_before=la_before,
                            la_after=self.la_stats(),
                        )
                        passes.append(raw)
                        done_tokens += raw["output_tokens"]
                        done_s += raw["elapsed_s"]
                    bar.close()
                    combined = combine_passes(passes)
                    section.update({k: v for k, v in combined.items() if k != "kind"})
                    if repeat > 1:
                        section["passes"] = passes
                    fig = section_figures(section)
                    tqdm.write(
                        f"   {cfg['label']} {ds} bs={bs}: {fig['output_tokens']} tokens in "
                        f"{fig['elapsed_s']:.1f} s, "
                        f"{_fmt('tokens_per_s', fig['tokens_per_s'])} tok/s, "
                        f"S {_fmt('step_compression', fig['step_compression'])}"
                        + (" (passes: " + ", ".join(
                            _fmt('step_compression', section_figures(p)['step_compression'])
                            for p in passes) + ")" if repeat > 1 else ""),
                        file=sys.stderr)
                except Exception:
                    section["error"] = traceback.format_exc()
                    tqdm.write(f"   {cfg['label']} {ds} bs={bs}: error "
                               f"{_short_error(section['error'])}", file=sys.stderr)
                result["sections"].append(section)
                if not self.in_group:
                    result["peak_rss_mb"] = _peak_rss_mb()
                self.checkpoint()  # partial results survive a later crash


class EngineIsolation:
    """What engines built in one process (``--one-process``) would share,
    kept apart engine by engine.

    - vLLM's Prometheus collectors: each engine's stat logger unregisters
      the earlier engines' ``vllm:`` collectors from the global registry
      at start-up, so ``LLM.get_metrics()`` would read the last engine's
      counters whichever engine asks. Each engine's collectors are put
      back while it runs its turn (they count its steps all along).
    - The random streams (torch's default generators, the CPU's and on a
      GPU the devices', Python's, NumPy's): unseeded sampling draws from
      torch's default generator of its device, which an engine seeds at
      start-up (``LLM(seed=...)``). Each engine gets its
      own stream back for its turn, so it draws what it would draw in a
      process of its own.
    - vLLM's CPU platform registers its fallbacks for Triton kernels
      (``register_triton_kernel_overrides``) process-wide each time a worker
      starts; a second registration would wrap the wrappers. After the
      first engine the registration is skipped (:meth:`started`): a
      benchmark-only adjustment, made nowhere else.
    """

    def __init__(self) -> None:
        self._collectors: dict[int, list] = {}
        self._rng: dict[int, tuple] = {}
        self._skipped_overrides = False

    @staticmethod
    def _vllm_collectors() -> list:
        from prometheus_client import REGISTRY

        return [c for c in list(REGISTRY._collector_to_names)
                if str(getattr(c, "_name", "")).startswith("vllm:")]

    @staticmethod
    def _random_state() -> tuple:
        import random

        import numpy as np
        import torch

        # on a GPU unseeded sampling draws from the devices' generators
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()

    def started(self, job: EngineJob) -> None:
        """``job``'s engine is built and warm: keep its collectors (the
        registry holds just those now) and its random streams."""
        self._collectors[id(job)] = self._vllm_collectors()
        self._rng[id(job)] = self._random_state()
        if not self._skipped_overrides:
            from vllm.platforms import current_platform

            type(current_platform).register_triton_kernel_overrides = classmethod(
                lambda cls: None)
            self._skipped_overrides = True

    def enter(self, job: EngineJob) -> None:
        """``job``'s turn: its collectors and random streams back."""
        import random

        import numpy as np
        import torch
        from prometheus_client import REGISTRY

        for collector in self._vllm_collectors():
            REGISTRY.unregister(collector)
        for collector in self._collectors[id(job)]:
            REGISTRY.register(collector)
        torch_state, cuda_state, py_state, np_state = self._rng[id(job)]
        torch.set_rng_state(torch_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
        random.setstate(py_state)
        np.random.set_state(np_state)

    def leave(self, job: EngineJob) -> None:
        self._rng[id(job)] = self._random_state()


def group_main(cfgs: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """``--one-process``: every engine of ``cfgs`` built in this process,
    one after another, then taking turns batch by batch (round robin, as
    :class:`Turns` between processes), each turn timed alone. Returns
    ``{"jobs": [each engine's result], "error": ..., "peak_rss_mb": ...}``
    (peak RSS is the group's, all engines together)."""
    from tqdm import tqdm

    jobs = [EngineJob(cfg, in_group=True) for cfg in cfgs]
    result: dict[str, Any] = {"jobs": [job.result for job in jobs], "error": None}
    bar = tqdm(total=sum(job.planned_prompts() for job in jobs), unit="prompt",
               desc=f"{len(jobs)} engines, one process", file=sys.stderr, leave=False,
               dynamic_ncols=True)
    isolation = EngineIsolation()
    for job in jobs:
        job.progress = bar.update
        job.checkpoint = lambda: _write_json(out, result)
    try:
        live = []
        for job in jobs:
            try:
                job.start()
            except Exception:
                job.result["error"] = traceback.format_exc()
                tqdm.write(f"   {job.cfg['label']}: error {_short_error(job.result['error'])}",
                           file=sys.stderr)
                continue
            isolation.started(job)
            live.append((job, job.work()))
        while live:
            for item in list(live):
                job, work = item
                isolation.enter(job)
                try:
                    next(work)
                except StopIteration:
                    live.remove(item)
                except Exception:
                    job.result["error"] = traceback.format_exc()
                    live.remove(item)
                finally:
                    isolation.leave(job)
    except BaseException:
        result["error"] = traceback.format_exc()
    bar.close()
    result["peak_rss_mb"] = _peak_rss_mb()
    return result


def child_main(config_path: str, result_path: str) -> int:
    """Run one engine (or, ``--one-process``, a group of them: config key
    ``group``) over every (dataset, batch size) and write the result."""
    cfg = json.loads(Path(config_path).read_text(encoding="utf-8"))
    out = Path(result_path)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if cfg.get("group"):
        result = group_main(cfg["group"], out)
    else:
        turns = Turns(cfg["turn"]) if cfg.get("turn") else None
        job = EngineJob(cfg, turns)
        result = job.result
        job.checkpoint = lambda: _write_json(out, result)
        if turns is not None:
            progress = Path(cfg["turn"]["dir"]) / f"progress.{turns.index}"

            def report_progress(count: int) -> None:
                with open(progress, "a") as f:
                    f.write(f"{count}\n")

            job.progress = report_progress
        try:
            job.start()
            if turns is not None:
                turns.ready()
            drain(job.work())
        except BaseException:
            result["error"] = traceback.format_exc()
        if turns is not None:
            turns.finish()
        result["peak_rss_mb"] = _peak_rss_mb()
    _write_json(out, result)
    # Skip interpreter teardown: vLLM's atexit/GC of an in-process engine can
    # hang or crash after the results are safely on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["error"] is None else 1)
