"""What a step of vLLM's own rows costs, by how its draft tokens are spread.

The planner's cost model fits steps without trees as a plane in the step's
requests, its draft tokens and its *drafting requests* (a request's first
draft token may cost more than its next ones). This script measures that
directly: one lookahead engine whose proposer is replaced, for this
measurement only, by fixed drafting patterns (e.g. ``1x4``: 4 requests with
1 draft token each; ``4x1``: 1 request with 4), taking turns step by step on
the same requests (so the machine's drift hits every pattern alike). The
drafts are a token the model never predicts: vLLM rejects them, and every
step does the same work. Steps are timed around ``LLMEngine.step``; medians.

    .venv/bin/python benchmarks/draft_spread_cost.py [--batch-sizes 1 4 16] [--dtype float32]

Writes ``benchmarks/results/draft_spread_cost.json`` (with the CPU model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

#: ``{batch: {pattern: draft tokens per request}}``: names are
#: ``<tokens>x<requests>``.
PATTERNS = {
    1: {"none": [0], "1x1": [1], "2x1": [2], "4x1": [4]},
    4: {"none": [0] * 4, "1x1": [1, 0, 0, 0], "1x2": [1, 1, 0, 0], "2x1": [2, 0, 0, 0],
        "1x4": [1] * 4, "2x2": [2, 2, 0, 0], "4x1": [4, 0, 0, 0]},
    16: {"none": [0] * 16, "1x1": [1] + [0] * 15, "2x1": [2] + [0] * 15,
         "4x1": [4] + [0] * 15, "1x8": [1] * 8 + [0] * 8, "2x4": [2] * 4 + [0] * 12,
         "4x2": [4, 4] + [0] * 14, "1x16": [1] * 16, "4x4": [4] * 4 + [0] * 12},
}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16],
                   choices=sorted(PATTERNS))
    p.add_argument("--tokens", type=int, default=400, help="new tokens per request")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0: greedy; > 0 runs vLLM's rejection sampler "
                        "with top-p)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--out", default="benchmarks/results/draft_spread_cost.json")
    return p.parse_args(argv)


def measure(model_path: str, dtype: str, batch: int, tokens: int,
            temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Median step ms per pattern of ``PATTERNS[batch]`` (and steps timed)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm_lookahead.proposer as proposer

    patterns = PATTERNS[batch]
    names = list(patterns)
    turn = {"k": 0, "next": None}

    def fixed_drafts(self, runner, sampled_token_ids):
        name = names[turn["k"] % len(names)]
        turn["k"] += 1
        turn["next"] = name
        lens = patterns[name]
        return [[7] * lens[i] if sampled and i < len(lens) else []
                for i, sampled in enumerate(sampled_token_ids)]

    proposer.LookaheadProposer.propose_for_runner = fixed_drafts
    llm = LLM(model_path, dtype=dtype, enforce_eager=True, max_model_len=1024,
              max_num_seqs=batch, kv_cache_memory_bytes=256 << 20, seed=0,
              speculative_config={"method": "lookahead", "num_speculative_tokens": 4,
                                  "adaptive": False})
    engine = llm.llm_engine
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=tokens,
                            ignore_eos=True)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(2):
        for i in range(batch):
            prompt = list(range(100 + i, 400 + i))
            engine.add_request(f"spread-{rep}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
        steps = 0
        while engine.has_unfinished_requests():
            pattern = turn["next"]
            t0 = time.perf_counter()
            engine.step()
            took = time.perf_counter() - t0
            steps += 1
            if steps > 5 and pattern is not None and engine.get_num_unfinished_requests() == batch:
                times[pattern].append(took)
    engine.engine_core.shutdown()
    return {n: {"ms": 1e3 * statistics.median(v), "steps": len(v)} for n, v in times.items() if v}


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from report import machine_info

    from vllm_lookahead.tools import MODELS

    path = str(MODELS[args.model]())
    result = {"meta": machine_info(sys.argv), "model": args.model, "dtype": args.dtype,
              "temperature": args.temperature, "top_p": args.top_p, "batches": {}}
    for b in args.batch_sizes:
        got = measure(path, args.dtype, b, args.tokens, args.temperature, args.top_p)
        result["batches"][str(b)] = got
        none = got["none"]["ms"]
        print(f"batch {b} ({args.dtype}, {result['meta'].get('cpu')}): " + ", ".join(
            f"{n} {v['ms']:.1f} ms (+{v['ms'] - none:.1f})" for n, v in got.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
