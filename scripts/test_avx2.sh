#!/usr/bin/env bash
# Build the patched llama.cpp for an AVX2-only CPU into its own venv and run the lossless tests on it.
#   scripts/test_avx2.sh [pytest args...]    # venv .venv-avx2; arguments replace the test list
# The default build is -march=native: on an AVX-512 machine (CI's) its host kernels (CPU_EXACT,
# llama.cpp's repacked and plain ones) are the AVX-512 paths, while users' desktops are often
# AVX2-only. This builds `build_native.py --cpu-variant avx2` (GGML_NATIVE off, AVX2/FMA/F16C/BMI2
# on, AVX-512 and AMX off: .venv's package with ggml's CPU backend built for them, its own stamp)
# and runs, on it, every test that holds
# speculative output to target-only's and the batch-invariance tests (scripts/stress_lossless.sh's
# list). Checks first that the venv loads the variant's libraries, that CPU_EXACT's kernel is the
# AVX2 one and gives the default build's bits (tests/exact_digest.py, every type, layout, op and
# batch), that llama.cpp's common library the real-files tests compile against is the one of the
# build that made the venv's libllama, and that no AVX-512 instruction is in libggml-cpu; builds stock llama-simple for AVX2 too (the
# real-files tests' byte-for-byte peer: build_native.stock_program follows the installed build).
# Needs scripts/install.sh --test first: the venv reuses .venv's packages and only has its own
# llama_cpp. A CI step (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-avx2
[ -x .venv/bin/python ] || { echo "run scripts/install.sh --test first" >&2; exit 1; }
for flag in avx2 fma f16c; do
    grep -qw "$flag" /proc/cpuinfo || { echo "this CPU has no $flag: it cannot run the AVX2 build" >&2; exit 1; }
done

purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
[ -x "$venv/bin/python" ] || .venv/bin/python -m venv "$venv"
# .venv's packages come after this venv's own site-packages, where the variant's llama_cpp goes
.venv/bin/python -c "$purelib" > "$("$venv/bin/python" -c "$purelib")/spac-base-venv.pth"
start=$SECONDS
"$venv/bin/python" scripts/build_native.py --cpu-variant avx2 --python "$venv/bin/python"
echo "[avx2] build: $((SECONDS - start)) s"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tests' subprocesses import orchestrator
"$venv/bin/python" - "$venv" <<'EOF'
"""What the tests will run on: the CPU, the variant's libraries, CPU_EXACT's kernel."""
import ctypes
import subprocess
import sys
import sysconfig
from pathlib import Path

sys.path[:0] = ["scripts", "tests"]
import build_native as bn
from conftest import _build_id, llama_common_dir, llama_lib_dir

from orchestrator.runtime.host_layout import cpu_model_and_flags

FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
         "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
model, flags = cpu_model_and_flags()
print(f"[avx2] CPU: {model}; flags: {' '.join(f for f in FLAGS if f in flags)}")


def fail(msg: str) -> None:
    sys.exit(f"[avx2] error: {msg}")


lib_dir = llama_lib_dir().resolve()
venv_lib = Path(sysconfig.get_paths()["purelib"]).resolve()
import llama_cpp  # noqa: E402  (what the tests import)

print(f"[avx2] llama_cpp: {Path(llama_cpp.__file__).parent}; libllama: {lib_dir / 'libllama.so'}")
if not lib_dir.is_relative_to(venv_lib) or not Path(llama_cpp.__file__).resolve().is_relative_to(venv_lib):
    fail(f"{sys.argv[1]} imports a llama_cpp outside its own site-packages {venv_lib}")

kernel = ctypes.CDLL(str(lib_dir / "libggml-cpu.so")).ggml_cpu_exact_kernel
kernel.restype = ctypes.c_char_p
name = kernel().decode()
print(f"[avx2] CPU_EXACT kernel: {name}")
if name != "avx2":
    fail(f"CPU_EXACT's kernel is {name!r}, not the AVX2 one")

# the variant is the default build's package with its own libggml-cpu (build_native.py's
# install_cpu_variant): the real-files tests compile a helper against llama.cpp's common library of
# the build that made the installed libllama (the same ELF build id), and link the venv's
# libggml-cpu first
common = llama_common_dir()
print(f"[avx2] common library: {common}")
if common is None or not _build_id(lib_dir / "libllama.so") or _build_id(common / "libllama.so") != _build_id(
        lib_dir / "libllama.so"):
    fail(f"llama.cpp's common library found is {common}, not that of the build of {lib_dir} (or no build id)")

# -march=native compiled nothing in: no AVX-512 register in the CPU library's code
try:
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib_dir / "libggml-cpu.so")],
                         capture_output=True, text=True, check=True).stdout
except (OSError, subprocess.CalledProcessError) as e:
    print(f"[avx2] objdump failed ({e}): the instruction check is skipped")
else:
    n = sum(1 for line in asm.splitlines() if "%zmm" in line or "{%k" in line)
    print(f"[avx2] instructions with an AVX-512 register in libggml-cpu: {n}")
    if n:
        fail("libggml-cpu has AVX-512 instructions")

# the real-files tests hold spac's output with llama.cpp's kernels to stock llama-simple's, byte
# for byte: stock_program builds it for the ISA of the spac build this interpreter imports
import time  # noqa: E402

t0 = time.monotonic()
simple = bn.stock_program("llama-simple")
print(f"[avx2] stock llama-simple: {simple} ({time.monotonic() - t0:.0f} s)")
if not simple.parent.parent.name.startswith("stock-avx2-"):
    fail(f"stock llama-simple {simple} is not the AVX2 build")
EOF

# the AVX2 kernels give the default build's bits (AVX-512 on a CPU with it): one order of every sum
"$venv/bin/python" tests/exact_digest.py > "$venv/exact-bits.txt"
.venv/bin/python tests/exact_digest.py > .venv/exact-bits.txt
if ! diff -q .venv/exact-bits.txt "$venv/exact-bits.txt" > /dev/null; then
    diff .venv/exact-bits.txt "$venv/exact-bits.txt" | head -20 >&2
    echo "[avx2] error: CPU_EXACT's AVX2 outputs differ from the default build's" >&2
    exit 1
fi
echo "[avx2] CPU_EXACT outputs: the default build's bits ($(wc -l < "$venv/exact-bits.txt") matmuls)"

tests=(tests/real_files tests/test_batch_invariance.py tests/test_exact_variant.py tests/test_attn_rows.py tests/test_host_layout.py tests/test_hybrid.py
       tests/test_mtp_draft.py tests/test_models_drafts.py tests/test_pool_draft.py
       tests/test_speculative.py)
[ $# -gt 0 ] && tests=("$@")
start=$SECONDS
rc=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" || rc=$?
echo "[avx2] tests: $((SECONDS - start)) s"
exit $rc
