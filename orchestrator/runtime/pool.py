"""The expert pool's devices: one typed value from the command line to the engine.

    opts.pool == (PoolDevice("CUDA0", Budget(ratio=0.25)), PoolDevice("CUDA1", Budget(nbytes=2 << 30)))

`RunOptions.from_cli` builds the tuple once from --device and --expert-budget (one entry per
device, a name None when --device is not given); the placement (placement.py) gives every
entry its device and a concrete budget; the session (decoding/speculative.py) gives each the
layers llama.cpp put on it and hands the tuple to the engine (native.py). No layer splits it
into a first device and the rest, or re-checks it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

DEFAULT_BUDGET_RATIO = 0.25  # the pool's share of the experts when nothing sizes it (spac.h's default)

_UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(text: str, hint: str) -> tuple[int, float]:
    """A size flag's value: "25%" → (0, 0.25); "512M", "2GiB", "123456" → (bytes, 0.0). ValueError
    (the text, then `hint`) for anything else: a percentage outside (0, 100], a fraction of a byte.
    Bytes of 0 or fewer are the caller's to refuse."""
    s = text.strip().upper().replace(" ", "")
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ValueError(f"{text!r}: {hint}") from None
        if not 0 < pct <= 100 or pct != pct:
            raise ValueError(f"{text!r}: a percentage must be in (0, 100]; {hint}")
        return 0, pct / 100.0
    m = re.fullmatch(r"(-?[0-9]*\.?[0-9]+)([KMGT]?I?)B?", s)
    if not m:
        raise ValueError(f"{text!r}: {hint}")
    value, unit = float(m.group(1)), m.group(2)
    if not unit and value != int(value):
        raise ValueError(f"{text!r} is ambiguous (a fraction of bytes?): {hint}")
    return int(value * _UNITS[unit]), 0.0


@dataclass(frozen=True)
class Budget:
    """--expert-budget, parsed once: `nbytes` > 0, or `ratio` in (0, 1] of all expert bytes.
    Neither (`Budget()`, the flag not given): the placement rule decides (placement.py)."""

    nbytes: int = 0
    ratio: float = 0.0

    @property
    def auto(self) -> bool:
        return not self.nbytes and not self.ratio

    @classmethod
    def parse(cls, text: str | None) -> Budget:
        """"25%" → ratio 0.25; "512M", "2GiB", "123456" → bytes. Anything that would leave the
        pool empty or is ambiguous ("0", "0%", "-5%", "0.5", "150%") raises ValueError naming
        the flag; --no-engine is how the pool is turned off."""
        if text is None:
            return cls()
        hint = "give bytes (512M, 2GiB) or a percentage of all experts (25%); --no-engine turns the pool off"
        try:
            nbytes, ratio = parse_size(text, hint)
        except ValueError as e:
            raise ValueError(f"--expert-budget {e}") from None
        if ratio:
            return cls(ratio=ratio)
        if nbytes <= 0:
            raise ValueError(f"--expert-budget {text!r} leaves the pool empty: {hint}")
        return cls(nbytes=nbytes)

    def describe(self) -> str:
        if self.nbytes:
            return f"{self.nbytes / 2**20:.0f} MiB"
        return f"{self.ratio:.0%} of the experts" if self.ratio else "auto"


@dataclass(frozen=True)
class PoolDevice:
    """One device of the expert pool: its ggml name ("CPU": the test stand-in, a second host
    buffer), its budget (bytes, else a share of the experts of the layers it holds) and the model
    layers [begin, end) it holds ((0, 0): every layer; None: none with routed experts, so no pool
    there). `name` None and an automatic budget: not decided yet (the placement decides)."""

    name: str | None = None
    budget: Budget = Budget()
    layers: tuple[int, int] | None = (0, 0)

    @property
    def on_host(self) -> bool:
        """The CPU test device (or not decided): llama.cpp's layers stay on the host."""
        return self.name is None or self.name.upper() == "CPU"


class StreamPrefill(str, Enum):
    """--stream-prefill: a prompt pass of more than 64 tokens computes its experts on the pool
    device (patch 0016; spac.h enum spac_stream_prefill). AHEAD copies every non-resident expert of
    the next layer while one computes, USED the experts a layer's router chose once it has run,
    OFF is llama.cpp's prefill. AUTO is decided once, by `resolve`."""

    AUTO = "auto"
    AHEAD = "ahead"
    USED = "used"
    OFF = "off"

    def resolve(self, device: PoolDevice) -> StreamPrefill:
        """AUTO: ahead on a GPU or RPC pool; off on the CPU test device, where streaming a prompt
        would only add copies to the host's work."""
        if self is not StreamPrefill.AUTO:
            return self
        return StreamPrefill.OFF if device.on_host else StreamPrefill.AHEAD
