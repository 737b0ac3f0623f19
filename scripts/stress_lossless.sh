#!/usr/bin/env bash
# Run the lossless tests N times in a row beside a parallel CPU load, stopping at the first failure.
#   scripts/stress_lossless.sh [N=20] [LOAD=2] [NICE=0]
# The tests: every file whose greedy speculative output must equal target-only's (the real-files
# table included, which builds its files once under runs/real-files) and the batch-invariance
# tests. LOAD busy loops run beside them for the whole soak, at the tests' priority plus NICE, so
# thread timings, the layout choice's timing and the scheduler all see a busy machine. Not a CI
# step: one run takes minutes, twenty take hours. On 2 cores, busy loops at the same priority
# stall llama.cpp's spinning threads at every barrier (one run: 2.5 min idle, 10-15 min beside two
# loops); NICE=10 leaves the loops every gap the tests' threads leave, and a run about 2.5 min.
# Needs scripts/install.sh --test first.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:-20}
load=${2:-2}
niceness=${3:-0}
[ -x .venv/bin/python ] || { echo "run scripts/install.sh --test first" >&2; exit 2; }
tests=(tests/real_files tests/test_batch_invariance.py tests/test_exact_variant.py tests/test_attn_rows.py tests/test_host_layout.py tests/test_hybrid.py
       tests/test_mtp_draft.py tests/test_models_drafts.py tests/test_pool_draft.py
       tests/test_speculative.py)

busy=()
for _ in $(seq "$load"); do nice -n "$niceness" bash -c 'while :; do :; done' & busy+=($!); done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
trap 'echo "interrupted" >&2; exit 130' INT

for i in $(seq "$runs"); do
    start=$SECONDS
    if ! .venv/bin/python -m pytest -q -x -p no:cacheprovider "${tests[@]}" > "/tmp/stress_lossless.$i.log" 2>&1; then
        echo "run $i/$runs FAILED after $((SECONDS - start)) s: /tmp/stress_lossless.$i.log"
        tail -30 "/tmp/stress_lossless.$i.log"
        exit 1
    fi
    echo "run $i/$runs: $(tail -1 "/tmp/stress_lossless.$i.log") ($((SECONDS - start)) s, load average $(cut -d' ' -f1 /proc/loadavg))"
done
echo "all $runs runs passed beside $load busy loops at nice $niceness"
