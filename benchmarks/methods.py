"""Method entries of ``--methods`` (``vanilla``, ``ngram:K,...``,
``la:N,W,G,flag,key=value``) and the ``speculative_config`` each stands for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_METHODS = ["vanilla", "ngram", "la:4,5,5", "la:4,5,5,nopool", "la:5,7,7"]

# vLLM's ngram (prompt lookup) proposer: drafts up to K tokens copied from the
# longest earlier match of the last 2..4 tokens. K = 4 equals lookahead's
# longest draft at N = 4.
NGRAM_DEFAULTS = {"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
_NGRAM_ALIASES = {"k": "num_speculative_tokens", "max": "prompt_lookup_max",
                  "min": "prompt_lookup_min"}
_LA_POSITIONAL = ("ngram_size", "window_size", "guess_set_size")
_LA_FLAGS = {
    "pool": ("prompt_pool", True),
    "nopool": ("prompt_pool", False),
    "fused": ("mode", "fused"),
    "separate": ("mode", "separate"),
    "fixed": ("adaptive", False),
    "adaptive": ("adaptive", True),
}


class MethodSpecError(ValueError):
    """A ``--methods`` entry cannot be parsed."""


@dataclass(frozen=True)
class Method:
    """One speculative configuration to benchmark."""

    label: str
    """As written on the command line (used in the table, JSON and plot)."""
    kind: str
    """``vanilla``, ``ngram`` or ``lookahead``."""
    spec: dict[str, Any] | None
    """The ``speculative_config`` passed to ``vllm.LLM`` (None: vanilla)."""


def _parse_value(text: str) -> Any:
    """``key=value`` value: int, float, bool (true/false) or string."""
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_method(text: str) -> Method:
    """Parse one ``--methods`` entry.

    Grammar (items after the colon are comma-separated)::

        vanilla
        ngram[:K][,key=value...]          keys: k|num_speculative_tokens,
                                          max|prompt_lookup_max, min|prompt_lookup_min,
                                          or any other SpeculativeConfig key
        la[:N[,W[,G]]][,flag...][,key=value...]     (also ``lookahead:...``)
            flags: nopool | pool | separate | fused | fixed (no planner:
                   the full tree every step) | adaptive
            key=value: any lookahead key, passed through unchecked
                       (e.g. mode=separate, max_tree_tokens=64)

    Raises:
        MethodSpecError: malformed entry (unknown name, bad number, a key
            given twice, too many positional numbers).
    """
    label = text.strip()
    if not label:
        raise MethodSpecError("empty method")
    name, _, rest = label.partition(":")
    name = name.strip().lower()
    items = [item.strip() for item in rest.split(",")] if rest.strip() else []
    if any(not item for item in items):
        raise MethodSpecError(f"{label!r}: empty item between commas")

    explicit: set[str] = set()

    def put(spec: dict[str, Any], key: str, value: Any) -> None:
        if not key:
            raise MethodSpecError(f"{label!r}: empty key")
        if key in explicit:
            raise MethodSpecError(f"{label!r}: {key!r} given twice")
        explicit.add(key)
        spec[key] = value

    if name == "vanilla":
        if items:
            raise MethodSpecError(f"{label!r}: vanilla takes no options")
        return Method(label, "vanilla", None)

    if name == "ngram":
        spec: dict[str, Any] = {"method": "ngram", **NGRAM_DEFAULTS}
        for i, item in enumerate(items):
            if "=" in item:
                key, _, value = item.partition("=")
                key = _NGRAM_ALIASES.get(key.strip(), key.strip())
                put(spec, key, _parse_value(value.strip()))
            elif i == 0 and item.isdigit():
                put(spec, "num_speculative_tokens", int(item))
            else:
                raise MethodSpecError(f"{label!r}: expected K or key=value, got {item!r}")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if (isinstance(lo, int) and isinstance(hi, int) and lo > hi
                and "prompt_lookup_min" not in explicit):
            spec["prompt_lookup_min"] = hi  # only max given, below the default min
        return Method(label, "ngram", spec)

    if name in ("la", "lookahead"):
        spec = {"method": "lookahead"}
        positional = 0
        for item in items:
            if "=" in item:
                key, _, value = item.partition("=")
                put(spec, key.strip(), _parse_value(value.strip()))
            elif item.lower() in _LA_FLAGS:
                put(spec, *_LA_FLAGS[item.lower()])
            else:
                try:
                    number = int(item)
                except ValueError:
                    raise MethodSpecError(
                        f"{label!r}: {item!r} is not a number, a flag "
                        f"({'/'.join(_LA_FLAGS)}) or key=value"
                    ) from None
                if positional >= len(_LA_POSITIONAL):
                    raise MethodSpecError(f"{label!r}: at most N,W,G as numbers")
                put(spec, _LA_POSITIONAL[positional], number)
                positional += 1
        if positional:  # an explicit configuration: spell the pool out too
            spec.setdefault("prompt_pool", True)
        return Method(label, "lookahead", spec)

    raise MethodSpecError(f"{label!r}: unknown method {name!r} (vanilla, ngram, la)")


def parse_methods(texts: Sequence[str]) -> list[Method]:
    """Parse ``--methods``; vanilla first (the reference), labels unique."""
    methods = [parse_method(t) for t in texts]
    labels = [m.label for m in methods]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise MethodSpecError(f"methods listed twice: {dupes}")
    return sorted(methods, key=lambda m: m.kind != "vanilla")
