"""The variant of CPU_EXACT's one-token kernels, chosen on this CPU by measurement (issue 52).

A decode streams its weights from memory once per token, and how fast a kernel streams depends on
the CPU's memory system more than on its instructions: how many independent loads each thread
keeps in flight and how far ahead it asks for the next weights. CPU_EXACT's one-token kernels
(patch 0029, `ggml_cpu_exact_set_variant`) take both as settings: the 16-row groups a thread reads
at once (1, 2, 4 or 8) and the software prefetch distance (bytes; 0: none, the hardware
prefetchers alone). Neither changes any output's operations (each output is still one sum in one
order), so every variant gives the same bits (tests/test_exact_variant.py) and only the speed is
chosen.

The choice is timed as a decode reads: the model's routed-expert matmuls at one token in
CPU_EXACT's layout, the weights rotated through copies eight times the last-level cache
(`host_layout.matmul_timer`, passed in: host_layout imports this module), first the group
counts at the default distance, then the distances at the best count. The default is kept unless
another variant is faster by MIN_GAIN (the timings' noise). The times are cached per CPU beside
the host layouts' (`host_layout.choose` calls `choose`), and the model's load sets the variant
(process-wide, like batch-invariant mode).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from orchestrator.runtime.native import ggml_library


class Variant(NamedTuple):
    groups: int    # 16-row groups a thread reads at once for one token
    prefetch: int  # bytes ahead the kernel asks for weights (0: none)

    def __str__(self) -> str:
        return f"{self.groups} group{'s' if self.groups != 1 else ''}, prefetch {self.prefetch} B"

    @property
    def key(self) -> str:
        return f"{self.groups}/{self.prefetch}"

    @classmethod
    def of_key(cls, key: str) -> Variant:
        groups, prefetch = key.split("/")
        return cls(int(groups), int(prefetch))


DEFAULT = Variant(4, 2048)  # what exact.cpp starts with (measured best on an AVX-512 Xeon, 2026-11)
GROUPS = (1, 2, 4, 8)
PREFETCH = (0, 1024, 2048, 4096)
EVERY = tuple(Variant(g, p) for g in GROUPS for p in PREFETCH)  # what the kernels take among these
# another variant replaces the default only when it is at least this much faster: repeated
# timings of one variant differ by about 1-2% on an idle machine
MIN_GAIN = 1.03
ROUNDS = 2  # every variant timed this many times in turn, best kept: a slow moment hits all alike


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ggml_library("ggml-cpu")
    lib.ggml_cpu_exact_set_variant.restype = ctypes.c_bool
    lib.ggml_cpu_exact_set_variant.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.ggml_cpu_exact_get_variant.restype = None
    lib.ggml_cpu_exact_get_variant.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    return lib


def set_variant(variant: Variant) -> None:
    """Every CPU_EXACT one-token matmul from now on runs this variant (process-wide: set it only while
    no graph computes). ValueError for a variant the kernels do not have."""
    if not _lib().ggml_cpu_exact_set_variant(variant.groups, variant.prefetch):
        raise ValueError(f"CPU_EXACT has no variant {variant}: groups one of {GROUPS}, "
                         "prefetch a multiple of 64 bytes up to 16384")


def current() -> Variant:
    groups, prefetch = ctypes.c_int(), ctypes.c_int()
    _lib().ggml_cpu_exact_get_variant(ctypes.byref(groups), ctypes.byref(prefetch))
    return Variant(groups.value, prefetch.value)


@contextmanager
def using(variant: Variant) -> Iterator[None]:
    """This variant for the block, the previous one after it."""
    before = current()
    set_variant(variant)
    try:
        yield
    finally:
        set_variant(before)


def time_variants(matmul_timer, ggml_type: int, shapes: list[tuple[int, int, int, int]], n_threads: int, buft: int,
                  candidates: list[Variant]) -> dict[str, float]:
    """ms of one token through the expert matmuls of these shapes ((n_in, n_out, n_expert, n_used):
    one token reads n_used experts whatever their count) in buffer type `buft`, per candidate
    variant (by `Variant.key`): each shape's graph built once by `matmul_timer`
    (host_layout.matmul_timer: weights out of cache), the candidates timed on it in turn, ROUNDS
    times, the best kept."""
    ms = {v.key: 0.0 for v in candidates}
    for n_in, n_out, n_expert, n_used in shapes:
        with matmul_timer(ggml_type, n_in, n_out, n_expert, n_used, 1, buft, n_threads, cold=True) as timer:
            if timer is None:
                raise ValueError(f"buffer type {buft:#x} does not take experts of shape {(n_in, n_out, n_expert)}")
            best = {v.key: float("inf") for v in candidates}
            for _ in range(ROUNDS):
                for v in candidates:
                    with using(v):
                        best[v.key] = min(best[v.key], timer(3))
        for key, t in best.items():
            ms[key] += t * 1e3
    return ms


def measure(matmul_timer, types: dict[int, list[tuple[int, int, int, int]]], n_threads: int,
            buft: int) -> dict[str, float]:
    """The summed ms of every type's expert matmuls at one token, per variant tried: the group
    counts at the default distance, then the distances at the fastest count (8 timings, not 16:
    the two settings act on the same loads, and a first run stays within seconds)."""
    def timed(candidates: list[Variant]) -> dict[str, float]:
        total: dict[str, float] = {}
        for ggml_type, shapes in sorted(types.items()):
            for key, t in time_variants(matmul_timer, ggml_type, shapes, n_threads, buft, candidates).items():
                total[key] = total.get(key, 0.0) + t
        return total

    ms = timed([Variant(g, DEFAULT.prefetch) for g in GROUPS])
    groups = Variant.of_key(min(ms, key=ms.get)).groups
    for key, t in timed([Variant(groups, p) for p in PREFETCH]).items():  # its own distance again, beside the others
        ms[key] = min(t, ms.get(key, t))
    return ms


def choose(ms: dict[str, float]) -> Variant:
    """The fastest variant of these times, where it beats the default's by MIN_GAIN; else the default."""
    best = min(ms, key=ms.get)
    if DEFAULT.key in ms and ms[DEFAULT.key] < MIN_GAIN * ms[best]:
        return DEFAULT
    return Variant.of_key(best)
