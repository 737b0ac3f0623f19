"""Where the weights go by default: the target's non-expert layers (-ngl) and the expert pool.

    sizes = model_sizes("target.gguf")                 # read from the GGUF header, nothing loaded
    p = place(sizes, n_ctx=4096, gpu=first_gpu(), device=None, budget=Budget(), ngl="auto")
    p.pool, p.n_gpu_layers, p.note                      # p.pool: (PoolDevice("CUDA0", Budget(nbytes=...)),)

The rule (`place`, a pure function, unit-tested without a GPU), like llama.cpp's `-ngl auto`
with `--fit`: with a GPU, the non-expert weights of as many layers as fit go to it (all of them
on any GPU this tool targets), and the pool takes the free device memory left after them, their
KV cache, a safety margin and a streamed prefill's staging slots (no pool if that leaves less
than one expert per layer; no staging slots, and llama.cpp's prefill, if the pool needs them). Without
a GPU the pool is off: the CPU pool (`--device CPU`) is a test device, slower than no pool.
`--expert-budget`, `-ngl` and `--device` override. Several devices (`--device A,B`,
`place_several`): llama.cpp's layer split gives each a range of layers, and each device's pool
holds its own layers' experts, sized by the same rule per device.

A hybrid model (qwen35moe, qwen3next: gated-delta-net layers with every 4th layer full
attention) has a KV cache in its full-attention layers only and a recurrent state in the others,
which llama.cpp puts with the layer, as it does the KV cache: the contexts hold
`recurrent_states(γ, pool_draft)` states of `ModelSizes.state_bytes` each, and the note says
how many bytes that is.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from orchestrator.runtime.native import ggml_device_api
from orchestrator.runtime.pool import DEFAULT_BUDGET_RATIO, Budget, PoolDevice
from orchestrator.runtime.ubatch import DEFAULT_UBATCH, buffer_growth, prompt_ubatch
from orchestrator.gguf_files.model_sizes import ModelSizes, model_sizes, recurrent_layers, state_per_layer  # noqa: F401  (placement's inputs)

MARGIN = 1 << 30       # left free on the device (llama.cpp's --fit target default: 1 GiB)
UBATCH_SHARE = 1 / 8   # a longer prompt pass's compute buffer may take this share of the pool's room
CPU_RATIO = DEFAULT_BUDGET_RATIO  # pool size on the CPU test device when no --expert-budget is given


@dataclass(frozen=True)
class GPU:
    name: str     # ggml device name, e.g. CUDA0
    free: int     # bytes
    total: int


@dataclass(frozen=True)
class Placement:
    pool: tuple[PoolDevice, ...]  # the pool's devices, each with its budget, in layer order; (): the pool is off
    n_gpu_layers: int      # target layers whose non-expert weights go to the GPU
    note: str              # one line: where things went and why (or why the pool is off)
    stream_off: str = ""   # why a streamed prefill has no room beside the pool ("": it has, or no GPU to say)
    ubatch: int = DEFAULT_UBATCH  # the prompt pass's tokens under -ub auto (runtime/ubatch.py)
    tensor_split: tuple[float, ...] = ()         # several devices: llama.cpp's --tensor-split (their free memory)
    state_bytes: int = 0   # the contexts' recurrent states over every layer (a hybrid; with the layers, device or host)

    @property
    def device(self) -> str | None:
        """The first pool device; None: the pool is off."""
        return self.pool[0].name if self.pool else None

    @property
    def stream_prefill(self) -> bool:
        return not self.stream_off


class PlacementError(ValueError):
    """An explicit request that cannot be met; the message names the flag."""


def _layers(ngl: str, n_layer: int) -> int | None:
    if ngl == "all":
        return n_layer
    if ngl == "auto":
        return None
    return min(int(ngl), n_layer)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def recurrent_states(gamma: int, pool_draft: bool) -> int:
    """Recurrent states per layer that spac's contexts keep on a hybrid model (llm.Context): the
    target's llama.cpp n_seq_max (1) × (1 + n_rs_seq), n_rs_seq = γ snapshots when speculating
    (0 when not), and a pool draft's context n_seq_max 2 (a scratch sequence), n_rs_seq 0."""
    return 1 + max(gamma, 0) + (2 if pool_draft else 0)


def _per_layer(sizes: ModelSizes, n_ctx: int, states: int) -> float:
    """Device bytes of one offloaded layer besides its experts, averaged over the layers: non-expert
    weights, KV cache and recurrent states (llama.cpp allocates a layer's memory on its device)."""
    held = sizes.non_expert_bytes + sizes.kv_bytes_per_token * n_ctx + sizes.state_bytes * states
    return held / max(sizes.n_layer, 1)


def _state_note(sizes: ModelSizes, states: int, n_layers: int, sep: str = ", ", where: str = "") -> str:
    """sep + "recurrent state X MiB (N × Y MiB)" for n_layers of the model's layers; "" without one."""
    if not sizes.state_bytes:
        return ""
    share = sizes.state_bytes * states * n_layers // max(sizes.n_layer, 1)
    size = lambda n: _mib(n) if n >= 10 << 20 else f"{n / 2**20:.2f} MiB"  # noqa: E731 - tiny models
    return f"{sep}recurrent state {size(share)}{where} ({states} × {size(sizes.state_bytes)})"


def _held(sizes: ModelSizes) -> str:
    return "weights, KV cache and recurrent state" if sizes.state_bytes else "weights and KV cache"


def place(sizes: ModelSizes, n_ctx: int, gpu: GPU | None, device: str | None, budget: Budget, ngl: str = "auto",
          expert_engine: bool | None = None, margin: int = MARGIN, stream: bool = True, states: int = 1,
          auto_ubatch: bool = True) -> Placement:
    """The placement for these model sizes, this free GPU memory (gpu: the first GPU, None if
    there is none) and these options (device: --device; budget: --expert-budget; ngl: -ngl;
    expert_engine: --engine/--no-engine, None = on when possible; stream: --stream-prefill is not off;
    states: recurrent states per layer, `recurrent_states`, counted where sizes.state_bytes;
    auto_ubatch: -ub auto, the prompt pass chosen here and paid for from the pool; False: -ub N).

    On a GPU a streamed prefill's staging slots (sizes.staging_bytes) are set aside before the
    pool takes the rest; where they do not fit beside the pool the pool keeps the room and the
    prompt takes llama.cpp's prefill (stream_prefill False, said in the note)."""
    n_layer = max(sizes.n_layer, 1)
    want = _layers(ngl, n_layer)
    total_state = sizes.state_bytes * states
    on_gpu = gpu if device is None or (gpu is not None and gpu.name == device) else None
    if on_gpu is None:  # the layers stay on the host, or go to a device of unknown memory (RPC) with -ngl
        remote = device is not None and device.upper() != "CPU" and want
        host = _state_note(sizes, states, n_layer, "; ", "" if remote else " on the host")
    if on_gpu is None and device is not None:  # CPU (the test stand-in) or a device of unknown memory (RPC)
        name = "the CPU test device" if device.upper() == "CPU" else device
        if budget.nbytes > sizes.expert_bytes > 0:
            return Placement((PoolDevice(device, Budget(nbytes=sizes.expert_bytes)),), want or 0, f"expert pool on {name}: every expert "
                             f"(--expert-budget {_mib(budget.nbytes)} > {_mib(sizes.expert_bytes)} of experts){host}",
                             state_bytes=total_state)
        return Placement((PoolDevice(device, budget if not budget.auto else Budget(ratio=CPU_RATIO)),), want or 0,
                         f"expert pool on {name}, {budget.describe() if not budget.auto else f'{CPU_RATIO:.0%} of the experts'}"
                         f"{host}", state_bytes=total_state)
    if device is None and gpu is None:
        ngl_off = want or 0
        if expert_engine:
            raise PlacementError("--engine: no GPU found for the expert pool (--device CPU runs it on the CPU test device)")
        return Placement((), ngl_off, "expert pool off: no GPU found (--device CPU runs it on the CPU test "
                         f"device){host}", state_bytes=total_state)
    per_layer = _per_layer(sizes, n_ctx, states)
    if want is None:  # auto: as many layers as fit, keeping the margin
        want = max(0, min(n_layer, int((on_gpu.free - margin) // per_layer))) if per_layer > 0 else n_layer
    used = per_layer * want
    layers = f"{want}/{n_layer} layers on {on_gpu.name}{_state_note(sizes, states, want)}"
    if expert_engine is False or not sizes.expert_bytes:
        why = "--no-engine" if sizes.expert_bytes else "the model has no routed experts"
        return Placement((), want, f"expert pool off ({why}); {layers}", state_bytes=total_state)
    left = int(on_gpu.free - used - margin)
    staging = sizes.staging_bytes if stream else 0

    def with_staging(pool: int, note: str, ubatch: int = DEFAULT_UBATCH) -> Placement:
        off = ""
        if pool >= sizes.expert_bytes:  # nothing is ever missing: no staging slots (patch 0026)
            note += " (every expert, copied at load)"
        elif staging and pool + staging <= left:
            note += f" + {_mib(staging)} of staging slots for streamed prefill"
        elif staging:
            off = f"its {_mib(staging)} of staging slots do not fit beside the pool on {on_gpu.name}"
            note += f"; streamed prefill off: {off} (--stream-prefill off silences this; a smaller --expert-budget makes room)"
        if ubatch != DEFAULT_UBATCH:
            note += f"; prompt passes of {ubatch} tokens (-ub auto)"
        return Placement((PoolDevice(on_gpu.name, Budget(nbytes=pool)),), want, note, stream_off=off,
                         state_bytes=total_state, ubatch=ubatch)

    if not budget.auto:
        pool = budget.nbytes or int(budget.ratio * sizes.expert_bytes)
        if pool > left:
            raise PlacementError(f"--expert-budget {_mib(pool)} does not fit {on_gpu.name}: {_mib(max(left, 0))} free "
                                 f"after {want} layers' {_held(sizes)} and a {_mib(margin)} margin")
        pool = min(pool, sizes.expert_bytes)
        ubatch = DEFAULT_UBATCH
        if auto_ubatch and staging and pool + staging <= left:  # a streamed prefill: the pass may use what the budget leaves
            ubatch = prompt_ubatch(sizes, pool, n_ctx, left - pool - staging)
        return with_staging(pool, f"{layers}, expert pool {_mib(pool)}", ubatch)
    if left < max(sizes.one_expert * n_layer, 1):  # less than one slot per layer: not worth a pool
        if expert_engine:
            raise PlacementError(f"--engine: no room for the expert pool on {on_gpu.name} ({_mib(on_gpu.free)} free, "
                                 f"{_mib(used)} for {want} layers' {_held(sizes)}); lower -ngl or --ctx-size")
        return Placement((), want, f"expert pool off: {on_gpu.name} is full after {want}/{n_layer} layers "
                         f"({_mib(on_gpu.free)} free, {_mib(used)} for their {_held(sizes)})", state_bytes=total_state)
    if left >= sizes.expert_bytes:  # every expert fits: no staging slots, no copies after load
        return with_staging(sizes.expert_bytes, f"{layers}, expert pool {_mib(sizes.expert_bytes)}")
    # the staging slots first, unless the pool would then drop below one slot per layer
    room = left - staging if left - staging >= sizes.one_expert * n_layer else left
    pool = min(room, sizes.expert_bytes)
    ubatch = DEFAULT_UBATCH
    if auto_ubatch and staging and room == left - staging:  # a streamed prefill: its pass, paid from the pool's room
        ubatch = prompt_ubatch(sizes, pool, n_ctx, int(UBATCH_SHARE * room))
        pool = min(room - buffer_growth(sizes, ubatch, n_ctx), sizes.expert_bytes)
    return with_staging(pool, f"{layers}, expert pool {_mib(pool)} "
                              f"({pool / sizes.expert_bytes:.0%} of the experts)", ubatch)


# ----------------------------------------------------------------------------- several devices

def layer_split(n_layers: int, free: list[int]) -> list[int]:
    """How many of the last n_layers layers llama.cpp's layer split puts on each device when its
    --tensor-split is left to the devices' free memory (Model passes -ngl n_layers + 1: the output
    layer counts as one more): offloaded layer i goes to the first device whose cumulative share
    exceeds i / (n_layers + 1)."""
    total = sum(free)
    shares = [f / total if total > 0 else 1 / len(free) for f in free]
    bounds = [sum(shares[: i + 1]) for i in range(len(free))]
    counts = [0] * len(free)
    for i in range(n_layers):
        counts[next((d for d, b in enumerate(bounds) if i / (n_layers + 1) < b), len(free) - 1)] += 1
    return counts


def place_several(sizes: ModelSizes, n_ctx: int, gpus: list[GPU], budgets: list[Budget], ngl: str = "auto",
                  margin: int = MARGIN, stream: bool = True, states: int = 1) -> Placement:
    """The placement over several devices (--device A,B): llama.cpp's layer split puts the
    non-expert weights and KV cache of a contiguous range of layers on each device, in proportion
    to its free memory; each device's pool holds the experts of its own layers and takes the
    free memory left after them (the place() rule per device), or its --expert-budget (one entry
    per device, or one for all; a percentage is of its own layers' experts). The layers left on
    the host (-ngl below the layer count) go to the first device's pool. The first device is the
    Placement's device; the note has one part per device."""
    n_layer = max(sizes.n_layer, 1)
    if len(budgets) not in (1, len(gpus)):
        raise PlacementError(f"--expert-budget: {len(budgets)} values for {len(gpus)} devices (give one, or one per device)")
    budgets = budgets * len(gpus) if len(budgets) == 1 else budgets
    per_layer = _per_layer(sizes, n_ctx, states)
    want = _layers(ngl, n_layer)
    if want is None:
        room = sum(max(g.free - margin, 0) for g in gpus)
        want = max(0, min(n_layer, int(room // per_layer))) if per_layer > 0 else n_layer
    counts = layer_split(want, [g.free for g in gpus])
    counts[0] += n_layer - want  # the host's layers: their experts in the first device's pool
    staging = sizes.staging_bytes if stream else 0
    out, stream_off = [], ""
    for i, (gpu, budget, n) in enumerate(zip(gpus, budgets, counts)):
        if n == 0:
            raise PlacementError(f"--device {gpu.name}: llama.cpp's layer split gives it no layer of {n_layer} "
                                 f"({want} on the devices); drop it or raise -ngl")
        on_dev = n - (n_layer - want if i == 0 else 0)
        left = int(gpu.free - per_layer * on_dev - margin)
        experts = sizes.expert_bytes * n // n_layer  # the experts of its layers
        if not budget.auto:
            pool = budget.nbytes or int(budget.ratio * experts)
            if pool > left:
                raise PlacementError(f"--expert-budget {_mib(pool)} does not fit {gpu.name}: {_mib(max(left, 0))} free "
                                     f"after {on_dev} layers' {_held(sizes)} and a {_mib(margin)} margin")
            nbytes, ratio = (min(budget.nbytes, experts), 0.0) if budget.nbytes else (0, budget.ratio)
        else:
            if left < max(sizes.one_expert * n, 1):
                raise PlacementError(f"--device {gpu.name}: no room for an expert pool ({_mib(gpu.free)} free, "
                                     f"{_mib(per_layer * on_dev)} for its {on_dev} layers' {_held(sizes)})")
            room = left - staging if left - staging >= sizes.one_expert * n else left
            nbytes, ratio = min(room, experts), 0.0
        pool = nbytes or int(ratio * experts)
        if staging and pool + staging > left and not stream_off:
            stream_off = f"its {_mib(staging)} of staging slots do not fit beside the pool on {gpu.name}"
        share = f"{pool / experts:.0%} of its experts" if experts else "no experts"
        lo = sum(counts[:i])
        out.append((PoolDevice(gpu.name, Budget(nbytes, ratio)),
                    f"{gpu.name}: layers {lo}..{lo + n - 1}{_state_note(sizes, states, on_dev)}, "
                    f"expert pool {_mib(pool)} ({share})"))
    note = f"{want}/{n_layer} layers on {len(gpus)} devices; " + "; ".join(n for _, n in out)
    if want < n_layer:
        note += _state_note(sizes, states, n_layer - want, "; ", " on the host")
    if stream_off:
        note += f"; streamed prefill off: {stream_off}"
    elif staging:
        note += f"; + {_mib(staging)} of staging slots for streamed prefill on each"
    # the free memory this rule split by is handed to llama.cpp as its --tensor-split, so that the
    # layers land where the budgets were sized, whatever the devices report at load time
    return Placement(tuple(d for d, _ in out), want, note, stream_off, tensor_split=tuple(float(g.free) for g in gpus),
                     state_bytes=sizes.state_bytes * states)


def pool_layer_ranges(layer_devices: list[str], pool_devices: list[str],
                      moe_layers: list[int] | None = None) -> list[tuple[int, int] | None]:
    """The model layers [begin, end) whose experts each pool device holds, from where llama.cpp
    placed each layer (`native.model_layer_devices`): the layers on that device, the first range
    also taking the host's layers before it (one device: (0, 0), every layer). None for a device
    whose layers have no routed experts (moe_layers: the layers that have; leading dense layers).
    PlacementError when a device holds no layer, or not one contiguous range."""
    if len(pool_devices) == 1:
        return [(0, 0)]
    spans = []
    for name in pool_devices:
        on = [il for il, d in enumerate(layer_devices) if d == name]
        if not on:
            raise PlacementError(f"--device {name}: llama.cpp placed no layer on it (layers are on "
                                 f"{', '.join(sorted(set(layer_devices)))}); lower -c or drop the device")
        if on[-1] - on[0] + 1 != len(on):
            raise PlacementError(f"--device {name}: its layers {on[0]}..{on[-1]} are not one contiguous range")
        spans.append([on[0], on[-1] + 1])
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    spans[order[0]][0] = 0  # the host's layers come first in llama.cpp's split
    for a, b in zip(order, order[1:]):
        spans[a][1] = spans[b][0]
    spans[order[-1]][1] = len(layer_devices)
    moe = range(len(layer_devices)) if moe_layers is None else moe_layers
    return [tuple(s) if any(s[0] <= il < s[1] for il in moe) else None for s in spans]


# ----------------------------------------------------------------------------- inputs of the rule

def devices() -> list[tuple[str, int, int, int]]:
    """Every ggml device as (name, type, free bytes, total bytes); type 1 is a GPU
    (ggml_backend_dev_type). Read from ggml's backend registry, which llama.cpp fills."""
    g = ggml_device_api()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append((g.ggml_backend_dev_name(dev).decode(), g.ggml_backend_dev_type(dev), free.value, total.value))
    return out


def first_gpu() -> GPU | None:
    """The first GPU ggml sees, with its free memory; None without one."""
    return next((GPU(name, free, total) for name, kind, free, total in devices() if kind == 1), None)
