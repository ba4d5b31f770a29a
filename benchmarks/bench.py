"""Benchmark suite: vanilla vLLM vs vLLM's ngram and suffix decoding vs
lookahead decoding.

One command compares, in one run on one machine, the same models, dtypes,
prompt sets and batch sizes across speculative methods, and writes a table,
a JSON file with every figure and a plot::

    bash scripts/bench.sh     # Qwen2.5-Coder-0.5B: vanilla, ngram, suffix, lookahead
    bash scripts/bench.sh --models smollm2 qwen-coder --dtypes bfloat16 float32 \\
        --datasets humaneval mtbench --prompts 8 --batch-sizes 1 4 16 \\
        --methods vanilla ngram la:4,5,5 la:4,5,5,nopool la:4,5,5,separate la:5,7,7
    bash scripts/bench.sh --datasets template --repeat 2 --temperature 0.8 --top-p 0.95 \
        --n 2 --seed 0 --methods vanilla ngram suffix suffix:nomem la la:nomem
    bash scripts/bench.sh --one-process --methods vanilla vanilla#2 ngram la
    python benchmarks/bench.py --from-json benchmarks/results/latest.json

Each (model, dtype, method) engine runs in a fresh subprocess (this script
with ``--child``): one vLLM engine per process, a clean peak-RSS figure, and a
crash or error in one configuration only costs that configuration. With
``--one-process`` the engines of one (model, dtype) are built in one
subprocess instead and take turns there, so that the speed of a process (it
differs between processes of one configuration) cancels out. See
benchmarks/README.md for the meaning of every column.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

# The suite's modules sit next to this file (methods, prompts, child,
# engines, figures, report, plot). Run as a script (the child processes are
# too), this directory is on sys.path already; loaded by path it may not be.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from child import child_main  # noqa: E402
from engines import run_benchmark  # noqa: E402
from methods import (  # noqa: E402
    DEFAULT_METHODS,
    MethodSpecError,
    parse_methods,
    suffix_unavailable,
)
from prompts import DATASETS, DEFAULT_DATASETS, DEFAULT_MODEL, MODEL_NAMES  # noqa: E402
from report import REPO, report  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "latest.json"


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench.py",
        description="Vanilla vLLM vs ngram vs suffix vs lookahead decoding, side by side.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="method entries: vanilla | ngram[:K][,key=value...] | "
               "suffix[:K][,nomem][,key=value...] | "
               "la[:N[,W[,G]]][,nopool|pool|separate|fused|fixed|adaptive|mem|nomem]"
               "[,key=value...]\n"
               "e.g. --methods vanilla ngram suffix la:4,5,5 la:4,5,5,nopool "
               "la:4,5,5,mode=separate la:5,7,7",
    )
    p.add_argument("--models", nargs="+", default=[DEFAULT_MODEL], choices=MODEL_NAMES,
                   help="qwen-coder (Qwen2.5-Coder-0.5B-Instruct) and/or smollm2 "
                        "(SmolLM2-135M-Instruct) (default: qwen-coder)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"],
                   choices=["bfloat16", "float32"])
    p.add_argument("--datasets", nargs="+", default=list(DEFAULT_DATASETS), choices=DATASETS,
                   help="humaneval, mtbench, template (one JSON-labelling instruction over "
                        "HumanEval and MT-Bench inputs) (default: humaneval mtbench)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per dataset (default 8)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4],
                   help="requests submitted together (default: 1 4)")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help=f"default: {' '.join(DEFAULT_METHODS)}")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per sample")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0.0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0)")
    p.add_argument("--n", type=int, default=1,
                   help="samples per prompt (vLLM's SamplingParams.n; > 1 needs "
                        "--temperature > 0); tok/s counts every sample's tokens (default 1)")
    p.add_argument("--seed", type=int, default=None,
                   help="seeded sampling: prompt i of a set gets seed BASE + n*i (its n "
                        "samples seed+0..n-1, same in every pass and engine) "
                        "(default: unseeded)")
    p.add_argument("--engine-seed", type=int, default=0, metavar="S",
                   help="every engine's seed (vLLM's LLM(seed=...)): unseeded samples "
                        "come from the engine's random stream, so with one seed every "
                        "run draws the same samples for a method; vary it across runs "
                        "to average over sample lengths (default 0)")
    p.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="run each set R times in a row within the section (the same "
                        "prompts again later in the run); the table adds pass 1 and "
                        "passes 2..R apart (default 1)")
    p.add_argument("--structured", action="store_true",
                   help="hold the template set's outputs to its JSON schema (vLLM "
                        "structured outputs); needs --datasets template")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-mib", type=int, default=512, help="KV cache per engine (MiB)")
    p.add_argument("--compile", action="store_true",
                   help="run the engines as vLLM does by default (torch.compile) "
                        "instead of eager (enforce_eager=True, the default here)")
    p.add_argument("--queue", action="store_true",
                   help="batch size b = b requests running at once, fed from a queue of "
                        "the set's prompts (a request joins when another finishes, as "
                        "on a loaded server; one turn per set); default: b prompts "
                        "submitted together and run to the end, turn by turn")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engines of one model and dtype at once, taking turns "
                        "batch by batch, so drift in machine speed hits every method "
                        "alike (default); --no-interleave: one engine after another")
    p.add_argument("--one-process", action="store_true",
                   help="build the engines of one model and dtype in one process and "
                        "let them take turns batch by batch there: engine processes of "
                        "one configuration differ in speed by up to 16%% (an A/A pair "
                        "measured on a 2-vCPU Xeon), which one process cancels; a crash "
                        "costs the whole group, peak RSS is the group's, no METHOD@PATH "
                        "(default: one process per engine)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per engine process (interleaved: per group of engines) "
                        "before it is killed (default: none)")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="results JSON (the plot goes next to it, .png)")
    p.add_argument("--plot", default=None, help="plot path (default: the JSON's, .png)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="do not run: print the table and render the plot of FILE")
    p.add_argument("-v", "--verbose", action="store_true", help="show vLLM's own logs")
    p.add_argument("--child", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    return p


def check_sampling_args(args: argparse.Namespace) -> str | None:
    """What is wrong with --temperature/--top-p/--n/--seed/--repeat/
    --structured, or None."""
    if not args.temperature >= 0:
        return "--temperature must be >= 0"
    if not 0 < args.top_p <= 1:
        return "--top-p must be in (0, 1]"
    if args.n < 1:
        return "--n must be >= 1"
    if args.n > 1 and args.temperature == 0:
        return "--n > 1 needs --temperature > 0 (vLLM: greedy sampling has n = 1)"
    if args.seed is not None and args.seed < 0:
        return "--seed must be >= 0"
    if args.repeat < 1:
        return "--repeat must be >= 1"
    if args.structured and "template" not in args.datasets:
        return "--structured holds the template set to its JSON schema: add --datasets template"
    return None


def drop_unavailable_suffix(methods: list, reason=suffix_unavailable) -> list:
    """The methods without the ``suffix`` entries when vLLM's suffix
    decoding cannot load here (``arctic_inference.suffix_decoding`` missing:
    ``bash scripts/setup_suffix.sh``), saying so in one line."""
    wanted = [m for m in methods if m.kind == "suffix"]
    if not wanted:
        return methods
    why = reason()
    if why is None:
        return methods
    print(f"skipping {' '.join(m.label for m in wanted)}: vLLM's suffix decoding needs "
          f"arctic_inference.suffix_decoding ({why}); run bash scripts/setup_suffix.sh",
          file=sys.stderr)
    return [m for m in methods if m.kind != "suffix"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return child_main(*args.child)

    if args.from_json:
        src = Path(args.from_json)
        results = json.loads(src.read_text(encoding="utf-8"))
        plot = Path(args.plot) if args.plot else src.with_suffix(".png")
        report(results, plot)
        return 0

    try:
        methods = parse_methods(args.methods)
    except MethodSpecError as exc:
        parser.error(str(exc))
    if args.prompts < 1:
        parser.error("--prompts must be >= 1")
    problem = check_sampling_args(args)
    if problem:
        parser.error(problem)
    if args.one_process and any(m.checkout for m in methods):
        parser.error("--one-process imports one vllm_lookahead: drop the METHOD@PATH entries "
                     "(they need a process of their own)")
    methods = drop_unavailable_suffix(methods)
    if not methods:
        parser.error("no method left to run")
    if any(b < 1 for b in args.batch_sizes):
        parser.error("--batch-sizes must be >= 1")
    if args.batch_sizes and max(args.batch_sizes) > args.prompts:
        print(f"note: batch sizes above --prompts {args.prompts} run all prompts in one batch",
              file=sys.stderr)
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    results = run_benchmark(args, methods, [sys.argv[0], *argv])
    out = Path(args.out)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    print()
    report(results, plot)
    print(f"results: {out}")
    failed = sum(1 for r in results["runs"] if r.get("error"))
    if failed:
        print(f"{failed} engine run(s) failed; see 'error' in {out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
