"""The simulator held against the engine: predicted and measured tok/s side by side, in one run.

    python bench/bench_sim_truth.py [-m runs/mb/olmoe-bytes-f16.gguf] [-md DRAFT] [-n 64] [--prompts 3]
                                    [--json rows.json] [--profile FILE]

1. Profile: `spac sim profile measure` of this machine, on the target's own file, with 9 timed
   passes per point (--profile-repeats; the one-token expert time moved by 10% between two
   profiles of 3), once before the live rows and once after them, the prediction taking their
   mean (profiles.average_measured: two profiles minutes apart differed by up to 29% in an expert
   table; --keep saves both besides): the host with 1 thread, the pool device a ggml RPC server on 127.0.0.1 with 1 thread (the stand-in GPU),
   the draft's tokens on the host (orchestrator/cli/profile_measure.py), the host and the RPC server
   pinned to one CPU each for the whole run (--no-pin leaves them to the scheduler). --profile FILE
   reuses one.
   --device CUDA0 -t 8 measures a real GPU instead, with that many host threads (docs/gpu.md, "The first
   lease"; bench/gpu_checks.sh truth runs it).
2. Live: the target (default: the memory-bound target of scripts/make_memory_bound_target.py,
   written to runs/mb/ if missing) with the shipped Q4_0 self-draft, every layer's non-expert
   weights on the RPC device (-ngl 99) and the expert pool on it, greedy, the same prompts for
   every row; rows = pool budget 25% and 50% × static placement (llama.cpp's --n-cpu-moe) and
   spac's default policy × speculative (γ adaptive, ≤ --draft-max) and autoregressive (--policies
   adds llama.cpp's cache, patch 0023, and spac's miss rule, patch 0031, which then decides on the
   profile's costs, as its replay does). Each
   row records its routing trace (`orchestrator.cli.record`'s writer on the session; the warm-up
   and every prompt's pass in it, untimed: they fill a pool that copies inside the passes) and its
   decode tok/s (prefill excluded), summed over the prompts, timed once the pool holds the
   warm-up's plan (the simulator replays the warm-up, then waits for its copies).
3. Predicted: each row's trace replayed by the simulator with the measured profile, the same
   policy class and the engine's slot count; the trace carries the γ and acceptance of every
   step, so only the cost model is under test.

4. The overlap bench's rows (bench_overlap.py's setting: all-host, serial, overlapped, each half
   alone), timed and predicted from a profile measured on that file in that layout.

--keep DIR saves the profile, the traces and the live numbers; --replay DIR predicts them again
with the current cost model (no live run): how a change to the model is held against the same
measurements.

Every row runs --repeats times (3; the rows interleaved, a fresh session each time), each run's
trace replayed on its own; a row's tok/s is over all its runs.

Printed: a table of predicted and measured tok/s with the error of each row (and the share of
expert work on the device and the expert copies, measured and simulated), whether the ranking
of the configurations agrees (every pair of rows that differ in one factor: budget, policy,
speculation; the runs order a pair when every run of one is faster than every run of the
other, and the prediction must order it the same way; rows whose runs overlap are alike, and
the prediction must not put them further apart than their runs spread), the machine load and
the command. --json FILE writes the rows as a list of objects ("row", "predicted_tok_s",
"measured_tok_s", "error", ...).

The sessions run one after the other (each holds its pool on the RPC server: 8 at once would
not fit); the machine's other load is reported, as in bench_live.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from bench_live import machine_cpu_seconds, own_cpu_seconds, steal_seconds  # noqa: E402
from orchestrator.shipped_models import MODELS_DIR  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "def read_file(path):\n    with open(path) as f:"]
WARM_UP = "def main():\n    "
DEFAULT_TARGET = ROOT / "runs" / "mb" / "olmoe-bytes-f16.gguf"
DEFAULT_DRAFT = MODELS_DIR / "spac-tiny-moe-q4_0.gguf"
BUDGETS = (0.25, 0.5)
# live name → the simulator's policy of the same class; llama-moe-cache: llama.cpp's own expert cache
# in spac's engine (patch 0023: its plain LRU, llama-moe-cache-lru), spac-reuse: spac's miss rule
# (patch 0031: each miss uploaded, on the host or streamed, decided after the router), on request (--policies)
POLICIES = {"static": "static", "spac": "spac/host", "llama-moe-cache": "llama-moe-cache-lru", "spac-reuse": "spac-reuse"}
IN_PASS_COPIES = ("llama-moe-cache", "spac-reuse")  # their copies are made inside the pass (n_staged)
DEFAULT_POLICIES = ("static", "spac")


@dataclass
class Run:
    """One live session of a row (every prompt), and its replay."""
    tokens: int = 0
    seconds: float = 0.0
    trace: object = None
    texts: list = field(default_factory=list)
    device_tokens: int = 0   # expert-token pairs the live engine computed on the device
    host_tokens: int = 0
    copies: int = 0
    predicted_s: float = float("nan")
    sim: dict = field(default_factory=dict)

    @property
    def measured(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


@dataclass
class Row:
    budget: float
    policy: str        # a key of POLICIES
    speculative: bool
    n_slots: int = 0
    runs: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.budget:.0%} {self.policy} {'+ speculative' if self.speculative else 'autoregressive'}"

    def total(self, key: str):
        return sum(getattr(r, key) for r in self.runs)

    @property
    def texts(self) -> list:
        return self.runs[0].texts if self.runs else []

    @property
    def measured_hit(self) -> float:
        n = self.total("device_tokens") + self.total("host_tokens")
        return self.total("device_tokens") / n if n else float("nan")

    @property
    def measured(self) -> float:
        """tok/s over every run"""
        seconds = self.total("seconds")
        return self.total("tokens") / seconds if seconds else float("nan")

    @property
    def predicted(self) -> float:
        seconds = self.total("predicted_s")
        return self.total("tokens") / seconds if seconds else float("nan")

    @property
    def measured_range(self) -> tuple[float, float]:
        """The slowest and the fastest run's tok/s."""
        v = [r.measured for r in self.runs]
        return min(v), max(v)

    def sim_total(self, key: str):
        return sum(r.sim[key] for r in self.runs)


def pin_compute_units() -> str:
    """This process (the host half, 1 thread) on one CPU, the RPC server (the stand-in device) on
    another: the two compute units the setting is about. Unpinned, the scheduler at times runs
    both on one core of this 2-core machine: a live token then cost up to 35% more than with the
    two pinned, and the same row moved by +-20% between runs (pinned: +-2%)."""
    import psutil

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "not pinned (one CPU)"
    for server in psutil.Process().children():
        server.cpu_affinity([cpus[1]])
    os.sched_setaffinity(0, {cpus[0]})
    return f"host on CPU {cpus[0]}, RPC server on CPU {cpus[1]}"


def run_live(row: Row, target: Path, draft: Path, device: str, args, cache: Path, profile: Path) -> Run:
    """One configuration: open, warm up, generate every prompt greedily, record the trace."""
    from orchestrator.policies.default import LookaheadUtility
    from orchestrator.policies.static import StaticPlacement
    from orchestrator.decoding.sampling import SamplingParams
    from orchestrator.sim.trace import TraceWriter
    from orchestrator.decoding.speculative import Session, SessionConfig
    from orchestrator.runtime.pool import Budget, PoolDevice

    cfg = SessionConfig(model=target, draft=draft if row.speculative else None, gamma=args.draft_max,
                        n_ctx=args.ctx_size, n_threads=args.threads, n_gpu_layers=-1, expert_engine=True,
                        pool=(PoolDevice(device or "CPU", Budget(ratio=row.budget)),), calibration_cache=cache, mmap=args.mmap)
    from orchestrator.policies.cache import LlamaMoeCacheLRU, ReuseCredited

    policy = {"static": StaticPlacement, "llama-moe-cache": LlamaMoeCacheLRU, "spac-reuse": ReuseCredited}.get(
        row.policy, lambda: LookaheadUtility(miss="cpu"))()  # spac: the session's default
    with Session(cfg, policy=policy) as s:
        if row.policy == "spac-reuse":
            s.engine.set_miss_costs(profile_miss_costs(row, profile, target, draft))
        eng = s.engine
        # the warm-up and the prompts are in the trace, untimed: what they leave in the pool is
        # where decoding starts (a cache filled inside the passes holds their experts)
        writer = TraceWriter(Path(cache).with_suffix(f".{row.policy}-{row.budget}-{row.speculative}.npz"),
                             n_layer=eng.n_moe_layers, n_expert=eng.n_expert, top_k=eng.n_expert_used,
                             model=target.stem, meta={"gguf": str(target), "draft_gguf": str(draft) if row.speculative else None})
        s.on_step = lambda step: writer.append(step, s.last_draft_routing)
        s.on_prompt = writer.append_prompt
        s.complete(WARM_UP, max_tokens=16)
        writer.meta["warm_up_steps"] = writer.n_steps
        # timing starts once the pool holds the warm-up's plan, as the simulator's does
        # (SimConfig.warm_up_steps): else a row pays for filling the pool inside its measured
        # tokens, and on the RPC device every copy holds up the pass behind it
        eng.wait_idle(600)
        row.n_slots = int(eng.stats()["n_slots"])
        run = Run()
        for prompt in PROMPTS[:args.prompts]:
            s.reset()
            staged = eng.stats()["n_staged"]
            c = s.complete(prompt, max_tokens=args.n, sampling=SamplingParams(temperature=0.0))
            if row.policy in IN_PASS_COPIES:  # its copies are the uploads on miss (patches 0023, 0031)
                run.copies += int(eng.stats()["n_staged"] - staged)
            run.tokens += c.metrics.n_tokens
            run.seconds += c.metrics.decode_s
            run.device_tokens += c.metrics.n_expert_tokens_device
            run.host_tokens += c.metrics.n_expert_tokens_cpu
            run.copies += c.metrics.n_copies
            run.texts.append(c.text)
        run.trace = writer.to_trace()
    row.runs.append(run)
    return run


def sim_config(row: Row, profile: Path, target: Path, draft: Path):
    """The simulator's setting of a row: the measured profile, the target (and its draft), the slots."""
    from orchestrator.sim import profiles
    from orchestrator.sim.simulator import SimConfig

    tprof, quant = profiles.from_gguf(target)
    dkey, dquant = None, "Q8_0"
    if row.speculative:
        dprof, dquant = profiles.from_gguf(draft, draft=True)
        dkey = profiles.register(dprof)
    return SimConfig(hardware=str(profile), model=profiles.register(tprof), draft=dkey, quant=quant,
                     draft_quant=dquant, capacity=row.n_slots)


def profile_miss_costs(row: Row, profile: Path, target: Path, draft: Path):
    """spac's miss rule on the profile's costs, the ones the replay decides by (the session's own
    are its calibration's unit costs): the live row then makes the choices the prediction models,
    so that only the cost model is under test."""
    from orchestrator.policies.cache import ReuseCredited
    from orchestrator.runtime.native import MissCosts

    c = sim_config(row, profile, target, draft).costs()
    return MissCosts(upload_s=c.fetch_s, sync_s=c.sync_s, horizon_tokens=ReuseCredited().horizon,
                     host_s=c.cpu_expert_s, device_s=c.gpu_expert_s)


def predict(row: Row, profile: Path, target: Path, draft: Path) -> None:
    """Replay each run's trace with the measured profile, the same policy and slot count."""
    from orchestrator.policies import make_policy
    from orchestrator.sim.simulator import Simulator

    config = sim_config(row, profile, target, draft)
    for run in row.runs:
        sim = Simulator(run.trace, replace(config, warm_up_steps=int(run.trace.meta.get("warm_up_steps", 0))))
        r = sim.run(make_policy(POLICIES[row.policy]))
        run.predicted_s = r.time_s
        run.sim = {"steps": r.n_steps, "tokens": r.tokens, "hit": r.hit_rate, "rows": run.trace.n_rows,
                   "hits": r.hit_rate * run.trace.n_rows,
                   "copies": round(r.bytes_moved / sim.costs.expert_bytes)}


def overlap_rows(device: str, tmp: Path, repeats: int) -> list[dict]:
    """bench_overlap.py's rows (synthetic OLMoE layers, Q4_0, non-expert weights on the host, a
    verify pass of 9 tokens, τ giving the device about half the activations), timed, and
    predicted from a profile measured on the same file in that layout."""
    import numpy as np

    import bench_overlap as bo

    from orchestrator.runtime.llm import Model
    from orchestrator.cli.profile_measure import measure
    from orchestrator.sim import profiles
    from orchestrator.gguf_files.synthetic_models import PRESETS

    cfg = PRESETS["olmoe-1b-7b"]
    path = bo.synthetic_layers(tmp, "olmoe-1b-7b", 4)
    prof = measure(path, device, 1, layers_on_device=False, repack="off", skip_absent=True,
                   progress=lambda s: print(f"  overlap profile: {s}", file=sys.stderr, flush=True))
    model = Model(path, repack="off")
    try:
        freq = bo.routing_freq(model, 1, cfg.n_expert, cfg.n_expert_used)
        utility = bo.utility_from_share(freq)
        n_layer = freq.shape[0]
        half = np.full(n_layer, bo.HALF)
        slot_bytes = 3 * cfg.n_ff_exp * cfg.n_embd // 32 * 18

        def make(name, tau, **kw):
            return bo.Config(name, model, path, device, utility, tau, slot_bytes, 1, **kw)

        configs = [make("all-host", None), make("serial (per-matmul graph)", half, split_graph="per-matmul"),
                   make("overlapped", half), make("host half alone", half, only_half="host"),
                   make("device half alone", half, only_half="device")]
        try:
            bo.rotate(configs, repeats)
            measured = {c.name: c.median_ms() / 1e3 for c in configs}
        finally:
            for c in configs:
                c.close()
    finally:
        model.close()
    tprof, quant = profiles.from_gguf(path)
    costs = profiles.CostModel.from_measured(prof, tprof, quant=quant)
    n = len(bo.VERIFY)
    resident = utility >= half[:, None]
    used = freq > 0
    ne = costs.fixed_pass_time(n) + n_layer * costs.dense_layer_time(n)
    dev = np.array([costs.gpu_expert_s(freq[m][used[m] & resident[m]]).sum() for m in range(n_layer)])
    host = np.array([costs.cpu_expert_s(freq[m][used[m] & ~resident[m]]).sum() for m in range(n_layer)])
    every = np.array([costs.cpu_expert_s(freq[m][used[m]]).sum() for m in range(n_layer)])
    c = costs.sync_s
    # the per-matmul graph crosses for each of gate/up (one input, two outputs) and down (one
    # each way): five one-way copies, 2.5 round trips, and its halves run one after the other
    predicted = {"all-host": ne + every.sum(), "serial (per-matmul graph)": ne + (dev + host + 2.5 * c).sum(),
                 "overlapped": ne + np.maximum(dev + c, host).sum(), "host half alone": ne + host.sum(),
                 "device half alone": ne + (dev + c).sum()}
    return [{"row": f"overlap bench: {k}", "predicted_s": predicted[k], "measured_s": measured[k]} for k in measured]


def keep(out: Path, rows: list[Row], profile: Path, overlap: list, target: Path, draft: Path) -> None:
    """What --replay needs: the profile, each row's trace and measured numbers, the overlap rows."""
    out.mkdir(parents=True, exist_ok=True)
    if Path(profile).resolve() != (out / "profile.toml").resolve():
        (out / "profile.toml").write_text(Path(profile).read_text())
    for i, r in enumerate(rows):
        for j, run in enumerate(r.runs):
            run.trace.save(out / f"row{i}-run{j}.npz")
    (out / "live.json").write_text(json.dumps({
        "target": str(target), "draft": str(draft), "overlap": overlap,
        "rows": [{"budget": r.budget, "policy": r.policy, "speculative": r.speculative, "n_slots": r.n_slots,
                  "runs": [{"tokens": run.tokens, "seconds": run.seconds, "device_tokens": run.device_tokens,
                            "host_tokens": run.host_tokens, "copies": run.copies, "texts": run.texts}
                           for run in r.runs]} for r in rows]}, indent=1))


def replay(args, command: str) -> None:
    """Predict the kept live rows again (a changed cost model, the same measurements)."""
    from orchestrator.sim.trace import read_trace

    data = json.loads((args.replay / "live.json").read_text())
    rows = []
    for i, r in enumerate(data["rows"]):
        row = Row(r["budget"], r["policy"], r["speculative"], n_slots=r["n_slots"],
                  runs=[Run(trace=read_trace(args.replay / f"row{i}-run{j}.npz"), **run) for j, run in enumerate(r["runs"])])
        predict(row, args.replay / "profile.toml", Path(data["target"]), Path(data["draft"]))
        rows.append(row)
    from orchestrator.sim import profiles

    report(rows, data["overlap"], args, command, Path(data["target"]), Path(data["draft"]),
           profiles.read_measured(args.replay / "profile.toml"), machine=f"replayed from {args.replay}")


def ranking_checks(rows: list[Row]) -> list[tuple[str, str, str, bool]]:
    """Every pair of rows that differ in exactly one factor: (a, b, the measured order, whether the
    prediction agrees). The runs order a pair when every run of one is faster than every run of
    the other; where their ranges overlap the measurement finds them alike ("tie"), and the
    prediction agrees when it puts them apart by no more than the measured ranges allow (the
    larger of the two rows' spreads, fastest over slowest run)."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if (a.budget != b.budget) + (a.policy != b.policy) + (a.speculative != b.speculative) != 1:
                continue
            (a_lo, a_hi), (b_lo, b_hi) = a.measured_range, b.measured_range
            if a_lo > b_hi or b_lo > a_hi:
                order = ">" if a_lo > b_hi else "<"
                ok = (a.predicted > b.predicted) == (order == ">")
            else:
                order = "tie"
                spread = max(a_hi / a_lo, b_hi / b_lo)
                ok = max(a.predicted, b.predicted) / min(a.predicted, b.predicted) <= spread
            out.append((a.name, b.name, order, ok))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("-m", "--model", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("-md", "--model-draft", type=Path, default=DEFAULT_DRAFT)
    ap.add_argument("-n", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                    help=f"live policies, of {', '.join(POLICIES)} (llama-moe-cache: llama.cpp's cache, patch 0023; "
                         "spac-reuse: spac's miss rule, patch 0031)")
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3,
                    help="live runs of every row, interleaved (their spread decides which rows differ)")
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("--profile", type=Path, help="reuse this measured profile instead of measuring one")
    ap.add_argument("--profile-repeats", type=int, default=9,
                    help="timed passes per point of the profile (spac sim profile measure's --repeats; 3 there)")
    ap.add_argument("--keep-profile", type=Path, help="also keep the measured profile here")
    ap.add_argument("--json", type=Path, help="also write the rows here (a JSON list of objects)")
    ap.add_argument("--no-overlap", action="store_true", help="leave out the overlap bench's rows")
    ap.add_argument("--no-live", action="store_true", help="leave out the live rows (the overlap rows only)")
    ap.add_argument("--overlap-repeats", type=int, default=7)
    ap.add_argument("--keep", type=Path, help="keep the profile, the traces and the live results in this directory")
    ap.add_argument("--replay", type=Path, help="predict again from a --keep directory (no live run, no measurement)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave the host and the RPC server to the scheduler (default: one CPU each)")
    ap.add_argument("--device", default="rpc",
                    help="pool device: 'rpc' (an RPC server on 127.0.0.1 with 1 thread, the stand-in GPU) or a "
                         "ggml device name such as CUDA0")
    ap.add_argument("-t", "--threads", type=int, default=1, help="host threads (profile and live rows)")
    ap.add_argument("--no-mmap", dest="mmap", action="store_false",
                    help="load the target as --no-mmap does (profile and live rows): on a GPU the pool then copies "
                         "from pinned host memory (patch 0017)")
    args = ap.parse_args()

    target, draft = args.model, args.model_draft
    if not target.exists():
        print(f"writing the memory-bound target {target} (once)", file=sys.stderr)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_memory_bound_target.py"), str(target)], check=True)

    from orchestrator.runtime.rpc import rpc_device
    from orchestrator.cli.profile_measure import cpu_name, measure, measure_to_file  # noqa: F401
    from orchestrator.sim import profiles

    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    load0 = os.getloadavg()
    cpu0, steal0, own0, t0 = machine_cpu_seconds(), steal_seconds(), own_cpu_seconds(), time.monotonic()
    policies = [p.strip() for p in args.policies.split(",")]
    if unknown := [p for p in policies if p not in POLICIES]:
        sys.exit(f"--policies: unknown {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    rows = [] if args.no_live else [Row(b, p, spec) for b in BUDGETS for p in policies for spec in (True, False)]
    overlap = []
    if args.replay:
        return replay(args, command)
    pool_device = rpc_device(n_threads=1) if args.device == "rpc" else contextlib.nullcontext(args.device)
    with tempfile.TemporaryDirectory() as tmp, pool_device as device:  # noqa: SIM117
        tmp = Path(tmp)
        pinned = pin_compute_units() if args.device == "rpc" and args.pin else "not pinned"
        profile = args.profile
        if not args.no_overlap:
            overlap = overlap_rows(device, tmp, args.overlap_repeats)
        measured = []  # the profiles this run measures: before the live rows and after them

        def measure_profile(when: str) -> None:
            t = time.monotonic()
            measured.append(measure(target, device, args.threads, draft, repeats=args.profile_repeats, mmap=args.mmap,
                                    progress=lambda s: print(f"  profile ({when}): {s}", file=sys.stderr, flush=True)))
            print(f"profile ({when}) measured in {time.monotonic() - t:.0f} s", file=sys.stderr)

        if profile is None and rows:
            profile = args.keep_profile or tmp / "profile.toml"
            measure_profile("before")
            profiles.write_measured(profile, measured[0], f"measured by bench/bench_sim_truth.py on {target.name}")
        for repeat in range(args.repeats):
            for row in rows:
                t = time.monotonic()
                run = run_live(row, target, draft, device, args, tmp / "calibration.json", profile)
                print(f"  live {row.name}, run {repeat + 1}/{args.repeats}: {run.measured:.2f} tok/s "
                      f"({time.monotonic() - t:.0f} s)", file=sys.stderr, flush=True)
        if measured:
            # two measurements of the machine, bracketing the live rows: their mean. One profile's
            # expert tables moved by up to 29% between two measurements minutes apart
            measure_profile("after")
            profiles.write_measured(profile, profiles.average_measured(measured),
                                    f"measured by bench/bench_sim_truth.py on {target.name}, before and after "
                                    "the live rows: their mean")
        if args.keep:
            keep(args.keep, rows, profile, overlap, target, draft)
            for when, prof in zip(("before", "after"), measured):
                profiles.write_measured(args.keep / f"profile-{when}.toml", prof, f"measured {when} the live rows")
        wall = time.monotonic() - t0
        load1 = os.getloadavg()
        cpu1, steal1, own_before = machine_cpu_seconds(), steal_seconds(), own_cpu_seconds()
        for row in rows:
            predict(row, profile, target, draft)
        predicting = own_cpu_seconds() - own_before
        prof = profiles.read_measured(profile) if rows else None
    # after the RPC server has exited: its CPU time is then counted as ours (a waited-for child)
    other = (cpu1 - cpu0) - (own_cpu_seconds() - own0 - predicting)

    n_cpu = os.cpu_count() or 1
    report(rows, overlap, args, command, target, draft, prof,
           machine=f"{cpu_name()}, {n_cpu} cores, {pinned}; load average {load0[0]:.2f} at start, {load1[0]:.2f} at the end; "
                   f"other processes used {max(other, 0):.0f} CPU-s of {wall * n_cpu:.0f} during the {wall:.0f} s run; "
                   f"the hypervisor took {steal1 - steal0:.0f} CPU-s ({(steal1 - steal0) / (wall * n_cpu):.0%}, steal time)")


def report(rows: list[Row], overlap: list, args, command: str, target: Path, draft: Path, prof, machine: str) -> None:
    """The tables, the checks, the machine line and the command; --json."""
    if overlap:
        print("overlap bench (bench/bench_overlap.py's setting: 4 synthetic OLMoE-1B-7B layers, Q4_0, one verify "
              "pass of 9 tokens, τ = 5; profile measured on that file with its layers on the host)")
        print("| row | measured ms | predicted ms | error |")
        print("|---|---|---|---|")
        for o in overlap:
            print(f"| {o['row'].split(': ')[1]} | {1e3 * o['measured_s']:.1f} | {1e3 * o['predicted_s']:.1f} | "
                  f"{100 * (o['predicted_s'] / o['measured_s'] - 1):+.1f}% |")
    if not rows:
        print(f"machine: {machine}")
        print(f"command: {command}")
        return
    device = "RPC device 1 thread on 127.0.0.1" if args.device == "rpc" else f"device {args.device}"
    print(f"target {target.name}, draft {draft.name}, {args.prompts} prompts × {args.n} tokens, greedy; "
          f"host {args.threads} thread(s), {device}; profile {prof.name} measured on {prof.measured_with}")
    n_runs = len(rows[0].runs)
    print(f"tok/s over {n_runs} run(s) of each row (interleaved), the runs' range in brackets")
    print("| row | slots | measured tok/s | predicted tok/s | error | steps | hit measured / simulated | "
          "copies measured / simulated |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        err = r.predicted / r.measured - 1
        lo, hi = r.measured_range
        sim_hit = r.sim_total("hits") / r.sim_total("rows")
        print(f"| {r.name} | {r.n_slots} | {r.measured:.2f} [{lo:.2f}, {hi:.2f}] | {r.predicted:.2f} | {100 * err:+.1f}% | "
              f"{r.sim_total('steps')} | {r.measured_hit:.2f} / {sim_hit:.2f} | {r.total('copies')} / "
              f"{r.sim_total('copies')} |")
    errors = [abs(r.predicted / r.measured - 1) for r in rows]
    checks = ranking_checks(rows)
    ties = sum(order == "tie" for _, _, order, _ in checks)
    print(f"largest error {100 * max(errors):.1f}%, mean |error| {100 * sum(errors) / len(errors):.1f}%; "
          f"ranking: {sum(ok for *_, ok in checks)}/{len(checks)} one-factor pairs agree ({len(checks) - ties} "
          f"ordered by the runs, {ties} alike within their spread)")
    for a, b, order, ok in checks:
        rel = {">": "faster than", "<": "slower than", "tie": "alike with"}[order]
        print(f"  {'agrees ' if ok else 'DIFFERS'}: {a} measured {rel} {b}")
    if rows[0].texts:
        first = rows[0].texts
        differ = [(r, run) for r in rows for run in r.runs if run.texts != first]
        print(f"outputs: {'every run of every row identical' if not differ else 'RUNS DIFFER'}")
        for r, run in differ:
            p = next(i for i, (a, b) in enumerate(zip(run.texts, first)) if a != b)
            a, b = run.texts[p], first[p]
            c = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"  {r.name} differs from {rows[0].name} in prompt {p} at character {c}: "
                  f"{a[max(c - 20, 0):c + 20]!r} vs {b[max(c - 20, 0):c + 20]!r}")
    print(f"machine: {machine}")
    print(f"command: {command}")
    if args.json:
        args.json.write_text(json.dumps([
            {"row": r.name, "budget": r.budget, "policy": r.policy, "speculative": r.speculative, "slots": r.n_slots,
             "predicted_tok_s": r.predicted, "measured_tok_s": r.measured, "error": r.predicted / r.measured - 1,
             "measured_runs_tok_s": [run.measured for run in r.runs], "tokens": r.total("tokens"),
             "seconds": r.total("seconds"), "measured_hit": r.measured_hit, "copies": r.total("copies"),
             **{f"sim_{k}": r.sim_total(k) for k in r.runs[0].sim}}
            for r in rows] + [{**o, "predicted_tok_s": None, "measured_tok_s": None,
                               "error": o["predicted_s"] / o["measured_s"] - 1} for o in overlap], indent=1) + "\n")


if __name__ == "__main__":
    main()
