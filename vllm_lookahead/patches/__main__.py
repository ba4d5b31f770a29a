"""``python -m vllm_lookahead.patches``: print the patch table (markdown)."""

from vllm_lookahead.patches import table

print(table())
