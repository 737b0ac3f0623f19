"""What every `spac` command shares with the user: one-line errors, safe output files, and the
option block of `generate`, `chat`, `calibrate` (and `serve`, `trace record`) declared once.

    from orchestrator.cli.options import RunOptions, run_options
    from orchestrator.cli.setup import open_session

    @app.command()
    @run_options("model", "sampling")         # groups: "model", "sampling", "ablations" (default: all)
    def serve(port: int = 8080, *, opts: RunOptions) -> None:
        session, setup = open_session(opts)   # bad file/device/budget: one line, exit 2
        print(setup.notes)                     # header lines: why no draft, where the pool went
        session.generate(prompt, 128, opts.stop, opts.sampling())

`OPTIONS` holds each knob once (flags, type, default, help, in llama.cpp's names);
`run_options` adds the chosen groups to a typer command and hands it one checked `RunOptions`
(`RunOptions.from_cli`: every value valid, --expert-budget parsed once into a `Budget`, the seed
drawn once when --seed < 0 so it can be reported; --device and --expert-budget made once into
the pool's list of `PoolDevice`s). `setup.session_setup` turns the options into a session's
config. Also:

    fail("--temp must be a finite number")      # "spac: error: ..." on stderr, exit 2
    check_output(dst, force, inputs=[src])      # the output is not the input, nor exists unless --force

Why ~330 lines: every shared flag, its check and its error text sit in one table here so that
no command re-declares them; what the options make (cli/setup.py), the placement
(runtime/placement.py) and the commands (cli/main.py) are separate.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import os
import secrets
import sys
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Optional

import psutil
import typer

from orchestrator.decoding.sampling import SamplingParams
from orchestrator.runtime.pool import Budget, PoolDevice, StreamPrefill
from orchestrator.runtime.rpc import parse_endpoint
from orchestrator.policies.spac import Ablations

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C'd program


def fail(message: str, code: int = EXIT_USAGE):
    """One line `spac: error: ...` on stderr (never wrapped), then exit `code`."""
    sys.stderr.write(f"spac: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output(dst: Path, force: bool = False, inputs: Iterable[Path] = ()) -> None:
    """Refuse (exit 2) an output path that is one of the inputs (even with --force), or that
    exists unless force."""
    for src in inputs:
        if _same_file(Path(src), dst) or Path(src).resolve() == dst.resolve():
            fail(f"output {dst} is the input file; give another output path")
    if dst.is_dir():
        fail(f"output {dst} is a directory")
    if dst.exists() and not force:
        fail(f"{dst} exists; pass --force to overwrite it")
    if not dst.parent.is_dir():
        fail(f"cannot write {dst}: directory {dst.parent} does not exist")


# ----------------------------------------------------------------------------- the shared option block

def default_threads(sys_devices: Path = Path("/sys/devices")) -> int:
    """llama.cpp's default -t (`common_cpu_get_num_math`): one thread per physical core. Its
    matmul threads run in lockstep, so the slowest sets the pace: a second hardware thread on a
    core (sharing the core's vector units) or an efficiency core of a hybrid CPU slows them all.
    On Linux, as llama.cpp: the distinct sibling sets of the CPUs, of the performance cores only
    where the kernel lists them (hybrid Intel); elsewhere psutil's physical cores. No cap: the
    former min(cpu_count, 8) counted hardware threads and left the cores of big machines idle."""
    siblings = set()
    for cpu in _cpu_list(sys_devices / "cpu_core" / "cpus") or itertools.count():
        try:
            siblings.add((sys_devices / f"system/cpu/cpu{cpu}/topology/thread_siblings").read_text().strip())
        except OSError:
            break
    if siblings:
        return len(siblings)
    return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)


def _cpu_list(path: Path) -> list[int]:
    """A kernel CPU list file ("0-7,16-23") as CPU numbers; [] when absent or unreadable."""
    try:
        spans = [span.partition("-") for span in path.read_text().strip().split(",")]
        return [c for a, _, b in spans for c in range(int(a), int(b or a) + 1)]
    except (OSError, ValueError):
        return []


_DEFAULT_THREADS = default_threads()


@dataclass(frozen=True)
class _Opt:
    group: str
    type: object
    default: object
    option: typer.models.OptionInfo


# one declaration per knob: name → group, type, default, flags and help (llama.cpp's names)
OPTIONS: dict[str, _Opt] = {
    "model": _Opt("model", Optional[Path], None, typer.Option(
        "-m", "--model", help="target MoE GGUF \\[default: the shipped model, orchestrator/shipped_models/MANIFEST.json]", show_default=False)),
    "model_draft": _Opt("model", Optional[Path], None, typer.Option(
        "-md", "--model-draft", help="draft GGUF (same vocabulary) \\[default: the shipped draft of the shipped target]",
        show_default=False)),
    "draft": _Opt("model", Optional[str], None, typer.Option(
        "--draft", help="pool: the target itself drafts, routed only to the experts in the device pool (costs its "
        "KV cache only); mtp: the target's multi-token-prediction head (Qwen3.5/3.6-MoE, Qwen3-Next files "
        "converted with it); none: no speculation \\[default: -md, else the shipped draft of the shipped target, "
        "else pool when the expert pool is on]", show_default=False)),
    "draft_max": _Opt("model", int, 8, typer.Option(
        "--spec-draft-n-max", "--draft-max",
        help="most draft tokens per verification step; greedy: γ adapts below it every step (MoE-SpeQ's governor), "
        "sampling: γ is this bound (the same seed gives the same text); 0 = no draft")),
    "expert_budget": _Opt("model", Optional[str], None, typer.Option(
        "--expert-budget", help="device pool: bytes (512M, 2GiB) or % of all experts; several devices: one value "
        "each (25%,50%), a % being of that device's layers' experts, or one for all \\[default: the free device "
        "memory left after the non-expert weights, the KV cache and a margin; 25% on --device CPU]",
        show_default=False)),
    "device": _Opt("model", Optional[str], None, typer.Option(
        "--device", help="pool device: a ggml device name (CUDA0, ...) or CPU (the test stand-in); a list "
        "(CUDA0,CUDA1 or RPC0,RPC1) splits the layers over the devices as llama.cpp does, each holding the pool "
        "of its own layers' experts \\[default: every GPU ggml sees, as llama.cpp (an RPC server's device is one); "
        "none: the pool is off]", show_default=False)),
    "rpc": _Opt("model", Optional[str], None, typer.Option(
        "--rpc", help="RPC servers HOST:PORT,... (spac rpc-server, llama.cpp's rpc-server): their devices join "
        "the list (RPC0, ...), for --device", show_default=False)),
    "n_gpu_layers": _Opt("model", str, "auto", typer.Option(
        "-ngl", "--n-gpu-layers", help="target layers whose non-expert weights go to the GPU: a number, 'all' or "
        "'auto' (what fits in free device memory)")),
    "threads": _Opt("model", int, _DEFAULT_THREADS, typer.Option(
        "-t", "--threads", help="CPU threads (default: the physical cores, as llama.cpp); <= 0 = the default")),
    "repack": _Opt("model", str, "auto", typer.Option(
        "--repack", help="host weights' layout: auto (per tensor type, measured on this CPU: the repacked layout, "
        "spac's CPU_EXACT for Q4_0/Q8_0/IQ4_NL/Q4_K/Q5_K/Q6_K and llama.cpp's for the rest, where it decodes faster, "
        "the file's plain layout for prompts where that is faster; a GPU run's experts: CPU_EXACT with plain twins "
        "for its prompts, or plain), on (each weight in the first layout that takes it, as llama.cpp's --repack 1: CPU_EXACT "
        "first; with a GPU as llama.cpp's --no-host, so a prompt's host experts run on the CPU), off (the file's layout); "
        "with --no-exact, llama.cpp's layouts only (no CPU_EXACT)")),
    "ctx_size": _Opt("model", int, 0, typer.Option("-c", "--ctx-size", help="context size, 0 = the model's")),
    "ubatch_size": _Opt("model", str, "auto", typer.Option(
        "-ub", "--ubatch-size", help="tokens per prompt-processing pass (llama.cpp's -b and -ub at once), or auto: "
        "llama.cpp's 512, longer with a streamed prefill, which copies each non-resident expert once per pass, as far "
        "as the pass's compute buffer fits (the run header says the choice; spac sim prefill)")),
    "expert_engine": _Opt("model", Optional[bool], None, typer.Option(
        "--engine/--no-engine", help="expert pool on/off \\[default: on when built and a pool device exists]",
        show_default=False)),
    "stream_prefill": _Opt("model", str, "auto", typer.Option(
        "--stream-prefill", help="prompt passes of more than 64 tokens compute their experts on the pool device: "
        "ahead (copy every non-resident expert of the next layer while one computes), used (copy the experts a "
        "layer's router chose, once it has run), off (llama.cpp's prefill), auto (ahead on a GPU or RPC pool, off "
        "on --device CPU)")),
    "exact": _Opt("model", bool, True, typer.Option(
        "--exact/--no-exact", help="host matmuls and attention of up to 32 tokens (--draft-max + 1 if more) compute every row as "
        "one token does, so speculative greedy output is exactly target-only's on the host (a verify pass's dense "
        "weights then take one-row kernels); --no-exact: llama.cpp's kernels in llama.cpp's layouts, as stock llama.cpp "
        "computes, faster verify passes whose rounding may turn a near-tie into another token")),
    "check_tensors": _Opt("model", bool, False, typer.Option(
        "--check-tensors", help="check the model's tensor data for NaN/Inf on load (as llama.cpp's)")),
    "mmap": _Opt("model", bool, True, typer.Option(
        "--mmap/--no-mmap", help="map the model file (llama.cpp's default); --no-mmap reads the host weights into "
        "memory: with a GPU into its pinned host buffers, which the expert pool and op offload copy from several "
        "times faster (H100: 55 against 6.3 GB/s); without a GPU it only costs the plain-layout prompt kernels "
        "of repacked types (they read the mapping)")),
    "pin_mapping": _Opt("model", bool, False, typer.Option(
        "--pin-mapping", help="register the mapped file's experts as the pool GPU's pinned host memory, so that the pool "
        "copies them at the pinned rate without --no-mmap's second copy of the weights; reads in and pins that "
        "whole range at load (off by default: not yet measured on a GPU); said in the log where the device cannot")),
    "recalibrate": _Opt("model", bool, False, typer.Option("--recalibrate", help="measure the unit costs again")),
    "verbose": _Opt("model", bool, False, typer.Option("--verbose", help="llama.cpp logs")),
    "temp": _Opt("sampling", float, 0.8, typer.Option("--temp", help="temperature, 0 = greedy")),
    "top_k": _Opt("sampling", int, 40, typer.Option("--top-k", help="top-k, 0 = off")),
    "top_p": _Opt("sampling", float, 0.95, typer.Option("--top-p", help="top-p, 1 = off")),
    "seed": _Opt("sampling", int, -1, typer.Option("--seed", help="RNG seed, -1 = random (the seed used is reported)")),
    "stop": _Opt("sampling", Optional[list[str]], None, typer.Option("--stop", help="stop string (repeatable)")),
    **{f.name: _Opt("ablations", bool, False, typer.Option("--" + f.name.replace("_", "-"),
                                                            help="ablation: " + f.metadata["help"]))
       for f in fields(Ablations)},
}


@dataclass(frozen=True)
class RunOptions:
    """The shared options, checked once (`from_cli`): every value here is valid."""

    model: Path | None = None
    model_draft: Path | None = None
    draft: str | None = None     # None (auto), "pool", "mtp" or "none"
    draft_max: int = 8
    # --device and --expert-budget: one entry per device with its budget (a name None: not given)
    pool: tuple[PoolDevice, ...] = (PoolDevice(),)
    rpc: tuple[str, ...] = ()    # RPC servers' HOST:PORT
    n_gpu_layers: str = "auto"  # "auto", "all" or a number
    threads: int = _DEFAULT_THREADS
    repack: str = "auto"         # auto | on | off (orchestrator.runtime.host_layout)
    ctx_size: int = 0
    ubatch_size: int = 0         # 0: auto (the placement's choice, orchestrator.runtime.ubatch)
    expert_engine: bool | None = None
    stream_prefill: StreamPrefill = StreamPrefill.AUTO
    exact: bool = True
    check_tensors: bool = False
    mmap: bool = True
    pin_mapping: bool = False
    recalibrate: bool = False
    verbose: bool = False
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0                # the seed used (a random one when --seed < 0)
    seed_random: bool = True
    stop: tuple[str, ...] = ()
    ablations: tuple[str, ...] = ()  # names of the Ablations switches that are on

    @classmethod
    def from_cli(cls, **values) -> RunOptions:
        """Check and convert what typer parsed; a bad value is `fail` naming its flag (exit 2)."""
        v = {n: values.get(n, spec.default) for n, spec in OPTIONS.items()}
        for name, flag in (("temp", "--temp"), ("top_p", "--top-p")):
            if not math.isfinite(v[name]):
                fail(f"{flag} must be a finite number, got {v[name]}")
        if not 0.0 <= v["top_p"] <= 1.0:
            fail(f"--top-p must be in [0, 1], got {v['top_p']}")
        if v["draft_max"] < 0:
            fail(f"--spec-draft-n-max (--draft-max) must be >= 0 (0: no draft), got {v['draft_max']}")
        if v["draft"] is not None:
            v["draft"] = v["draft"].strip().lower()
            if v["draft"] not in ("pool", "mtp", "none"):
                fail(f"--draft must be pool, mtp or none (or -md FILE for a draft model), got {v['draft']!r}")
            if v["draft"] in ("pool", "mtp") and v["model_draft"] is not None:
                fail(f"--draft {v['draft']} and -md/--model-draft are exclusive: the {v['draft']} draft is the target's own")
        if v["pin_mapping"] and not v["mmap"]:
            fail("--pin-mapping pins the mapped file, and --no-mmap maps none (with a GPU its copy is pinned already)")
        v["repack"] = str(v["repack"]).strip().lower()
        if v["repack"] not in ("auto", "on", "off"):
            fail(f"--repack must be auto, on or off, got {v['repack']!r}")
        try:
            stream = StreamPrefill(str(v["stream_prefill"]).strip().lower())
        except ValueError:
            fail(f"--stream-prefill must be auto, ahead, used or off, got {v['stream_prefill']!r}")
        ub = str(v["ubatch_size"]).strip().lower()
        if ub == "auto":
            ubatch = 0
        elif ub.isdigit() and int(ub) >= 1:
            ubatch = int(ub)
        else:
            fail(f"-ub/--ubatch-size must be auto or a number >= 1, got {v['ubatch_size']!r}")
        if v["ctx_size"] < 0:
            fail(f"-c/--ctx-size must be >= 0 (0: the model's), got {v['ctx_size']}")
        if v["top_k"] < 0:
            fail(f"--top-k must be >= 0 (0: off), got {v['top_k']}")
        ngl = str(v["n_gpu_layers"]).strip().lower()
        if ngl not in ("auto", "all") and not (ngl.isdigit()):
            fail(f"-ngl/--n-gpu-layers must be a number >= 0, 'all' or 'auto', got {v['n_gpu_layers']!r}")
        try:
            budgets = [Budget.parse(b) for b in (v["expert_budget"] or "").split(",")] if v["expert_budget"] else [Budget()]
        except ValueError as e:
            fail(str(e))
        devices = [d.strip() for d in (v["device"] or "").split(",")] if v["device"] is not None else [None]
        if "" in devices or len(set(devices)) < len(devices):
            fail(f"--device {v['device']!r}: give distinct device names, comma-separated")
        devices = ["CPU" if d and d.upper() == "CPU" else d for d in devices]
        if len(devices) > 1 and "CPU" in devices:
            fail("--device: CPU (the test stand-in) cannot be one of several devices")
        if len(budgets) > 1 and len(budgets) != len(devices):
            fail(f"--expert-budget: {len(budgets)} values for {len(devices)} device(s) (give one, or one per --device)")
        pool = tuple(PoolDevice(d, b) for d, b in zip(devices, budgets * len(devices) if len(budgets) == 1 else budgets))
        rpc = tuple(e.strip() for e in (v["rpc"] or "").split(",") if e.strip())
        for endpoint in rpc:
            try:
                parse_endpoint(endpoint)
            except ValueError as e:
                fail(f"--rpc: {e}")
        threads = v["threads"] if v["threads"] > 0 else _DEFAULT_THREADS  # llama.cpp: <= 0 = the default
        seed, seed_random = v["seed"], v["seed"] < 0
        if seed_random:
            seed = secrets.randbits(32)
        for path, flag in ((v["model"], "-m/--model"), (v["model_draft"], "-md/--model-draft")):
            if path is not None and str(path) == "":
                fail(f"{flag} is empty")
        return cls(model=v["model"], model_draft=v["model_draft"], draft=v["draft"], draft_max=v["draft_max"], pool=pool, rpc=rpc, n_gpu_layers=ngl, threads=threads, repack=v["repack"], ctx_size=v["ctx_size"], ubatch_size=ubatch, expert_engine=v["expert_engine"],
                   stream_prefill=stream, exact=v["exact"],
                   check_tensors=v["check_tensors"], mmap=v["mmap"], pin_mapping=v["pin_mapping"], recalibrate=v["recalibrate"], verbose=v["verbose"],
                   temp=v["temp"], top_k=v["top_k"], top_p=v["top_p"], seed=seed, seed_random=seed_random,
                   stop=tuple(v["stop"] or ()), ablations=tuple(n for n in OPTIONS if n.startswith("no_") and v[n]))

    def __post_init__(self) -> None:
        object.__setattr__(self, "stream_prefill", StreamPrefill(self.stream_prefill))  # RunOptions(stream_prefill="off")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temp, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

    def ablation_switches(self):
        return Ablations(**{n: True for n in self.ablations})


def run_options(*groups: str):
    """Decorator for a typer command with a parameter `opts: RunOptions`: the command gets the
    shared flags of `groups` ("model", "sampling", "ablations"; default all three) as its own
    parameters, and is called with `opts=RunOptions.from_cli(...)` instead of them.

        @app.command()
        @run_options("model", "sampling")
        def serve(port: int = 8080, *, opts: RunOptions) -> None: ...
    """
    groups = groups or ("model", "sampling", "ablations")
    names = [n for n, spec in OPTIONS.items() if spec.group in groups]

    def decorate(fn):
        # eval_str, not typing.get_type_hints: on 3.10 that wraps a None default's Annotated in Optional
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=OPTIONS[n].default,
                                    annotation=Annotated[OPTIONS[n].type, OPTIONS[n].option]) for n in names]

        @functools.wraps(fn)
        def command(**kwargs):
            opts = RunOptions.from_cli(**{n: kwargs.pop(n) for n in names})
            return fn(**kwargs, opts=opts)

        params = own + shared
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
