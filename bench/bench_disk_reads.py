"""Ways to read the disk tier's experts (issue 50): page faults, madvise/fadvise WILLNEED, pread,
O_DIRECT, io_uring, each timed on one token's missing experts.

    .venv/bin/python bench/bench_disk_reads.py [--file F.gguf] [--experts 48] [--repeats 3]
        [--depths 1,4,16] [--json FILE]

Compiles bench/disk_read_methods.c (gcc) and runs it on the byte ranges of --experts random
experts of the GGUF (default: bench_disk.py's 6-layer Qwen3-30B-A3B-shaped Q4_0 file, made once
under runs/): each expert is its slice of one MoE layer's ffn_{gate,up,down}_exps (3 ranges),
spread 8 to a layer as one token's misses are (48 = 8 of 128 experts in each of 6 layers), in
layer order. Every run evicts the file from the page cache first and reports the share of the
ranges' pages still cached when it started (should be 0) and the bytes it read from the disk.

Depth: for pread/odirect the threads, for uring the reads in flight (1 MiB at most each); for
willneed/fadvise the ranges advised before their pages are touched: 24 is the gate's (one MoE
layer's 8 experts, what spac does today), `all` every range first (a read ahead). `fault` has
none: one thread, one 4 KiB page read per fault (MADV_RANDOM). Every method runs at --depths and
the gate's; the methods and depths interleave within a repeat. The disk's sequential rate (8 MiB
reads, bench_disk.disk_rates) is measured in the same run: the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_cpu import cpu_description  # noqa: E402
from bench_disk import DEFAULT_FILE, disk_rates, make_file, queue_setting, user_cpu_seconds  # noqa: E402
from memory_cgroup import drop_from_page_cache  # noqa: E402

SOURCE = ROOT / "bench" / "disk_read_methods.c"
TOP_K = 8  # a token's routed experts per MoE layer (Qwen3-30B-A3B): at most what one gate reads
ADVISED = ("willneed", "fadvise")
READERS = ("pread", "odirect", "uring", "uring-direct")


def compile_program(directory: Path) -> Path:
    exe = directory / "disk_read_methods"
    subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-pthread", "-o", str(exe), str(SOURCE)], check=True)
    return exe


def expert_ranges(path: Path, n_experts: int, seed: int = 0) -> tuple[list[tuple[int, int]], int, int]:
    """(offset, length) of n_experts random experts' slices, TOP_K to a MoE layer in turn, layer by
    layer; and the MoE layers' count and one expert's ranges (its matrices)."""
    import gguf

    layers: dict[int, list] = {}
    for t in gguf.GGUFReader(path).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2].endswith("_exps"):  # [n_in, n_out, n_expert]: experts outermost
            per = int(t.n_bytes) // int(t.shape[2])
            layers.setdefault(int(parts[1]), []).append((int(t.data_offset), per, int(t.shape[2])))
    blocks = sorted(layers)
    if not blocks:
        sys.exit(f"bench_disk_reads: {path} has no ffn_*_exps tensors")
    rng = random.Random(seed)
    chosen: dict[int, list[int]] = {b: [] for b in blocks}
    for i in range(n_experts):
        b = blocks[i // TOP_K % len(blocks)]
        n_expert = layers[b][0][2]
        chosen[b].append(rng.choice([e for e in range(n_expert) if e not in chosen[b]]))
    ranges = [(offset + e * per, per) for b in blocks for e in chosen[b] for offset, per, _ in sorted(layers[b])]
    return ranges, len(blocks), len(layers[blocks[0]])


def run_once(exe: Path, path: Path, method: str, depth: int, ranges_text: str) -> dict:
    drop_from_page_cache(path)
    proc = subprocess.run([str(exe), str(path), method, str(depth)], input=ranges_text, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} depth {depth}: exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def summarize(runs: list[dict], sequential: float) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"method": runs[0]["method"], "depth": runs[0]["depth"], "error": runs[0]["error"]}
    rates = [r["MB/s"] * 1e6 for r in ok]
    return {"method": ok[0]["method"], "depth": ok[0]["depth"], "median_Bps": statistics.median(rates),
            "min_Bps": min(rates), "max_Bps": max(rates), "of_sequential": statistics.median(rates) / sequential,
            "token_ms": 1e3 * statistics.median(r["seconds"] for r in ok),
            "disk_over_asked": statistics.median(r["disk_bytes"] / r["bytes"] for r in ok),
            "max_cached": max(r["cached"] for r in ok)}


def depth_name(method: str, depth: int, gate: int) -> str:
    if method == "fault":
        return "-"
    return "all" if depth == 0 else f"{depth} gate" if depth == gate else str(depth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--experts", type=int, default=48, help="experts read per run: one token's misses (default: "
                    "8 of 128 in each of 6 layers)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depths", default="1,4,16", help="requests in flight (threads, io_uring entries, ranges advised)")
    ap.add_argument("--json", type=Path, help="write every run and the table's rows here")
    args = ap.parse_args()
    path = make_file(args.file)
    ranges, n_layers, per_expert = expert_ranges(path, args.experts)
    ranges_text = "".join(f"{o} {n}\n" for o, n in ranges)
    asked = sum(n for _, n in ranges)
    gate = TOP_K * per_expert
    depths = sorted({int(d) for d in args.depths.split(",")} | {gate})
    rows = [("fault", 1)] + [(m, d) for m in ADVISED for d in [*depths, 0]] + [(m, d) for m in READERS for d in depths]
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_program(Path(tmp))
        print(f"CPU: {cpu_description()}")
        print(f"file {path.name} {path.stat().st_size / 2**30:.2f} GiB; {args.experts} experts over {n_layers} MoE "
              f"layers, {len(ranges)} ranges of {asked / len(ranges) / 2**10:.0f} KiB, {asked / 2**20:.1f} MiB a run; "
              f"read_ahead_kb {queue_setting(path, 'read_ahead_kb')}; {args.repeats} repeats", flush=True)
        others0, t0 = user_cpu_seconds(), time.monotonic()
        rates = disk_rates(path)
        runs: list[dict] = []
        for _ in range(args.repeats):  # interleaved: a drift in the disk's rate spreads over every method
            runs += [run_once(exe, path, m, d, ranges_text) for m, d in rows]
        others = user_cpu_seconds()
    others_s = sum(v - others0.get(pid, 0.0) for pid, v in others.items() if pid != os.getpid())
    wall = time.monotonic() - t0
    seq = rates["sequential"]
    print("disk: " + ", ".join(f"{k} {v / 1e6:.0f} MB/s" for k, v in rates.items()))
    table = [summarize([r for r in runs if (r["method"], r["depth"]) == row], seq) for row in rows]
    print(f"{'method':13s} {'depth':>7s} {'MB/s median (min-max)':>23s} {'÷ seq':>6s} {'disk/asked':>10s} "
          f"{'cached':>6s} {f'ms/{args.experts} experts':>15s}")
    for r in table:
        name = f"{r['method']:13s} {depth_name(r['method'], r['depth'], gate):>7s}"
        if "error" in r:
            print(f"{name} error: {r['error']}")
            continue
        spread = f"{r['median_Bps'] / 1e6:.0f} ({r['min_Bps'] / 1e6:.0f}-{r['max_Bps'] / 1e6:.0f})"
        print(f"{name} {spread:>23s} {r['of_sequential']:6.2f} {r['disk_over_asked']:10.2f} {r['max_cached']:6.3f} "
              f"{r['token_ms']:15.1f}")
    ok = [r for r in table if "error" not in r]
    best = max(ok, key=lambda r: r["median_Bps"])
    at_gate = next(r for r in ok if (r["method"], r["depth"]) == ("willneed", gate))
    best_willneed = max((r for r in ok if r["method"] == "willneed"), key=lambda r: r["median_Bps"])
    print(f"fastest: {best['method']} depth {depth_name(best['method'], best['depth'], gate)}, "
          f"{best['median_Bps'] / 1e6:.0f} MB/s: {best['median_Bps'] / at_gate['median_Bps']:.2f}x willneed at the "
          f"gate's depth ({at_gate['median_Bps'] / 1e6:.0f} MB/s), {best['median_Bps'] / best_willneed['median_Bps']:.2f}x "
          f"willneed's best (depth {depth_name('willneed', best_willneed['depth'], gate)})")
    print(f"other user processes: {others_s:.1f} CPU-s in {wall:.0f} s: "
          f"{'idle otherwise' if others_s < 0.02 * wall else 'NOT idle: another process ran'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_description(), "file": str(path), "experts": args.experts,
                                         "ranges": ranges, "disk": rates, "gate_depth": gate, "rows": table,
                                         "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
