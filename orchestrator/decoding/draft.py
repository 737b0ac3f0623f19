"""What drafts for the target: nothing, a draft GGUF, the target through its expert pool, or the
target's multi-token-prediction head. A `Draft` is asked what it is (`kind`, `is_target`),
never recognised by identity.

    Draft.of(None)            # NO_DRAFT: autoregressive decoding
    Draft.of("draft.gguf")    # DraftKind.FILE with its path (-md)
    Draft.of("pool")          # POOL_DRAFT (--draft pool), Draft.of("mtp"): MTP_DRAFT (--draft mtp)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class DraftKind(str, Enum):
    NONE = "none"   # no speculation
    FILE = "file"   # a second model (-md): same vocabulary, its own context
    POOL = "pool"   # the target itself, a second context routed only to the experts in the pool
    MTP = "mtp"     # the target's MTP head (orchestrator.decoding.mtp_draft)


@dataclass(frozen=True)
class Draft:
    kind: DraftKind = DraftKind.NONE
    path: Path | None = None  # DraftKind.FILE only

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", DraftKind(self.kind))
        if (self.kind is DraftKind.FILE) != (self.path is not None):
            raise ValueError(f"a {self.kind.value} draft {'needs' if self.path is None else 'has no'} path")

    @classmethod
    def of(cls, value: Draft | DraftKind | str | Path | None) -> Draft:
        """None: no draft; a Draft as it is; a kind or its name ("none", "pool", "mtp"); any other
        string or a Path: a draft file."""
        if value is None:
            return NO_DRAFT
        if isinstance(value, Draft):
            return value
        if isinstance(value, DraftKind):
            return cls(value)
        if isinstance(value, str) and value in (DraftKind.NONE.value, DraftKind.POOL.value, DraftKind.MTP.value):
            return cls(DraftKind(value))
        return cls(DraftKind.FILE, Path(value))

    @property
    def is_target(self) -> bool:
        """The target's own weights draft (pool or MTP): no second model, no vocabulary to check."""
        return self.kind in (DraftKind.POOL, DraftKind.MTP)

    @property
    def none(self) -> bool:
        return self.kind is DraftKind.NONE

    def __str__(self) -> str:
        return str(self.path) if self.path is not None else self.kind.value


NO_DRAFT = Draft()
POOL_DRAFT = Draft(DraftKind.POOL)
MTP_DRAFT = Draft(DraftKind.MTP)
