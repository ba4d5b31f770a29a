"""Demo: the same prompts with and without lookahead decoding, side by side.

SmolLM2-135M-Instruct (built from its PyPI package) generates greedily on real
prompts (HumanEval code, MT-Bench first turns), one request at a time (the
paper's batch-size-1 setting), with vanilla vLLM and with
``method="lookahead"``. The two engines take turns prompt by prompt, so a
drift in the machine's speed hits both alike. The terminal shows a progress
bar and the final table; vLLM's and the plugin's logs go to a log file.
``--dtype auto`` picks the dtype whose vanilla steps are faster here.

    python -m vllm_lookahead.demo [--dtype auto|bfloat16|float32] [--prompts 4] ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

DTYPES = ("bfloat16", "float32")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


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
    p.add_argument("--log", default=None,
                   help="vLLM's and the plugin's logs (default: demo.log in the model cache, "
                   "~/.cache/vllm-lookahead)")
    return p.parse_args(argv)


@contextlib.contextmanager
def output_to_log(path: Path) -> Iterator[tuple[TextIO, TextIO]]:
    """Send everything written to file descriptors 1 and 2 -- vLLM's and the
    plugin's log lines, third-party Python warnings, C-level prints of torch
    and OpenMP -- to ``path``; yield text streams (out, err) on the original
    stdout and stderr. Warnings raised in vllm_lookahead's own code still go
    to the terminal: they would be our bugs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    out = open(saved[0], "w", buffering=1, closefd=False)  # noqa: SIM115
    err = open(saved[1], "w", buffering=1, closefd=False)  # noqa: SIM115
    show = warnings.showwarning

    def route(message, category, filename, lineno, file=None, line=None):
        own = os.path.abspath(filename).startswith(_PACKAGE_DIR)
        show(message, category, filename, lineno, err if own else file, line)

    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        warnings.showwarning = route
        try:
            yield out, err
        finally:
            warnings.showwarning = show
            for stream in (sys.stdout, sys.stderr, out, err):
                stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            out.close()
            err.close()
            os.close(saved[0])
            os.close(saved[1])


def cpu_name() -> str:
    from vllm_lookahead.planner.machine import hardware_id

    return hardware_id().get("cpu") or platform.machine()


def _engine(model, dtype, spec):
    from vllm import LLM

    return LLM(model, dtype=dtype, speculative_config=spec, enforce_eager=True,
               max_model_len=2048, max_num_seqs=8, seed=0, kv_cache_memory_bytes=512 << 20)


def _timed(llm, prompt, params):
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), time.perf_counter() - t0


def pick_dtype(prompt, engines) -> tuple[str, dict[str, float]]:
    """The dtype whose vanilla engine (``engines[dtype]``) generates faster
    here: 32 tokens, five turns each, interleaved; the best of each."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for d in DTYPES:
        _timed(engines[d], prompt, params)  # warm-up
    best = {d: float("inf") for d in DTYPES}
    for _ in range(5):
        for d in DTYPES:
            best[d] = min(best[d], _timed(engines[d], prompt, params)[1])
    return min(best, key=best.get), best


def main(argv=None) -> int:
    args = _parse(argv)
    # vLLM reads these when first imported: in-process engines, plain log lines.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_COLOR", "0")
    from vllm_lookahead.tools import cache_dir

    log = Path(args.log) if args.log else cache_dir() / "demo.log"
    with output_to_log(log) as (out, err):
        try:
            lines, results = _run(args, err)
        except BaseException:
            print(f"the demo failed; its log: {log}", file=err)
            raise
        print("\n".join(lines), file=out)
        print(f"log: {log}", file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _run(args, bar_file: TextIO) -> tuple[list[str], dict]:
    """Run the demo; the table's lines and the results for ``--json``."""
    print(f"== vllm_lookahead demo {time.strftime('%Y-%m-%d %H:%M:%S')}: {vars(args)}",
          flush=True)
    from tqdm import tqdm

    auto = args.dtype == "auto"
    setup_steps = 6 if auto else 4  # model, vanilla engine(s), timing, lookahead, warm-up
    bar = tqdm(total=setup_steps + 2 * args.prompts, desc="preparing SmolLM2-135M-Instruct",
               unit="step", file=bar_file,
               bar_format="{desc:<40} {bar} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")
    stage = bar.set_description_str

    with bar:
        from transformers import AutoTokenizer
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vllm_lookahead import get_lookahead_stats
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
        bar.total = setup_steps + len(prompts)
        bar.update()
        spec = {"method": "lookahead"}
        for key in ("ngram_size", "window_size", "guess_set_size"):
            if getattr(args, key) is not None:
                spec[key] = getattr(args, key)

        # In-process engines stay up to the end (shutting one down breaks the others).
        engines, choice = {}, ""
        for d in DTYPES if auto else (args.dtype,):
            stage(f"starting vanilla vLLM ({d})")
            engines[d] = _engine(model, d, None)
            bar.update()
        dtype = args.dtype
        if auto:
            stage("timing bfloat16 against float32")
            dtype, best = pick_dtype(prompts[0], engines)
            choice = " (auto: vanilla 32 tokens " + ", ".join(
                f"{d} {s * 1e3:.0f} ms" for d, s in best.items()) + ")"
            bar.update()
        vanilla = engines[dtype]
        stage("starting lookahead (measures step cost)")
        lookahead = _engine(model, dtype, spec)
        bar.update()
        stage("warming up")
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        warm = SamplingParams(temperature=0.0, max_tokens=16)
        for llm in (vanilla, lookahead):
            llm.generate(prompts[:1], warm, use_tqdm=False)
        bar.update()
        van_out, la_out, van_s, la_s = [], [], 0.0, 0.0
        for i, p in enumerate(prompts):
            stage(f"prompt {i + 1}/{len(prompts)} ({names[i]}), both engines")
            order = (vanilla, lookahead) if i % 2 == 0 else (lookahead, vanilla)
            for llm in order:
                out, sec = _timed(llm, p, params)
                if llm is vanilla:
                    van_out.append(out)
                    van_s += sec
                else:
                    la_out.append(out)
                    la_s += sec
            bar.update()
        stage("done")
        stats = get_lookahead_stats(lookahead)

    van_tok = sum(map(len, van_out))
    la_tok = sum(map(len, la_out))
    per_set = {}
    for name in sets:
        idx = [i for i, n in enumerate(names) if n == name]
        per_set[name] = sum(van_out[i] == la_out[i] for i in idx), len(idx)
    van_tps, la_tps = van_tok / van_s, la_tok / la_s
    cfg = stats["config"]
    src = stats["accepted_by_source"]
    preload = os.environ.get("LD_PRELOAD", "")
    shapes = sorted(stats["shape_steps"].items(), key=lambda kv: -kv[1])
    forwards = 1 + stats["pass_requests"] / max(stats["decode_steps"], 1)
    lines = [
        "",
        f"SmolLM2-135M-Instruct, {dtype}{choice}, batch size 1, greedy, "
        f"{len(prompts)} prompts x {args.max_tokens} new tokens max",
        f"CPU: {cpu_name()}, {os.cpu_count()} cores; LD_PRELOAD={preload or '(none)'}",
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
        "planner shapes (request-steps): " + ", ".join(f"{k} {v}" for k, v in shapes[:6]),
        f"target forwards per step: {forwards:.2f} (fused: 1, catch-ups included; "
        f"separate: 2); tokens per forward {stats['tokens_per_forward']:.2f}",
        "identical to vanilla: "
        + ", ".join(f"{n} {s}/{t}" for n, (s, t) in per_set.items())
        + ("" if dtype == "float32" else
           "  (bfloat16 on CPU is not batch-invariant; run --dtype float32 for exactness)"),
    ]
    results = {"vanilla_tokens_per_s": van_tps, "lookahead_tokens_per_s": la_tps,
               "speedup": la_tps / van_tps, "identical": sum(s for s, _ in per_set.values()),
               "prompts": len(prompts), "stats": stats, "dtype": dtype,
               "cpu": cpu_name(), "ld_preload": preload}
    return lines, results


if __name__ == "__main__":
    sys.exit(main())
