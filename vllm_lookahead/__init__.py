"""Lookahead decoding for vLLM: installed, it registers with vLLM (``vllm.general_plugins``);
users pass ``speculative_config={"method": "lookahead", ...}``."""

from vllm_lookahead.config import LookaheadConfig, LookaheadConfigError

__all__ = ["LookaheadConfig", "LookaheadConfigError", "get_lookahead_stats"]
__version__ = "0.1.0"


def get_lookahead_stats(llm) -> dict:
    """Lookahead statistics of a ``vllm.LLM``: :class:`vllm_lookahead.stats.LookaheadStats`."""
    from vllm_lookahead.stats import get_lookahead_stats as _get

    return _get(llm)
