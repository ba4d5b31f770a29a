#!/usr/bin/env bash
# Run the whole test suite (unit + end-to-end on a real model), after setup.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
exec .venv/bin/python -m pytest -p no:cacheprovider -q "$@" tests
