"""The bits of CPU_EXACT's outputs in this interpreter's build, one line per (type, layout, op,
batch): a digest that scripts/test_avx2.sh compares between the AVX2 build and the default
(-march=native) one, whose kernels must give the same bits (one order of every sum, whatever the
SIMD width). Every type CPU_EXACT takes, in its buffer type and in the plain layout of exact mode,
MUL_MAT and MUL_MAT_ID, batches 1..9, 16 and 32; F16 and BF16 in the plain layout.

    python tests/exact_digest.py > bits.txt
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orchestrator.decoding.speculative import EXACT_ROWS  # noqa: E402
from orchestrator.runtime import host_layout  # noqa: E402

QUANTS = ("Q4_0", "Q8_0", "IQ4_NL", "IQ4_XS", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FLOATS = ("F16", "BF16")
BATCHES = (*range(1, 10), 16, 32)
N_IN, N_OUT, N_EXPERT, N_USED = 512, 64, 8, 2


def lines() -> list[str]:
    host_layout.set_batch_invariant_rows(EXACT_ROWS)
    bufts = host_layout.cpu_buffer_types()
    rng = np.random.default_rng(0)
    out = []
    for name in (*QUANTS, *FLOATS):
        ggml_type = int(GGMLQuantizationType[name])
        for layout in ("CPU",) if name in FLOATS else ("CPU", host_layout.EXACT_BUFT):
            for n_expert, n_used in ((0, 1), (N_EXPERT, N_USED)):
                for n in BATCHES:
                    xs = rng.standard_normal((n, n_used, N_IN), dtype=np.float32)
                    ids = np.argsort(rng.random((n, n_expert)), axis=1)[:, :n_used].astype(np.int32) if n_expert else None
                    got = host_layout.matmul_output(ggml_type, N_IN, N_OUT, n_expert, xs, ids, bufts[layout], 2)
                    digest = hashlib.sha256(got.tobytes()).hexdigest()[:16] if got is not None else "not taken"
                    out.append(f"{name} {layout} {'MUL_MAT_ID' if n_expert else 'MUL_MAT'} {n}: {digest}")
    return out


if __name__ == "__main__":
    print("\n".join(lines()))
