"""Models larger than RAM (issue 50): spac's host tier against llama.cpp's mmap, in one memory limit.

    .venv/bin/python bench/bench_disk.py [--file F.gguf] [--limit 768M] [--json rows.json]

Every row runs alone in a fresh memory cgroup of --limit bytes (scripts/memory_cgroup.py, root),
the file evicted from the page cache first, 2 threads; the file is at least 3x the limit (default:
a 6-layer Qwen3-30B-A3B-shaped Q4_0 file, made once under runs/). The rows:

  disk                       the disk's own rate in this run: 8 MiB reads in order, and 1 MiB reads
                             at random offsets 16 and 32 at a time (the best is the limit); in the
                             limit, a gate's expert reads (madvise WILLNEED) and the same reads with
                             O_DIRECT into buffers of their own, 24 in flight (rate, CPU per GB)
  llama-mmap                 stock llama-bench, mmap, --repack 0 (a repacked weight is copied out of the
                             mapping into memory: llama.cpp's default repack does not fit the limit)
  llama-mmap-repack          stock llama-bench, its defaults (reported, OOM or not)
  spac-mmap                  spac with every weight mapped as today (--host-budget above the file)
  spac-tier-no-read-ahead    the experts on the disk, read only when a pass uses them
  spac-tier                  ... and read ahead after every pass
  spac-tier-sd               ... with speculation: the pool draft (a CPU pool of 5%) names the experts
                             the verify pass will use while it drafts; with -md FILE, that draft model
                             instead (the default file's random weights give the pool draft nothing to
                             agree on: its acceptance is 0)

Per row: decode and prompt tok/s, the bytes the row's process read from the disk (getrusage's
block reads) and its stalls: a spac gate's expert that was not in memory, llama.cpp's major page
faults (a fault that waited for the disk). Prints the CPU, whether the machine was idle, and each
row against llama-mmap. `--json FILE` writes the rows: {"system", "decode_tok_s", "prompt_tok_s",
"bytes_read", "stalls", ...}, llama.cpp's systems named llama-*.

Each spac row runs --repeats times (default 3) and reports the median run. Predicted: each run of
a spac tier row records its passes' choices (the tier's trace) and its draft lengths, and has a twin
run with no limit and the file in the page cache that takes the same draft lengths (the same
kernels and passes, no disk: its decode time). Each run's prediction starts from its twin's time;
the row's is the median prediction. `replay`
puts the trace through the live tier's own ranking (runtime/host_tier.py's HostTier, over a
`ModelledDisk`) and adds the simulator's disk time (orchestrator/sim/disk.py's Disk, at the rate a
gate's reads reach in the same limit, measured in the run):

    a pass's stall      each MoE layer's chosen experts not in memory, read at once while the layer
                        waits: Disk.read_s(3 reads per expert, their bytes)
    a read ahead        issued after a pass or a draft token, it runs while the next pass computes:
                        only what it takes beyond that pass's compute time is waited for

predicted decode time = the cached run's decode time + the stalls + the reads ahead's excess. The
prompt's pass is replayed (it fills the tier) but not timed, as the live decode time leaves it out.

Bound: per tier row without a device pool, the decode tok/s no host tier in the limit can beat on
the row's own passes (`bound`): the fewest reads any tier could make for them (Belady's MIN at
pass granularity, the tier as large as the limit less the other weights), at the best rate the
disk showed in the run and no CPU cost, beside the decode time in memory; reading on demand (the
reads before their pass's compute) and with every read hidden behind compute. What is between the
row and its bound is the tier's ranking, the CPU its reads cost and the disk's rate.
(The replay lives here, not in orchestrator/sim/: the simulator does not import the runtime.)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))

import memory_cgroup  # noqa: E402
from bench_cpu import cpu_description  # noqa: E402
from bench_live import steal_seconds, stock_program  # noqa: E402

import numpy as np  # noqa: E402

from orchestrator.runtime.host_tier import HostTier, chosen  # noqa: E402
from orchestrator.runtime.native import DISK_READ  # noqa: E402
from orchestrator.sim.disk import Disk, measure_disk  # noqa: E402
from orchestrator.sim.locality import fewest_reads  # noqa: E402

DEFAULT_FILE = ROOT / "runs" / "bench_disk" / "qwen3-30b-a3b-6l-Q4_0.gguf"
WILLNEED_CHUNK = 128 << 10  # llama-experts-on-disk.cpp's madvise(WILLNEED) calls
THREADS = 2  # every row's -t; each graph thread asks for a share of a gate's experts
CALIBRATION_PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 7)  # about 64 tokens


def expert_bytes(path: Path) -> int:
    from orchestrator.gguf_files.model_sizes import model_sizes

    return model_sizes(path).one_expert


def make_file(path: Path) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_moe.py"), "qwen3-30b-a3b", str(path),
                        "--n-layer", "6"], check=True)
    return path


def queue_setting(path: Path, name: str) -> int | None:
    """A setting of the block device holding `path` (read_ahead_kb, max_sectors_kb): one
    madvise/fadvise WILLNEED reads at most the larger of the two of a range, which is why the gate
    advises 128 KiB at a time."""
    dev = os.stat(path).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (block / "queue", block / ".." / "queue"):  # a partition's settings are its disk's
        if (queue / name).exists():
            return int((queue / name).read_text())
    return None


def disk_rates(path: Path, n_bytes: int = 512 << 20) -> dict:
    """Bytes/s reading the file from the disk: in order (8 MiB reads), and 1 MiB reads at random
    offsets, 16 and 32 in flight."""
    fd = os.open(path, os.O_RDONLY)
    size = os.path.getsize(path)
    rng = random.Random(0)
    out = {}
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t, done = time.perf_counter(), 0
        while done < min(n_bytes, size):
            done += len(os.pread(fd, 8 << 20, done))
        out["sequential"] = done / (time.perf_counter() - t)
        for depth in (16, 32):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            offsets = [rng.randrange(0, size - (1 << 20)) & ~4095 for _ in range(256)]
            t = time.perf_counter()
            with ThreadPoolExecutor(depth) as pool:
                done = sum(pool.map(lambda o: len(os.pread(fd, 1 << 20, o)), offsets))
            out[f"random_1m_qd{depth}"] = done / (time.perf_counter() - t)
    finally:
        os.close(fd)
    return out


def gate_reads(path: Path, expert_bytes: int, limit: int, k: int = 8, n_batches: int = 24) -> dict:
    """In its own process (in the limit): a MoE layer's gate's reads, as the engine's limit holds them.
    Half the limit is a resident region (the file's first bytes: the engine's other weights), touched
    before every batch so that it stays in use; the limit is filled from the file's end. A batch is k
    experts at random offsets between the two, three ranges of a third of an expert each, all advised
    (madvise WILLNEED, 128 KiB a call, on a MADV_RANDOM mapping, as upstream maps lazy tensors) before
    their pages are touched, left mapped (as the matmuls leave them): every page read reclaims another.
    Returns {"read_bytes_per_s": the batches' bytes over their time (the resident touches left out),
    "advise_cpu_s_per_byte": the CPU time of the advice calls per byte, its charge and reclaim}."""
    import mmap

    size = path.stat().st_size
    resident, fill = limit // 2, limit
    if resident + fill + expert_bytes >= size:
        raise ValueError(f"{path}: {size} bytes is too small for a gate probe in a {limit}-byte limit")
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        for off in range(0, fill, 8 << 20):
            os.pread(f.fileno(), 8 << 20, size - fill + off)
    m.madvise(mmap.MADV_RANDOM)
    pages = np.frombuffer(m, dtype=np.uint8)
    rng = random.Random(1)
    third = expert_bytes // 3 & ~4095
    wall = advise_cpu = 0.0
    done = 0
    for _ in range(n_batches):
        int(pages[:resident:4096].sum())  # the other weights, used by every pass
        ranges = [rng.randrange(resident, size - fill - third) & ~4095 for _ in range(3 * k)]
        t, cpu = time.perf_counter(), time.thread_time()
        for off in ranges:  # 128 KiB a call, as the gate (a call reads at most the device's window)
            for chunk in range(off, off + third, WILLNEED_CHUNK):
                m.madvise(mmap.MADV_WILLNEED, chunk, min(WILLNEED_CHUNK, off + third - chunk))
        advise_cpu += time.thread_time() - cpu
        for off in ranges:
            int(pages[off:off + third:4096].sum())
            done += third
        wall += time.perf_counter() - t
    del pages
    return {"read_bytes_per_s": done / wall, "advise_cpu_s_per_byte": advise_cpu / done}


def direct_reads(path: Path, expert_bytes: int, limit: int, k: int = 8, n_batches: int = 24, depth: int = 24) -> dict:
    """In its own process (in the limit): the same batches as `gate_reads` (k experts, three ranges
    each, at random offsets past a resident half of the limit touched before every batch), read as a
    pool with direct reads does (llama_direct_reader): O_DIRECT preads into buffers of its own, `depth`
    in flight. Returns {"read_bytes_per_s", "cpu_s_per_byte": the process's CPU time per byte}."""
    import mmap

    size = path.stat().st_size
    resident = limit // 2
    third = expert_bytes // 3 & ~4095
    if resident + third >= size:
        raise ValueError(f"{path}: {size} bytes is too small for a read probe in a {limit}-byte limit")
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    pages = np.frombuffer(m, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffers = [mmap.mmap(-1, third) for _ in range(3 * k)]  # page-aligned, as O_DIRECT asks
    rng = random.Random(1)
    wall = cpu = 0.0
    done = 0
    with ThreadPoolExecutor(depth) as pool:
        for _ in range(n_batches):
            int(pages[:resident:4096].sum())
            ranges = [rng.randrange(resident, size - third) & ~4095 for _ in range(3 * k)]
            t, r = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            list(pool.map(lambda i: os.preadv(fd, [buffers[i]], ranges[i]), range(len(ranges))))
            r2 = resource.getrusage(resource.RUSAGE_SELF)
            wall += time.perf_counter() - t
            cpu += (r2.ru_utime - r.ru_utime) + (r2.ru_stime - r.ru_stime)
            done += third * len(ranges)
    os.close(fd)
    del pages
    return {"read_bytes_per_s": done / wall, "cpu_s_per_byte": cpu / done}


def in_limit(cmd: list[str], limit: int, path: Path) -> tuple[str, dict]:
    """cmd in a fresh cgroup with the file out of the page cache: (stdout, the cgroup's report with
    the child's block reads and major faults)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc, report = memory_cgroup.run(cmd, limit, [path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report |= {"bytes_read": (after.ru_inblock - before.ru_inblock) * 512, "majflt": after.ru_majflt - before.ru_majflt}
    if proc.returncode != 0 and not report["oom_kills"]:
        raise RuntimeError(f"{' '.join(cmd[:3])}... exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc.stdout, report


def llama_row(name: str, path: Path, limit: int, settings: list[str], n_prompt: int, n_gen: int) -> dict:
    bench = str(stock_program("llama-bench"))
    row = {"system": name, "decode_tok_s": 0.0, "prompt_tok_s": 0.0, "bytes_read": 0, "stalls": 0, "oom": False}
    for key, p, n in (("prompt_tok_s", n_prompt, 0), ("decode_tok_s", 0, n_gen)):
        out, rep = in_limit([bench, "-m", str(path), "-t", str(THREADS), "-p", str(p), "-n", str(n), "-r", "1", "-lm", "mmap",
                             *settings, "-o", "json"], limit, path)
        if rep["oom_kills"]:
            row["oom"] = True
            return row
        row[key] = json.loads(out)[0]["avg_ts"]
        row["bytes_read"] += rep["bytes_read"]
        row["stalls"] += rep["majflt"]
    return row


def generate_recording(trace_path: Path, args: list[str]) -> None:
    """In its own process: `spac generate ARGS` with the host tier's trace written to trace_path and
    the draft length of every step (the governor's choices) to gammas_path(trace_path)."""
    from orchestrator.cli.main import app
    from orchestrator.decoding.governor import Governor
    from orchestrator.runtime import host_tier

    trace: list = []
    gammas: list[int] = []
    opened, chosen = host_tier.HostTier.__init__, Governor.next_gamma

    def recording(self, *a, **k):
        opened(self, *a, **k)
        self.trace = trace

    def recording_gamma(self) -> int:
        gammas.append(chosen(self))
        return gammas[-1]

    host_tier.HostTier.__init__ = recording
    Governor.next_gamma = recording_gamma
    try:
        app(["generate", *args], standalone_mode=False)
    finally:
        trace_path.write_bytes(pickle.dumps(trace))
        gammas_path(trace_path).write_text(json.dumps(gammas))


def gammas_path(trace_path: Path) -> Path:
    return trace_path.with_suffix(".gammas.json")


def generate_with_gammas(gammas_file: Path, args: list[str]) -> None:
    """In its own process: `spac generate ARGS` whose governor answers with the draft lengths a run in
    the limit chose, in order (its own choices once they run out). A run in memory then does that
    run's computation: the governor times the passes, and without the disk it picks other lengths."""
    from orchestrator.cli.main import app
    from orchestrator.decoding.governor import Governor

    recorded = json.loads(gammas_file.read_text())
    chosen = Governor.next_gamma

    def replayed(self) -> int:
        return recorded.pop(0) if recorded else chosen(self)

    Governor.next_gamma = replayed
    app(["generate", *args], standalone_mode=False)


def calibrate_advice(path: Path, limit: int, n_gen: int) -> float:
    """Seconds the engine's gates spend asking for a byte in the limit (spac_disk_stats.gate_advise_ns
    over bytes_stalled; the graph threads' times summed): a run of its own, no read ahead, on another
    prompt than the rows'. A lone thread's madvise costs a third of it (the gate probe): in the engine
    both graph threads ask at once, beside the pages the run keeps in use."""
    args = ["-m", str(path), "-t", str(THREADS), "--temp", "0", "-n", str(n_gen), "-c", "512", "--json",
            "--draft", "none", "--no-disk-read-ahead", CALIBRATION_PROMPT]
    out, _ = in_limit([sys.executable, "-m", "orchestrator.cli", "generate", *args], limit, path)
    tier = json.loads(out)["host_tier"]
    return tier["gate_advise_ns"] * 1e-9 / max(tier["bytes_stalled"], 1)


def spac_row(name: str, path: Path, limit: int, flags: list[str], n_gen: int, disk=None, repeats: int = 1,
             advise_s_per_byte: float = 0.0) -> dict:
    """A spac row in the limit, run `repeats` times: the median run's numbers, every run's decode
    tok/s beside them. With `disk` (a sim Disk), its decode time predicted too (`predict`)."""
    args = ["-m", str(path), "-t", str(THREADS), "--temp", "0", "-n", str(n_gen), "-c", "512", "--json", *flags, PROMPT]
    runs = []
    for i in range(repeats):
        trace_path = ROOT / "runs" / "bench_disk" / f"{path.stem}-{name}-{i}.trace"  # one per file: the JSON keeps the path
        out, rep = in_limit([sys.executable, __file__, "--record", str(trace_path), "--", *args], limit, path)
        if rep["oom_kills"]:
            return {"system": name, "decode_tok_s": 0.0, "prompt_tok_s": 0.0, "bytes_read": rep["bytes_read"],
                    "stalls": 0, "oom": True}
        d = json.loads(out)
        runs.append({"out": d, "rep": rep, "trace": trace_path, "decode_tok_s": (d["n_tokens"] - 1) / d["decode_s"]})
    runs.sort(key=lambda r: r["decode_tok_s"])
    median = runs[len(runs) // 2]
    d, rep = median["out"], median["rep"]
    tier = d.get("host_tier") or {}
    row = {"system": name, "decode_tok_s": median["decode_tok_s"],
           "decode_tok_s_runs": [r["decode_tok_s"] for r in runs],
           "prompt_tok_s": d["n_prompt_tokens"] / d["prefill_s"], "bytes_read": rep["bytes_read"],
           "stalls": tier.get("stalls", rep["majflt"]), "majflt": rep["majflt"], "oom": False,
           "hits": tier.get("hits"), "tokens": d["tokens"], "acceptance_rate": d.get("acceptance_rate"),
           "tokens_per_step": d.get("tokens_per_step"),
           "peak": max(r["rep"]["peak"] for r in runs),
           "same_tokens_every_run": all(r["out"]["tokens"] == d["tokens"] for r in runs)}
    if disk is not None and tier.get("experts_on_disk"):
        row |= predict(path, args, runs, disk, "--no-disk-read-ahead" not in flags, advise_s_per_byte)
        row |= {"trace": str(median["trace"]), "n_decoded": d["n_tokens"] - 1,
                "expert_bytes": tier["expert_bytes"], "one_expert_bytes": tier["one_expert_bytes"]}
    return row


def bound(row: dict, limit: int, file_bytes: int, best_rate: float) -> dict:
    """What no host tier in this limit can beat on the row's own passes: the fewest experts any tier
    could read for them (orchestrator/sim/locality.py's fewest_reads: Belady's MIN, reads ahead
    included), the tier as large as the limit less the non-expert weights (more than a live one
    gets: the KV cache, compute buffers and the interpreter are left out), read at the best rate the
    disk showed in this run and at no CPU cost, beside the row's decode time in memory: `serial`
    when each read waits for its pass (what a read on demand does), `overlapped` when every read
    hides behind compute (a tier that knew every pass's experts a layer early). Rows with a device
    pool get none (its experts need no read)."""
    trace = pickle.loads(Path(row["trace"]).read_bytes())
    if any(kind == "pass" and on_device is not None for kind, _, on_device in trace):
        return {}
    passes = []
    for kind, ids, _ in trace:
        if kind == "pass":
            used = np.zeros((ids.shape[0], int(row["expert_bytes"] // row["one_expert_bytes"]) // ids.shape[0]), bool)
            used[chosen(ids)] = True
            passes.append(used)
    capacity = int((limit - (file_bytes - row["expert_bytes"])) // row["one_expert_bytes"])
    reads = int(fewest_reads(passes, capacity)[1:].sum())  # the decode's passes: the prompt's is not timed
    t_memory = row["n_decoded"] / row["memory_decode_tok_s"]
    t_read = reads * row["one_expert_bytes"] / best_rate
    return {"bound_capacity": capacity, "bound_decode_reads": reads,
            "bound_decode_tok_s": {"serial": row["n_decoded"] / (t_memory + t_read),
                                   "overlapped": row["n_decoded"] / max(t_memory, t_read)}}


READS_PER_EXPERT = 3  # an expert's gate, up and down matrices: three ranges of the file


class ModelledDisk:
    """What the live tier asks of the native disk, kept as sets: an expert is in memory once read
    (by a gate or a read ahead) until dropped. `pending` holds the reads ahead not yet waited for."""

    def __init__(self, n_layer: int, n_expert: int):
        self.in_memory = np.zeros((n_layer, n_expert), bool)
        self.pending = np.zeros((n_layer, n_expert), bool)
        self.on_device = np.zeros((n_layer, n_expert), bool)

    def advise(self, pairs, advice: int) -> int:
        p = np.asarray(pairs).reshape(-1, 2)
        if advice == DISK_READ:
            self.pending[p[:, 0], p[:, 1]] |= ~self.in_memory[p[:, 0], p[:, 1]]
            self.in_memory[p[:, 0], p[:, 1]] = True
        else:
            self.in_memory[p[:, 0], p[:, 1]] = False
            self.pending[p[:, 0], p[:, 1]] = False
        return len(p)

    def set_on_device(self, on_device) -> None:
        self.on_device = np.asarray(on_device, bool)

    def stats(self) -> dict:
        return dict.fromkeys(("n_gate_experts", "n_stalls", "bytes_stalled", "n_read_ahead", "bytes_read_ahead",
                              "n_dropped"), 0)


def replay(trace: list, capacity: int, n_expert: int, expert_bytes: float, disk: Disk, t_decode_memory: float,
           read_ahead: bool = True, advise_s_per_byte: float = 0.0) -> dict:
    """trace: HostTier.trace of a live run, [(kind, ids [n_layer, n_tokens, k], on_device or None)];
    t_decode_memory: that run's decode seconds with every weight in memory; advise_s_per_byte: the
    engine's time asking for a byte in the limit (`calibrate_advice`, the graph threads' times summed),
    THREADS threads sharing it, before the disk's time. Returns the predicted decode seconds, and the stalls and bytes read the
    replay counted."""
    n_layer = trace[0][1].shape[0]
    modelled = ModelledDisk(n_layer, n_expert)
    tier = HostTier(modelled, n_layer, n_expert, capacity, read_ahead=read_ahead)
    t_pass = t_decode_memory / max(sum(1 for kind, *_ in trace[1:] if kind == "pass"), 1)
    stall_s = ahead_s = 0.0
    n_stalls = n_bytes = decode_bytes = 0
    for i, (kind, ids, on_device) in enumerate(trace):
        if kind == "lookahead":
            tier.lookahead(ids)
            continue
        if on_device is not None:
            modelled.set_on_device(on_device)
        pending = modelled.pending.sum()
        if i > 0 and pending:  # the reads ahead ran while this pass computed
            nbytes = pending * expert_bytes
            ahead_s += max(disk.read_s(READS_PER_EXPERT * int(pending), nbytes) - t_pass, 0.0)
            # asked for on the loop's thread, which takes a core from the graph: about what a lone gate
            # thread spends (1.03-1.09 s per GB, against 1.5-1.7 summed over two asking at once)
            ahead_s += advise_s_per_byte * nbytes / THREADS
        modelled.pending[:] = False
        for m in range(n_layer):
            chosen = np.unique(ids[m][ids[m] >= 0])
            chosen = chosen[~modelled.on_device[m, chosen]]
            missing = chosen[~modelled.in_memory[m, chosen]]
            if missing.size:
                nbytes = missing.size * expert_bytes
                n_stalls += missing.size
                n_bytes += int(nbytes)
                if i > 0:
                    decode_bytes += nbytes
                    stall_s += (disk.read_s(READS_PER_EXPERT * missing.size, nbytes)
                                + advise_s_per_byte * nbytes / THREADS)
                modelled.in_memory[m, missing] = True
        tier.after_pass(ids, on_device)
    return {"decode_s": t_decode_memory + stall_s + ahead_s, "stall_s": stall_s, "read_ahead_wait_s": ahead_s,
            "stalls": n_stalls, "bytes_read": n_bytes, "decode_stall_bytes": decode_bytes}


def predict(path: Path, args: list[str], runs: list[dict], disk, read_ahead: bool,
            advise_s_per_byte: float = 0.0) -> dict:
    """The predicted decode tok/s of a live tier row: each run's trace `replay`ed on the decode time
    of its twin, the same command without the limit, the file in the page cache, a tier just over
    the experts and the run's draft lengths (the same kernels and passes, no disk); the median
    prediction."""
    under = str(path.stat().st_size - 1)  # every expert fits the tier: the same kernels, nothing to read
    memory_args = [*args[:-1], "--host-budget", under, args[-1]]
    with open(path, "rb") as f:  # the file into the page cache (the limited run left most of it out)
        while f.read(64 << 20):
            pass
    # each run's twin in memory takes that run's draft lengths (none without a draft)
    memory = [json.loads(subprocess.run([sys.executable, __file__, "--gammas", str(gammas_path(run["trace"])), "--",
                                         *memory_args], capture_output=True, text=True, check=True).stdout)
              for run in runs]
    predicted, replays = [], []
    for run, twin in zip(runs, memory):
        tier, live = run["out"]["host_tier"], run["out"]
        trace = pickle.loads(run["trace"].read_bytes())
        n_expert = int(tier["expert_bytes"] // tier["one_expert_bytes"] // len(trace[0][1]))
        got = replay(trace, tier["capacity"], n_expert, tier["one_expert_bytes"], disk, twin["decode_s"], read_ahead,
                     advise_s_per_byte)
        predicted.append((live["n_tokens"] - 1) / got["decode_s"])
        replays.append(got)
    mid = int(np.argsort(predicted)[len(predicted) // 2])
    n_tokens = runs[0]["out"]["n_tokens"]
    return {"predicted_decode_tok_s": predicted[mid], "predicted_decode_tok_s_runs": sorted(predicted),
            "memory_decode_tok_s": (n_tokens - 1) / memory[mid]["decode_s"],
            "memory_decode_tok_s_runs": sorted((m["n_tokens"] - 1) / m["decode_s"] for m in memory),
            "predicted_stalls": replays[mid]["stalls"], "predicted_decode_stall_bytes": replays[mid]["decode_stall_bytes"],
            "same_tokens_in_memory": all(m["tokens"] == runs[0]["out"]["tokens"] for m in memory)}


def user_cpu_seconds() -> dict[int, float]:
    """CPU seconds of every user-space process now, by pid (kernel threads left out: the page
    cache's reclaim and readahead run there, on this benchmark's behalf)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[6]) & 0x00200000:  # PF_KTHREAD
            continue
        out[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--limit", default="768M", help="the memory cgroup's limit (the file must be >= 3x)")
    ap.add_argument("--n-prompt", type=int, default=64, help="llama-bench's prompt tokens (spac's prompt is ~64)")
    ap.add_argument("--n-gen", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each spac row and of its run in memory (medians reported; llama.cpp's rows run once)")
    ap.add_argument("-md", "--model-draft", type=Path,
                    help="spac-tier-sd's draft: this model (in memory) instead of the pool draft")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--record", type=Path, help=argparse.SUPPRESS)  # a spac row's process
    ap.add_argument("--gammas", type=Path, help=argparse.SUPPRESS)  # a spac row's run in memory
    ap.add_argument("--gate-reads", type=int, help=argparse.SUPPRESS)  # gate_reads' process: an expert's bytes
    ap.add_argument("--direct-reads", type=int, help=argparse.SUPPRESS)  # direct_reads' process: an expert's bytes
    ap.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gate_reads:
        print(json.dumps(gate_reads(args.file, args.gate_reads, memory_cgroup.parse_size(args.limit))))
        return
    if args.direct_reads:
        print(json.dumps(direct_reads(args.file, args.direct_reads, memory_cgroup.parse_size(args.limit))))
        return
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if args.record:
        generate_recording(args.record, rest)
        return
    if args.gammas:
        generate_with_gammas(args.gammas, rest)
        return
    limit = memory_cgroup.parse_size(args.limit)
    why = memory_cgroup.available()
    if why:
        sys.exit(f"bench_disk: needs a memory cgroup: {why}")
    path = make_file(args.file)
    size = path.stat().st_size
    if size < 3 * limit:
        sys.exit(f"bench_disk: {path} ({size / 2**30:.2f} GiB) is not 3x --limit {args.limit}")
    print(f"CPU: {cpu_description()}")
    print(f"file {path.name} {size / 2**30:.2f} GiB, limit {limit / 2**30:.2f} GiB ({size / limit:.1f}x), "
          f"{THREADS} threads, decode {args.n_gen} tokens; its disk's read_ahead_kb {queue_setting(path, 'read_ahead_kb')}, "
          f"max_sectors_kb {queue_setting(path, 'max_sectors_kb')} (a page fault reads the first, at most)", flush=True)
    others0, steal0, t0 = user_cpu_seconds(), steal_seconds(), time.monotonic()
    rates = disk_rates(path)
    measured = measure_disk(path)
    # the replay's disk: the rate of a gate's reads in this limit (expert ranges at random offsets,
    # 128 KiB advice calls, every page read reclaiming another) with the latency and queue depth of the
    # simulator's profile (sim/disk.py's measure_disk, `spac sim profile measure`, whose rate, 1 MiB
    # reads outside the limit, is printed beside it); and the engine's own time asking for a byte
    # (calibrate_advice). Until 2026-11-29 the replay took the profile's rate alone, and the gate
    # probe read ranges that filling the limit had cached (docs/benchmarks.md)
    out, _ = in_limit([sys.executable, __file__, "--file", str(path), "--limit", args.limit, "--gate-reads",
                       str(expert_bytes(path))], limit, path)
    gate = json.loads(out)
    # the other way to read an expert the issue names: O_DIRECT into buffers of the reader's own
    # (tried as a CPU pool that reads its uploads itself, 2026-11-30: not kept, docs/benchmarks.md)
    out, _ = in_limit([sys.executable, __file__, "--file", str(path), "--limit", args.limit, "--direct-reads",
                       str(expert_bytes(path))], limit, path)
    direct = json.loads(out)
    disk = Disk(gate["read_bytes_per_s"], measured.latency_s, measured.queue_depth)
    advise = calibrate_advice(path, limit, args.n_gen)
    print("disk: " + ", ".join(f"{k} {v / 1e6:.0f} MB/s" for k, v in rates.items())
          + f"; a gate's reads in the limit (the replay's disk) {disk.read_bytes_per_s / 1e6:.0f} MB/s, "
          f"{disk.latency_s * 1e6:.0f} us, queue depth {disk.queue_depth}; sim/disk.py's measure "
          f"{measured.read_bytes_per_s / 1e6:.0f} MB/s; asking for a GB: the engine's gates {advise * 1e9:.2f} s "
          f"(the calibration run), a lone thread's madvise {gate['advise_cpu_s_per_byte'] * 1e9:.2f} CPU-s; the same "
          f"reads with O_DIRECT, 24 in flight: {direct['read_bytes_per_s'] / 1e6:.0f} MB/s, "
          f"{direct['cpu_s_per_byte'] * 1e9:.2f} CPU-s a GB", flush=True)
    spac_tier = ["--draft", "none"]  # -c 512 in every spac row: llama-bench's context is its own tokens
    draft = (["-md", str(args.model_draft)] if args.model_draft
             else ["--draft", "pool", "--device", "CPU", "--expert-budget", "5%"])
    rows = [llama_row("llama-mmap", path, limit, ["--repack", "0"], args.n_prompt, args.n_gen),
            llama_row("llama-mmap-repack", path, limit, [], args.n_prompt, args.n_gen),
            spac_row("spac-mmap", path, limit, [*spac_tier, "--host-budget", f"{2 * size}"], args.n_gen),
            spac_row("spac-tier-no-read-ahead", path, limit, [*spac_tier, "--no-disk-read-ahead"], args.n_gen, disk,
                     args.repeats, advise),
            spac_row("spac-tier", path, limit, spac_tier, args.n_gen, disk, args.repeats, advise),
            spac_row("spac-tier-sd", path, limit, draft, args.n_gen, disk, args.repeats, advise)]
    best_rate = max(*rates.values(), gate["read_bytes_per_s"], direct["read_bytes_per_s"])
    for r in rows:
        if r.get("trace"):
            r |= bound(r, limit, size, best_rate)
    others = user_cpu_seconds()
    mine = {os.getpid()}
    others_s = sum(v - others0.get(pid, 0.0) for pid, v in others.items() if pid not in mine)
    wall = time.monotonic() - t0
    base = rows[0]["decode_tok_s"] or float("nan")
    print(f"{'system':26s} {'decode tok/s':>12s} {'÷ llama':>8s} {'prompt tok/s':>12s} {'read MiB':>9s} {'stalls':>7s}"
          f" {'predicted':>10s} {'error':>6s}")
    for r in rows:
        note = " OOM-killed" if r["oom"] else ""
        guess = r.get("predicted_decode_tok_s")
        pred = f" {guess:10.2f} {guess / r['decode_tok_s'] - 1:+6.0%}" if guess else ""
        print(f"{r['system']:26s} {r['decode_tok_s']:12.2f} {r['decode_tok_s'] / base:8.2f} {r['prompt_tok_s']:12.1f} "
              f"{r['bytes_read'] / 2**20:9.0f} {r['stalls']:7d}{pred}{note}")
    for r in rows:
        if len(r.get("decode_tok_s_runs", ())) > 1:
            spread = lambda key: "–".join(f"{v:.2f}" for v in (min(r[key]), max(r[key])))  # noqa: E731
            print(f"  {r['system']}: {len(r['decode_tok_s_runs'])} runs, decode {spread('decode_tok_s_runs')} tok/s"
                  + (f"; predicted {spread('predicted_decode_tok_s_runs')}; in memory "
                     f"{spread('memory_decode_tok_s_runs')}" if "predicted_decode_tok_s_runs" in r else "")
                  + (f"; acceptance {r['acceptance_rate']:.2f}, {r['tokens_per_step']:.2f} tokens a step"
                     if r.get("acceptance_rate") is not None else ""))
    for r in rows:
        if "bound_decode_tok_s" in r:
            b = r["bound_decode_tok_s"]
            print(f"  {r['system']}: no tier of {r['bound_capacity']} experts reads fewer than {r['bound_decode_reads']} for "
                  f"these {r['n_decoded']} tokens (the replay's tier: {r['predicted_decode_stall_bytes'] / r['one_expert_bytes']:.0f} "
                  f"stalled); at {best_rate / 1e6:.0f} MB/s and no CPU beside {r['memory_decode_tok_s']:.2f} tok/s in memory: "
                  f"at most {b['serial']:.2f} tok/s reading on demand ({b['serial'] / base:.2f}x llama-mmap), "
                  f"{b['overlapped']:.2f} with every read behind compute ({b['overlapped'] / base:.2f}x)")
    texts = {r["system"]: r["tokens"] for r in rows if r.get("tokens")}
    same = (len({tuple(t) for t in texts.values()}) == 1 and all(r.get("same_tokens_every_run", True)
                                                                  and r.get("same_tokens_in_memory", True) for r in rows))
    print(f"spac rows give the same tokens (every run, and the runs in memory): {same}")
    steal = steal_seconds() - steal0
    print(f"stolen by the hypervisor: {steal:.1f} CPU-s in {wall:.0f} s ({steal / (wall * (os.cpu_count() or 1)):.0%})")
    print(f"other user processes: {others_s:.1f} CPU-s in {wall:.0f} s: "
          f"{'idle otherwise' if others_s < 0.02 * wall else 'NOT idle: another process ran'}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_description(), "disk": rates, "limit": limit, "file_bytes": size,
                                         "sd_draft": str(args.model_draft) if args.model_draft else "pool",
                                         "read_ahead_kb": queue_setting(path, "read_ahead_kb"),
                                         "max_sectors_kb": queue_setting(path, "max_sectors_kb"),
                                         "replay_disk": {"read_bytes_per_s": disk.read_bytes_per_s,
                                                         "latency_s": disk.latency_s, "queue_depth": disk.queue_depth,
                                                         "advise_s_per_byte": advise},
                                         "gate_probe": gate, "direct_probe": direct,
                                         "steal_s": steal, "wall_s": wall, "others_cpu_s": others_s,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
