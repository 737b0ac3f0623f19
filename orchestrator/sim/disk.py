"""The disk below the host tier: its read times, and how `spac sim profile measure` times it.

A model larger than the host RAM keeps the experts that do not fit on the disk (the GGUF file,
through the page cache). Three numbers describe the disk (hardware.toml's `disk_read_gbps`,
`disk_latency_us`, `disk_queue_depth`; a measured profile's `[disk]`):

    read_bytes_per_s   sequential read rate
    latency_s          one small (4 KiB) read
    queue_depth        reads in flight that the rate needs

and two ways of reading an expert, the two systems the simulator compares:

    planned reads   spac: a layer's (or a read-ahead's) missing experts issued at once, up to
                    queue_depth in flight:  ceil(n / queue_depth) · latency + bytes / rate
    page faults     llama.cpp's mmap: the threads touching an expert fault it in, one 128 KiB
                    readahead window per fault, one fault per thread at a time:
                    max(windows · (latency + window / rate) / threads, bytes / rate)
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FAULT_WINDOW = 128 << 10  # the kernel's default readahead for a page fault on a file mapping (read_ahead_kb)
# assumption: llama.cpp's threads fault in parallel, each one page run at a time (2-8 in practice)
FAULT_THREADS = 4


@dataclass(frozen=True)
class Disk:
    read_bytes_per_s: float
    latency_s: float
    queue_depth: int = 32

    def read_s(self, n_reads: int, nbytes: float) -> float:
        """n_reads issued at once (nbytes in all), queue_depth of them in flight."""
        if n_reads <= 0:
            return 0.0
        return math.ceil(n_reads / max(self.queue_depth, 1)) * self.latency_s + nbytes / self.read_bytes_per_s

    def fault_s(self, n_experts: int, expert_bytes: float, threads: int = FAULT_THREADS) -> float:
        """n_experts read by page faults, `threads` faulting at once (no more than the queue holds)."""
        if n_experts <= 0:
            return 0.0
        windows = n_experts * math.ceil(expert_bytes / FAULT_WINDOW)
        per_window = self.latency_s + FAULT_WINDOW / self.read_bytes_per_s
        parallel = max(min(threads, self.queue_depth), 1)
        return max(windows * per_window / parallel, n_experts * expert_bytes / self.read_bytes_per_s)


# ---------------------------------------------------------------------------- measuring a disk

MEASURE_FILE_BYTES = 512 << 20
CHUNK = 1 << 20            # the reads of the rate and queue-depth measurements
QUEUE_DEPTHS = (1, 2, 4, 8, 16, 32)


def _drop_cache(fd: int) -> None:
    """Ask the kernel to forget the file's cached pages, so that the disk answers the next reads."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)  # page-aligned, as O_DIRECT would need


def write_measure_file(path: Path, nbytes: int = MEASURE_FILE_BYTES) -> Path:
    """A file of random bytes (so that no layer below compresses it) to time reads on."""
    block = np.random.default_rng(0).integers(0, 256, CHUNK * 8, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return path


def _parallel_read_rate(fd: int, size: int, threads: int, nbytes: int, rng: np.random.Generator) -> float:
    """Bytes/s of `threads` threads each reading 1 MiB chunks at random aligned offsets."""
    n_chunks = max(size // CHUNK, 1)
    per_thread = max(nbytes // CHUNK // threads, 1)
    offsets = rng.integers(0, n_chunks, (threads, per_thread)) * CHUNK

    def work(row) -> None:
        buf = bytearray(CHUNK)
        for off in row:
            os.preadv(fd, [buf], int(off))

    workers = [threading.Thread(target=work, args=(row,)) for row in offsets]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return offsets.size * CHUNK / (time.perf_counter() - t0)


def measure_disk(path: Path, rate_bytes: int | None = None, rng_seed: int = 0) -> Disk:
    """Time the disk holding `path` (a file of some hundred MiB): its sequential rate (one pass
    over the file in 1 MiB reads), the median latency of 4 KiB reads at random offsets, and the
    fewest reads in flight (threads doing 1 MiB preads at random offsets) that reach 90% of the
    best rate. The file's cached pages are dropped before each part (posix_fadvise DONTNEED): a
    file on tmpfs, whose pages are its storage, measures the memory instead."""
    rng = np.random.default_rng(rng_seed)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < 16 * CHUNK:
            raise ValueError(f"{path}: {size} bytes; measuring a disk needs a file of 16 MiB or more")
        rate_bytes = min(rate_bytes or size, size)
        _drop_cache(fd)
        buf = _aligned(CHUNK)
        t0 = time.perf_counter()
        for off in range(0, rate_bytes - CHUNK + 1, CHUNK):
            os.preadv(fd, [buf], off)
        sequential = rate_bytes // CHUNK * CHUNK / (time.perf_counter() - t0)

        _drop_cache(fd)
        small = _aligned(4096)
        latencies = []
        for off in rng.integers(0, size // 4096, 200) * 4096:
            t0 = time.perf_counter()
            os.preadv(fd, [small], int(off))
            latencies.append(time.perf_counter() - t0)

        rates = {}
        for q in QUEUE_DEPTHS:
            _drop_cache(fd)
            rates[q] = _parallel_read_rate(fd, size, q, min(64 * CHUNK, size), rng)
        best = max(max(rates.values()), sequential)
        depth = next(q for q in QUEUE_DEPTHS if rates[q] >= 0.9 * max(rates.values()))
        return Disk(read_bytes_per_s=best, latency_s=float(np.median(latencies)), queue_depth=depth)
    finally:
        os.close(fd)
