"""The engine's :class:`~vllm_lookahead.planner.cost_model.CostModel`, set up
after vLLM's warm-up, by the ``cost_model`` setting: ``"auto"``, the curve
cached for this model, dtype, parallel sizes, hardware and vLLM version, else
measured (:func:`measure`, :func:`measure_verify`) and cached; ``"measure"``,
measured at every start; a path, the curve in that file; ``"off"``, assumed
(each query token :data:`ASSUMED_PER_TOKEN` of a step), scaled by the steps seen."""

from __future__ import annotations

import statistics
import time

from vllm.logger import init_logger

from vllm_lookahead.planner.cost_cache import CostCache, cache_key, load_curve
from vllm_lookahead.planner.cost_model import (BATCH_LADDER, TOKEN_LADDER, CostCurve,
                                               CostModel, measure_curve)
from vllm_lookahead.planner.machine import timed_under_load

logger = init_logger("vllm." + __name__)

BUDGET_S = 6.0
CONTEXT = 256
#: In the cache key: bumped when a change moves what the measured steps cost.
STEP_REVISION = 8
ASSUMED_PER_TOKEN = 0.1
#: A point timed while other processes kept more than LOAD_CORES cores busy
#: is timed again after LOAD_WAIT_S, at most LOAD_RETRIES times.
LOAD_CORES, LOAD_WAIT_S, LOAD_RETRIES = 0.3, 0.5, 6


def build_cost_model(setting: str, runner, worker, agree=None) -> CostModel:
    """The engine's cost model for ``setting`` (module doc). ``agree(obj)``:
    rank 0's ``obj`` on every rank (tensor parallel ranks must run the same
    measuring forwards and plan alike)."""
    one = (lambda x: x) if agree is None else agree
    if setting == "off":
        return CostModel(CostCurve.flat(0.05, ASSUMED_PER_TOKEN), source="assumed")
    key, cache = _key(runner), CostCache()
    if setting == "auto":
        curve, where, source = cache.load(key), cache.path(key), "cached"
    elif setting == "measure":
        curve, where, source = None, None, None
    else:
        curve, where, source = load_curve(setting), setting, f"file:{setting}"
        if curve is None:
            logger.warning("Lookahead: no usable cost curve in %s; measuring one", setting)
    if one(curve is not None):  # a file may be readable on one node only
        logger.info("Lookahead: step cost curve from %s", where)
        return CostModel(one(curve), source=source)
    curve, loaded = measure(runner, worker, agree)
    max_seqs = runner.vllm_config.scheduler_config.max_num_seqs
    verify = measure_verify(runner, [b for b in BATCH_LADDER if b <= max_seqs])
    curve, loaded = one((CostCurve(curve.points, verify), loaded))
    if loaded:  # other processes took the cores meanwhile: used, not kept
        logger.warning("Lookahead: other processes kept the CPU busy while the step cost "
                       "was measured (%d of its points); not caching the curve", loaded)
    path = None if loaded else cache.save(key, curve)
    logger.info("Lookahead: step cost measured (%s), 1-token step %.1f ms, a sampled draft's "
                "verification (first, next, bonus, switch) %s ms at batch 1%s",
                ", ".join(f"batch {b}: {len(p)} sizes" for b, p in curve.points.items()),
                curve.predict(1, 1) * 1e3,
                [round(x * 1e3, 2) for x in curve.verify_row(1, sampled=True)],
                f", cached in {path}" if path else "")
    return CostModel(curve, source="measured-under-load" if loaded else "measured")


def measure(runner, worker, agree=None) -> tuple[CostCurve, int]:
    """Time the tree step on the engine's KV cache, ``b`` requests of ``t``
    query tokens over :data:`CONTEXT` cached ones, within :data:`BUDGET_S`
    seconds (the waits for load not counted); returns the curve and how many
    points stayed loaded. With tensor parallelism (``agree``) there is no load
    check: the other ranks load the cores themselves."""
    import numpy as np

    from vllm_lookahead.worker import TreeRequest

    cfg = runner.vllm_config
    max_len = cfg.model_config.max_model_len
    context = max(1, min(CONTEXT, max_len - 2 * TOKEN_LADDER[-1]))
    batches = [b for b in BATCH_LADDER if b <= cfg.scheduler_config.max_num_seqs]
    tokens = [t for t in TOKEN_LADDER if context + t < max_len]
    waited, loaded = [0.0], set()

    def time_step(b: int, t: int) -> float:
        mask = np.tril(np.ones((t, t), dtype=bool))
        reqs = [TreeRequest(tokens=np.full(t, 100 + r, dtype=np.int32),
                            positions=np.arange(context, context + t, dtype=np.int64),
                            mask=mask, context_len=context, batch_index=r) for r in range(b)]
        for attempt in range(LOAD_RETRIES + 1):
            if attempt:
                t0 = time.perf_counter()
                time.sleep(LOAD_WAIT_S)
                waited[0] += time.perf_counter() - t0
            took, cores = timed_under_load(lambda: worker.run(reqs))
            if agree is not None or cores <= LOAD_CORES:
                return took
        loaded.add((b, t))
        return took

    keep_going = None if agree is None else (lambda wish: bool(agree(wish)))
    curve = measure_curve(time_step, batches, tokens, budget_s=BUDGET_S, keep_going=keep_going,
                          clock=lambda: time.perf_counter() - waited[0])
    return curve, len(loaded)


#: Draft tokens of the longer draft :func:`measure_verify` times, timed runs
#: per point (their median), and the sampled requests' temperature and top-p.
VERIFY_LONG, VERIFY_REPEATS = 4, 5
VERIFY_TEMPERATURE, VERIFY_TOP_P = 0.8, 0.95


def measure_verify(runner, batches) -> dict:
    """:attr:`~vllm_lookahead.planner.cost_model.CostCurve.verify`, per kind
    and batch: vLLM's plain sampler against its rejection sampler on synthetic
    peaked logits. A failure is logged and measures nothing."""
    try:
        return _measure_verify(runner, batches)
    except Exception as e:  # never stop the engine for a measurement
        logger.warning("Lookahead: could not time vLLM's verification (%s: %s); the planner "
                       "counts none", type(e).__name__, e)
        return {}


def _measure_verify(runner, batches) -> dict:
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    device, dtype, vocab = runner.device, runner.model_config.dtype, \
        runner.model_config.get_vocab_size()
    sampler, verifier = runner.sampler, runner.rejection_sampler
    gen = torch.Generator(device="cpu").manual_seed(0)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def metadata(b: int, sampled: bool, seeded: bool):
        full = lambda v: torch.full((b,), v, device=device, dtype=torch.float32)  # noqa: E731
        return SamplingMetadata(
            temperature=full(VERIFY_TEMPERATURE) if sampled else None,
            all_greedy=not sampled, all_random=sampled,
            top_p=full(VERIFY_TOP_P) if sampled else None, top_k=None,
            generators={i: torch.Generator(device=device).manual_seed(1000 + i)
                        for i in range(b)} if seeded else {},
            max_num_logprobs=None, logprob_token_ids=None, no_penalties=True,
            prompt_token_ids=None, frequency_penalties=full(0.0),
            presence_penalties=full(0.0), repetition_penalties=full(1.0),
            output_token_ids=[[] for _ in range(b)], spec_token_ids=[[] for _ in range(b)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())

    def spec(drafts: list[int], token: int = 1):
        md = SpecDecodeMetadata.make_dummy([[token] * k for k in drafts], device)
        # vLLM's row order: each request's draft rows, then its bonus row
        ends = [sum(drafts[:i + 1]) + i for i in range(len(drafts))]
        md.bonus_logits_indices = torch.tensor(ends, dtype=torch.int32, device=device)
        md.target_logits_indices = torch.tensor(
            [e - k + j for e, k in zip(ends, drafts) for j in range(k)],
            dtype=torch.int32, device=device)
        md.logits_indices = torch.arange(ends[-1] + 1, dtype=torch.int32, device=device)
        return md

    def timed(call, rows: int) -> float:
        # token 1 holds nearly all the mass: drafts of it are accepted
        x = torch.randn(rows, vocab, generator=gen)
        x[:, :5] += torch.tensor([15.0, 24.0, 14.5, 14.0, 12.0])
        x = x.to(device=device, dtype=dtype)
        took = []
        for _ in range(VERIFY_REPEATS + 1):
            y = x.clone()
            sync()
            t0 = time.perf_counter()
            call(y)
            sync()
            took.append(time.perf_counter() - t0)
        return statistics.median(took[1:])

    def verified(md, meta, rows: int) -> float:
        return timed(lambda y: verifier(md, None, y, meta), rows)

    out: dict = {}
    with torch.inference_mode():
        for kind, sampled, seeded in (("sampled", True, False), ("greedy", False, False),
                                      ("seeded", True, True)):
            out[kind] = {}
            for b in batches:
                meta = metadata(b, sampled, seeded)
                if getattr(runner, "use_async_scheduling", False):  # no draft, verifier's path
                    plain = verified(spec([0] * b), meta, b)
                else:
                    plain = timed(lambda y: sampler(logits=y, sampling_metadata=meta), b)
                first = verified(spec([1] + [0] * (b - 1)), meta, b + 1)
                last = verified(spec([VERIFY_LONG] + [0] * (b - 1)), meta, b + VERIFY_LONG)
                accepted = verified(spec([1] * b), meta, 2 * b)
                bonus = 0.0  # accepted over rejected (the last token, no mass) per request
                if sampled and not seeded:  # elsewhere bonus rows are never skipped
                    rejected = verified(spec([1] * b, vocab - 1), meta, 2 * b)
                    bonus = max(accepted - rejected, 0.0) / b
                # first: what each further drafting request adds, at most what the
                # one adds; switch: the rest of that
                one = max(first - plain, 0.0)
                own = one if b == 1 else min(max(accepted - first, 0.0) / (b - 1), one)
                out[kind][b] = (own, max(last - first, 0.0) / (VERIFY_LONG - 1), bonus, one - own)
    return out


def _key(runner) -> dict:
    import torch
    import vllm

    cfg = runner.vllm_config
    mc, pc = cfg.model_config, cfg.parallel_config
    dev = getattr(runner, "device", None)
    device = torch.cuda.get_device_name(dev) if getattr(dev, "type", "") == "cuda" else "cpu"
    return cache_key(
        model=mc.model, dtype=str(mc.dtype).replace("torch.", ""),
        tensor_parallel=pc.tensor_parallel_size, pipeline_parallel=pc.pipeline_parallel_size,
        vllm_version=getattr(vllm, "__version__", "unknown"), device=device,
        extra={"enforce_eager": bool(mc.enforce_eager), "context": CONTEXT,
               "step_revision": STEP_REVISION,
               "max_num_seqs": cfg.scheduler_config.max_num_seqs})
