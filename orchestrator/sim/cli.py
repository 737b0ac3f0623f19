"""`spac sim ...` and `spac trace ...`: typer sub-apps, mounted by `orchestrator.cli`.

    app.add_typer(orchestrator.sim.cli.app, name="sim")
    app.add_typer(orchestrator.sim.cli.trace_app, name="trace")

Without `--trace`, the simulator replays a synthetic trace with the target model's shape
(calibrated for Qwen3-30B-A3B; the same dynamics, uncalibrated, for the other models).

Why ~480 lines: one typer command per simulator experiment with its table and plot; the
experiments themselves are in experiments.py, the prefill model in prefill.py.
"""

from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from dataclasses import replace
from typing import List, Optional

import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrator.policies import COMBINATIONS, POLICIES
from orchestrator.sim import profiles
from orchestrator.sim.experiments import ablation, compare, hot_cold_accuracy, sweep_cache_ratio, sweep_k
from orchestrator.sim.limit import limit
from orchestrator.sim.locality import belady_hit_curve, lru_hit_curve, repeat_rates, shared_expert_rate
from orchestrator.sim.prefill import PrefillModel, SYSTEMS
from orchestrator.sim.simulator import SimConfig, SimResult
from orchestrator.sim.synthetic import FAMILIES, QWEN3_30B_A3B, family_trace, generate_routing, synthesize_trace
from orchestrator.sim.trace import Trace, TraceError, read_trace

app = typer.Typer(help="Trace-driven simulation of expert caching policies (tables and PNG plots).",
                  no_args_is_help=True)
trace_app = typer.Typer(help="Routing traces: record (mounted by the main CLI), synthesise, inspect.",
                        no_args_is_help=True)
profile_app = typer.Typer(help="Hardware profiles: measure this machine (mounted by the main CLI), show one.",
                          no_args_is_help=True)
app.add_typer(profile_app, name="profile")
console = Console(width=220)
err_console = Console(stderr=True, highlight=False)

DEFAULT_RATIOS = "0.05,0.10,0.17,0.25,0.35,0.50"

TraceOpt = typer.Option(None, "--trace", help="routing trace (.npz); default: a synthetic one")
StepsOpt = typer.Option(200, "--steps", help="verification steps (synthetic length, or a limit on --trace)")
SeedOpt = typer.Option(0, "--seed", help="synthetic trace seed")
GammaOpt = typer.Option(8, "--gamma", help="synthetic draft length γ")
AcceptOpt = typer.Option(0.75, "--acceptance", help="synthetic per-token acceptance α")
HardwareOpt = typer.Option("rtx4090", "--hardware", help="hardware profile (spac sim profiles), or a measured "
                           "profile's .toml file (spac sim profile measure)")
ModelOpt = typer.Option(None, "--model-profile", "--model",
                        help="target model profile (spac sim profiles) [default: qwen3-30b-a3b; with --trace: "
                             "the trace's own model, from the GGUF it was recorded from]")
GgufOpt = typer.Option(None, "--gguf", help="GGUF the trace was recorded from (its shape and expert size)")
DEFAULT_MODEL = "qwen3-30b-a3b"
DraftOpt = typer.Option(None, "--draft", help="draft model profile or GGUF, 'pool' or 'mtp' (spac's drafts made of "
                        "the target: its pool draft, its MTP head), or 'none' for free drafting "
                        "[default: qwen3-4b; with --trace: the draft GGUF the trace was recorded with]")
RatioOpt = typer.Option(0.17, "--cache-ratio", help="expert pool / all experts")
QuantOpt = typer.Option("Q4_K", "--quant", help="weight format of the target (Q4_K, Q6_K, Q8_0, MXFP4, BF16)")
VisibilityOpt = typer.Option("pass", "--visibility", help="'pass' (engine: maps per ubatch) or 'layer' (paper Fig. 3)")
PolicyOpt = typer.Option(None, "--policy", "-p", help="policy (repeatable); default: all")
OutOpt = typer.Option(None, "--out", help="directory for PNG plots and JSON results")
HostRamOpt = typer.Option(None, "--host-ram", help="host RAM the run may use (24GiB, 32G, bytes): the experts that "
                          "do not fit after the non-expert weights, the KV caches and a 1 GiB margin are read from "
                          "the disk [default: unlimited, every expert in RAM]")
DiskOpt = typer.Option(None, "--disk", help="the disk below the host RAM, a preset of hardware.toml's [disks] "
                       "(nvme-pcie3, nvme-pcie4) [default: the hardware profile's own, else nvme-pcie4]")
SIZE_UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
              "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def _usage_error(message: str) -> None:
    """One line `spac: error: ...` and exit 2, as the main CLI's bad input."""
    sys.stderr.write(f"spac: error: {message}\n")
    raise typer.Exit(code=2)


def _host_ram(text: Optional[str]) -> Optional[float]:
    """--host-ram: "24GiB", "32G", "500M", a plain byte count; None: unlimited."""
    if text is None:
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([KMGT]?I?)B?", text.strip().upper().replace(" ", ""))
    if not m or float(m.group(1)) <= 0:
        _usage_error(f"--host-ram {text!r}: give a size in bytes (24GiB, 32G, 500M or a byte count)")
    return float(m.group(1)) * SIZE_UNITS[m.group(2)]


def _disk_key(key: Optional[str]) -> Optional[str]:
    if key is not None and key not in profiles.disk_presets():
        _usage_error(f"--disk {key!r}: not a disk of hardware.toml; known: {', '.join(profiles.disk_presets())}")
    return key


def _config(hardware, model, draft, ratio, visibility, quant="Q4_K", trace: Trace | None = None) -> SimConfig:
    if quant not in profiles.BITS_PER_WEIGHT:
        raise typer.BadParameter(f"unknown format {quant!r}; known: {', '.join(profiles.BITS_PER_WEIGHT)}", param_hint="--quant")
    draft_quant = "Q8_0"
    if draft is None:  # the draft the trace was recorded with, else the paper's
        recorded = None if trace is None else trace.meta.get("draft_gguf")
        draft = recorded if recorded and Path(recorded).exists() else "qwen3-4b"
    if str(draft).endswith(".gguf"):
        try:
            profile, draft_quant = profiles.from_gguf(draft, draft=True)
        except (ValueError, OSError, KeyError) as e:
            raise typer.BadParameter(f"{draft}: {e}", param_hint="--draft") from None
        draft = profiles.register(profile)
    # a hybrid target keeps a recurrent-state snapshot per draft token of a verify pass (n_rs_seq = γ)
    snapshots = int(trace.n_drafted.max()) if trace is not None and len(trace.n_drafted) else 0
    config = SimConfig(hardware=hardware, model=model, draft=None if draft == "none" else draft,
                       cache_ratio=ratio, visibility=visibility, quant=quant, draft_quant=draft_quant, snapshots=snapshots)
    if draft in profiles.SELF_DRAFTS:  # a target without an MTP block, a measured profile: one line
        try:
            config.costs()
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--draft") from None
    return config


def _trace(path: Optional[Path], steps: int, seed: int, gamma: int, acceptance: float, model: Optional[str],
           gguf: Optional[Path] = None) -> tuple[Trace, str, Optional[str]]:
    """(trace, model profile key, weight format of a GGUF-derived profile or None)."""
    if path is None:
        model = model or DEFAULT_MODEL
        m = profiles.model(model)
        if model in FAMILIES:
            return family_trace(model, steps, gamma=gamma, acceptance=acceptance, seed=seed), model, None
        routing = QWEN3_30B_A3B.with_shape(m.n_layer, m.n_expert, m.top_k)
        label = f"synthetic {m.name} (Qwen3 dynamics, uncalibrated)"
        return synthesize_trace(steps, routing, gamma=gamma, acceptance=acceptance, seed=seed, name=label), model, None
    try:
        trace = read_trace(path)
    except TraceError as e:
        raise typer.BadParameter(str(e), param_hint="--trace") from None
    quant = None
    if model is None:  # the trace's own model: from its GGUF
        source = gguf or trace.meta.get("gguf")
        if source is None or not Path(source).exists():
            raise typer.BadParameter(f"the trace names no GGUF that exists here ({source}); give --gguf FILE or "
                                     "--model-profile NAME", param_hint="--trace")
        try:
            profile, quant = profiles.from_gguf(source)
        except (ValueError, OSError, KeyError) as e:
            raise typer.BadParameter(f"{source}: {e}", param_hint="--gguf") from None
        model = profiles.register(profile)
    m = profiles.model(model)
    if (trace.n_layer, trace.n_expert, trace.top_k) != (m.n_layer, m.n_expert, m.top_k):
        raise typer.BadParameter(
            f"trace shape (layers {trace.n_layer}, experts {trace.n_expert}, top-k {trace.top_k}) does not match "
            f"--model-profile {model} ({m.n_layer}, {m.n_expert}, {m.top_k})", param_hint="--trace")
    return trace.head(steps), model, quant


def _names(policy: Optional[List[str]]) -> list[str]:
    names = list(POLICIES) if not policy else policy
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise typer.BadParameter(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}", param_hint="--policy")
    return names


def _ratios(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated ratios, got {text!r}", param_hint="--ratios") from None


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return "nan" if np.isnan(v) else f"{v:.3f}" if abs(v) < 1 else f"{v:.1f}"
    return str(v)


def _table(title: str, rows: list[dict]) -> Table:
    table = Table(title=title)
    for col in rows[0] if rows else []:
        table.add_column(col, justify="right" if isinstance(rows[0][col], (int, float)) else "left")
    for row in rows:
        table.add_row(*(_fmt(v) for v in row.values()))
    return table


def _hardware_name(key: str) -> str:
    return profiles.read_measured(key).name if profiles.is_measured(key) else profiles.hardware(key).name


def _setting(trace: Trace, config: SimConfig) -> str:
    return (f"{trace.model or 'trace'}: {trace.n_steps} steps, {trace.n_generated} tokens; "
            f"{_hardware_name(config.hardware)}; {config.quant}; draft {config.draft or 'free'}; "
            f"cache {100 * config.cache_ratio:.0f}%; visibility {config.visibility}")


def _dump(out: Optional[Path], name: str, payload) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(payload, indent=1, default=float) + "\n")


def _write(out: Optional[Path], stem: str, payload, draw) -> None:
    """With --out: stem.json from payload and stem.png by draw(plots_module, path); without
    matplotlib (not in the plain install) the JSON is written and the plot skipped, saying so."""
    if out is None:
        return
    _dump(out, f"{stem}.json", payload)
    try:
        from orchestrator.sim import plots  # matplotlib only when a plot is asked for
    except ImportError:
        err_console.print(f"wrote {out / stem}.json; skipped {stem}.png: matplotlib is not installed "
                          "(pip install matplotlib)", soft_wrap=True)
        return
    draw(plots, out / f"{stem}.png")
    console.print(f"wrote {out / stem}.png and .json")


@contextmanager
def working(what: str):
    """A spinner with elapsed time on stderr while long work runs (stdout keeps the tables)."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                  transient=True) as bar:
        bar.add_task(what, total=None)
        yield


@app.command("profiles")
def profiles_cmd() -> None:
    """List hardware and model profiles (numbers and sources in orchestrator/profiles/*.toml)."""
    hw = [{"key": h.key, "cards": h.n_devices, "VRAM GB": h.vram_GB, "GPU GB/s": h.gpu_bw / 1e9, "PCIe GB/s": h.pcie_bw / 1e9,
           "network GB/s, µs": f"{h.remote_GBps:g}, {h.remote_latency_us:g}" if h.remote_GBps else "-",
           "CPU GB/s": h.cpu_bw / 1e9, "CPU GFLOP/s": h.cpu_gflops, "name": h.name}
          for h in profiles.hardware_profiles().values()]
    console.print(_table("hardware (effective rates)", hw))
    ms = [{"key": m.key, "name": m.name, "MoE layers": m.n_layer, "experts": m.n_expert, "top-k": m.top_k,
           "params B": m.params / 1e9, "expert MB Q4_K": m.expert_bytes() / 1e6 if m.n_expert else 0.0}
          for m in profiles.model_profiles().values()]
    console.print(_table("models", ms))


@profile_app.command("show")
def profile_show_cmd(path: Path = typer.Argument(..., help="a measured profile (.toml)")) -> None:
    """Load a measured profile and print its unit times (for one expert of each model profile)."""
    try:
        p = profiles.read_measured(path)
    except ValueError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(code=1) from None
    rows = [{"what": f"{side} expert {q}, µs per MB", **{f"{m} token(s)": 1e12 * x for m, x in zip(n, xs)}}
            for side, rates in (("host", p.host), ("device", p.device_rates)) for q, (n, xs) in rates.items()]
    console.print(_table(f"{p.name} ({p.device}, measured {p.measured_at} on {p.measured_with})", rows))
    console.print(f"non-expert part of a pass: {1e12 * p.non_expert_s_per_byte:.1f} µs per MB + "
                  f"{1e12 * p.non_expert_s_per_byte_token:.1f} per token ({p.non_expert_on})")
    console.print(f"copy {p.copy_bytes_per_s / 1e9:.2f} GB/s + {1e6 * p.copy_latency_s:.0f} µs; crossing "
                  f"{1e3 * p.crossing_s:.2f} ms per split layer; draft {1e3 * p.draft_s_per_token:.2f} ms per token "
                  f"({p.draft_file or '-'}); device memory {p.vram_GB:.1f} GB")
    if p.disk is not None:
        console.print(f"disk {p.disk.read_bytes_per_s / 1e9:.2f} GB/s, {1e6 * p.disk.latency_s:.0f} µs per 4 KiB read, "
                      f"queue depth {p.disk.queue_depth}")


@app.command("run")
def run_cmd(trace: Optional[Path] = TraceOpt, steps: int = StepsOpt, seed: int = SeedOpt, gamma: int = GammaOpt,
            acceptance: float = AcceptOpt, hardware: str = HardwareOpt, model: Optional[str] = ModelOpt, gguf: Optional[Path] = GgufOpt, draft: str = DraftOpt,
            cache_ratio: float = RatioOpt, visibility: str = VisibilityOpt, policy: Optional[List[str]] = PolicyOpt,
            quant: str = QuantOpt, out: Optional[Path] = OutOpt, host_ram: Optional[str] = HostRamOpt,
            disk: Optional[str] = DiskOpt) -> None:
    """All policies side by side on one trace."""
    ram, disk = _host_ram(host_ram), _disk_key(disk)
    t, model, gguf_quant = _trace(trace, steps, seed, gamma, acceptance, model, gguf)
    config = replace(_config(hardware, model, draft, cache_ratio, visibility, gguf_quant or quant, t),
                     host_ram=ram, disk=disk)
    names = _names(policy)
    with working(f"simulating {len(names)} policies on {t.n_steps} steps"):
        results, skipped = compare(t, config, names)
    setting = _setting(t, config)
    bound = limit(t, results[0].capacity, config.costs(), host_slots=results[0].host_slots) if results else None
    rows = []
    for r in results:
        ranking, miss, window, split = COMBINATIONS.get(r.policy, ("?",) * 4)
        row = r.row()
        rows.append({"policy": row.pop("policy"), "ranking": ranking, "miss": miss, "window": window, "split": split,
                     **row, "÷ limit": row["tok/s"] / bound.tokens_per_s})
    console.print(_table(setting, rows))
    if bound is not None:
        console.print(f"limit (an upper bound on tok/s under this cost model, orchestrator/sim/limit.py): "
                      f"{bound.tokens_per_s:.1f} tok/s")
    if results and results[0].host_slots is not None:
        c = config.costs()
        d = c.disk or profiles.disk(profiles.DEFAULT_DISK)
        console.print(f"host tier: {results[0].host_slots} experts of {t.n_layer * t.n_expert} in "
                      f"{ram / 2**30:.1f} GiB of host RAM, the rest on the disk ({d.read_bytes_per_s / 1e9:.1f} GB/s, "
                      f"{1e6 * d.latency_s:.0f} µs, queue depth {d.queue_depth}); spac's policies read ahead, the "
                      f"others page on demand (llama.cpp's mmap)")
    elif ram is not None:
        console.print(f"host tier: every expert fits in {ram / 2**30:.1f} GiB of host RAM")
    for s in skipped:
        console.print(f"[yellow]skipped {s.policy}: {s.reason}[/yellow]")
    _write(out, "policies", {"setting": setting, "results": [r.row() for r in results]},
           lambda plots, path: plots.policies_bar(results, path, title=setting))


@app.command("sweep-cache")
def sweep_cache_cmd(trace: Optional[Path] = TraceOpt, steps: int = StepsOpt, seed: int = SeedOpt, gamma: int = GammaOpt,
                    acceptance: float = AcceptOpt, hardware: str = HardwareOpt, model: Optional[str] = ModelOpt, gguf: Optional[Path] = GgufOpt,
                    draft: str = DraftOpt, visibility: str = VisibilityOpt, policy: Optional[List[str]] = PolicyOpt,
                    ratios: str = typer.Option(DEFAULT_RATIOS, "--ratios", help="comma-separated cache ratios"),
                    quant: str = QuantOpt, out: Optional[Path] = OutOpt) -> None:
    """Tokens/s against the expert cache ratio (paper Fig. 5 left)."""
    t, model, gguf_quant = _trace(trace, steps, seed, gamma, acceptance, model, gguf)
    rs = _ratios(ratios)
    config = _config(hardware, model, draft, rs[0], visibility, gguf_quant or quant, t)
    with working(f"sweeping {len(rs)} cache ratios"):
        sweep = sweep_cache_ratio(t, config, _names(policy), rs)
    rows = [{"policy": name, **{f"{100 * r:.0f}%": (np.nan if x is None else x.tokens_per_s) for r, x in zip(rs, res)}}
            for name, res in sweep.items()]
    console.print(_table("tokens/s vs expert cache ratio — " + _setting(t, config).split("; cache")[0], rows))
    fits = {f"{100 * r:.0f}%": next((x.fits_vram for x in res if x is not None), None) for r, res in zip(rs, zip(*sweep.values()))}
    console.print(f"fits in VRAM: {fits}")
    _write(out, "cache_ratio", rows, lambda plots, path: plots.cache_ratio_lines(sweep, rs, path, title=f"{t.model} on {hardware}"))


@app.command("sweep-k")
def sweep_k_cmd(trace: Optional[Path] = TraceOpt, steps: int = StepsOpt, seed: int = SeedOpt, gamma: int = GammaOpt,
                acceptance: float = AcceptOpt, hardware: str = HardwareOpt, model: Optional[str] = ModelOpt, gguf: Optional[Path] = GgufOpt, draft: str = DraftOpt,
                cache_ratio: float = RatioOpt, visibility: str = VisibilityOpt,
                k_max: int = typer.Option(8, "--k-max", help="largest K"), quant: str = QuantOpt,
                out: Optional[Path] = OutOpt) -> None:
    """MoE-SpAc tokens/s against the utility bound K (paper Fig. 5 right)."""
    t, model, gguf_quant = _trace(trace, steps, seed, gamma, acceptance, model, gguf)
    config = _config(hardware, model, draft, cache_ratio, visibility, gguf_quant or quant, t)
    ks = list(range(1, k_max + 1))
    with working(f"sweeping K = 1..{k_max}"):
        results = sweep_k(t, config, ks)
    rows = [{"K": k, **r.row()} for k, r in zip(ks, results)]
    for row in rows:
        row.pop("policy")
    console.print(_table("MoE-SpAc vs utility bound K — " + _setting(t, config), rows))
    _write(out, "k", rows, lambda plots, path: plots.k_line(ks, results, path, title=f"MoE-SpAc, {hardware}, cache {100 * cache_ratio:.0f}%"))


@app.command("ablation")
def ablation_cmd(trace: Optional[Path] = TraceOpt, steps: int = StepsOpt, seed: int = SeedOpt, gamma: int = GammaOpt,
                 acceptance: float = AcceptOpt, hardware: str = HardwareOpt, model: Optional[str] = ModelOpt, gguf: Optional[Path] = GgufOpt, draft: str = DraftOpt,
                 cache_ratio: float = RatioOpt, visibility: str = VisibilityOpt, quant: str = QuantOpt,
                 out: Optional[Path] = OutOpt) -> None:
    """MoE-SpAc with one component removed at a time (paper Table 4). "w/o SD" needs a synthetic
    trace (it replays the same routing model decoded autoregressively)."""
    t, model, gguf_quant = _trace(trace, steps, seed, gamma, acceptance, model, gguf)
    ar = None
    if trace is None:
        ar = _trace(None, t.n_generated, seed, 0, acceptance, model)[0]
    config = _config(hardware, model, draft, cache_ratio, visibility, gguf_quant or quant, t)
    with working("simulating the ablations"):
        rows = [{"variant": label, **r.row()} for label, r in ablation(t, config, ar)]
    for row in rows:
        row.pop("policy")
    console.print(_table("ablation — " + _setting(t, config), rows))
    _dump(out, "ablation.json", rows)


@app.command("accuracy")
def accuracy_cmd(trace: Optional[Path] = TraceOpt, steps: int = StepsOpt, seed: int = SeedOpt, gamma: int = GammaOpt,
                 acceptance: float = AcceptOpt, model: Optional[str] = ModelOpt, gguf: Optional[Path] = GgufOpt,
                 tau: int = typer.Option(1, "--tau", help="hot ⇔ utility ≥ τ (the paper's Fig. 4 uses 1)"),
                 k_max: int = typer.Option(4, "--k-max", help="utility bound K")) -> None:
    """Hot/cold prediction accuracy of the utility estimator (paper Fig. 4)."""
    t = _trace(trace, steps, seed, gamma, acceptance, model, gguf)[0]
    rows = []
    for label, layer in (("all", None), (f"last ({t.n_layer - 1})", t.n_layer - 1)):
        acc = hot_cold_accuracy(t, k_max=k_max, tau=tau, layer=layer)
        for name in ("previous step", "paper", "spac"):
            rows.append({"layers": label, "predictor": name, "accuracy": acc[f"{name} accuracy"],
                         "precision": acc[f"{name} precision"], "recall": acc[f"{name} recall"]})
    console.print(_table(f"hot/cold prediction of the next verify pass (paper: τ = {tau}, K = {k_max}; "
                         f"spac: p ≥ 1/2) — {t.model}", rows))
    console.print(f"share of experts used per step {acc['share used']:.3f}; Algorithm 1's calibrated boundaries "
                  f"at the end: mean θ↑ {acc['paper mean θ↑']:.2f}, θ↓ {acc['paper mean θ↓']:.2f} (start ⌊γ/2⌋)")


@app.command("families")
def families_cmd(tokens: int = typer.Option(400, "--tokens"), seed: int = SeedOpt) -> None:
    """The synthetic trace families: shape, what their locality is calibrated against, and the
    locality this generator gives them (autoregressive routing of --tokens tokens)."""
    rows = []
    for key, f in FAMILIES.items():
        r = f.routing
        selected, _ = generate_routing(tokens, r, seed=seed)
        rep = repeat_rates(selected, r.n_expert)
        rows.append({"family": key, "layers": r.n_layer, "experts": r.n_expert, "top-k": r.top_k,
                     "repeat next %": 100 * rep[1].mean(), "within 8 %": 100 * rep[8].mean(),
                     "share an expert %": 100 * shared_expert_rate(selected), "locality": f.locality})
    console.print(_table(f"trace families, {tokens} tokens", rows))


@app.command("calibrate")
def calibrate_cmd(tokens: int = typer.Option(1000, "--tokens"), seed: int = SeedOpt) -> None:
    """Locality of the synthetic Qwen3-30B-A3B generator against the published numbers."""
    selected, _ = generate_routing(tokens, QWEN3_30B_A3B, seed=seed)
    caps = (8, 16, 32, 64)
    lru, belady = lru_hit_curve(selected, caps).mean(axis=1), belady_hit_curve(selected, caps).mean(axis=1)
    rep = repeat_rates(selected, QWEN3_30B_A3B.n_expert)
    rows = [{"statistic": f"LRU hit, {c} experts/layer", "synthetic": 100 * v, "published": p}
            for c, v, p in zip(caps, lru, (42, 65, 81, 92))]
    rows += [{"statistic": f"Belady hit, {c} experts/layer", "synthetic": 100 * v, "published": p}
             for c, v, p in zip(caps, belady, (61, 78, 89, 93))]
    rows += [{"statistic": "repeat at next token", "synthetic": 100 * rep[1].mean(), "published": 45},
             {"statistic": "repeat within 8 tokens", "synthetic": 100 * rep[8].mean(), "published": 80}]
    console.print(_table(f"synthetic Qwen3-30B-A3B routing, {tokens} tokens (%)", rows))


@app.command("report")
def report_cmd(steps: int = StepsOpt, seed: int = SeedOpt, hardware: str = HardwareOpt, draft: str = DraftOpt,
               cache_ratio: float = RatioOpt, visibility: str = VisibilityOpt, quant: str = QuantOpt,
               out: Path = typer.Option(Path("sim-report"), "--out")) -> None:
    """The paper's experiments on the synthetic Qwen3-30B-A3B trace: policies, cache sweep, K
    sweep, ablation and estimator accuracy, as tables plus PNGs in --out."""
    common = dict(trace=None, steps=steps, seed=seed, gamma=8, acceptance=0.75, hardware=hardware,
                  model="qwen3-30b-a3b", gguf=None, draft=draft, visibility=visibility, quant=quant)
    run_cmd(**common, cache_ratio=cache_ratio, policy=None, out=out)
    sweep_cache_cmd(**common, policy=["static", "lru/host", "hybrimoe", "moe-spac-paper", "spac"], ratios=DEFAULT_RATIOS, out=out)
    sweep_k_cmd(**common, cache_ratio=cache_ratio, k_max=8, out=out)
    ablation_cmd(**common, cache_ratio=cache_ratio, out=out)
    accuracy_cmd(trace=None, steps=steps, seed=seed, gamma=8, acceptance=0.75, model="qwen3-30b-a3b", gguf=None,
                 tau=1, k_max=4)


@app.command("prefill")
def prefill_cmd(hardware: str = typer.Option("rtx4090,rtx4060", "--hardware",
                                            help="datasheet hardware profiles, comma-separated (spac sim profiles)"),
                model: str = typer.Option(DEFAULT_MODEL, "--model-profile", "--model", help="target model profile"),
                quant: str = QuantOpt,
                prompt_tokens: str = typer.Option("512,2048,8192", "--prompt-tokens", help="prompt lengths, comma-separated"),
                cache_ratio: float = typer.Option(0.17, "--cache-ratio", help="expert pool / all experts (resident before the prompt)"),
                as_json: bool = typer.Option(False, "--json", help="write the rows to stdout as a JSON list instead of tables")) -> None:
    """Time to first token of long prompts with the experts in host RAM (simulated): llama.cpp's op
    offload, llama.cpp on the CPU, spac's prefill streamed through the pool, and a limit."""
    if quant not in profiles.BITS_PER_WEIGHT:
        raise typer.BadParameter(f"unknown format {quant!r}; known: {', '.join(profiles.BITS_PER_WEIGHT)}", param_hint="--quant")
    try:
        prompts = [int(x) for x in prompt_tokens.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated token counts, got {prompt_tokens!r}", param_hint="--prompt-tokens") from None
    if not prompts or min(prompts) < 1:
        raise typer.BadParameter("give one or more positive token counts", param_hint="--prompt-tokens")
    keys = [k.strip() for k in hardware.split(",") if k.strip()]
    if any(profiles.is_measured(k) for k in keys):
        raise typer.BadParameter("a measured profile times passes of at most γ+1 tokens; prefill needs a datasheet "
                                 "profile (spac sim profiles)", param_hint="--hardware")
    try:
        hws, m = [profiles.hardware(k) for k in keys], profiles.model(model)
        setups = [(hw, PrefillModel(hw, m, quant, cache_ratio)) for hw in hws]
    except (KeyError, ValueError) as e:
        raise typer.BadParameter(str(e.args[0]), param_hint="--hardware/--model-profile/--cache-ratio") from None
    rows = []
    for hw, pm in setups:
        for n in prompts:
            results = {s: pm.best(s, n) for s in SYSTEMS}
            for r in results.values():
                rows.append({"hardware": hw.key, "prompt_tokens": n, "system": r.system, "ttft_s": r.ttft_s,
                             "ubatch": r.ubatch, "bytes_copied": r.bytes_copied, "copy_hidden": r.copy_hidden,
                             "vs_op_offload": results["op-offload"].ttft_s / r.ttft_s,
                             "vs_limit": r.ttft_s / results["limit"].ttft_s, "simulated": True})
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    for hw, pm in setups:
        table_rows = [{"prompt tokens": r["prompt_tokens"], "system": r["system"], "TTFT s": r["ttft_s"],
                       "tok/s": r["prompt_tokens"] / r["ttft_s"], "ubatch": r["ubatch"],
                       "GB copied": r["bytes_copied"] / 1e9, "copy hidden": r["copy_hidden"],
                       "× op offload": f"{r['vs_op_offload']:.2f}", "÷ limit": f"{r['vs_limit']:.2f}"}
                      for r in rows if r["hardware"] == hw.key]
        console.print(_table(f"SIMULATED time to first token: {m.name} {quant}, {hw.name}; pool {100 * cache_ratio:.0f}% "
                             f"of the experts", table_rows))
        console.print(f"  spac stages two layers of experts besides the pool: {pm.staging_bytes() / 1e9:.2f} GB; GPU "
                      f"{hw.prefill_tflops:.0f} TFLOP/s in prefill, CPU {hw.cpu_gflops:.0f} GFLOP/s, link "
                      f"{hw.pcie_bw / 1e9:.1f} GB/s (assumptions: orchestrator/profiles/hardware.toml)")
    console.print("Model: orchestrator/sim/prefill.py. op-offload copies every expert of a layer per ubatch, then "
                  "computes (no overlap); cpu computes experts on the host (repacked kernels); spac copies the next "
                  "layer's non-resident experts while a layer computes (--stream-prefill ahead); spac-used copies the "
                  "non-resident experts each router chose, after it ran (--stream-prefill used); limit = max(non-resident experts the prompt "
                  "uses, copied once; the prompt's flops on the GPU). Each system at its best ubatch; uniform routing. "
                  "The pool's share is --cache-ratio, whatever the card's memory (a 4090 holds all of Qwen3-30B-A3B's "
                  "experts: 17% stands for a model ~6× the pool, as in the other sim commands).",
                  soft_wrap=True)


@trace_app.command("synth")
def synth_cmd(out: Path = typer.Argument(..., help="trace file to write (.npz)"), steps: int = StepsOpt,
              seed: int = SeedOpt, gamma: int = GammaOpt, acceptance: float = AcceptOpt, model: Optional[str] = ModelOpt,
              draft_fidelity: float = typer.Option(0.9, "--draft-fidelity", help="MoE draft routing agreement; 0: none")) -> None:
    """Write a synthetic routing trace: a trace family's dynamics (spac sim families) or, for
    another profile, Qwen3-30B-A3B's dynamics on its shape."""
    model = model or DEFAULT_MODEL
    m = profiles.model(model)
    if model in FAMILIES:
        t = family_trace(model, steps, gamma=gamma, acceptance=acceptance, draft_fidelity=draft_fidelity or None, seed=seed)
    else:
        routing = QWEN3_30B_A3B.with_shape(m.n_layer, m.n_expert, m.top_k)
        t = synthesize_trace(steps, routing, gamma=gamma, acceptance=acceptance, draft_fidelity=draft_fidelity or None,
                             seed=seed, name=f"synthetic {m.name}", layer_index=m.layer_index)
    t.save(out)
    console.print(f"wrote {out}: {t.n_steps} steps, {t.n_generated} tokens, {t.n_layer} MoE layers")


@trace_app.command("info")
def info_cmd(path: Path = typer.Argument(..., help="trace file (.npz)")) -> None:
    """Validate a trace and summarise it."""
    try:
        t = read_trace(path)
    except TraceError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(code=1) from None
    accepted = t.n_accepted.astype(float)
    rows = [{"field": k, "value": v} for k, v in {
        "model": t.model or "?", "MoE layers": t.n_layer, "experts": t.n_expert, "top-k": t.top_k,
        "steps": t.n_steps, "verified tokens": t.n_rows, "generated tokens": t.n_generated,
        "mean drafted": float(t.n_drafted.mean()) if t.n_steps else 0.0,
        "mean accepted": float(accepted.mean()) if t.n_steps else 0.0,
        "routing weights": t.weights is not None, "draft routing": t.has_draft_routing,
    }.items()]
    console.print(_table(str(path), rows))
    if t.n_rows > 9:
        rep = repeat_rates(t.selected, t.n_expert)
        console.print(f"verified-token repeat rate: next {100 * rep[1].mean():.1f}%, within 8 {100 * rep[8].mean():.1f}%")
