#!/usr/bin/env python3
"""Run a command in a fresh memory cgroup with a limit, and say how it went.

    scripts/memory_cgroup.py --limit 600M [--drop FILE]... -- CMD ARG...

The machine a user runs spac on has less RAM than the model; a memory cgroup is how one machine
plays that one (tests/test_host_tier.py, bench/bench_disk.py). Needs root and the memory
controller (cgroup v1's, or v2's). --drop evicts a file from the page cache first, so that the run
reads it from the disk. Prints one JSON line on stderr: {"limit", "peak", "oom_kills", "rc"}; exits
with the command's code (137 when the OOM killer took it). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"([0-9]+)([KMG]?)(I?B)?", text.strip().upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (bytes, or 600M, 2G)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def available() -> str | None:
    """Why no memory cgroup can be made here, or None when one can."""
    if os.geteuid() != 0:
        return "not root"
    if (V1 / "memory.limit_in_bytes").exists() and os.access(V1, os.W_OK):
        return None
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return None
    return "no writable memory controller (cgroup v1 or v2)"


def drop_from_page_cache(path: Path) -> None:
    """Evict the file's pages (those no process maps) from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class MemoryCgroup:
    """A new cgroup with a memory limit (v1's memory controller where mounted, else v2)."""

    def __init__(self, limit: int):
        self.limit = limit
        name = f"spac-{uuid.uuid4().hex[:8]}"
        self.v1 = (V1 / "memory.limit_in_bytes").exists()
        self.path = (V1 if self.v1 else V2) / name
        self.path.mkdir()
        if self.v1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit))  # no swapping out of the limit either
        else:
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")

    def join(self) -> None:
        """Move the calling process in (a child's preexec_fn)."""
        (self.path / ("tasks" if self.v1 else "cgroup.procs")).write_text(str(os.getpid()))

    def peak(self) -> int:
        f = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        return int((self.path / f).read_text()) if (self.path / f).exists() else -1

    def oom_kills(self) -> int:
        text = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
        m = re.search(r"^oom_kill (\d+)", text, re.M)
        return int(m.group(1)) if m else 0

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def run(cmd: list[str], limit: int, drop: list[Path] = (), **kwargs) -> tuple[subprocess.CompletedProcess, dict]:
    """cmd in a fresh cgroup of `limit` bytes, the files in `drop` evicted from the page cache
    first: (the completed process, {"limit", "peak", "oom_kills", "rc"})."""
    for path in drop:
        drop_from_page_cache(path)
    group = MemoryCgroup(limit)
    try:
        proc = subprocess.run(cmd, preexec_fn=group.join, **kwargs)
        report = {"limit": limit, "peak": group.peak(), "oom_kills": group.oom_kills(), "rc": proc.returncode}
    finally:
        group.remove()
    return proc, report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", required=True, type=parse_size, help="the memory limit: bytes, or 600M, 2G")
    ap.add_argument("--drop", action="append", type=Path, default=[], help="evict this file from the page cache first")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command after --")
    why = available()
    if why:
        print(f"memory_cgroup: cannot make a memory cgroup here: {why}", file=sys.stderr)
        return 2
    proc, report = run(cmd, args.limit, args.drop)
    print(json.dumps(report), file=sys.stderr)
    return 137 if report["oom_kills"] else proc.returncode


if __name__ == "__main__":
    sys.exit(main())
