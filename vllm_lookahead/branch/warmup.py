"""The cost model of an engine, set up when vLLM warms the model up.

``cost_model`` (a lookahead setting) says where the curve comes from:

* ``"auto"`` (default): the curve cached on disk for this model, dtype,
  parallel sizes, hardware and vLLM version; measured (and cached) if there
  is none;
* ``"measure"``: measured at every start (and cached);
* a path to a JSON file (as :class:`~.cost_cache.CostCache` writes them):
  that curve, whatever the machine;
* ``"off"``: nothing measured; the planner assumes each query token adds
  :data:`ASSUMED_PER_TOKEN` of a one-token step, and corrects only the scale
  from the steps it sees.

The measurement times the real model on the engine's own KV cache: ``B``
requests with ``T`` query tokens each over a cached prefix of
:data:`CONTEXT` tokens (a lookahead step's shape: a few tree or draft rows
per request, not a prefill), within :data:`BUDGET_S` seconds.
"""

from __future__ import annotations

import statistics
import time

from vllm.logger import init_logger

from vllm_lookahead.planner.cost_cache import CostCache, cache_key, load_curve
from vllm_lookahead.planner.cost_model import (
    BATCH_LADDER,
    TOKEN_LADDER,
    CostCurve,
    CostModel,
    measure_curve,
)
from vllm_lookahead.planner.machine import LoadProbe

logger = init_logger("vllm." + __name__)

#: Seconds the engine-start measurement may take (the ladder is cut there).
BUDGET_S = 6.0
#: Cached tokens in front of the timed rows.
CONTEXT = 256
#: Revision of the tree step's code, in the cost cache's key: a change that
#: moves what the measured steps cost bumps it, so a curve cached before it
#: is measured again (2: the tiled read of vLLM's AMX cache, half the
#: bfloat16 tree step on a CPU with AMX; 3: the verification timed with
#: drafts that are accepted, so that a lazy verifier computes every row;
#: 4: and a rejected one, for the bonus row a lazy verifier skips; 5: and
#: every request drafting, for what a step pays once where any drafts;
#: 7 (6 was a reverted change): the ladder breadth first, every batch's
#: first two sizes before the first batches' long ones; 8: the
#: verification of seeded requests timed apart).
STEP_REVISION = 8
#: ``cost_model="off"``: relative cost of each extra query token.
ASSUMED_PER_TOKEN = 0.1
#: A timed run during which other processes kept more cores than this busy
#: is retried after LOAD_WAIT_S, at most LOAD_RETRIES times.
LOAD_CORES = 0.3
LOAD_WAIT_S = 0.5
LOAD_RETRIES = 6


def build_cost_model(setting: str, runner, worker, agree=None) -> CostModel:
    """The engine's :class:`CostModel` for ``setting`` (see module doc).

    ``agree(obj) -> obj``: with tensor parallelism, rank 0's value on every
    rank (all ranks must run the same measuring forwards and plan alike).
    """
    one = (lambda x: x) if agree is None else agree
    if setting == "off":
        return CostModel(CostCurve.flat(0.05, ASSUMED_PER_TOKEN), source="assumed")
    key = _key(runner)
    cache = CostCache()
    if setting == "auto":
        curve, where, source = cache.load(key), cache.path(key), "cached"
    elif setting == "measure":
        curve, where, source = None, None, None
    else:
        curve, where, source = load_curve(setting), setting, f"file:{setting}"
        if curve is None:
            logger.warning("Lookahead: no usable cost curve in %s; measuring one", setting)
    # Every rank must agree on whether to measure (measuring runs forwards,
    # and a file or cache may be readable on one node only), and use rank
    # 0's curve.
    if one(curve is not None):
        logger.info("Lookahead: step cost curve from %s", where)
        return CostModel(one(curve), source=source)
    curve, loaded = measure(runner, worker, agree)
    max_seqs = runner.vllm_config.scheduler_config.max_num_seqs
    verify = measure_verify(runner, [b for b in BATCH_LADDER if b <= max_seqs])
    curve, loaded = one((CostCurve(curve.points, verify), loaded))
    if loaded:
        # Other processes took the cores while we timed: the curve may be
        # off. Use it for this run, but do not keep it.
        logger.warning("Lookahead: other processes kept the CPU busy while the step cost "
                       "was measured (%d of its points); not caching the curve", loaded)
        path = None
    else:
        path = cache.save(key, curve)
    first, nxt = curve.verify_at(1, sampled=True)
    top = max((b for table in curve.verify.values() for b in table), default=1)
    logger.info("Lookahead: step cost measured (%s), 1-token step %.1f ms, a sampled "
                "draft's verification %.2f ms + %.2f ms per next token (%.2f ms of it "
                "saved where the draft is rejected; at batch %d %.2f ms a drafting "
                "request and %.2f ms a step with any)%s",
                ", ".join(f"batch {b}: {len(p)} sizes" for b, p in curve.points.items()),
                curve.predict(1, 1) * 1e3, first * 1e3, nxt * 1e3,
                curve.bonus_at(1, sampled=True) * 1e3, top,
                curve.verify_at(top, sampled=True)[0] * 1e3,
                curve.switch_at(top, sampled=True) * 1e3,
                f", cached in {path}" if path else "")
    return CostModel(curve, source="measured" if not loaded else "measured-under-load")


def measure(runner, worker, agree=None) -> tuple[CostCurve, int]:
    """Time the model's step on the engine's KV cache (see module doc).

    A run during which other processes kept more than :data:`LOAD_CORES`
    cores busy is retried after a short wait (up to :data:`LOAD_RETRIES`
    times; waiting does not count against the budget). Returns the curve
    and how many points stayed loaded. With tensor parallelism (``agree``)
    there is no load check: the other ranks load the cores themselves, and
    every rank must run the same forwards."""
    import numpy as np

    from vllm_lookahead.worker import TreeRequest

    cfg = runner.vllm_config
    max_seqs = cfg.scheduler_config.max_num_seqs
    context = max(1, min(CONTEXT, cfg.model_config.max_model_len - 2 * TOKEN_LADDER[-1]))
    batches = [b for b in BATCH_LADDER if b <= max_seqs]
    tokens = [t for t in TOKEN_LADDER if context + t < cfg.model_config.max_model_len]

    def time_step(b: int, t: int) -> float:
        mask = np.tril(np.ones((t, t), dtype=bool))
        reqs = [TreeRequest(tokens=np.full(t, 100 + r, dtype=np.int32),
                            positions=np.arange(context, context + t, dtype=np.int64),
                            mask=mask, context_len=context, batch_index=r)
                for r in range(b)]
        if agree is not None:
            # Tensor parallel: the other ranks' CPU time is no foreign load,
            # and a retry is a collective forward every rank must run.
            t0 = time.perf_counter()
            worker.run(reqs)
            return time.perf_counter() - t0
        for attempt in range(LOAD_RETRIES + 1):
            with LoadProbe() as probe:
                t0 = time.perf_counter()
                worker.run(reqs)
                took = time.perf_counter() - t0
            if probe.cores <= LOAD_CORES:
                return took
            if attempt < LOAD_RETRIES:
                t1 = time.perf_counter()
                time.sleep(LOAD_WAIT_S)
                waited[0] += time.perf_counter() - t1
        loaded.add((b, t))
        return took

    waited, loaded = [0.0], set()
    keep_going = None if agree is None else (lambda wish: bool(agree(wish)))
    curve = measure_curve(time_step, batches, tokens, budget_s=BUDGET_S, keep_going=keep_going,
                          clock=lambda: time.perf_counter() - waited[0])
    return curve, len(loaded)


#: Draft tokens of the longer draft :func:`measure_verify` times.
VERIFY_LONG = 4
#: Timed runs per verification point (after one warm-up run); the median
#: counts (the verifier runs on fresh logits in a step, never warm).
VERIFY_REPEATS = 5
#: Sampling parameters of the timed sampled requests (the common ones).
VERIFY_TEMPERATURE, VERIFY_TOP_P = 0.8, 0.95


def measure_verify(runner, batches) -> dict:
    """Time vLLM's own samplers, as the engine's steps run them, for a batch
    of ``b`` sampled (top-p), greedy or seeded (sampled, each request with
    its own generator, which vLLM's samplers draw from request by request)
    requests: the plain sampler (a step
    without drafts; vLLM's rejection sampler over no draft where async
    scheduling keeps it), and the rejection sampler with one request
    drafting one token and :data:`VERIFY_LONG` tokens, all accepted, and,
    every request drafting one token, all accepted, and, sampled, all
    rejected (a verifier that samples bonus rows only where a draft was
    wholly accepted, patch 15, skips the rejected ones'). Returns
    :attr:`CostCurve.verify`: per kind and ``b``, ``(first, next, bonus,
    switch)`` seconds, from the median of :data:`VERIFY_REPEATS` runs each
    (``first``: what each drafting request adds, the batch of ``b``
    one-token drafts over the one, per further request, at most what the
    one added over the plain sampler; ``switch``: the rest of that, which
    the step pays once; 0 at batch 1; ``bonus``: a batch of ``b`` sampled
    one-token drafts all accepted over all rejected, per request; 0 for
    greedy and seeded requests, whose bonus rows patch 15 never skips).

    The logits are synthetic and peaked (a handful of tokens hold nearly all
    the mass, as a language model's next token mostly does), so top-p keeps
    a small nucleus, as it does in decoding. A failure (a vLLM whose
    samplers take other arguments) is logged and measures nothing: the
    planner then counts no verification cost."""
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

    device = runner.device
    vocab = runner.model_config.get_vocab_size()
    dtype = runner.model_config.dtype
    sampler, verifier = runner.sampler, runner.rejection_sampler
    plain_verifier = getattr(runner, "use_async_scheduling", False)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def logits(rows: int) -> torch.Tensor:
        # the drafts' token (1) holds nearly all the mass, so every draft
        # row is accepted: a lazy verifier (patch 15) computes them all and
        # the next token's seconds are a computed row's
        x = torch.randn(rows, vocab, generator=gen)
        top = torch.tensor([15.0, 24.0, 14.5, 14.0, 12.0])
        x[:, : top.numel()] += top
        return x.to(device=device, dtype=dtype)

    def metadata(b: int, sampled: bool, seeded: bool = False):
        full = lambda v: torch.full((b,), v, device=device, dtype=torch.float32)  # noqa: E731
        # seeded: every request its own generator, as vLLM gives a request
        # with a seed (its samplers then draw each request's noise apart)
        generators = ({i: torch.Generator(device=device).manual_seed(1000 + i) for i in range(b)}
                      if seeded else {})
        return SamplingMetadata(
            temperature=full(VERIFY_TEMPERATURE) if sampled else None,
            all_greedy=not sampled, all_random=sampled,
            top_p=full(VERIFY_TOP_P) if sampled else None, top_k=None,
            generators=generators, max_num_logprobs=None, logprob_token_ids=None,
            no_penalties=True, prompt_token_ids=None,
            frequency_penalties=full(0.0), presence_penalties=full(0.0),
            repetition_penalties=full(1.0),
            output_token_ids=[[] for _ in range(b)], spec_token_ids=[[] for _ in range(b)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())

    def spec(drafts: list[int], token: int = 1):
        b, n = len(drafts), sum(drafts)
        md = SpecDecodeMetadata.make_dummy([[token] * k for k in drafts], device)
        # vLLM's row order: each request's draft rows, then its bonus row.
        target, bonus, row = [], [], 0
        for k in drafts:
            target += list(range(row, row + k))
            bonus.append(row + k)
            row += k + 1
        md.target_logits_indices = torch.tensor(target, dtype=torch.int32, device=device)
        md.bonus_logits_indices = torch.tensor(bonus, dtype=torch.int32, device=device)
        md.logits_indices = torch.arange(n + b, dtype=torch.int32, device=device)
        return md

    def timed(call, rows: int) -> float:
        x = logits(rows)
        took = []
        for _ in range(VERIFY_REPEATS + 1):
            y = x.clone()
            sync()
            t0 = time.perf_counter()
            call(y)
            sync()
            took.append(time.perf_counter() - t0)
        return statistics.median(took[1:])

    out: dict = {}
    with torch.inference_mode():
        for kind, sampled, seeded in (("sampled", True, False), ("greedy", False, False),
                                      ("seeded", True, True)):
            table = {}
            for b in batches:
                meta = metadata(b, sampled, seeded)
                if plain_verifier:
                    none = spec([0] * b)
                    plain = timed(lambda y: verifier(none, None, y, meta), b)
                else:
                    plain = timed(lambda y: sampler(logits=y, sampling_metadata=meta), b)
                one, long = spec([1] + [0] * (b - 1)), spec([VERIFY_LONG] + [0] * (b - 1))
                first = timed(lambda y: verifier(one, None, y, meta), b + 1)
                last = timed(lambda y: verifier(long, None, y, meta), b + VERIFY_LONG)
                # every request drafting one token, accepted: what each
                # drafting request adds past the first, whose step pays the
                # rejection sampler over the plain one once (the switch)
                hit = spec([1] * b)
                accepted = timed(lambda y: verifier(hit, None, y, meta), 2 * b)
                each = max(accepted - first, 0.0) / (b - 1) if b > 1 else None
                # greedy and seeded batches' bonus rows are never skipped
                # (lazy_bonus.applies)
                bonus = 0.0
                if sampled and not seeded:
                    # and one the peaked rows give no mass to, rejected: the
                    # bonus rows a lazy verifier skips, per request (the
                    # sampler's threads split a batch's rows: one row more
                    # may cost nothing, or a whole row's time)
                    miss = spec([1] * b, token=vocab - 1)
                    rejected = timed(lambda y: verifier(miss, None, y, meta), 2 * b)
                    bonus = max(accepted - rejected, 0.0) / b
                one_first = max(first - plain, 0.0)
                own = one_first if each is None else min(each, one_first)
                table[b] = (own, max(last - first, 0.0) / (VERIFY_LONG - 1), bonus,
                            one_first - own)
            out[kind] = table
    return out


def _key(runner) -> dict:
    import vllm

    cfg = runner.vllm_config
    mc, pc = cfg.model_config, cfg.parallel_config
    device = "cpu"
    try:
        import torch

        dev = getattr(runner, "device", None)
        if dev is not None and getattr(dev, "type", "cpu") == "cuda":
            device = torch.cuda.get_device_name(dev)
    except Exception:  # pragma: no cover
        pass
    return cache_key(
        model=mc.model, dtype=str(mc.dtype).replace("torch.", ""),
        tensor_parallel=pc.tensor_parallel_size, pipeline_parallel=pc.pipeline_parallel_size,
        vllm_version=getattr(vllm, "__version__", "unknown"), device=device,
        extra={"enforce_eager": bool(mc.enforce_eager), "context": CONTEXT,
               "step_revision": STEP_REVISION,
               "max_num_seqs": cfg.scheduler_config.max_num_seqs},
    )
