"""spac: speculative decoding for MoE models with a device expert pool (see README.md)."""

import os

# numpy's OpenBLAS keeps a thread per core spinning after each call it parallelises; the
# orchestrator's matrices are tiny, and those threads took 6% of the CPU of a `spac generate`
# run from llama.cpp's own threads. Set before numpy is first imported; a user's setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"
