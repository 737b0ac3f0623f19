"""Which host matmul kernels give a batch's rows, bit for bit, what one token gets (issue 37).

Speculative output equals target-only output exactly only where a verify pass of n tokens computes
each row as a one-token decode does. This prints, per weight type, CPU buffer type (llama.cpp's
plain layout, CPU_REPACK, AMX where the build and the CPU have them) and op (MUL_MAT: a dense
weight; MUL_MAT_ID: experts), whether the rows of one n-token matmul equal the same tokens
computed one at a time ("=": bit-identical; else the largest difference relative to the largest
output), for n = 2..9 (a verify pass of γ + 1 ≤ 9), 16, 64 and 512 (prompt ubatches), and whether
2 threads give what 1 thread gives. The baseline for a batch-invariant kernel of spac's own.

    .venv/bin/python bench/batch_invariance.py [--n-in 2048] [--n-out 256] [--types q4_0,q8_0,...]
                                                [--batch-invariant-rows N] [--device CUDA0]

--device runs the same comparison on a GPU's kernels (the device's own buffer type, its
backend; issue 37's point 4: which verify sizes a GPU computes column by column); `rpc` is the
stand-in, an RPC server on this machine serving its CPU with llama.cpp's kernels.

--batch-invariant-rows N turns on ggml-cpu's batch-invariant mode for batches of up to N rows (spac's
exact mode sets it to the largest verify batch); 0, the default, measures llama.cpp's kernels.

Weights: a few random quantized rows repeated (host_layout's micro-benchmark); activations and
expert choices random, seeded. Nothing is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.runtime.host_layout import (  # noqa: E402
    cpu_buffer_types,
    cpu_model_and_flags,
    device_buffer_type,
    matmul_output,
    set_batch_invariant_rows,
)
from orchestrator.runtime.llm import init_backend  # noqa: E402

TYPES = ("f16", "bf16", "q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_nl")
BATCHES = (2, 3, 4, 5, 6, 7, 8, 9, 16, 64, 512)
N_REFERENCE = 64  # rows compared against one-token runs (the first ones of a larger batch)


def cell(got: np.ndarray, want: np.ndarray) -> str:
    if got.tobytes() == want.tobytes():
        return "="
    scale = float(np.abs(want).max()) or 1.0
    return f"{float(np.abs(got.astype(np.float64) - want).max()) / scale:.0e}"


def rows(ggml_type: int, buft: int, n_in: int, n_out: int, n_expert: int, n_used: int, args) -> list[str] | None:
    rng = np.random.default_rng(args.seed)
    n_max = max(BATCHES)
    xs = rng.standard_normal((n_max, n_used, n_in), dtype=np.float32)
    ids = np.argsort(rng.random((n_max, n_expert)), axis=1)[:, :n_used].astype(np.int32) if n_expert else None

    def run(n: int, threads: int = 1, start: int = 0):
        return matmul_output(ggml_type, n_in, n_out, n_expert, xs[start:start + n],
                             None if ids is None else ids[start:start + n], buft, threads, seed=args.seed,
                             device=args.device)

    first = run(1)
    if first is None:
        return None  # this buffer type does not take the weight
    single = np.concatenate([first] + [run(1, start=i) for i in range(1, N_REFERENCE)])
    out = []
    for n in BATCHES:
        batch = run(n)
        k = min(n, N_REFERENCE)
        out.append(cell(batch[:k], single[:k]))
    out.append(cell(run(9, threads=2), run(9)) if args.device == "CPU" else "-")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-in", type=int, default=2048, help="row length (a multiple of 256 for the K-quants)")
    ap.add_argument("--n-out", type=int, default=256, help="output rows")
    ap.add_argument("--n-expert", type=int, default=8, help="experts of the MUL_MAT_ID weight")
    ap.add_argument("--n-used", type=int, default=2, help="experts each token uses")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-invariant-rows", type=int, default=0,
                    help="ggml-cpu's batch-invariant mode up to this many rows (0: off, llama.cpp's kernels)")
    ap.add_argument("--device", default="CPU", help="a ggml device (CUDA0, ...) instead of the CPU's buffer "
                    "types; rpc: a stand-in RPC server on this machine")
    args = ap.parse_args()
    if args.device == "rpc":
        from orchestrator.runtime.rpc import rpc_device
        with rpc_device() as name:
            args.device = name
            report(args)
    else:
        report(args)


def report(args) -> None:
    """The table, on the CPU's buffer types or on args.device."""
    init_backend()  # llama.cpp's and ggml's errors only (not the repack lines)
    model, flags = cpu_model_and_flags()
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    print(f"CPU: {model}; flags {' '.join(simd)}")
    set_batch_invariant_rows(args.batch_invariant_rows)
    print(f"batch-invariant rows: {args.batch_invariant_rows or 'off'}")
    print(f"weights [{args.n_in} x {args.n_out}] (MUL_MAT_ID: x {args.n_expert} experts, {args.n_used} per token); "
          f"1 thread unless said; '=': bit-identical to the same tokens one at a time, else the largest "
          f"difference relative to the largest output\n")
    try:
        bufts = cpu_buffer_types() if args.device == "CPU" else {args.device: device_buffer_type(args.device)}
    except ValueError as e:
        print(f"--device: {e}", file=sys.stderr)
        sys.exit(2)
    if args.device != "CPU":
        print(f"device {args.device}: its kernels at every n (the batch-invariant rows apply to the CPU only)")
    head = " | ".join(f"n={n}" for n in BATCHES)
    print(f"| type | buffer | op | {head} | 2 threads = 1 (n=9) |")
    print("|---|---|---|" + "---|" * (len(BATCHES) + 1))
    for name in args.types.split(","):
        ggml_type = int(GGMLQuantizationType[name.strip().upper()])
        for buft_name, buft in bufts.items():
            for op, n_expert, n_used in (("MUL_MAT", 0, 1), ("MUL_MAT_ID", args.n_expert, args.n_used)):
                got = rows(ggml_type, buft, args.n_in, args.n_out, n_expert, n_used, args)
                if got is None:
                    continue
                print(f"| {name} | {buft_name} | {op} | " + " | ".join(got) + " |", flush=True)


if __name__ == "__main__":
    main()
