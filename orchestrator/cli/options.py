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

Each flag is declared once (orchestrator/option.py's `option`, STYLE.md "vLLM's config"): the
session's own on `SessionConfig`'s fields, the CLI-only ones on `CliFlags` here, the ablation
switches on `Ablations`; `OPTIONS` (flags, type, default, help, check, in llama.cpp's names) is
made from them. `run_options` adds the chosen groups to a typer command and hands it one checked
`RunOptions` (`RunOptions.from_cli`: every value valid, --expert-budget parsed once into a
`Budget`, the seed drawn once when --seed < 0 so it can be reported; --device and
--expert-budget made once into the pool's list of `PoolDevice`s; the session's own options as
they are, `RunOptions.config`). `setup.session_setup` fills in the rest of that config. Also:

    fail("--temp must be a finite number")      # "spac: error: ..." on stderr, exit 2
    check_output(dst, force, inputs=[src])      # the output is not the input, nor exists unless --force

Why ~350 lines: every CLI-only flag and the checks across flags sit here so that no command
re-declares them; what the options make (cli/setup.py), the placement
(runtime/placement.py) and the commands (cli/main.py) are separate.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import os
import secrets
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import psutil
import typer

from orchestrator.decoding.draft import DraftKind
from orchestrator.decoding.sampling import SamplingParams
from orchestrator.decoding.speculative import SessionConfig
from orchestrator.option import Option, declared, option
from orchestrator.runtime.pool import Budget, PoolDevice
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


@dataclass
class CliFlags:
    """The flags only the front end reads: session_setup resolves them (the models, the pool's
    devices and budgets, the layer split, the ubatch) into the SessionConfig; and the sampling."""

    model: Optional[Path] = option("-m", "--model", default=None, show_default=False,
                                   help="target MoE GGUF \\[default: the shipped model, orchestrator/shipped_models/MANIFEST.json]")
    model_draft: Optional[Path] = option(
        "-md", "--model-draft", default=None, show_default=False,
        help="draft GGUF (same vocabulary) \\[default: the shipped draft of the shipped target]")
    draft: Optional[str] = option("--draft", default=None, show_default=False, help=(
        "pool: the target itself drafts, routed only to the experts in the device pool (costs its "
        "KV cache only); mtp: the target's multi-token-prediction head (Qwen3.5/3.6-MoE, Qwen3-Next files "
        "converted with it); none: no speculation \\[default: -md, else the shipped draft of the shipped target, "
        "else mtp when the file has an MTP head, else pool when the expert pool is on]"))
    expert_budget: Optional[str] = option("--expert-budget", default=None, show_default=False, help=(
        "device pool: bytes (512M, 2GiB) or % of all experts; several devices: one value "
        "each (25%,50%), a % being of that device's layers' experts, or one for all \\[default: the free device "
        "memory left after the non-expert weights, the KV cache and a margin; 25% on --device CPU]"))
    device: Optional[str] = option("--device", default=None, show_default=False, help=(
        "pool device: a ggml device name (CUDA0, ...) or CPU (the test stand-in); a list "
        "(CUDA0,CUDA1 or RPC0,RPC1) splits the layers over the devices as llama.cpp does, each holding the pool "
        "of its own layers' experts \\[default: every GPU ggml sees, as llama.cpp (an RPC server's device is one); "
        "none: the pool is off]"))
    rpc: Optional[str] = option("--rpc", default=None, show_default=False, help=(
        "RPC servers HOST:PORT,... (spac rpc-server, llama.cpp's rpc-server): their devices join "
        "the list (RPC0, ...), for --device"))
    n_gpu_layers: str = option("-ngl", "--n-gpu-layers", default="auto", help=(
        "target layers whose non-expert weights go to the GPU: a number, 'all' or "
        "'auto' (what fits in free device memory)"))
    threads: int = option("-t", "--threads", default=_DEFAULT_THREADS,
                          help="CPU threads (default: the physical cores, as llama.cpp); <= 0 = the default")
    ubatch_size: str = option("-ub", "--ubatch-size", default="auto", help=(
        "tokens per prompt-processing pass (llama.cpp's -b and -ub at once), or auto: "
        "llama.cpp's 512, longer with a streamed prefill, which copies each non-resident expert once per pass, as far "
        "as the pass's compute buffer fits (the run header says the choice; spac sim prefill)"))
    temp: float = option("--temp", default=0.8, group="sampling", help="temperature, 0 = greedy")
    top_k: int = option("--top-k", default=40, group="sampling", help="top-k, 0 = off")
    top_p: float = option("--top-p", default=0.95, group="sampling", help="top-p, 1 = off")
    seed: int = option("--seed", default=-1, group="sampling", help="RNG seed, -1 = random (the seed used is reported)")
    stop: Optional[list[str]] = option("--stop", default=None, group="sampling", help="stop string (repeatable)")


@dataclass(frozen=True)
class _Opt:
    group: str
    type: object
    default: object
    option: typer.models.OptionInfo
    check: object = None  # the declaration's check: parsed value → stored value, ValueError → `fail`
    flags: tuple[str, ...] = ()


def _typer_option(name: str, f, opt: Option, hints: dict) -> _Opt:
    """A declared dataclass field (orchestrator.option) as a typer option of the same name."""
    default = f.default.value if isinstance(f.default, Enum) else f.default
    info = typer.Option(*opt.flags, help=opt.help, show_default=opt.show_default)
    return _Opt(opt.group, opt.cli_type or hints[name], default, info, opt.check, opt.flags)


def _declared_options() -> dict[str, _Opt]:
    """Every shared flag, from its one declaration: the CLI-only ones (CliFlags), the session's own
    (SessionConfig's fields declared with `option`), then one switch per Ablations field."""
    out = {}
    for cls in (CliFlags, SessionConfig):
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
        out.update((name, _typer_option(name, f, opt, hints)) for name, f, opt in declared(cls))
    return dict(sorted(out.items(), key=lambda kv: kv[1].group != "model"), **{
        f.name: _Opt("ablations", bool, False, typer.Option("--" + f.name.replace("_", "-"), help="ablation: " + f.metadata["help"]))
        for f in fields(Ablations)})


# name → group, type, default, flags, help, check: one declaration per knob (llama.cpp's names)
OPTIONS: dict[str, _Opt] = _declared_options()
SESSION_OPTIONS = frozenset(name for name, _, _ in declared(SessionConfig))


def _flags(name: str) -> str:
    return "/".join(OPTIONS[name].flags)


@dataclass(frozen=True)
class RunOptions:
    """The shared options, checked once (`from_cli`): every value here is valid. The session's own
    options (SessionConfig's declared fields) are `config`, as the flags gave them; the rest are
    what only the front end reads, which session_setup resolves into the session's config."""

    model: Path | None = None
    model_draft: Path | None = None
    draft: DraftKind | None = None  # None: chosen by resolve_models (-md, the shipped draft, else the MTP head or the pool draft)
    # --device and --expert-budget: one entry per device with its budget (a name None: not given)
    pool: tuple[PoolDevice, ...] = (PoolDevice(),)
    rpc: tuple[str, ...] = ()    # RPC servers' HOST:PORT
    n_gpu_layers: str = "auto"  # "auto", "all" or a number
    threads: int = _DEFAULT_THREADS
    ubatch_size: int = 0         # 0: auto (the placement's choice, orchestrator.runtime.ubatch)
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0                # the seed used (a random one when --seed < 0)
    seed_random: bool = True
    stop: tuple[str, ...] = ()
    ablations: tuple[str, ...] = ()  # names of the Ablations switches that are on
    config: SessionConfig = field(default_factory=lambda: SessionConfig(model=""))

    def __post_init__(self) -> None:
        if self.draft is not None:  # RunOptions.of(draft="none")
            object.__setattr__(self, "draft", DraftKind(self.draft))

    @classmethod
    def of(cls, **values) -> RunOptions:
        """RunOptions(...) taking the session's options by name too: RunOptions.of(model=m, n_ctx=512)."""
        own = {k: v for k, v in values.items() if k not in SESSION_OPTIONS}
        return cls(**own, config=SessionConfig(model="", **{k: v for k, v in values.items() if k in SESSION_OPTIONS}))

    def replace(self, **values) -> RunOptions:
        """dataclasses.replace, the session's options by name too."""
        config = dataclasses.replace(self.config, **{k: v for k, v in values.items() if k in SESSION_OPTIONS})
        return dataclasses.replace(self, **{k: v for k, v in values.items() if k not in SESSION_OPTIONS}, config=config)

    @classmethod
    def from_cli(cls, **values) -> RunOptions:
        """Check and convert what typer parsed; a bad value is `fail` naming its flag (exit 2)."""
        v = {n: values.get(n, spec.default) for n, spec in OPTIONS.items()}
        for name, spec in OPTIONS.items():  # the declarations' own checks
            if spec.check is not None:
                try:
                    v[name] = spec.check(v[name])
                except ValueError as e:
                    fail(f"{_flags(name)} {e}")
        for name, flag in (("temp", "--temp"), ("top_p", "--top-p")):
            if not math.isfinite(v[name]):
                fail(f"{flag} must be a finite number, got {v[name]}")
        if not 0.0 <= v["top_p"] <= 1.0:
            fail(f"--top-p must be in [0, 1], got {v['top_p']}")
        if v["draft"] is not None:
            v["draft"] = v["draft"].strip().lower()
            if v["draft"] not in ("pool", "mtp", "none"):
                fail(f"--draft must be pool, mtp or none (or -md FILE for a draft model), got {v['draft']!r}")
            if v["draft"] in ("pool", "mtp") and v["model_draft"] is not None:
                fail(f"--draft {v['draft']} and -md/--model-draft are exclusive: the {v['draft']} draft is the target's own")
            v["draft"] = DraftKind(v["draft"])
        if v["pin_mapping"] and not v["mmap"]:
            fail("--pin-mapping pins the mapped file, and --no-mmap maps none (with a GPU its copy is pinned already)")
        if v["gamma_min"] > v["gamma"]:
            fail(f"--spec-draft-n-min must be <= --spec-draft-n-max ({v['gamma']}), got {v['gamma_min']}")
        ub = str(v["ubatch_size"]).strip().lower()
        if ub == "auto":
            ubatch = 0
        elif ub.isdigit() and int(ub) >= 1:
            ubatch = int(ub)
        else:
            fail(f"-ub/--ubatch-size must be auto or a number >= 1, got {v['ubatch_size']!r}")
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
        return cls(model=v["model"], model_draft=v["model_draft"], draft=v["draft"], pool=pool, rpc=rpc,
                   n_gpu_layers=ngl, threads=threads, ubatch_size=ubatch, temp=v["temp"], top_k=v["top_k"],
                   top_p=v["top_p"], seed=seed, seed_random=seed_random, stop=tuple(v["stop"] or ()),
                   ablations=tuple(n for n in OPTIONS if n.startswith("no_") and v[n]),
                   config=SessionConfig(model="", **{n: v[n] for n in SESSION_OPTIONS}))

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
