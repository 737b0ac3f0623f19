"""spac: speculative decoding for MoE models with a device expert pool (see README.md)."""

import os

# numpy's OpenBLAS keeps a thread per core spinning after each call it parallelises; the
# orchestrator's matrices are tiny, and those threads took 6% of the CPU of a `spac generate`
# run from llama.cpp's own threads. Set before numpy is first imported; a user's setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# llama.cpp's OpenMP workers spin (libgomp's GOMP_SPINCOUNT) after every graph and at every barrier
# inside one, and spac leaves that as it is: between two decodes they wait ~20 µs of Python and
# spinning on their own cores costs the loop nothing. Measured on the shipped model, 2 cores,
# `spac generate "class Stack:" -n 256 --temp 0` (median tok/s of 5 runs, --draft none / default):
# libgomp's default 2694 / 2781; OMP_WAIT_POLICY=passive 174 / 157 (ggml's barriers inside a graph
# are OpenMP barriers: each became a sleep and a wake-up); GOMP_SPINCOUNT=1000 2554 / 2475,
# 10000 2830 / 2737, 100000 2784 / 2577 (noise). The Python time per step outside llama_decode
# was lowest with the default too (20.6 µs; 27.0 with GOMP_SPINCOUNT=1000, 43.7 passive).

__version__ = "0.1.0"
