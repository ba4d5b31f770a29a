"""User-facing settings: the engine's :class:`LookaheadConfig` and a request's own.

Pure Python (no vLLM import). Every bad value fails with a message naming the
field and its allowed values. How a ``speculative_config`` selects lookahead
is :mod:`vllm_lookahead.spellings`; what each setting does: README, "Settings".
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

#: ``VllmConfig.additional_config`` key carrying the settings to the workers.
ADDITIONAL_CONFIG_KEY = "lookahead"

_RANGES = {"ngram_size": (2, 16), "window_size": (0, 64), "guess_set_size": (1, 64),
           "seed": (0, 2**63 - 1), "max_tree_tokens": (0, 1 << 20), "lookup_len": (0, 64),
           "disable_batch_size": (0, 1 << 20), "memory_tokens": (256, 1 << 26),
           "seeded_batch": (0, 1 << 20)}
_MODES = ("fused", "separate")
#: ``cost_model`` keywords; any other value is the path of a curve file.
COST_MODEL_CHOICES = ("auto", "measure", "off")
#: Settings removed, and what replaced them: given one, start-up fails naming it.
REMOVED = {
    "batch_end": "the planner plans each request for its own end, a parent's samples for the "
                 "parent's (parent_latency)",
    "min_draft_p": "the planner weighs every draft length by its expected tokens per second",
}


class LookaheadConfigError(ValueError):
    """A lookahead setting is invalid. The message names the field."""


@dataclass(frozen=True)
class LookaheadConfig:
    """Settings of lookahead decoding (Fu et al., ICML 2024); README, "Settings"."""

    ngram_size: int = 4  # N: n-gram length (the window has N-1 levels)
    window_size: int = 3  # W: Jacobi columns (0: none, needs prompt_pool)
    guess_set_size: int = 3  # G: candidates kept per key token and checked
    prompt_pool: bool = True  # the pool also holds the request's own n-grams
    seed: int = 0  # base seed of the windows (mixed with the prompt)
    mode: str = "fused"  # the tree in vLLM's forward, or "separate": an extra one
    max_tree_tokens: int = 0  # tree tokens per step (0: no limit)
    disable_batch_size: int | None = None  # a batch this large runs vanilla (None/0: never)
    adaptive: bool = True  # the planner picks each draft and tree (False: full trees)
    cost_model: str = "auto"  # the step-cost curve: auto, measure, off or a file
    shared_memory: bool = True  # draft from the engine's requests' text
    memory_tokens: int = 131072  # its capacity
    lookup_len: int = 0  # the longest unchecked draft (0: N)
    parent_latency: bool = True  # plan n samples for the parent's end
    batch_end: None = None  # removed (REMOVED): fails if given
    learn_step_cost: bool | str = "auto"  # learn draft costs from steps ("auto": 8+ requests)
    min_draft_p: None = None  # removed (REMOVED): fails if given
    seeded_batch: int = 0  # the batch a seeded draft is priced in (0: its n)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            name, value = f.name, getattr(self, f.name)
            if name in _RANGES:
                if value is None and name == "disable_batch_size":
                    continue
                lo, hi = _RANGES[name]
                if isinstance(value, bool) or not isinstance(value, int):
                    _fail(name, f"an integer in [{lo}, {hi}]",
                          f"{value!r} ({type(value).__name__})")
                if not lo <= value <= hi:
                    _fail(name, f"in [{lo}, {hi}]", value)
            elif name == "mode" and value not in _MODES:
                _fail(name, f"one of {list(_MODES)}", repr(value))
            elif name == "cost_model" and not (value in COST_MODEL_CHOICES or (
                    isinstance(value, str) and os.path.isfile(value))):
                _fail(name, f"one of {list(COST_MODEL_CHOICES)} or an existing file", repr(value))
            elif name == "learn_step_cost" and not (isinstance(value, bool) or value == "auto"):
                _fail(name, 'a boolean (true/false) or "auto"', repr(value))
            elif name in REMOVED and value is not None:
                raise LookaheadConfigError(
                    f"speculative_config['{name}'] was removed in 0.2.0: {REMOVED[name]}")
            elif f.type in ("bool", bool) and not isinstance(value, bool):
                _fail(name, "a boolean (true/false)", repr(value))
        if self.window_size == 0 and not self.prompt_pool:
            raise LookaheadConfigError(
                "speculative_config['window_size'] = 0 (no Jacobi window) needs "
                "prompt_pool = true, or nothing would ever be drafted")

    @property
    def max_draft_len(self) -> int:
        """Longest draft a step hands the verifier: a checked (N-1)-token
        candidate plus the model's next token, or a ``lookup_len`` lookup."""
        return max(self.ngram_size, self.lookup_len)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in REMOVED}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LookaheadConfig":
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise LookaheadConfigError(
                f"unknown lookahead setting(s) {unknown}; allowed: {cls.field_names()}")
        return cls(**d)


def _fail(name: str, what: str, got) -> None:
    raise LookaheadConfigError(f"speculative_config['{name}'] must be {what}, got {got}")


#: ``SamplingParams.extra_args`` key of a request's own settings.
REQUEST_KEY = "lookahead"
#: Fields a request may lower (never raise above the engine's), and their floors.
_REQUEST_LOWS = {"ngram_size": 2, "window_size": 0, "guess_set_size": 1, "lookup_len": 0}


@dataclass(frozen=True)
class RequestSettings:
    """Lookahead settings of one request (the engine's, maybe lowered)."""

    enabled: bool = True
    ngram_size: int = 4
    window_size: int = 3
    guess_set_size: int = 3
    lookup_len: int = 0
    shared_memory: bool = True  # reads and feeds the engine's shared memory


def request_settings(extra_args: dict[str, Any] | None, engine: LookaheadConfig) -> RequestSettings:
    """A request's settings from its ``SamplingParams.extra_args``::

        {"lookahead": False}  or  {"lookahead": {"enabled": False}}
        {"lookahead": {"ngram_size": 3, "window_size": 2, "guess_set_size": 2}}
        {"lookahead_window_size": 2}                 # flat form (vllm_xargs)
        {"lookahead": {"shared_memory": False}}      # out of the shared memory

    N, W, G and ``lookup_len`` may only be lowered. Raises
    :class:`LookaheadConfigError` naming the field for a bad key or value.
    """
    base = {"enabled": True, "ngram_size": engine.ngram_size, "window_size": engine.window_size,
            "guess_set_size": engine.guess_set_size, "lookup_len": engine.lookup_len,
            "shared_memory": engine.shared_memory}
    if not extra_args:
        return RequestSettings(**base)
    nested = extra_args.get(REQUEST_KEY)
    if isinstance(nested, bool):
        nested = {"enabled": nested}
    elif nested is not None and not isinstance(nested, dict):
        raise LookaheadConfigError(
            f"extra_args['{REQUEST_KEY}'] must be true/false or a dict of {list(base)}, "
            f"got {nested!r}")
    prefix = REQUEST_KEY + "_"
    given = {**(nested or {}), **{k[len(prefix):]: v for k, v in extra_args.items()
                                  if isinstance(k, str) and k.startswith(prefix)}}
    unknown = sorted(set(given) - set(base))
    if unknown:
        raise LookaheadConfigError(
            f"unknown per-request lookahead setting(s) {unknown} in extra_args; "
            f"allowed: {list(base)}")
    for name, value in given.items():
        if name in ("enabled", "shared_memory"):
            base[name] = _flag(value, name) and (name == "enabled" or base[name])
            continue
        lo, hi = _REQUEST_LOWS[name], base[name]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise LookaheadConfigError(
                f"extra_args['{REQUEST_KEY}']['{name}'] must be an integer in [{lo}, {hi}] "
                f"(a request may lower the engine's {name}={hi}, not raise it), got {value!r}")
        base[name] = value
    if base["window_size"] == 0 and not engine.prompt_pool and base["enabled"]:
        raise LookaheadConfigError(
            f"extra_args['{REQUEST_KEY}']['window_size'] = 0 needs the engine's "
            "prompt_pool, which is off: nothing would ever be drafted")
    return RequestSettings(**base)


def _flag(value, name: str) -> bool:
    """A per-request boolean; vllm_xargs sends 0/1 and "true"/"false" too."""
    if type(value) is int and value in (0, 1):  # type(): not a bool
        value = bool(value)
    elif isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, bool):
        raise LookaheadConfigError(
            f"extra_args['{REQUEST_KEY}']['{name}'] must be true/false, got {value!r}")
    return value
