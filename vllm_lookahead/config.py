"""User-facing configuration of lookahead decoding.

Users write ``speculative_config={"method": "lookahead", "ngram_size": 4, ...}``
(or any other spelling vLLM takes for a method: :func:`is_lookahead`,
:func:`merge_spec_flags`).
:func:`split_speculative_config` separates our keys from the ones vLLM's own
``SpeculativeConfig`` understands, validates ours into a :class:`LookaheadConfig`
and reports every bad value with the name of the field and its allowed range.

This module is pure Python (no vLLM import) so it can be unit-tested and
imported cheaply from the plugin entry point.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

METHOD = "lookahead"
#: Every ``method`` that selects lookahead (vLLM takes ``"[ngram]"`` as a
#: method too).
METHOD_NAMES = ("lookahead", "[lookahead]")
#: Every ``model`` that selects lookahead when no method is given, as
#: ``"[ngram]"`` and ``"ngram"`` select prompt lookup in vLLM
#: (``--spec-model "[lookahead]"``, ``--speculative-model "[lookahead]"``).
MODEL_NAMES = ("[lookahead]", "lookahead")
#: vLLM 0.32's shorthand flags, merged into ``speculative_config`` by
#: ``EngineArgs.create_speculative_config``: (flag, key, EngineArgs field).
SPEC_FLAGS = (
    ("--spec-method", "method", "spec_method"),
    ("--spec-model", "model", "spec_model"),
    ("--spec-tokens", "num_speculative_tokens", "spec_tokens"),
)
#: Key of ``VllmConfig.additional_config`` that carries the validated
#: lookahead settings to every worker process.
ADDITIONAL_CONFIG_KEY = "lookahead"
#: The proposer class vLLM instantiates (through its ``custom_class`` hook).
PROPOSER_QUALNAME = "vllm_lookahead.proposer.LookaheadProposer"

# Keys of vLLM's SpeculativeConfig a lookahead user may still set. ``method``
# and ``model`` are ours to fill in; draft-model keys make no sense here.
PASSTHROUGH_KEYS = frozenset(
    {
        "num_speculative_tokens",
        "num_speculative_tokens_per_batch_size",
        "rejection_sample_method",
        "enforce_eager",
    }
)


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
        adaptive: plan every step (see :mod:`vllm_lookahead.planner`): per
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

    _RANGES = {
        "ngram_size": (2, 16),
        "window_size": (0, 64),
        "guess_set_size": (1, 64),
        "seed": (0, 2**63 - 1),
        "max_tree_tokens": (0, 1 << 20),
        "disable_batch_size": (0, 1 << 20),
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
        (N-1)-token candidate plus the target's next token after it."""
        return self.ngram_size

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


@dataclass
class SplitConfig:
    """Result of :func:`split_speculative_config`."""

    lookahead: LookaheadConfig
    #: Keyword arguments for vLLM's SpeculativeConfig.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)


def _underscored(spec: dict[str, Any]) -> dict[str, Any]:
    """The dict with dashes in its keys read as underscores, as vLLM's CLI
    reads them (``ngram-size`` == ``ngram_size``)."""
    return {str(k).replace("-", "_"): v for k, v in spec.items()}


def is_lookahead(spec: Any) -> bool:
    """Whether a (merged) ``speculative_config`` dict selects lookahead:
    ``method`` is ``"lookahead"``, or no method and ``model`` is
    ``"[lookahead]"``/``"lookahead"`` (how ``"[ngram]"`` selects ngram).

    Raises:
        LookaheadConfigError: ``model`` names lookahead but ``method`` names
            another method.
    """
    if not isinstance(spec, dict):
        return False
    spec = _underscored(spec)
    method, model = spec.get("method"), spec.get("model")
    if method in METHOD_NAMES:
        return True
    if model in MODEL_NAMES and method is not None:
        raise LookaheadConfigError(
            f"speculative model {model!r} selects method 'lookahead', but the "
            f"method is {method!r}; give one of them"
        )
    return method is None and model in MODEL_NAMES


def merge_spec_flags(spec: Any, args: Any) -> tuple[Any, dict[str, str]]:
    """``speculative_config`` with vLLM's shorthand flags merged in, as
    vLLM 0.32's ``EngineArgs.create_speculative_config`` merges them, but
    without changing ``args``.

    Args:
        spec: ``EngineArgs.speculative_config`` (a dict or None).
        args: the ``EngineArgs`` (``spec_method``, ``spec_model``,
            ``spec_tokens``; missing fields count as not given).

    Returns:
        The merged dict (None when nothing is set) and, per key that came
        from a flag, that flag's name (for error messages).

    Raises:
        ValueError: a flag and the same key of ``--speculative-config`` are
            both given (vLLM's own message: "... are mutually exclusive").
    """
    merged = dict(spec) if isinstance(spec, dict) else spec
    names: dict[str, str] = {}
    for flag, key, attr in SPEC_FLAGS:
        value = getattr(args, attr, None)
        if value is None:
            continue
        if merged is None:
            merged = {}
        if key in _underscored(merged):
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        merged[key] = value
        names[key] = flag
    return merged, names


def split_speculative_config(
    spec: dict[str, Any], names: dict[str, str] | None = None
) -> SplitConfig:
    """Validate a ``speculative_config`` dict that selects lookahead
    (:func:`is_lookahead`).

    Returns our settings and the kwargs for vLLM's ``SpeculativeConfig``
    (``method="custom_class"`` pointing at our proposer). Dashes in keys are
    accepted like vLLM's CLI does (``ngram-size`` == ``ngram_size``).

    Args:
        spec: the merged dict.
        names: how the user spelled a key that came from a flag
            (``{"num_speculative_tokens": "--spec-tokens"}``), for messages.

    Raises:
        LookaheadConfigError: unknown key, wrong type or value out of range.
    """
    spec = _underscored(spec)
    names = names or {}

    def name(key: str) -> str:
        return names.get(key) or f"speculative_config['{key}']"

    if not is_lookahead(spec):
        raise LookaheadConfigError(f"{spec!r} does not select method 'lookahead'")
    spec.pop("method", None)
    model = spec.pop("model", None)
    if model is not None and model not in MODEL_NAMES:
        raise LookaheadConfigError(
            f"{name('model')} = {model!r}: lookahead drafts from the text and takes "
            f"no draft model (leave it out, or give {MODEL_NAMES[0]!r})"
        )
    ours = {k: spec.pop(k) for k in list(spec) if k in LookaheadConfig.field_names()}
    unknown = sorted(set(spec) - PASSTHROUGH_KEYS)
    if unknown:
        raise LookaheadConfigError(
            f"unknown key(s) {unknown} in speculative_config for method "
            f"'lookahead'; allowed: "
            f"{sorted(LookaheadConfig.field_names() + list(PASSTHROUGH_KEYS))}"
        )
    cfg = LookaheadConfig.from_dict(ours)
    k = spec.pop("num_speculative_tokens", None)
    if k is None:
        k = cfg.max_draft_len
    elif isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cfg.max_draft_len:
        raise LookaheadConfigError(
            f"{name('num_speculative_tokens')} must be an integer "
            f"in [1, ngram_size={cfg.max_draft_len}], got {k!r}"
        )
    vllm_kwargs = {
        **spec,
        "method": "custom_class",
        "model": PROPOSER_QUALNAME,
        "num_speculative_tokens": k,
    }
    return SplitConfig(lookahead=cfg, vllm_kwargs=vllm_kwargs)


# -- per-request settings ----------------------------------------------------

#: ``SamplingParams.extra_args`` key of a request's own lookahead settings.
REQUEST_KEY = "lookahead"
#: Fields a request may lower (never raise above the engine's).
REQUEST_FIELDS = ("ngram_size", "window_size", "guess_set_size")


@dataclass(frozen=True)
class RequestSettings:
    """Lookahead settings of one request (engine settings, maybe lowered)."""

    enabled: bool = True
    ngram_size: int = 4
    window_size: int = 3
    guess_set_size: int = 3


def request_settings(extra_args: dict[str, Any] | None, engine: LookaheadConfig) -> RequestSettings:
    """A request's settings from its ``SamplingParams.extra_args``.

    Accepted forms (all optional)::

        extra_args={"lookahead": False}                  # off for this request
        extra_args={"lookahead": {"enabled": False}}
        extra_args={"lookahead": {"ngram_size": 3, "window_size": 2, "guess_set_size": 2}}
        extra_args={"lookahead_window_size": 2}          # flat form (vllm_xargs)

    A request may lower N (down to 2), W (down to 0) and G (down to 1) below
    the engine's values, never raise them.

    Raises:
        LookaheadConfigError: unknown key, wrong type or value out of range;
            the message names the field.
    """
    base = {
        "enabled": True,
        "ngram_size": engine.ngram_size,
        "window_size": engine.window_size,
        "guess_set_size": engine.guess_set_size,
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
            f"{['enabled', *REQUEST_FIELDS]}, got {nested!r}"
        )
    prefix = REQUEST_KEY + "_"
    for key, value in extra_args.items():
        if isinstance(key, str) and key.startswith(prefix):
            given[key[len(prefix):]] = value
    allowed = ["enabled", *REQUEST_FIELDS]
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise LookaheadConfigError(
            f"unknown per-request lookahead setting(s) {unknown} in extra_args; "
            f"allowed: {allowed}"
        )
    enabled = given.pop("enabled", True)
    # vllm_xargs (the server's way in) carries str | int | float only: a JSON
    # false arrives as 0, "false" stays a string.
    if type(enabled) is int and enabled in (0, 1):  # not a bool: type() is exact
        enabled = bool(enabled)
    elif isinstance(enabled, str) and enabled.lower() in ("true", "false"):
        enabled = enabled.lower() == "true"
    if not isinstance(enabled, bool):
        raise LookaheadConfigError(
            f"extra_args['{REQUEST_KEY}']['enabled'] must be true/false, got {enabled!r}"
        )
    lows = {"ngram_size": 2, "window_size": 0, "guess_set_size": 1}
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
