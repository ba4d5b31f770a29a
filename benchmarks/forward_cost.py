"""Cost of one target-model forward against its number of query tokens.

Lookahead adds query tokens to every step (the tree: about (N-1)(W+G) per
request), so its defaults depend on how the cost of a forward grows with its
token count on the machine at hand. This script measures that curve inside
vLLM: the wall time of an engine step that prefills T fresh tokens (prefix
caching off, one new token sampled), for T from 1 to 128, as the median of
several repeats, and prints it relative to T = 1.

    .venv/bin/python benchmarks/forward_cost.py [--dtypes bfloat16 float32] [--model smollm2]

Writes ``benchmarks/results/forward_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--context", type=int, default=256,
                   help="cached tokens in front of the timed tokens (a decode-like step)")
    p.add_argument("--out", default="benchmarks/results/forward_cost.json")
    return p.parse_args(argv)


def measure(model: str, dtype: str, sizes, repeats: int, context: int) -> dict[int, float]:
    """Median seconds of an engine step feeding T new tokens after a cached
    prefix of ``context`` tokens."""
    import numpy as np
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, dtype=dtype, enforce_eager=True, max_model_len=2048, seed=0,
              kv_cache_memory_bytes=512 << 20, enable_prefix_caching=True)
    rng = np.random.default_rng(0)
    vocab = 1000
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out = {}
    for t in tqdm(sizes, desc=f"{dtype:9s}", unit="size", file=sys.stderr):
        times = []
        for r in range(repeats + 1):
            prefix = rng.integers(100, 100 + vocab, size=context).tolist()
            tail = rng.integers(100, 100 + vocab, size=t).tolist()
            # cache the prefix first, then time the step that adds t tokens
            llm.generate([TokensPrompt(prompt_token_ids=prefix)], params, use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prefix + tail)], params, use_tqdm=False)
            if r:  # first one is a warm-up
                times.append(time.perf_counter() - t0)
        out[t] = statistics.median(times)
    llm.llm_engine.engine_core.shutdown()
    return out


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm_lookahead.assets import MODELS

    model = str(MODELS[args.model]())
    results = {}
    for dtype in args.dtypes:
        results[dtype] = measure(model, dtype, args.sizes, args.repeats, args.context)
    print(f"\nforward cost vs query tokens ({args.model}, {args.context} cached tokens), "
          "relative to 1 token")
    print("tokens " + "".join(f"{d:>16s}" for d in args.dtypes))
    for t in args.sizes:
        row = "".join(
            f"{results[d][t] * 1e3:8.1f}ms {results[d][t] / results[d][args.sizes[0]]:5.2f}x"
            for d in args.dtypes
        )
        print(f"{t:6d} {row}")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "model": args.model, "context": args.context, "repeats": args.repeats,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "seconds": {d: {str(t): s for t, s in r.items()} for d, r in results.items()},
    }, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
