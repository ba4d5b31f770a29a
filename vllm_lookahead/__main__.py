"""``python -m vllm_lookahead serve MODEL ...``: see :mod:`vllm_lookahead.cli`."""

from vllm_lookahead.cli import main

main()
