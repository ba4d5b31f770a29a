"""Every change this package makes to vLLM, in a registry (:mod:`.registry`), filed by
vLLM area (the CPU platform's in :mod:`vllm_lookahead.cpu`).
``python -m vllm_lookahead.patches`` prints the table.
"""

from __future__ import annotations

from vllm_lookahead.patches import engine_args, model_runner, engine  # noqa: F401 (declare, in order)
from vllm_lookahead.patches.model_runner import install_logits_hook
from vllm_lookahead.patches.registry import APPLIED, CPU_SAMPLER_ENV, PATCHES, Patch
from vllm_lookahead.stats import WORKER_STATS_METHOD

__all__ = ["CPU_SAMPLER_ENV", "WORKER_STATS_METHOD", "Patch", "apply_all", "declared",
           "install_logits_hook", "table"]


def declared() -> list[Patch]:
    """Every patch, in the order :func:`apply_all` applies them."""
    from vllm_lookahead.cpu import patches as _cpu, ray as _ray  # noqa: F401 (declare)

    return PATCHES


def apply_all() -> list[Patch]:
    """Apply each patch not applied yet whose ``when`` holds; returns those applied."""
    done = [p for p in declared() if APPLIED.get(p.target) is not p and p.when.holds()]
    for p in done:
        p.apply()
    return done


def table() -> str:
    """The patches as a markdown table (the docs include it)."""
    rows = ["| # | patch | target | area | when | what |", "|---|---|---|---|---|---|"]
    rows += [f"| {i} | `{p.name}` | `{p.target}` | {p.area} | {p.when.label} | {p.doc} |"
             for i, p in enumerate(declared(), 1)]
    return "\n".join(rows)
