#!/usr/bin/env bash
# The checks that need a real GPU, in stages that each fit a short lease of a GPU machine.
#
#   bench/gpu_checks.sh correct  OUT_DIR   # lossless + tolerance checks with the pool on CUDA0, and
#                                          # which verify sizes its matmuls compute column by column
#   bench/gpu_checks.sh truth    OUT_DIR   # bench_sim_truth.py on CUDA0: predicted vs measured tok/s
#                                          # (static, spac and llama.cpp's cache, live in spac's engine)
#   bench/gpu_checks.sh peer     OUT_DIR   # llama.cpp -ngl 99 --n-cpu-moe on the same target
#   bench/gpu_checks.sh prefill  OUT_DIR   # streamed prefill against llama.cpp's op offload (issue 23)
#                                          # and a 4,096-token prompt under -ub auto against -ub 512
#   bench/gpu_checks.sh copies   OUT_DIR   # the pool's copy rate: per expert / per layer batch,
#                                          # pageable / registered (--pin-mapping) / pinned (--no-mmap)
#
# Needs: spac importable by `python3` (a CUDA build, scripts/install.sh --cuda), the device SPAC_DEVICE
# names (default CUDA0; rpc: the stand-in, every stage but peer),
# and for `peer` LLAMA_BENCH naming a CUDA build of llama-bench. SPAC_THREADS sets the host
# threads (default: half the cores, llama.cpp's usual choice on SMT machines); SPAC_NO_MMAP=1 loads
# the target as --no-mmap in truth and peer (llama.cpp too: -mmp 0, --no-mmap). Every stage
# prints the GPU and the CPU's flags first, and writes its logs and JSON under OUT_DIR.
set -euo pipefail
stage=${1:?stage: correct, truth, peer, prefill or copies}
out=${2:?output directory}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
device=${SPAC_DEVICE:-CUDA0}
no_mmap=${SPAC_NO_MMAP:+--no-mmap}
threads=${SPAC_THREADS:-$(( $(nproc) / 2 ))}
# SPAC_DEVICE=rpc: every stage but peer on the stand-in device, to try the script without a GPU
# (`spac rpc-server` on 127.0.0.1 with one thread for spac's commands; the benchmarks start their
# own). In `correct` it runs as a user serving a CPU would, with its default --exact: the device
# then computes an expert bit for bit as the host does, and its tokens must equal target-only's.
# Elsewhere --no-exact: llama.cpp's kernels, a device's own, as a GPU's are.
bench_device=$device rpc_args=() test_device=$device stand_in=0
if [ "$device" = rpc ]; then
    port=$(( 20000 + RANDOM % 20000 ))
    exact=--no-exact; [ "$stage" = correct ] && exact=--exact
    "$py" -m orchestrator.cli rpc-server -H 127.0.0.1 -p $port -t 1 -d CPU $exact > "$out/rpc-server.log" 2>&1 &
    server=$!
    trap 'kill $server 2> /dev/null' EXIT
    for _ in $(seq 300); do grep -q "RPC server on" "$out/rpc-server.log" && break; sleep 0.1; done
    grep -q "RPC server on" "$out/rpc-server.log" || { echo "the RPC server did not start" >&2; exit 1; }
    device=RPC0 rpc_args=(--rpc 127.0.0.1:$port) test_device= stand_in=1
fi
spac() { "$py" -m orchestrator.cli "$@" ${rpc_args[@]+"${rpc_args[@]}"}; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $(nproc)"
echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|f16c|avx512f|avx512_vnni|avx512bw|amx_tile|amx_int8)$' | tr '\n' ' ')"
echo "host threads: $threads"

target=${SPAC_MB_TARGET:-/tmp/spac-mb/olmoe-bytes-f16.gguf}
make_target() {
    [ -e "$target" ] || { mkdir -p "$(dirname "$target")"; "$py" scripts/make_memory_bound_target.py "$target"; }
}

case $stage in
correct)
    # 1. end to end on the shipped models: every pool/draft setting against the target's own greedy
    # tokens. On the stand-in a difference fails the stage (at the end). On a GPU it is reported: the
    # GPU computes an expert in another order than the host, and speculation changes which experts
    # the pool holds when, so a near-tie can go the other way (README, "Where lossless does not hold")
    prompt=$'class Stack:\n    def __init__(self):'
    failed=0 differ=0
    # a K-quant target too (random weights, Q4_K_M through llama.cpp's quantizer): the type whose
    # verify and decode kernels differ most (issue 37)
    kquant=${SPAC_KQUANT_TARGET:-/tmp/spac-kq/qwen3moe-q4_k_m.gguf}
    [ -e "$kquant" ] || { mkdir -p "$(dirname "$kquant")"; "$py" scripts/make_random_moe.py "$kquant" --n-embd 256 \
        --n-layer 4 --n-expert 32 --n-expert-used 4 --n-ff-exp 256 --quant q4_k_m > /dev/null; }
    for model in orchestrator/shipped_models/spac-tiny-moe-f16.gguf orchestrator/shipped_models/spac-tiny-moe-q4_0.gguf "$kquant"; do
        name=$(basename "$model" .gguf)
        for budget in 25% 50%; do
            spac generate "$prompt" -m "$model" -n 64 --temp 0 --json --device "$device" --expert-budget $budget \
                --draft none -t "$threads" > "$out/$name-plain-$budget.json" || { failed=1; continue; }
            drafts=(pool); [ "$name" = spac-tiny-moe-f16 ] && drafts=(pool model)
            for draft in "${drafts[@]}"; do
                args=(--draft pool); [ "$draft" = model ] && args=()   # model: the shipped draft, the default
                spac generate "$prompt" -m "$model" -n 64 --temp 0 --json --device "$device" --expert-budget $budget \
                    ${args[@]+"${args[@]}"} -t "$threads" > "$out/$name-$draft-$budget.json" || { failed=1; continue; }
                "$py" - "$out/$name-plain-$budget.json" "$out/$name-$draft-$budget.json" <<'EOF' || differ=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
same = a["tokens"] == b["tokens"]
print(f"{sys.argv[2].rsplit('/', 1)[1]}: {'identical to' if same else 'DIFFERS from'} target-only greedy "
      f"({len(b['tokens'])} tokens; pool {b.get('pool_device')}, {b.get('n_slots')} slots)")
if not same:
    i = next(i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
    print(f"  first difference at token {i}: {a['text']!r} vs {b['text']!r}")
sys.exit(0 if same else 1)
EOF
            done
        done
    done
    [ $stand_in = 1 ] && failed=$(( failed | differ ))
    # 2. the engine tests that take a second device, with this device as that device
    #    (the streamed prefill's too: events and the copy worker's own stream on a real GPU)
    SPAC_TEST_DEVICE=$test_device "$py" -m pytest -q -p no:cacheprovider tests/test_engine_rpc.py tests/test_pool_draft.py \
        tests/test_host_layout.py tests/test_stream_prefill.py -k "rpc_device or gpu_run" 2>&1 \
        | tee "$out/pytest-device.log" || failed=1
    # 3. which n-token passes the device's matmul kernels compute column by column, bit for bit as
    #    n one-token passes (issue 37, point 4): a report, it fails nothing but an error
    bi_device=$device; [ $stand_in = 1 ] && bi_device=rpc   # its own stand-in, on llama.cpp's kernels
    "$py" bench/batch_invariance.py --device "$bi_device" --types f16,q4_0,q8_0,q4_k,q5_k,q6_k,iq4_nl \
        2>&1 | tee "$out/batch-invariance.md" || failed=1
    exit $failed
    ;;
truth)
    make_target
    PYTHONUNBUFFERED=1 "$py" bench/bench_sim_truth.py -m "$target" --device "$bench_device" -t "$threads" --no-overlap --repeats ${SPAC_TRUTH_REPEATS:-3} $no_mmap \
        --policies ${SPAC_TRUTH_POLICIES:-static,spac,llama-moe-cache} \
        --json "$out/sim-truth.json" --keep "$out/sim-truth-keep" 2>&1 | tee "$out/sim-truth.log"
    tar -C "$out" -czf "$out/sim-truth-keep.tgz" sim-truth-keep && rm -r "$out/sim-truth-keep"
    ;;
peer)
    [ "$bench_device" = rpc ] && { echo "peer: llama.cpp's CUDA programs, a GPU stage"; exit 0; }
    make_target
    : "${LLAMA_BENCH:?LLAMA_BENCH must name a CUDA build of llama-bench}"
    # the target has 16 MoE layers: --n-cpu-moe 12 / 8 leave 25% / 50% of the experts on the GPU
    "$LLAMA_BENCH" -m "$target" -ngl 99 -ncmoe 16,12,8,0 -t "$threads" -p 0 -n 64 -r 3 -o json ${no_mmap:+-mmp 0} \
        > "$out/llama-bench.json" 2> "$out/llama-bench.err" || { tail -20 "$out/llama-bench.err"; exit 1; }
    "$py" - "$out/llama-bench.json" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"llama-bench -ngl 99 --n-cpu-moe {r.get('n_cpu_moe')}: tg{r['n_gen']} {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} tok/s")
EOF
    # llama.cpp's own speculative decoding with the shipped draft on the GPU, bench_sim_truth's
    # prompts and length, γ ≤ 8, greedy
    spec=$(dirname "$LLAMA_BENCH")/llama-speculative-simple
    for ncmoe in 12 8; do
        "$py" - "$spec" "$target" "$ncmoe" "$threads" $no_mmap <<'EOF'
import re, subprocess, sys
sys.path.insert(0, "bench")
from bench_sim_truth import PROMPTS
exe, target, ncmoe, threads, *no_mmap = sys.argv[1:]
n = secs = drafted = accepted = 0
for prompt in PROMPTS[:3]:
    cmd = [exe, "-m", target, "-md", "orchestrator/shipped_models/spac-tiny-moe-q4_0.gguf", "--spec-type", "draft-simple",
           "-ngl", "99", "-ngld", "99",
           "--n-cpu-moe", ncmoe, "-p", prompt, "-n", "64", "-c", "512", "-t", threads, "-td", threads,
           "--spec-draft-n-max", "8", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
           "--temp", "0", "--top-k", "1", "--seed", "1", *no_mmap]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    m = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds", res.stderr)
    d = re.search(r"n_drafted\s*=\s*(\d+).*?n_accept\s*=\s*(\d+)", res.stderr, re.S)
    n, secs = n + int(m.group(1)), secs + float(m.group(2))
    drafted, accepted = drafted + int(d.group(1)), accepted + int(d.group(2))
print(f"llama-speculative-simple -ngl 99 -ngld 99 --n-cpu-moe {ncmoe} γ≤8: {n / secs:.2f} tok/s "
      f"({n} tokens, {accepted}/{drafted} drafts accepted)")
EOF
    done
    ;;
prefill)
    # a Qwen3-30B-A3B-shaped prompt through the pool (25%) against llama.cpp's -ngl 99 --cpu-moe
    # with and without op offload, and every expert resident (the GPU's compute alone)
    PYTHONUNBUFFERED=1 "$py" bench/bench_stream_prefill.py --device "$bench_device" -t "$threads" --preset qwen3-30b-a3b \
        --n-layer ${SPAC_PREFILL_LAYERS:-8} --tokens 512,2048 --repeats ${SPAC_PREFILL_REPEATS:-5} --json "$out/stream-prefill.json" 2>&1 \
        | tee "$out/stream-prefill.log"
    # the prompt's pass under -ub auto against llama.cpp's 512: a 4,096-token prompt through a 25%
    # pool of a Qwen3-30B-A3B-shaped file, time to the first token (prefill_s), streamed both ways
    synth=${SPAC_UB_TARGET:-/tmp/spac-ub/qwen3-30b-a3b-${SPAC_PREFILL_LAYERS:-8}l.gguf}
    [ -e "$synth" ] || { mkdir -p "$(dirname "$synth")"; "$py" scripts/make_synthetic_moe.py qwen3-30b-a3b "$synth" \
        --n-layer ${SPAC_PREFILL_LAYERS:-8} > /dev/null; }
    "$py" -c "import random; random.seed(1); print(' '.join(random.choice(['def', 'class', 'return', 'x', 'y', '(', ')', ':', '=', '+']) for _ in range(4000)))" \
        > "$out/ub-prompt.txt"
    for ub in auto 512; do
        spac generate - -m "$synth" -n 1 --temp 0 --json --device "$device" --expert-budget 25% --draft none -c 8192 \
            -ub $ub -t "$threads" < "$out/ub-prompt.txt" > "$out/ub-$ub.json" || exit 1
        "$py" -c "import json, sys; r = json.load(open(sys.argv[1])); print(f\"-ub {sys.argv[2]}: passes of {r['n_ubatch']} tokens, prefill {r['prefill_s']:.2f} s ({r['n_prompt_tokens']} tokens)\")" \
            "$out/ub-$ub.json" $ub
    done
    ;;
copies)
    make_target
    PYTHONUNBUFFERED=1 "$py" bench/bench_copies.py -m "$target" --device "$bench_device" -t "$threads" 2>&1 | tee "$out/copies.log"
    ;;
*)
    echo "unknown stage $stage (correct, truth, peer, prefill, copies)" >&2; exit 2 ;;
esac
