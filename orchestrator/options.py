"""What every `spac` command shares with the user: one-line errors, safe output files, and the
option block of `generate`, `chat`, `calibrate` (and `serve`, `trace record`) defined once.

    from orchestrator.options import check_output, fail

    fail("--temp must be a finite number")      # "spac: error: ..." on stderr, exit 2
    check_output(dst, force, inputs=[src])      # the output is not the input, nor exists unless --force
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

import typer

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
