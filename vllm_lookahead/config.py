"""User-facing configuration of lookahead decoding.

Users write ``speculative_config={"method": "lookahead", "ngram_size": 4, ...}``.
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
    """

    ngram_size: int = 4
    window_size: int = 5
    guess_set_size: int = 5
    prompt_pool: bool = True
    seed: int = 0

    _RANGES = {
        "ngram_size": (2, 16),
        "window_size": (0, 64),
        "guess_set_size": (1, 64),
        "seed": (0, 2**63 - 1),
    }

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
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


def is_lookahead(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("method") == METHOD


def split_speculative_config(spec: dict[str, Any]) -> SplitConfig:
    """Validate a ``{"method": "lookahead", ...}`` dict.

    Returns our settings and the kwargs for vLLM's ``SpeculativeConfig``
    (``method="custom_class"`` pointing at our proposer). Dashes in keys are
    accepted like vLLM's CLI does (``ngram-size`` == ``ngram_size``).

    Raises:
        LookaheadConfigError: unknown key, wrong type or value out of range.
    """
    spec = {str(k).replace("-", "_"): v for k, v in spec.items()}
    assert spec.pop("method") == METHOD
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
            "speculative_config['num_speculative_tokens'] must be an integer "
            f"in [1, ngram_size={cfg.max_draft_len}], got {k!r}"
        )
    vllm_kwargs = {
        **spec,
        "method": "custom_class",
        "model": PROPOSER_QUALNAME,
        "num_speculative_tokens": k,
    }
    return SplitConfig(lookahead=cfg, vllm_kwargs=vllm_kwargs)
