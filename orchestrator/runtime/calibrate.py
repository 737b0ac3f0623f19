"""Warm-up calibration: the unit costs the workload balancer needs, measured on this machine.

    T^u_cpu  one expert on one token on the host          least squares over timed verify
    T^u_gpu  one expert's batched call on the device       passes with 0, ¼, ½, ¾, all of the
                                                            experts they use resident (below)
    T^u_io   copying one expert host → device               engine stats: copy time / copies
    T^u_up   uploading one expert inside a pass (the miss    engine stats: the passes' wait for
             gate's uploads: the staging queue)              their uploads / uploads (a gate only)
    W^u_e    bytes of one expert                            GGUF tensor sizes (gate+up+down)
    T^u_draft the draft's time per drafted token            timed single-token draft decodes
    T_total  one layer's share of a verify pass             median verify time / MoE layers

The timed passes decode the same γ+1 tokens after the same prefix again and again (the KV
cache is trimmed back after each), so the routing is identical and only the residency changes;
each pass is modelled as time = c0 + T^u_cpu · (expert-token pairs on the host) + T^u_gpu ·
(distinct resident experts used), with the counts taken from the engine's stats and the routing
export. Residency only grows during the measurement, so it also works with eviction off.

r_c(τ), r_g(τ) and b are not measured here: the balancer estimates them online from recent steps.
The calibration reaches the policy as its first `Feedback`; the session then reports T_total,
T^u_draft and T^u_io of every step, which the policy smooths in.

Results are cached per (target file, draft file, machine, device, threads, pool budget) in a
JSON file (`cache_path()`: $SPAC_CACHE_DIR or the user cache dir, `spac/calibration.json`);
`load_or_calibrate(force=True)` (`spac ... --recalibrate`) measures again.

This module only measures: it drives the pool through the engine it is given and leaves it
wanting nothing (what it copied stays resident until a plan needs the slots), and returns a value. What the pool holds afterwards, and which plan is in force, is the
session's business (`Session._calibrate`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from orchestrator.runtime import progress
from orchestrator.policies.base import Feedback
from orchestrator.policies.plan import Plan

VERSION = 1
# the shares of the experts a verify pass uses that are resident in the timed passes
RESIDENT_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
_FINGERPRINT_BYTES = 1 << 20


@dataclass
class Calibration:
    t_cpu_unit: float
    t_gpu_unit: float
    t_io_unit: float
    expert_bytes: float
    t_draft_token: float
    t_total: float
    n_moe_layers: int
    n_slots: int
    # one expert uploaded inside a pass by the miss gate (the staging queue, a layer's uploads as
    # one batch whose cost it shares); 0: not measured (no gate), t_io_unit stands in
    t_upload_unit: float = 0.0
    measured_at: float = 0.0
    source: str = "measured"  # or "cache"

    def feedback(self) -> Feedback:
        """The measurement as a policy's first `Feedback` (policies smooth later ones into it)."""
        return Feedback(t_cpu_unit=self.t_cpu_unit, t_gpu_unit=self.t_gpu_unit, t_io_unit=self.t_io_unit,
                        t_draft_token=self.t_draft_token, t_layer=np.full(self.n_moe_layers, self.t_total),
                        expert_bytes=self.expert_bytes, free_slots=self.n_slots)


def cache_path() -> Path:
    root = os.environ.get("SPAC_CACHE_DIR")
    if root:
        return Path(root) / "calibration.json"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "spac" / "calibration.json"


def file_fingerprint(path: str | Path) -> str:
    """sha256 of the size and the first and last MiB: cheap on a 20 GB file, and any re-export
    or re-quantisation changes the header (tensor offsets, metadata) or the tail."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
        if size > _FINGERPRINT_BYTES:
            f.seek(max(size - _FINGERPRINT_BYTES, _FINGERPRINT_BYTES))
            h.update(f.read())
    return h.hexdigest()[:16]


def machine_id() -> str:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.system()}-{platform.machine()}-{cpu}-{os.cpu_count()}cpu"


@dataclass(frozen=True)
class Rig:
    """What a measurement runs on: the target context with its engine and routing export, the
    draft context if any, and the setup that keys the cache."""

    engine: object            # native.ExpertEngine
    routing: object           # native.Routing
    ctx: object               # llm.Context of the target
    draft_ctx: object | None  # llm.Context of the draft
    model_path: Path
    draft_path: Path | None
    device: str
    n_threads: int
    budget: str               # the pool budget as configured (bytes or ratio)
    gamma: int
    k_max: int
    draft_kind: str = ""      # a draft on the target's own file: "pool" or "mtp" (they cost differently)
    miss_gate: bool = False   # the engine's gates decide the misses: their uploads are timed too

    def cache_key(self) -> str:
        parts = [f"v{VERSION}", file_fingerprint(self.model_path),
                 file_fingerprint(self.draft_path) if self.draft_path is not None else "-",
                 machine_id(), self.device, f"t{self.n_threads}", f"b{self.budget}", f"g{self.gamma}"]
        return "|".join(parts + ([self.draft_kind] if self.draft_kind else []) + (["gate"] if self.miss_gate else []))


def expert_bytes(model_path: str | Path) -> float:
    """W^u_e: bytes of one routed expert (gate + up + down), averaged over the MoE layers."""
    import gguf
    from gguf import MODEL_TENSOR

    reader = gguf.GGUFReader(str(model_path))
    parts = [gguf.TENSOR_NAMES[t] for t in (MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP, MODEL_TENSOR.FFN_DOWN_EXP)]
    total, n_expert_total = 0, 0
    for t in reader.tensors:
        name = t.name.removesuffix(".weight")
        for pattern in parts:
            head, _, tail = pattern.partition("{bid}")
            if name.startswith(head) and name.endswith(tail) and name[len(head):len(name) - len(tail)].isdigit():
                total += int(t.n_bytes)
                if pattern == parts[0]:
                    n_expert_total += int(t.shape[-1])  # gguf-py shapes are ggml's: experts last
    if not n_expert_total:
        raise ValueError(f"{Path(model_path).name} has no routed expert tensors")
    return total / n_expert_total


def load_or_calibrate(rig: Rig, force: bool = False, path: str | Path | None = None) -> Calibration:
    """The cached calibration for this setup, or a fresh measurement (then cached)."""
    path = Path(path) if path else cache_path()
    key = rig.cache_key()
    cache = _read(path)
    if not force and key in cache:
        try:
            return Calibration(**{**cache[key], "source": "cache"})
        except TypeError:
            pass  # written by another version: measure again
    steps = len(RESIDENT_SHARES) + 2  # the warm-up, each share, the copy and draft costs
    with progress.phase("calibrating", total=steps) as calibrating:
        cal = measure(rig, step=calibrating.advance)
    cache[key] = asdict(cal)
    _write(path, cache)
    return cal


def measure(rig: Rig, repeats: int = 3, prefix_len: int = 16, seed: int = 0,
            step: Callable[[], object] = lambda: None) -> Calibration:
    """Run the warm-up measurement (the KV caches end up empty, the pool wanting nothing); `step`
    is called after each of its len(RESIDENT_SHARES) + 2 steps (a progress display)."""
    engine, routing, ctx = rig.engine, rig.routing, rig.ctx
    if rig.miss_gate:  # a recalibration: the timed passes compute every miss on the host, as at the start
        engine.set_miss_costs(None)
    gamma = max(rig.gamma, 1)
    rng = np.random.default_rng(seed)
    n_vocab = ctx.n_vocab
    n_layer, n_expert = engine.n_moe_layers, engine.n_expert
    stats0 = engine.stats()
    n_slots = int(stats0["n_slots"])

    prefix = rng.integers(0, n_vocab, prefix_len)
    batch = rng.integers(0, n_vocab, gamma + 1)
    ctx.clear()
    ctx.decode(prefix, logits_all=False)
    base = ctx.n_past

    def timed_pass() -> tuple[float, dict, np.ndarray]:
        s0 = engine.stats()
        t0 = time.perf_counter()
        ctx.decode(batch, logits_all=True)
        dt = time.perf_counter() - t0
        s1 = engine.stats()
        ids = routing.last()[0].copy()  # [n_layer, n_tokens, top_k]
        ctx.trim(base)
        return dt, {k: s1[k] - s0[k] for k in ("n_expert_tokens_cpu", "n_expert_tokens_device")}, ids

    timed_pass()  # warm-up (first-touch of weights and buffers)
    _, _, ids = timed_pass()
    step()
    used = np.zeros((n_layer, n_expert), dtype=bool)
    np.put_along_axis(used, ids.reshape(n_layer, -1), True, axis=1)
    used_pairs = np.argwhere(used)
    order = rng.permutation(len(used_pairs))
    k_max = rig.k_max
    rows, times = [], []
    for frac in RESIDENT_SHARES:
        n_res = min(int(round(frac * len(used_pairs))), n_slots)
        utility = np.zeros((n_layer, n_expert), dtype=np.uint8)
        chosen = used_pairs[order[:n_res]]
        utility[chosen[:, 0], chosen[:, 1]] = k_max
        engine.set_plan(Plan(utility=utility, threshold=np.full(n_layer, k_max, dtype=np.int32)))
        engine.wait_idle()
        resident = engine.residency() >= 0
        n_dev_distinct = int((resident & used).sum())
        samples = [timed_pass() for _ in range(repeats)]
        dt = float(np.median([s[0] for s in samples]))
        n_cpu = float(np.median([s[1]["n_expert_tokens_cpu"] for s in samples]))
        rows.append((1.0, n_cpu, float(n_dev_distinct)))
        times.append(dt)
        step()
    stats1 = engine.stats()
    # leave nothing wanted: the live plans take over from here
    engine.set_plan(Plan(utility=np.zeros((n_layer, n_expert), dtype=np.uint8),
                         threshold=np.full(n_layer, k_max, dtype=np.int32)))
    engine.wait_idle()
    ctx.clear()

    n_act = float(ids.size)  # expert-token pairs of one pass
    (c0, t_cpu, t_gpu), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    if not t_cpu > 0:  # noise on a busy machine: bound it by the all-host pass
        t_cpu = times[0] / n_act
    if not t_gpu > 0:
        t_gpu = t_cpu * n_act / max(len(used_pairs), 1)

    w_e = expert_bytes(rig.model_path)
    n_copies = stats1["n_copies"] - stats0["n_copies"]
    if n_copies > 0:
        t_io = (stats1["copy_busy_us"] - stats0["copy_busy_us"]) * 1e-6 / n_copies
    else:
        t_io = w_e / host_copy_bandwidth()

    t_upload = measure_uploads(rig, prefix, rng, repeats) if rig.miss_gate else 0.0
    t_draft = measure_draft(rig.draft_ctx, prefix, rng) if rig.draft_ctx is not None else 0.0
    step()
    return Calibration(t_cpu_unit=float(t_cpu), t_gpu_unit=float(t_gpu), t_io_unit=float(t_io), t_upload_unit=t_upload,
                       expert_bytes=float(w_e), t_draft_token=float(t_draft),
                       t_total=float(np.median(times)) / n_layer, n_moe_layers=n_layer,
                       n_slots=n_slots, measured_at=time.time())


def measure_uploads(rig: Rig, prefix: np.ndarray, rng: np.random.Generator, repeats: int) -> float:
    """T^u_up: the passes' wait per expert their gates uploaded, with costs that upload every miss
    (a plan's copies go another way, the copy worker's, at another rate: 9-10 against 18 GB/s on
    the CPU test device). Passes of new γ+1 tokens, so that they miss; 0 where none did (a pool
    of every expert). The gates are left with no costs (every miss on the host), as `measure`
    runs them; the session then sets its own."""
    from orchestrator.runtime.native import MissCosts

    engine, ctx = rig.engine, rig.ctx
    engine.set_miss_costs(MissCosts(upload_s=0.0, sync_s=0.0, horizon_tokens=0.0,
                                    host_s=lambda n: n * 1.0, device_s=lambda n: n * 0.0))
    try:
        ctx.clear()
        ctx.decode(prefix, logits_all=False)
        base = ctx.n_past
        s0 = engine.stats()
        for _ in range(max(repeats, 6)):  # one pass's uploads cost 0.5-1.5 ms each on the CPU test device
            ctx.decode(rng.integers(0, ctx.n_vocab, max(rig.gamma, 1) + 1), logits_all=True)
            ctx.trim(base)
        s1 = engine.stats()
    finally:
        engine.set_miss_costs(None)
        ctx.clear()
    n = s1["n_staged"] - s0["n_staged"]
    return (s1["stage_wait_us"] - s0["stage_wait_us"]) * 1e-6 / n if n > 0 else 0.0


def measure_draft(dctx, prefix: np.ndarray, rng: np.random.Generator, n: int = 8) -> float:
    """Median time of one single-token draft decode."""
    dctx.clear()
    dctx.decode(prefix, logits_all=False)
    times = []
    for t in rng.integers(0, dctx.n_vocab, n):
        t0 = time.perf_counter()
        dctx.decode([int(t)], logits_all=False)
        times.append(time.perf_counter() - t0)
    dctx.clear()
    return float(np.median(times))


def host_copy_bandwidth(n_bytes: int = 32 << 20) -> float:
    """bytes/s of a plain host memory copy (fallback for T^u_io when nothing was copied)."""
    src = np.ones(n_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return n_bytes / max(time.perf_counter() - t0, 1e-9)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache dir only costs a re-measurement next time
