# Sourced by scripts/demo.sh and scripts/bench.sh: vLLM's CPU performance
# setup, as its CPU install guide does it -- preload tcmalloc and Intel
# OpenMP (libiomp5, from the intel-openmp wheel in the venv). Without
# libiomp5 vLLM warns "Speculative decoding on CPU without Intel OpenMP in
# LD_PRELOAD will cause significant performance loss".
# LOOKAHEAD_NO_PRELOAD=1 leaves LD_PRELOAD alone (to measure without).
# Expects $VENV.
if [ "${LOOKAHEAD_NO_PRELOAD:-0}" != 1 ] && [ "$(uname -s)" = Linux ]; then
    _la_pre=()
    # awk reads to the end (no early exit): under `set -o pipefail` an
    # early exit could end ldconfig with SIGPIPE and the calling script
    # with it, now and then
    _la_tc=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 / && !f {print $NF; f = 1}')
    [ -n "$_la_tc" ] && _la_pre+=("$_la_tc")
    [ -f "$VENV/lib/libiomp5.so" ] && _la_pre+=("$(cd "$VENV/lib" && pwd)/libiomp5.so")
    for _la_lib in "${_la_pre[@]}"; do
        case ":${LD_PRELOAD:-}:" in *":$_la_lib:"*) ;; *) LD_PRELOAD="${LD_PRELOAD:+$LD_PRELOAD:}$_la_lib" ;; esac
    done
    [ -n "${LD_PRELOAD:-}" ] && export LD_PRELOAD
    unset _la_pre _la_tc _la_lib
fi
