#!/usr/bin/env bash
# vLLM's own suffix decoding (speculative_config method "suffix", the
# benchmark's `suffix` entries) needs `arctic_inference.suffix_decoding`.
# This installs ONLY that: the suffix-tree C++ module of the arctic-inference
# 0.3.0 sdist (csrc/suffix_decoding, CMake + nanobind) and the few Python
# files that load it (arctic_inference/__init__.py,
# arctic_inference/suffix_decoding/{__init__,cache}.py), copied into the
# venv's site-packages. Deliberately WITHOUT arctic-inference's dist-info and
# entry points: its own vLLM plugin patches much of vLLM and must never load
# next to ours (the benchmark's engine processes also set VLLM_PLUGINS).
#
# Idempotent: exits at once when `arctic_inference.suffix_decoding` imports
# (--force rebuilds). Needs network access to the package index, g++, cmake
# >= 3.18 and Python headers. Where it cannot build it prints one line
# starting with "setup_suffix: " and exits non-zero.
#   bash scripts/setup_suffix.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_LOOKAHEAD_VENV:-.venv}
PY="$VENV/bin/python"
ARCTIC_VERSION=0.3.0
NANOBIND_VERSION=2.9.2   # the arctic-inference 0.3.0 build requirement
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

fail() { echo "setup_suffix: $*; the suffix method is unavailable" >&2; exit 1; }

[ -x "$PY" ] || fail "no virtualenv at $VENV (run scripts/setup.sh first)"
check() {
    "$PY" - <<'PY' 2>/dev/null
from arctic_inference.suffix_decoding import SuffixDecodingCache
cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=4)
cache.start_request("r", [1, 2, 3, 1, 2])
cache.add_active_response("r", [3])
draft = cache.speculate("r", [1, 2], max_spec_tokens=4)
assert list(draft.token_ids)[:1] == [3], draft
PY
}
if [ "$FORCE" = 0 ] && check; then
    exit 0
fi
for tool in g++ cmake; do
    command -v "$tool" >/dev/null || fail "$tool not found"
done

SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if compgen -G "$SITE/arctic_inference-*.dist-info" >/dev/null; then
    fail "a full arctic-inference is installed in $VENV (its vLLM plugin would patch vLLM); uninstall it first"
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/vllm-la-suffix.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
LOG="$TMP/build.log"
started=$SECONDS
echo "== building arctic_inference.suffix_decoding $ARCTIC_VERSION (suffix-tree module only, about a minute)" >&2

# The sdist, never into the checkout. Its setup.py imports torch just to
# prepare metadata: run with the venv's pip, without build isolation (the
# venv has torch and setuptools), so nothing is built or installed here.
"$PY" -m pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
    --no-build-isolation "arctic-inference==$ARCTIC_VERSION" -d "$TMP/dl" >"$LOG" 2>&1 \
    || fail "could not download the arctic-inference==$ARCTIC_VERSION sdist ($(tail -n 1 "$LOG"))"
tar -xzf "$TMP/dl/arctic_inference-$ARCTIC_VERSION.tar.gz" -C "$TMP" \
    || fail "could not unpack the sdist"
SRC="$TMP/arctic_inference-$ARCTIC_VERSION"
[ -f "$SRC/csrc/suffix_decoding/CMakeLists.txt" ] || fail "the sdist has no csrc/suffix_decoding"

# nanobind in a throw-away build venv on the same interpreter (the
# extension's ABI is the interpreter's), not in the project's venv.
BASE_PY=$("$PY" -c 'import sys; print(sys._base_executable)')
"$BASE_PY" -m venv "$TMP/buildenv" >>"$LOG" 2>&1 || fail "could not create a build venv"
"$TMP/buildenv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "nanobind==$NANOBIND_VERSION" >>"$LOG" 2>&1 \
    || fail "could not install nanobind==$NANOBIND_VERSION ($(tail -n 1 "$LOG"))"

cmake -S "$SRC/csrc/suffix_decoding" -B "$TMP/build" -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$TMP/buildenv/bin/python" >>"$LOG" 2>&1 \
    || fail "cmake configure failed ($(grep -m1 -i error "$LOG" || tail -n 1 "$LOG"))"
cmake --build "$TMP/build" -j "$(nproc 2>/dev/null || echo 2)" >>"$LOG" 2>&1 \
    || fail "the C++ build failed ($(grep -m1 -i 'error' "$LOG" || tail -n 1 "$LOG"))"
EXT=$(find "$TMP/build" -maxdepth 2 -name '_C*.so' -print -quit)
[ -n "$EXT" ] || fail "the build produced no _C extension"

DEST="$SITE/arctic_inference"
rm -rf "$DEST"
mkdir -p "$DEST/suffix_decoding"
cp "$SRC/arctic_inference/__init__.py" "$DEST/__init__.py"
cp "$SRC/arctic_inference/suffix_decoding/__init__.py" \
   "$SRC/arctic_inference/suffix_decoding/cache.py" "$DEST/suffix_decoding/"
cp "$EXT" "$DEST/suffix_decoding/"
cp "$SRC/LICENSE" "$DEST/LICENSE" 2>/dev/null || true
cat >"$DEST/VLLM_LOOKAHEAD_README" <<EOF
Installed by vllm-lookahead's scripts/setup_suffix.sh: only the suffix-tree
module of the arctic-inference $ARCTIC_VERSION sdist (for vLLM's suffix
decoding), no dist-info, no entry points, no vLLM plugin. Remove this folder
to uninstall.
EOF
check || fail "built, but arctic_inference.suffix_decoding does not work in $VENV"
echo "== arctic_inference.suffix_decoding installed into $DEST ($((SECONDS - started)) s)" >&2
