"""User-facing configuration of lookahead decoding.

:class:`LookaheadConfig` holds the engine's settings, validated (every bad
value is reported with the name of the field and its allowed range);
:func:`request_settings` reads one request's own settings from its
``SamplingParams.extra_args``. How a user's ``speculative_config`` (and
vLLM's shorthand flags) select lookahead and become a :class:`LookaheadConfig`
is :mod:`vllm_lookahead.spellings`.

This module is pure Python (no vLLM import) so it can be unit-tested and
imported cheaply from the plugin entry point.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: Key of ``VllmConfig.additional_config`` that carries the validated
#: lookahead settings to every worker process.
ADDITIONAL_CONFIG_KEY = "lookahead"
#: The ``SchedulerOutput`` attribute that carries the requests left waiting
#: to the workers (``patches`` 16; the planner's ``batch_end``).
WAITING_ATTR = "lookahead_waiting"


class LookaheadConfigError(ValueError):
    """A lookahead setting is invalid. The message names the field."""


@dataclass(frozen=True)
class LookaheadConfig:
    """Settings of lookahead decoding (Fu et al., ICML 2024).

    Attributes:
        ngram_size: N, the length of the n-grams the Jacobi window produces
            and the pool stores (a key token plus N-1 continuation tokens).
            The window has N-1 levels. Range: 2..16.
        window_size: W, the number of Jacobi columns (parallel n-gram
            trajectories). Range: 0..64; 0 turns the Jacobi branch off, leaving
            prompt lookup from the pool (needs ``prompt_pool``).
        guess_set_size: G, the most candidate continuations kept per key token
            in the n-gram pool and checked per step. Range: 1..64.
        prompt_pool: also seed the pool with every n-gram of the prompt (and
            keep adding the n-grams of the generated text).
        seed: base seed of the window initialisation; the per-request seed
            is derived from it and the prompt tokens, so every tensor-parallel
            rank computes the same window.
        mode: ``"fused"`` (default): the lookahead branch rides in vLLM's
            verification forward as extra tree-masked query tokens, one
            target forward per step. ``"separate"``: a second, tree-masked
            forward after sampling (two forwards per step; the draft is
            pre-checked against every pool candidate).
        max_tree_tokens: budget of lookahead query tokens per engine step,
            summed over the batch (0 = no limit). When the batch's trees do
            not fit, the window is left out of the step (it resumes later),
            then fewer candidates are checked, then no tree is run.
        disable_batch_size: with this many requests decoding or more, the
            step runs without lookahead at all (no tree, no draft): a vanilla
            step. 0 or None (default) = never: the planner (``adaptive``)
            already runs no tree and no draft where they do not pay, from
            the measured cost of a step on the machine at hand.
        adaptive: plan every step (see :mod:`vllm_lookahead.planner.planner`): per
            request, the draft length and the tree shape (including no tree
            and no draft) that maximise the batch's expected tokens per
            second, from the measured cost of a step (``cost_model``) and
            each request's measured acceptance; N, W and G are upper
            bounds. Outputs never depend on it. False: every step runs the
            full tree (a fixed shape, for experiments and tests).
        cost_model: where the step-cost curve the planner uses comes from:
            ``"auto"`` (cached for this model, dtype, parallel sizes,
            hardware and vLLM version; measured at start-up, in a few
            seconds, when there is none), ``"measure"`` (at every start),
            ``"off"`` (an assumed curve, corrected from the steps seen), or
            the path of a JSON curve file (see :mod:`.cost_model`).
        shared_memory: keep a memory of the engine's requests' text
            (:mod:`.memory`) and draft from it where a request's own text
            has no match: n samples of one prompt, repeated questions and
            templated work repeat across requests. Requests only draft
            from text of their own ``cache_salt``; seeded sampled requests
            never draft from it (their tokens must not depend on what ran
            before them). A request can opt out (``extra_args``).
        memory_tokens: the memory's capacity in tokens (all requests'
            text; the oldest request's text is evicted first). The default,
            131072, holds a 128k-token mix in about 9 MB. Range 256..2^26.
        lookup_len: the longest unchecked draft: the continuation of a
            match in the request's own text or in the shared memory (a
            repeated answer, a template's fixed fields run on for many
            tokens). A tree's checked draft stays within N. The planner
            picks each step's length up to it from the measured
            acceptance and cost; vLLM's ``num_speculative_tokens``
            defaults to ``max(ngram_size, lookup_len)``. Past N a lookup
            runs no further than its match is long (suffix decoding's
            rule; ``drafting.lookup``). 0 = N (the lookups draft no
            further than the trees), the default: on the CPUs measured,
            drafts past N moved templated work at batch 1 by -0.07 to
            +0.11x vanilla (seven runs) and n=4 work either way (README,
            benchmark results); on CUDA the ``num_speculative_tokens`` it
            sets also rounds vLLM's graph capture sizes. Range 0..64.
        parent_latency: plan the n samples of one request
            (``SamplingParams.n``, best-of-n, rollouts) for the request's
            latency: vLLM answers it when its last sample ends, so a
            token a sample gains is worth the parent's last step where the
            sample would have ended last, and the batch slot it frees
            otherwise (:func:`~vllm_lookahead.planner.planner.sibling_weights`,
            :mod:`~vllm_lookahead.planner.siblings`). True (the default): on the
            CPU measured it was 1.026x planning every sample for its own
            tokens (False) over 24 paired rows, n = 4 and 16 (README), for
            0.3-0.6 ms more proposer time a step.
        batch_end: where nothing waits for the batch's slots (vLLM's
            scheduler has no request waiting) and every request of the
            batch decodes with lookahead towards an output cap, plan the
            batch for its end, as if its requests were the samples of one
            parent (:func:`~vllm_lookahead.planner.planner.sibling_weights`): a
            token gained by a request that would not end last only frees
            its slot a step sooner. That is what a caller waiting for a
            whole batch gets (``LLM.generate``, a rollout batch); a server's
            clients each wait for their own request. False (the default):
            each request (or parent) for its own end.
        learn_step_cost: correct what a draft costs (the cost model's plane
            of steps without trees, ``CostModel.observe``) from the step
            times the engine sees: ``True`` in every batch bucket,
            ``"auto"`` (the default) in buckets of
            ``CostModel.AUTO_LEARN_BUCKET`` (8) requests or more, ``False``
            in none. Where it does not learn, drafts are priced from the
            cost curve and vLLM's verification as measured at start-up (or
            cached), and only steps with trees correct their price (an
            assumed curve, ``cost_model: "off"`` or an engine where trees
            cannot run, is corrected from the steps still). At 4 requests
            and fewer the learnt price moved from run to run by several
            times on the 2-vCPU AMX Xeon (a drafting request 0.7-4.6 ms,
            stop 51) and the start-up price read better paired (+2.7% over
            eight rows at n = 4, +3.2% on the template set at batch 1,
            stops 51-52); at 16 sampled sequences the start-up price
            drafts far longer without more tokens a step, and learning
            read better: by 1.8% over eight paired rows on the Xeon
            (stops 51-52), and on the 2-vCPU Zen 5 EPYC (stop 53) by +2.9
            and +8.4% (``True``, seed 207) and, ``"auto"`` against
            ``False``, +3.6 and +11.6% (seed 208) and +8.7 and +13.5%
            (seed 209), where ``False`` read 0.981x and 0.961x vanilla
            on MT-Bench; there at n = 4 ``True`` read -4.9 and -3.9%
            (0.974x vanilla on MT-Bench), at n = 8 ``"auto"`` +0.3 and
            +1.4% over ``False`` (README).
        min_draft_p: an unchecked draft runs no further than the token
            at which its expected acceptance of every token so far
            (``p^k``, p its kind's measured per-token rate) falls below
            this, whatever the planner's prices say (suffix decoding's
            ``min_token_prob`` rule, on lookahead's own estimates): a
            bound on the draft tokens a wrong cost curve can buy. 0 (the
            default): off. On the 2-vCPU Zen 5 EPYC 0.1 read +5.5% and
            +1.0% over 0 at 16 samples with the start-up price
            (``learn_step_cost: false``), and -2.6% and 0.0% at 4 samples
            under the defaults, where it cut drafts that paid (stop 54,
            README). Range 0..1.
        seeded_batch: the batch a seeded sampled request's draft is
            priced in (``Planner.steady_draft``; nothing timed while it
            runs may size it, so not the batch it meets): its parent's n
            (vLLM runs a request's n samples together) or this, whichever
            is larger, at most ``max_num_seqs``. 0 (the default): n. A
            draft that pays alone may not in a batch: on the AVX2 EPYC a
            sampled draft had to gain about 0.1 tokens alone and 0.4 at 4
            requests. A server batching seeded requests with others can
            give its typical batch (seeded drafts then run less). Range
            0..2^20.

    The defaults (N, W, G) = (4, 3, 3) are the fastest measured on a 2-core
    CPU (bfloat16, SmolLM2-135M, HumanEval and MT-Bench): there every query
    token adds to the cost of a forward, so a small tree wins.
    """

    ngram_size: int = 4
    window_size: int = 3
    guess_set_size: int = 3
    prompt_pool: bool = True
    seed: int = 0
    mode: str = "fused"
    max_tree_tokens: int = 0
    disable_batch_size: int | None = None
    adaptive: bool = True
    cost_model: str = "auto"
    shared_memory: bool = True
    memory_tokens: int = 131072
    lookup_len: int = 0
    parent_latency: bool = True
    batch_end: bool = False
    learn_step_cost: bool | str = "auto"
    min_draft_p: float = 0.0
    seeded_batch: int = 0

    _RANGES = {
        "ngram_size": (2, 16),
        "window_size": (0, 64),
        "guess_set_size": (1, 64),
        "seed": (0, 2**63 - 1),
        "max_tree_tokens": (0, 1 << 20),
        "disable_batch_size": (0, 1 << 20),
        "memory_tokens": (256, 1 << 26),
        "lookup_len": (0, 64),
        "seeded_batch": (0, 1 << 20),
    }
    _CHOICES = {"mode": ("fused", "separate")}
    #: ``cost_model`` keywords; any other value is a file path.
    COST_MODEL_CHOICES = ("auto", "measure", "off")
    _OPTIONAL = frozenset({"disable_batch_size"})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self._OPTIONAL:
                continue
            if f.name in self._CHOICES:
                choices = self._CHOICES[f.name]
                if value not in choices:
                    raise LookaheadConfigError(
                        f"speculative_config['{f.name}'] must be one of "
                        f"{list(choices)}, got {value!r}"
                    )
                continue
            if f.name == "cost_model":
                self._check_cost_model(value)
                continue
            if f.name == "learn_step_cost":
                if not (isinstance(value, bool) or value == "auto"):
                    raise LookaheadConfigError(
                        f"speculative_config['learn_step_cost'] must be a boolean "
                        f"(true/false) or \"auto\", got {value!r}"
                    )
                continue
            if f.name == "min_draft_p":
                if (isinstance(value, bool) or not isinstance(value, (int, float))
                        or not 0.0 <= value <= 1.0):
                    raise LookaheadConfigError(
                        f"speculative_config['min_draft_p'] must be a number in [0, 1], "
                        f"got {value!r}"
                    )
                continue
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise LookaheadConfigError(
                        f"speculative_config['{f.name}'] must be a boolean "
                        f"(true/false), got {value!r}"
                    )
                continue
            lo, hi = self._RANGES[f.name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise LookaheadConfigError(
                    f"speculative_config['{f.name}'] must be an integer in "
                    f"[{lo}, {hi}], got {value!r} ({type(value).__name__})"
                )
            if not lo <= value <= hi:
                raise LookaheadConfigError(
                    f"speculative_config['{f.name}'] must be in [{lo}, {hi}], "
                    f"got {value}"
                )

        if self.window_size == 0 and not self.prompt_pool:
            raise LookaheadConfigError(
                "speculative_config['window_size'] = 0 (no Jacobi window) needs "
                "prompt_pool = true, or nothing would ever be drafted"
            )

    @classmethod
    def _check_cost_model(cls, value) -> None:
        import os

        if not isinstance(value, str) or not value:
            raise LookaheadConfigError(
                f"speculative_config['cost_model'] must be one of "
                f"{list(cls.COST_MODEL_CHOICES)} or a file path, got {value!r}"
            )
        if value not in cls.COST_MODEL_CHOICES and not os.path.isfile(value):
            raise LookaheadConfigError(
                f"speculative_config['cost_model'] = {value!r} is neither one of "
                f"{list(cls.COST_MODEL_CHOICES)} nor an existing file"
            )

    @property
    def max_draft_len(self) -> int:
        """Longest draft one step can hand the verifier: a fully confirmed
        (N-1)-token candidate plus the target's next token after it, or an
        unchecked lookup of ``lookup_len`` tokens."""
        return max(self.ngram_size, self.lookup_len)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LookaheadConfig":
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise LookaheadConfigError(
                f"unknown lookahead setting(s) {unknown}; "
                f"allowed: {cls.field_names()}"
            )
        return cls(**d)


# -- per-request settings ----------------------------------------------------

#: ``SamplingParams.extra_args`` key of a request's own lookahead settings.
REQUEST_KEY = "lookahead"
#: Fields a request may lower (never raise above the engine's).
REQUEST_FIELDS = ("ngram_size", "window_size", "guess_set_size", "lookup_len")


@dataclass(frozen=True)
class RequestSettings:
    """Lookahead settings of one request (engine settings, maybe lowered)."""

    enabled: bool = True
    ngram_size: int = 4
    window_size: int = 3
    guess_set_size: int = 3
    #: longest unchecked draft (0: N; ``LookaheadConfig.lookup_len``)
    lookup_len: int = 0
    #: reads and feeds the engine's shared memory (``LookaheadConfig.shared_memory``)
    shared_memory: bool = True


def request_settings(extra_args: dict[str, Any] | None, engine: LookaheadConfig) -> RequestSettings:
    """A request's settings from its ``SamplingParams.extra_args``.

    Accepted forms (all optional)::

        extra_args={"lookahead": False}                  # off for this request
        extra_args={"lookahead": {"enabled": False}}
        extra_args={"lookahead": {"ngram_size": 3, "window_size": 2, "guess_set_size": 2}}
        extra_args={"lookahead_window_size": 2}          # flat form (vllm_xargs)
        extra_args={"lookahead": {"shared_memory": False}}  # keep out of the shared memory

    ``shared_memory: false`` keeps the request out of the engine's shared
    memory: it neither drafts from other requests' text nor leaves its own
    there. (``true`` where the engine's memory is off changes nothing.)

    A request may lower N (down to 2), W (down to 0), G (down to 1) and
    ``lookup_len`` (down to 0: N) below the engine's values, never raise
    them.

    Raises:
        LookaheadConfigError: unknown key, wrong type or value out of range;
            the message names the field.
    """
    base = {
        "enabled": True,
        "ngram_size": engine.ngram_size,
        "window_size": engine.window_size,
        "guess_set_size": engine.guess_set_size,
        "lookup_len": engine.lookup_len,
        "shared_memory": engine.shared_memory,
    }
    if not extra_args:
        return RequestSettings(**base)
    given: dict[str, Any] = {}
    nested = extra_args.get(REQUEST_KEY)
    if isinstance(nested, bool):
        given["enabled"] = nested
    elif isinstance(nested, dict):
        given.update(nested)
    elif nested is not None:
        raise LookaheadConfigError(
            f"extra_args['{REQUEST_KEY}'] must be true/false or a dict of "
            f"{['enabled', *REQUEST_FIELDS, 'shared_memory']}, got {nested!r}"
        )
    prefix = REQUEST_KEY + "_"
    for key, value in extra_args.items():
        if isinstance(key, str) and key.startswith(prefix):
            given[key[len(prefix):]] = value
    allowed = ["enabled", *REQUEST_FIELDS, "shared_memory"]
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise LookaheadConfigError(
            f"unknown per-request lookahead setting(s) {unknown} in extra_args; "
            f"allowed: {allowed}"
        )
    enabled = _flag(given.pop("enabled", True), "enabled")
    if "shared_memory" in given:
        memory = _flag(given.pop("shared_memory"), "shared_memory")
        base["shared_memory"] = base["shared_memory"] and memory
    lows = {"ngram_size": 2, "window_size": 0, "guess_set_size": 1, "lookup_len": 0}
    for name, value in given.items():
        hi = base[name]
        lo = lows[name]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise LookaheadConfigError(
                f"extra_args['{REQUEST_KEY}']['{name}'] must be an integer in "
                f"[{lo}, {hi}] (a request may lower the engine's {name}={hi}, "
                f"not raise it), got {value!r}"
            )
        base[name] = value
    base["enabled"] = enabled
    if base["window_size"] == 0 and not engine.prompt_pool and enabled:
        raise LookaheadConfigError(
            f"extra_args['{REQUEST_KEY}']['window_size'] = 0 needs the engine's "
            "prompt_pool, which is off: nothing would ever be drafted"
        )
    return RequestSettings(**base)


def _flag(value, name: str) -> bool:
    """A per-request boolean. vllm_xargs (the server's way in) carries
    str | int | float only: a JSON false arrives as 0, "false" stays a
    string."""
    if type(value) is int and value in (0, 1):  # not a bool: type() is exact
        value = bool(value)
    elif isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, bool):
        raise LookaheadConfigError(
            f"extra_args['{REQUEST_KEY}']['{name}'] must be true/false, got {value!r}"
        )
    return value
