"""How a user's ``speculative_config`` selects lookahead (pure Python, no vLLM):
any spelling vLLM takes for a method; our keys become a ``LookaheadConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_lookahead.config import LookaheadConfig, LookaheadConfigError

METHOD = "lookahead"
#: Every ``method`` that selects lookahead (vLLM also takes ``"[ngram]"``).
METHOD_NAMES = ("lookahead", "[lookahead]")
#: Every ``model`` that selects it without a method, as ``"[ngram]"`` does ngram.
MODEL_NAMES = ("[lookahead]", "lookahead")
#: vLLM 0.32's shorthand flags: (flag, key, ``EngineArgs`` field).
SPEC_FLAGS = (
    ("--spec-method", "method", "spec_method"),
    ("--spec-model", "model", "spec_model"),
    ("--spec-tokens", "num_speculative_tokens", "spec_tokens"),
)
#: The proposer vLLM instantiates through its ``custom_class`` hook.
PROPOSER_QUALNAME = "vllm_lookahead.proposer.LookaheadProposer"
#: Keys of vLLM's ``SpeculativeConfig`` a lookahead user may still set.
PASSTHROUGH_KEYS = frozenset({"num_speculative_tokens", "num_speculative_tokens_per_batch_size",
                              "rejection_sample_method", "enforce_eager"})


@dataclass
class SplitConfig:
    lookahead: LookaheadConfig
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # for vLLM's SpeculativeConfig


def _underscored(spec: dict[str, Any]) -> dict[str, Any]:
    """Dashes in keys read as underscores, as vLLM's CLI reads them."""
    return {str(k).replace("-", "_"): v for k, v in spec.items()}


def is_lookahead(spec: Any) -> bool:
    """Whether a (merged) ``speculative_config`` selects lookahead, by its
    ``method`` or by its ``model`` alone (an error where they disagree)."""
    if not isinstance(spec, dict):
        return False
    spec = _underscored(spec)
    method, model = spec.get("method"), spec.get("model")
    if method in METHOD_NAMES:
        return True
    if model in MODEL_NAMES and method is not None:
        raise LookaheadConfigError(
            f"speculative model {model!r} selects method 'lookahead', but the "
            f"method is {method!r}; give one of them")
    return method is None and model in MODEL_NAMES


def merge_spec_flags(spec: Any, args: Any) -> tuple[Any, dict[str, str]]:
    """``spec`` with the flags of ``args`` (``EngineArgs``) merged in as vLLM
    0.32 does (``args`` untouched), and per key from a flag its name. A flag
    and the same key: vLLM's ``ValueError`` ("... are mutually exclusive")."""
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


def split_speculative_config(spec: dict[str, Any],
                             names: dict[str, str] | None = None) -> SplitConfig:
    """Our settings and vLLM's ``SpeculativeConfig`` kwargs (our proposer as
    its ``custom_class``) of a lookahead ``spec``; ``names``: the flags keys
    came from, for messages (:class:`LookaheadConfigError` names the field)."""
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
            f"no draft model (leave it out, or give {MODEL_NAMES[0]!r})")
    fields = LookaheadConfig.field_names()
    ours = {k: spec.pop(k) for k in list(spec) if k in fields}
    unknown = sorted(set(spec) - PASSTHROUGH_KEYS)
    if unknown:
        raise LookaheadConfigError(
            f"unknown key(s) {unknown} in speculative_config for method 'lookahead'; "
            f"allowed: {sorted(fields + list(PASSTHROUGH_KEYS))}")
    cfg = LookaheadConfig.from_dict(ours)
    k = spec.pop("num_speculative_tokens", None)
    if k is None:
        k = cfg.max_draft_len
    elif isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cfg.max_draft_len:
        raise LookaheadConfigError(
            f"{name('num_speculative_tokens')} must be an integer in [1, {cfg.max_draft_len}] "
            f"(max(ngram_size, lookup_len): the longest draft lookahead makes), got {k!r}")
    return SplitConfig(lookahead=cfg, vllm_kwargs={
        **spec, "method": "custom_class", "model": PROPOSER_QUALNAME, "num_speculative_tokens": k})
