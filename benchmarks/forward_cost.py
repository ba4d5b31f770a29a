"""Cost of an engine step against its query tokens, as the planner sees it.

Lookahead adds query tokens to a step (a draft, a tree: up to (N-1)(W+G) per
request), so what pays depends on what a query token costs on the machine
at hand. This script starts a lookahead engine with ``cost_model="measure"``
-- the very code the engine runs at start-up (``vllm_lookahead.branch.warmup``):
B requests with T query tokens each over 256 cached tokens, through the
model's real layers and its paged KV cache -- and prints the curve relative
to one token, per batch size.

    .venv/bin/python benchmarks/forward_cost.py [--dtypes bfloat16 float32] [--model smollm2]

Writes ``benchmarks/results/forward_cost.json`` (with the CPU model and flags).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per dtype (default: the engine's start-up budget)")
    p.add_argument("--out", default="benchmarks/results/forward_cost.json")
    return p.parse_args(argv)


def measure(model: str, dtype: str) -> dict:
    """The engine's measured cost curve: ``{batch: [[tokens, ms], ...]}``."""
    from vllm import LLM

    from vllm_lookahead import get_lookahead_stats

    llm = LLM(model, dtype=dtype, enforce_eager=True, max_model_len=2048, seed=0,
              kv_cache_memory_bytes=512 << 20, max_num_seqs=16,
              speculative_config={"method": "lookahead", "cost_model": "measure"})
    curve = get_lookahead_stats(llm)["cost_model"]["curve_ms"]
    llm.llm_engine.engine_core.shutdown()
    return curve


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm_lookahead.branch.warmup as warmup
    from vllm_lookahead.tools import MODELS
    from vllm_lookahead.planner.cost_model import hardware_id

    if args.budget is not None:
        warmup.BUDGET_S = args.budget
    model = str(MODELS[args.model]())
    results = {d: measure(model, d) for d in args.dtypes}
    hw = hardware_id()
    print(f"\nstep cost vs query tokens per request ({args.model}, {warmup.CONTEXT} cached "
          f"tokens), relative to 1 token at batch 1; CPU: {hw.get('cpu')}")
    for d, curve in results.items():
        one = curve["1"][0][1]
        print(f"\n{d}: 1 token at batch 1 = {one:.1f} ms")
        for b, pts in curve.items():
            print(f"  batch {b:>2s}: " + "  ".join(f"{t}:{ms / one:.2f}x" for t, ms in pts))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "model": args.model, "context": warmup.CONTEXT, "hardware": hw,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "curve_ms": results,
    }, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
