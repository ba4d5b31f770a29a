"""How a user's speculative config selects lookahead.

Users write ``speculative_config={"method": "lookahead", "ngram_size": 4, ...}``
(or any other spelling vLLM takes for a method: :func:`is_lookahead`,
:func:`merge_spec_flags`).
:func:`split_speculative_config` separates our keys from the ones vLLM's own
``SpeculativeConfig`` understands, validates ours into a
:class:`~vllm_lookahead.config.LookaheadConfig` and reports every bad value
with the name of the field and its allowed range.

This module is pure Python (no vLLM import) so it can be unit-tested and
imported cheaply from the plugin entry point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_lookahead.config import LookaheadConfig, LookaheadConfigError

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
            f"in [1, {cfg.max_draft_len}] (max(ngram_size, lookup_len): the "
            f"longest draft lookahead makes), got {k!r}"
        )
    vllm_kwargs = {
        **spec,
        "method": "custom_class",
        "model": PROPOSER_QUALNAME,
        "num_speculative_tokens": k,
    }
    return SplitConfig(lookahead=cfg, vllm_kwargs=vllm_kwargs)
