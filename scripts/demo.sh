#!/usr/bin/env bash
# The demo: prepare SmolLM2-135M-Instruct, generate on real prompts with and
# without lookahead, print tokens/s, speedup, step compression, acceptance.
# The terminal shows a progress bar and the table; vLLM's logs go to a log
# file (its path is printed at the end).
# Extra arguments go to the demo, e.g. `bash scripts/demo.sh --dtype float32`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VLLM_LOOKAHEAD_VENV:-.venv}
source scripts/cpu_env.sh   # vLLM's CPU setup: tcmalloc + Intel OpenMP preloaded
exec "$VENV/bin/python" -m vllm_lookahead.demo "$@"
