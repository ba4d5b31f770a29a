"""Method entries of ``--methods`` (``vanilla``, ``ngram:K,...``,
``suffix:K,...``, ``la:N,W,G,flag,key=value``) and the ``speculative_config``
each stands for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's own speculative methods that need no draft model, and lookahead at
# the plugin's defaults
DEFAULT_METHODS = ["vanilla", "ngram", "suffix", "la"]

# vLLM's ngram (prompt lookup) proposer: drafts up to K tokens copied from the
# longest earlier match of the last 2..4 tokens. K = 4 equals lookahead's
# longest draft at N = 4.
NGRAM_DEFAULTS = {"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
_NGRAM_ALIASES = {"k": "num_speculative_tokens", "max": "prompt_lookup_max",
                  "min": "prompt_lookup_min"}
# vLLM's suffix decoding (Arctic Inference's suffix trees): drafts from a
# suffix tree of the request's prompt and output plus a global tree of the
# outputs of earlier requests (up to max_cached_requests: a memory shared
# across requests). No defaults of our own: vLLM's apply (K = the tree depth
# 24, 10000 cached requests, spec factor 1.0, min token prob 0.1). Needs
# `arctic_inference.suffix_decoding` (scripts/setup_suffix.sh).
_SUFFIX_KEYS = ("max_tree_depth", "max_cached_requests", "max_spec_factor", "min_token_prob")
_SUFFIX_ALIASES = {
    "k": "num_speculative_tokens",
    "depth": "suffix_decoding_max_tree_depth",
    "cached": "suffix_decoding_max_cached_requests",
    "factor": "suffix_decoding_max_spec_factor",
    "prob": "suffix_decoding_min_token_prob",
    **{key: f"suffix_decoding_{key}" for key in _SUFFIX_KEYS},
}
_SUFFIX_FLAGS = {
    # the global tree off: prompt (and own output) trees only, nothing
    # remembered across requests
    "nomem": ("suffix_decoding_max_cached_requests", 0),
    "nocache": ("suffix_decoding_max_cached_requests", 0),
}
_LA_POSITIONAL = ("ngram_size", "window_size", "guess_set_size")
_LA_FLAGS = {
    "pool": ("prompt_pool", True),
    "nopool": ("prompt_pool", False),
    "fused": ("mode", "fused"),
    "separate": ("mode", "separate"),
    "fixed": ("adaptive", False),
    "adaptive": ("adaptive", True),
    # the n-gram memory shared across requests (engine setting shared_memory)
    "mem": ("shared_memory", True),
    "nomem": ("shared_memory", False),
    # the n samples of a request planned for the parent's end (parent_latency)
    # or for their own tokens (the default)
    "parent": ("parent_latency", True),
    "noparent": ("parent_latency", False),
}


class MethodSpecError(ValueError):
    """A ``--methods`` entry cannot be parsed."""


@dataclass(frozen=True)
class Method:
    """One speculative configuration to benchmark."""

    label: str
    """As written on the command line (used in the table, JSON and plot)."""
    kind: str
    """``vanilla``, ``ngram``, ``suffix`` or ``lookahead``."""
    spec: dict[str, Any] | None
    """The ``speculative_config`` passed to ``vllm.LLM`` (None: vanilla)."""
    checkout: str | None = None
    """A folder holding another ``vllm_lookahead`` (e.g. a ``git worktree``
    of an earlier commit, ``...@PATH``): its engine imports the plugin from
    there, to compare two versions interleaved in one run (None: the
    installed one)."""


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
        suffix[:K][,nomem][,key=value...] keys: k|num_speculative_tokens,
                                          depth|max_tree_depth, cached|max_cached_requests,
                                          factor|max_spec_factor, prob|min_token_prob
                                          (suffix_decoding_ prefixed) or any other
                                          SpeculativeConfig key; nomem|nocache:
                                          max_cached_requests=0 (no global tree)
        la[:N[,W[,G]]][,flag...][,key=value...]     (also ``lookahead:...``)
        any of them followed by @PATH: the engine imports vllm_lookahead
            from the folder PATH (another checkout, e.g. a git worktree
            of an earlier commit) instead of the installed one
        any of them followed by #TAG (last): another engine of the same
            configuration, labelled apart (an A/A copy: vanilla#2); the
            first vanilla listed stays the reference
            flags: nopool | pool | separate | fused | fixed (no planner:
                   the full tree every step) | adaptive | mem | nomem
                   (shared_memory true/false)
            key=value: any lookahead key, passed through unchecked
                       (e.g. mode=separate, max_tree_tokens=64)

    Raises:
        MethodSpecError: malformed entry (unknown name, bad number, a key
            given twice, too many positional numbers).
    """
    label = text.strip()
    if not label:
        raise MethodSpecError("empty method")
    body, sharp, tag = label.partition("#")
    if sharp:
        # another engine of the same configuration (an A/A copy), labelled apart
        if not tag.strip() or not body.strip():
            raise MethodSpecError(f"{label!r}: '#' needs a method before it and a tag after it")
        method = parse_method(body)
        return Method(label, method.kind, method.spec, method.checkout)
    body, at, checkout = label.partition("@")
    if at:
        checkout = checkout.strip()
        if not checkout:
            raise MethodSpecError(f"{label!r}: '@' without a folder")
        if not (Path(checkout) / "vllm_lookahead" / "__init__.py").is_file():
            raise MethodSpecError(f"{label!r}: {checkout!r} holds no vllm_lookahead package")
        method = parse_method(body)
        return Method(label, method.kind, method.spec, str(Path(checkout).resolve()))
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

    if name == "suffix":
        spec = {"method": "suffix"}
        for i, item in enumerate(items):
            if "=" in item:
                key, _, value = item.partition("=")
                key = _SUFFIX_ALIASES.get(key.strip(), key.strip())
                put(spec, key, _parse_value(value.strip()))
            elif item.lower() in _SUFFIX_FLAGS:
                put(spec, *_SUFFIX_FLAGS[item.lower()])
            elif i == 0 and item.isdigit():
                put(spec, "num_speculative_tokens", int(item))
            else:
                raise MethodSpecError(
                    f"{label!r}: expected K, a flag ({'/'.join(_SUFFIX_FLAGS)}) or "
                    f"key=value, got {item!r}")
        return Method(label, "suffix", spec)

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

    raise MethodSpecError(
        f"{label!r}: unknown method {name!r} (vanilla, ngram, suffix, la)")


def parse_methods(texts: Sequence[str]) -> list[Method]:
    """Parse ``--methods``; vanilla first (the reference), labels unique."""
    methods = [parse_method(t) for t in texts]
    labels = [m.label for m in methods]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise MethodSpecError(f"methods listed twice: {dupes}")
    return sorted(methods, key=lambda m: (m.kind != "vanilla", "#" in m.label))


def suffix_unavailable() -> str | None:
    """Why vLLM's suffix decoding cannot run here (None: it can): vLLM
    imports ``arctic_inference.suffix_decoding`` for it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except Exception as exc:  # missing, or a broken build
        return f"{type(exc).__name__}: {exc}"
    return None
