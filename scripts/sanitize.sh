#!/usr/bin/env bash
# Build the patched llama.cpp with a sanitizer into its own venv and run the engine tests under it.
#   scripts/sanitize.sh address [pytest args...]   # AddressSanitizer, venv .venv-asan
#   scripts/sanitize.sh thread  [pytest args...]   # ThreadSanitizer, venv .venv-tsan
# Default tests: the engine (copy worker, plans sent during decodes, injected copy delays), the
# RPC device and the plan-API fuzzer. Needs scripts/install.sh --test first: the sanitizer venv
# reuses .venv's packages and only has its own llama_cpp. Not a CI step (a sanitized build takes
# as long as the first build).
set -euo pipefail
cd "$(dirname "$0")/.."

kind=${1:-}
case "$kind" in
    address) venv=.venv-asan; runtime_lib=libasan.so ;;
    thread)  venv=.venv-tsan; runtime_lib=libtsan.so ;;
    *) echo "usage: $0 address|thread [pytest args...]" >&2; exit 2 ;;
esac
shift
[ -x .venv/bin/python ] || { echo "run scripts/install.sh --test first" >&2; exit 1; }

purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
[ -x "$venv/bin/python" ] || .venv/bin/python -m venv "$venv"
# .venv's packages come after this venv's own site-packages, where the sanitized llama_cpp goes
.venv/bin/python -c "$purelib" > "$("$venv/bin/python" -c "$purelib")/spac-base-venv.pth"
"$venv/bin/python" scripts/build_native.py --sanitize "$kind" --python "$venv/bin/python"

# Python itself is not instrumented: the sanitizer runtime must be loaded first. Python's own
# allocations are never freed at exit, so leak checking is off; RPC servers started by the tests
# inherit the environment and run sanitized too.
runtime=$("${CC:-cc}" -print-file-name="$runtime_lib")
[ -f "$runtime" ] || { echo "the compiler has no $runtime_lib (install its sanitizer runtime)" >&2; exit 1; }
tests=(tests/test_engine.py tests/test_engine_rpc.py tests/test_engine_fuzz.py)
[ $# -gt 0 ] && tests=("$@")
# libstdc++ too: Python is not a C++ program, and the sanitizer's exception interceptor needs
# the real __cxa_throw resolvable when it starts
export LD_PRELOAD="$runtime $("${CC:-cc}" -print-file-name=libstdc++.so.6)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0"
export SPAC_FUZZ_CASES="${SPAC_FUZZ_CASES:-10000}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tests' subprocesses import orchestrator
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"
