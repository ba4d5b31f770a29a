"""Command line of :mod:`vllm_lookahead.tools` (see its docstring).

``python -m vllm_lookahead.tools smollm2|qwen-coder|tiny PATH|prompts ...``
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_lookahead.tools.models import MODELS
from vllm_lookahead.tools.packages import AssetMissingError
from vllm_lookahead.tools.prompts import load_humaneval, load_mtbench
from vllm_lookahead.tools.tiny import make_tiny_model


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_lookahead.tools",
        description="Prepare offline models and prompt sets for vllm-lookahead.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, what in (("smollm2", "SmolLM2-135M-Instruct"),
                       ("qwen-coder", "Qwen2.5-Coder-0.5B-Instruct")):
        model = sub.add_parser(name, help=f"build (if needed) and print the {what} folder")
        model.add_argument("--force", action="store_true", help="rebuild even if cached")

    tiny = sub.add_parser("tiny", help="write a tiny random Llama to PATH")
    tiny.add_argument("path", type=Path)
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument("--hidden-size", type=int, default=128)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--num-heads", type=int, default=4)
    tiny.add_argument("--num-kv-heads", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--max-position-embeddings", type=int, default=2048)

    prompts = sub.add_parser("prompts", help="print prompts as JSON lines (one string each)")
    prompts.add_argument("dataset", choices=("humaneval", "mtbench"))
    prompts.add_argument("-n", type=int, default=None, help="only the first N prompts")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line interface; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command in MODELS:
            print(MODELS[args.command](force=args.force))
        elif args.command == "tiny":
            print(
                make_tiny_model(
                    args.path,
                    vocab_size=args.vocab_size,
                    hidden_size=args.hidden_size,
                    num_layers=args.num_layers,
                    num_heads=args.num_heads,
                    num_kv_heads=args.num_kv_heads,
                    seed=args.seed,
                    max_position_embeddings=args.max_position_embeddings,
                )
            )
        else:
            loader = load_humaneval if args.dataset == "humaneval" else load_mtbench
            for prompt in loader(args.n):
                print(json.dumps(prompt))
    except (AssetMissingError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
