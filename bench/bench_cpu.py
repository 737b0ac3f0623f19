"""The host's kernels against stock llama.cpp and ik_llama.cpp: decode and prefill tok/s on the
same files, same threads, in one run.

For each file: stock `llama-bench` (built from the pinned tree, `scripts/build_native.py --stock`)
with `--repack 0` and `--repack 1` (its default); ik_llama.cpp's `llama-bench` (built from the
sdist pinned in vendor/ik-llama-cpp-python.lock, `scripts/build_native.py --ik`) with the
settings its users pick for a hybrid MoE on the CPU, `-rtr 0 -fmoe 1` and `-rtr 1 -fmoe 1`
(run-time repacking off/on, fused up/gate experts; flash attention on, its default); and spac's target-only decoding (the model loaded
as `spac generate` loads it, pool off as on a machine without a GPU, decoded through
`orchestrator.runtime.llm`) with `--repack` as given (default: spac's default), both timed the same way:
tg = --n-gen single-token decodes of random tokens from an empty context (decoding, not sampling),
pp = one --n-prompt-token prompt after a warm-up run of it. Printed: tok/s, the median of --repeats,
spac ÷ llama.cpp's default, ÷ the better of its two settings and ÷ ik_llama.cpp's better one
(per phase), and each process's peak resident memory.

The files are the OLMoE and Qwen3-30B-A3B shapes with a few layers (`make_synthetic_moe.py`,
random zero-mean Q4_0, so that a prompt's routing spreads over the experts as a real model's),
requantized by stock `llama-quantize` (`--allow-requantize`) to Q4_K_M (which puts
Q6_K on half of the layers' ffn_down_exps, as real Q4_K_M files do), Q8_0 and IQ4_NL; cached
under --dir.

First, what bounds a decode: the machine's memory read rate at these threads (every thread
streaming its share of a buffer larger than the last-level cache, `spac_host_read_rate`), and
per file the read rate of one token's matmuls (the first layer's experts, its attention's Q
weight and the output head) in each CPU buffer type that takes them, timed as `--repack auto`
times them: the weights rotated through copies eight times the last-level cache, so that they come
from memory as in a real decode. The experts' CPU_EXACT matmul is then timed again in the kernel
variant the variant table puts first (`exact_variant.choose`, `--repack auto`'s rule: the fastest,
where it beats the default by 3%), 7 times, each between two read-rate measurements in the same
process, and printed as a share of the higher (the median is the issue's "GEMV ÷ bandwidth").

Every row runs in its own process, one at a time (llama.cpp's threads spin), rows alternating
per repeat, each repeat starting one system later, so that the machine's load hits each alike; the
CPU's flags and the CPU time other processes used during the run are printed. The memory read rate
is measured again before every run and its median per system printed beside the file's row: on a
virtual machine it can move by half between two runs (2 threads on a Zen 5 guest: about 53 or 79
GB/s, at times from one second to the next), and a decode with it.
--json writes {"cpu", "decode_rates", "rows"}.

    .venv/bin/python bench/bench_cpu.py                        # 2 shapes x 4 types, 4 layers
    .venv/bin/python bench/bench_cpu.py --files a.gguf b.gguf -t 2 --json rows.json
    .venv/bin/python bench/bench_cpu.py --spac-repack off      # spac with llama.cpp's repacking off
    .venv/bin/python bench/bench_cpu.py --no-ik                # without ik_llama.cpp (no build of it)
    .venv-avx2/bin/python bench/bench_cpu.py --files ...       # every system built for AVX2 only
                                                               # (scripts/test_avx2.sh makes the venv)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_live import machine_cpu_seconds, own_cpu_seconds, steal_seconds, stock_program  # noqa: E402
from build_native import ik_program, installed_variant  # noqa: E402  (scripts/, on the path through bench_live)

from orchestrator.runtime.host_layout import cpu_model_and_flags  # noqa: E402

SHAPES = ("olmoe-1b-7b", "qwen3-30b-a3b")
TYPES = ("Q4_0", "Q4_K_M", "Q8_0", "IQ4_NL")
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "sve", "asimddp", "i8mm")


def cpu_description() -> str:
    """The CPU, its flags, and the ISA every system in the run was built for: -march=native, or
    the --cpu-variant of the spac build this interpreter imports (scripts/test_avx2.sh's venv), which
    stock llama.cpp and ik_llama.cpp are then built for too."""
    model, flags = cpu_model_and_flags()
    variant = installed_variant(sys.executable)
    return (f"{model}; {os.cpu_count()} logical CPUs; flags: {' '.join(f for f in CPU_FLAGS if f in flags) or '-'}; "
            f"builds: {f'--cpu-variant {variant} (every system)' if variant else '-march=native'}")


def make_files(directory: Path, n_layer: int, types: list[str], shapes: list[str]) -> list[Path]:
    """The synthetic Q4_0 file of each shape and its requantizations by stock llama-quantize."""
    directory.mkdir(parents=True, exist_ok=True)
    quantize = stock_program("llama-quantize")
    out = []
    for shape in shapes:
        base = directory / f"{shape}-{n_layer}l-Q4_0.gguf"
        if not base.exists():
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_moe.py"), shape, str(base),
                            "--n-layer", str(n_layer)], check=True)
        for t in types:
            f = directory / f"{shape}-{n_layer}l-{t}.gguf"
            if not f.exists():
                tmp = f.with_suffix(".part")
                subprocess.run([str(quantize), "--allow-requantize", str(base), str(tmp), t],
                               check=True, capture_output=True)
                tmp.rename(f)
            out.append(f)
    return out


# a decode's matmuls whose read rate is printed: the first layer's experts, its attention's Q weight,
# the output head (each one token, weights read from memory)
RATE_WEIGHTS = ("blk.0.ffn_up_exps.weight", "blk.0.attn_q.weight", "output.weight")


def decode_rates(path: Path, threads: int) -> list[dict]:
    """Per weight of RATE_WEIGHTS and per CPU buffer type that takes it (in exact mode's choice
    of kernels, as spac decodes): one token's matmul timed as `--repack auto` times it (cold:
    the weights rotated through copies larger than the last-level cache), and the bytes it reads
    per second. In its own process: llama.cpp's libraries loaded, no model."""
    import gguf

    from orchestrator.decoding.speculative import EXACT_ROWS
    from orchestrator.runtime import exact_variant, host_layout

    host_layout.set_batch_invariant_rows(EXACT_ROWS)
    g = host_layout._lib()
    weights = host_layout.read_weights(path)
    rows = []
    for name, ggml_type, ne in weights.tensors:
        if name not in RATE_WEIGHTS:
            continue
        n_in, n_out = ne[0], min(ne[1], host_layout.MAX_BENCH_ROWS)
        n_expert = min(ne[2], host_layout.MAX_BENCH_EXPERTS) if len(ne) > 2 else 0
        n_used = min(weights.n_used, n_expert) if n_expert else 1
        read = g["row_size"](ggml_type, n_in) * n_out * n_used  # one token reads its experts' rows
        op = host_layout.MUL_MAT_ID if n_expert else host_layout.MUL_MAT
        shape = (n_in, n_out, n_expert) if n_expert else (n_in, n_out)
        for buft_name, buft in host_layout.cpu_buffer_types().items():
            if not host_layout.supports(ggml_type, shape, buft, op, n_used):
                continue
            t = host_layout.time_matmul(ggml_type, n_in, n_out, n_expert, n_used, 1, buft, threads)
            if t is None:
                continue
            row = {"weight": name, "type": gguf.GGMLQuantizationType(ggml_type).name, "buft": buft_name,
                   "us": t * 1e6, "gb_s": read / t / 1e9}
            if n_expert and buft_name == host_layout.EXACT_BUFT:  # every variant of its one-token kernels
                ms = exact_variant.time_variants(host_layout.matmul_timer, ggml_type, [(n_in, n_out, n_expert, n_used)],
                                                 threads, buft, list(exact_variant.EVERY))
                row["variants_gb_s"] = {k: read / (v / 1e3) / 1e9 for k, v in ms.items()}
                row["beside_read_rate"] = beside_read_rate(ggml_type, (n_in, n_out, n_expert, n_used), buft, threads,
                                                           read, exact_variant.choose(ms))
            rows.append(row)
    return rows


BESIDE_ROUNDS = 7


def memory_read_rate(threads: int) -> float:
    """GB/s that `threads` threads read together from a buffer 8x the last-level cache (at least
    512 MiB): what a one-token matmul is held to."""
    from orchestrator.runtime.host_layout import last_level_cache_bytes
    from orchestrator.runtime.native import host_read_rate

    return host_read_rate(threads, max(8 * last_level_cache_bytes(), 512 << 20)) / 1e9


def beside_read_rate(ggml_type: int, shape: tuple[int, int, int, int], buft: int, threads: int, read: int,
                     variant) -> dict:
    """The one-token expert matmul in `variant` (the variant table's choice), each of BESIDE_ROUNDS
    timings between two measurements of the memory read rate in the same process: its GB/s over the
    higher of the two, per round (this host's speed drifts within minutes, so a matmul and a read
    rate from other moments do not compare)."""
    from orchestrator.runtime import exact_variant, host_layout

    ratios = []
    with exact_variant.using(variant), host_layout.matmul_timer(ggml_type, *shape, 1, buft, threads, cold=True) as timer:
        for _ in range(BESIDE_ROUNDS):
            before = memory_read_rate(threads)
            t = timer(3)
            after = memory_read_rate(threads)
            ratios.append(read / t / max(before, after) / 1e9)
    return {"variant": variant.key, "ratios": ratios}


def run_measured(cmd: list[str]) -> tuple[str, int]:
    """Run a command; its stdout and its own peak RSS in bytes (os.wait4: this child alone)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, not by Popen, to read its rusage
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if rc != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({rc}):\n{err.read().decode(errors='replace')[-3000:]}")
        return out.read().decode(), usage.ru_maxrss * 1024


def llama_bench(exe: Path, path: Path, settings: list[str], threads: int, n_prompt: int, n_gen: int) -> dict:
    """One llama-bench run (one repetition of pp and tg: the rows alternate between repetitions);
    settings: the peer's own flags (stock `--repack 1`, ik_llama.cpp `-rtr 1 -fmoe 1`)."""
    rows = {}
    rss = 0
    for phase, p, n in (("pp", n_prompt, 0), ("tg", 0, n_gen)):
        out, r = run_measured([str(exe), "-m", str(path), "-t", str(threads), "-p", str(p), "-n", str(n),
                               "-r", "1", *settings, "-o", "json"])
        rows[phase] = json.loads(out)[0]["avg_ts"]
        rss = max(rss, r)
    return {"pp": rows["pp"], "tg": rows["tg"], "rss": rss}


def spac_bench(path: Path, repack: str, threads: int, n_prompt: int, n_gen: int) -> dict:
    out, rss = run_measured([sys.executable, __file__, "--spac-row", str(path), "--spac-repack", repack,
                             "-t", str(threads), "--n-prompt", str(n_prompt), "--n-gen", str(n_gen)])
    row = json.loads(out.strip().splitlines()[-1])
    return {**row, "rss": rss}


def spac_row(path: Path, repack: str, threads: int, n_prompt: int, n_gen: int) -> dict:
    """In its own process: spac's target-only decoding of `path` (the model loaded as `spac
    generate` loads it, no pool, through orchestrator.runtime.llm), timed as llama-bench times its runs."""
    import numpy as np

    from orchestrator.decoding.speculative import EXACT_ROWS
    from orchestrator.runtime.host_layout import set_batch_invariant_rows
    from orchestrator.runtime.llm import Context, Model

    set_batch_invariant_rows(EXACT_ROWS)  # a session's default (--exact): passes of up to 32 tokens row by row
    model = Model(path, repack=repack)
    # one context for both phases (cleared in between), as large as llama-bench's larger one
    ctx = Context(model, n_ctx=max(n_prompt, n_gen), n_batch=n_prompt, n_threads=threads)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, model.n_vocab, n_prompt)
    ctx.decode(prompt, logits_all=False)  # warm-up: llama-bench runs the whole prompt once first
    ctx.clear()
    t = time.perf_counter()
    ctx.decode(prompt, logits_all=False)  # llama-bench's pp: one prompt into an empty cache
    pp = n_prompt / (time.perf_counter() - t)
    ctx.clear()
    tokens = rng.integers(100, model.n_vocab, n_gen + 1)
    ctx.decode(tokens[:1])  # warm-up, then llama-bench's tg: n_gen single-token decodes from an empty
    ctx.clear()             # cache, each fed a random token (it times decoding, not sampling)
    t = time.perf_counter()
    for token in tokens[1:]:
        ctx.decode([token])
    tg = n_gen / (time.perf_counter() - t)
    return {"pp": pp, "tg": tg, "layout": model.layout_report()}


def print_decode_rates(files: list[Path], threads: int) -> dict:
    """The machine's memory read rate at `threads` threads, and each file's decode matmuls' read
    rates against it (`decode_rates`, one process per file), printed; returned for --json. The
    read rate is measured before and after every file and the highest taken: on a host whose speed
    drifts, a matmul's best time and one read rate from another moment would not compare."""
    rates = [memory_read_rate(threads)]
    out = {"matmuls": {}}
    for f in files:
        text, _ = run_measured([sys.executable, __file__, "--rates-of", str(f), "-t", str(threads)])
        out["matmuls"][f.name] = json.loads(text.strip().splitlines()[-1])
        rates.append(memory_read_rate(threads))
    limit = out["read_rate_gb_s"] = max(rates)
    print(f"memory read rate, {threads} threads: {limit:.1f} GB/s, the highest of "
          f"{', '.join(f'{r:.1f}' for r in rates)} (before and after each file; the limit of a one-token matmul)")
    print("| file | weight | type | layout | µs | GB/s | ÷ read rate |\n|---|---|---|---|---|---|---|")
    for name, rows in out["matmuls"].items():
        for r in rows:
            print(f"| {name} | {r['weight']} | {r['type']} | {r['buft']} | {r['us']:.0f} | {r['gb_s']:.1f} | "
                  f"{r['gb_s'] / limit:.2f} |")
    print_variant_rates(out["matmuls"], limit)
    for name, rows in out["matmuls"].items():
        for r in rows:
            if "beside_read_rate" in r:
                b = r["beside_read_rate"]
                print(f"{name} {r['weight']}, one token in variant {b['variant']}, each timing between two read-rate "
                      f"measurements: {', '.join(f'{x:.2f}' for x in b['ratios'])} of the higher; median "
                      f"{statistics.median(b['ratios']):.2f}")
    print(flush=True)
    return out


def print_variant_rates(matmuls: dict[str, list[dict]], limit: float) -> None:
    """CPU_EXACT's one-token expert matmul under each kernel variant (groups a thread reads at once /
    prefetch bytes; exact_variant.py), as GB/s ÷ the read rate: the best four and the default."""
    from orchestrator.runtime.exact_variant import DEFAULT

    print("\nCPU_EXACT's kernel variants, one token of experts (groups/prefetch: GB/s ÷ read rate; the best four, "
          "then the default)")
    print("| file | weight | best | 2nd | 3rd | 4th | default |\n|---|---|---|---|---|---|---|")
    for name, rows in matmuls.items():
        for r in rows:
            if "variants_gb_s" not in r:
                continue
            v = sorted(r["variants_gb_s"].items(), key=lambda kv: -kv[1])
            cells = " | ".join(f"{k}: {gb / limit:.2f}" for k, gb in v[:4])
            print(f"| {name} | {r['weight']} | {cells} | {DEFAULT.key}: {r['variants_gb_s'][DEFAULT.key] / limit:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="*", type=Path, help="GGUF files (default: build the synthetic set)")
    # zero-mean/: not the earlier files of uniform nibbles, whose prompts all routed to 8 experts per layer
    ap.add_argument("--dir", type=Path, default=ROOT / "runs" / "bench_cpu" / "zero-mean",
                    help="where the built files are cached")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--spac-repack", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--no-ik", action="store_true", help="leave ik_llama.cpp out (no build of it)")
    ap.add_argument("--json", type=Path, help="also write the rows here as a JSON list")
    ap.add_argument("--spac-row", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rates-of", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.spac_row:
        print(json.dumps(spac_row(args.spac_row, args.spac_repack, args.threads, args.n_prompt, args.n_gen)))
        return
    if args.rates_of:
        print(json.dumps(decode_rates(args.rates_of, args.threads)))
        return

    print(f"CPU: {cpu_description()}")
    files = args.files or make_files(args.dir, args.n_layer, args.types.split(","), args.shapes.split(","))
    rates = print_decode_rates(files, args.threads)
    bench = stock_program("llama-bench")
    peers = {"llama.cpp --repack 0": (bench, ["--repack", "0"]), "llama.cpp --repack 1": (bench, ["--repack", "1"])}
    if not args.no_ik:
        ik = ik_program("llama-bench")
        peers |= {"ik -rtr 0 -fmoe 1": (ik, ["-rtr", "0", "-fmoe", "1"]), "ik -rtr 1 -fmoe 1": (ik, ["-rtr", "1", "-fmoe", "1"])}
    print(f"threads {args.threads}, pp {args.n_prompt}, tg {args.n_gen}, median of {args.repeats}; "
          f"spac --repack {args.spac_repack}", flush=True)
    machine0, own0, steal0, t0 = machine_cpu_seconds(), own_cpu_seconds(), steal_seconds(), time.monotonic()
    results = []
    for f in files:
        runs: dict[str, list[dict]] = {name: [] for name in [*peers, "spac"]}
        failed: dict[str, str] = {}  # a peer that cannot run this file (ik_llama.cpp has no OLMoE)
        order = list(runs)
        for rep in range(args.repeats):
            for name in order[rep % len(order):] + order[:rep % len(order)]:
                if name in failed:
                    continue
                read = memory_read_rate(args.threads)
                try:
                    if name == "spac":
                        run = spac_bench(f, args.spac_repack, args.threads, args.n_prompt, args.n_gen)
                    else:
                        exe, settings = peers[name]
                        run = llama_bench(exe, f, settings, args.threads, args.n_prompt, args.n_gen)
                except RuntimeError as e:
                    if not name.startswith("ik"):
                        raise
                    failed[name] = str(e).strip().splitlines()[-1]
                    print(f"  {f.name}: {name}: {failed[name]}", flush=True)
                    continue
                runs[name].append({**run, "read_gb_s": read})
        runs = {k: v for k, v in runs.items() if k not in failed}
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("pp", "tg", "rss", "read_gb_s")}
               for k, v in runs.items()}
        r0, r1, sp = med["llama.cpp --repack 0"], med["llama.cpp --repack 1"], med["spac"]
        best = {m: max(r0[m], r1[m]) for m in ("pp", "tg")}
        ik = [med[k] for k in med if k.startswith("ik")]
        row = {"file": f.name, "llama_repack0": r0, "llama_repack1": r1, "spac": sp,
               "ik": {k: med[k] for k in med if k.startswith("ik")},
               "spac_layout": runs["spac"][-1]["layout"],
               "spac_vs_default": {m: sp[m] / r1[m] for m in ("pp", "tg")},
               "spac_vs_best": {m: sp[m] / best[m] for m in ("pp", "tg")},
               "spac_vs_ik_best": {m: sp[m] / max(r[m] for r in ik) for m in ("pp", "tg")} if ik else None,
               "rss_vs_default": sp["rss"] / r1["rss"]}
        results.append(row)
        print(f"  {f.name}: " + ", ".join(f"{k} {v['tg']:.1f}/{v['pp']:.1f}" for k, v in med.items())
              + f" (tg/pp tok/s); spac layout: {row['spac_layout']}", flush=True)
        print(f"  {f.name}: memory read rate before each run, median per system: "
              + ", ".join(f"{k} {v['read_gb_s']:.1f}" for k, v in med.items()) + " GB/s", flush=True)
    wall = time.monotonic() - t0
    other = machine_cpu_seconds() - machine0 - (own_cpu_seconds() - own0)
    steal = steal_seconds() - steal0
    print()
    ik_names = [k for k in peers if k.startswith("ik")]
    print("| file | llama.cpp --repack 0 tg / pp | --repack 1 (default) tg / pp | "
          + "".join(f"{k} tg / pp | " for k in ik_names) + "spac tg / pp | "
          "spac ÷ default tg / pp | spac ÷ best tg / pp | " + ("spac ÷ ik best tg / pp | " if ik_names else "")
          + "RSS spac ÷ default |")
    print("|---|---|---|" + "---|" * len(ik_names) + "---|---|---|---|" + ("---|" if ik_names else ""))
    for r in results:
        r0, r1, sp = r["llama_repack0"], r["llama_repack1"], r["spac"]
        ik_cells = "".join(f"{r['ik'][k]['tg']:.1f} / {r['ik'][k]['pp']:.1f} | " if k in r["ik"] else "cannot load | "
                           for k in ik_names)
        vs = r["spac_vs_ik_best"]
        vs_ik = (f"{vs['tg']:.3f} / {vs['pp']:.3f} | " if vs else "- | ") if ik_names else ""
        print(f"| {r['file']} | {r0['tg']:.1f} / {r0['pp']:.1f} | {r1['tg']:.1f} / {r1['pp']:.1f} | {ik_cells}"
              f"{sp['tg']:.1f} / {sp['pp']:.1f} | {r['spac_vs_default']['tg']:.3f} / {r['spac_vs_default']['pp']:.3f} | "
              f"{r['spac_vs_best']['tg']:.3f} / {r['spac_vs_best']['pp']:.3f} | {vs_ik}{r['rss_vs_default']:.3f} |")
    # children are timed as their own processes: what is not ours or theirs is the machine's other load
    print(f"\nwall {wall:.0f} s; other processes used {max(other, 0.0):.1f} CPU s "
          f"({100 * max(other, 0.0) / (wall * (os.cpu_count() or 1)):.1f}% of the machine); the hypervisor took "
          f"{steal:.1f} CPU s ({100 * steal / (wall * (os.cpu_count() or 1)):.1f}%, steal time)")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_description(), "decode_rates": rates, "rows": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
