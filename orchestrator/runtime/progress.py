"""What the slow steps of opening a session are doing, told to whoever shows it. The engine opens
phases (the model load, the host layout timing, the warm-up calibration); the CLI installs a
reporter that shows them on stderr. The default reporter shows nothing, so a library user or a
test sees no output unless it installs one.

    with progress.phase("calibrating", total=8) as calibrating:     # engine code
        ...; calibrating.advance()
    report_fraction("loading model.gguf", 0.4)                       # a callback that knows only a fraction
    with progress.reporting(progress.on_stderr(err, plain=json_out)):  # the CLI
        session = Session(cfg)

On a terminal: a rich display that vanishes when its phase ends (a phase of a second or more
leaves one line). Elsewhere, and under --json: plain lines on stderr for a phase that runs past a
second (its start, its share done every 10%, its end with seconds); a quicker one prints nothing,
so a warm start stays quiet and a bad file's error stays one line. stdout is never written.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

PREFIX = "spac: "
# plain lines: a phase's share done every 10%, but no more often than once a second (so a fast
# phase is its start and end lines only)
PLAIN_SHARE_STEP = 0.1
PLAIN_MIN_GAP_S = 1.0
# on a terminal a phase this long leaves a line behind; a shorter one vanishes with its display
KEEP_LINE_S = 1.0
# plain lines: a phase is shown once it has run this long (a timer prints its start line)
PLAIN_QUIET_S = 1.0


class Phase:
    """One running phase, as its reporter shows it; this one shows nothing."""

    def advance(self, steps: float = 1) -> None:
        """`steps` more of the total done."""

    def update(self, completed: float) -> None:
        """`completed` of the total done."""

    def end(self, finished: bool) -> None:
        """Over: finished, or left by an error or Ctrl-C."""


class Reporter:
    """Shows phases; this one shows nothing (the default)."""

    def start(self, name: str, total: float | None) -> Phase:
        return Phase()


_reporter = Reporter()
# the phases report_fraction opened and has not seen end: name -> (reporter, phase, last fraction)
_by_name: dict[str, tuple[Reporter, Phase, float]] = {}
_lock = threading.Lock()


@contextmanager
def phase(name: str, total: float | None = None) -> Iterator[Phase]:
    """A phase of `total` steps (None: unknown) shown by the installed reporter while the block runs."""
    running = _reporter.start(name, total)
    finished = False
    try:
        yield running
        finished = True
    finally:
        running.end(finished)


def report_fraction(name: str, fraction: float) -> bool:
    """The phase `name` is `fraction` (0..1) done: it opens at its first report (or at a fraction
    below the last one: the same file loaded again) and ends at 1.0. For a callback that cannot hold
    a `with` block (llama.cpp's load callback). Returns True, for `report_fraction(...) and not
    interrupted()`; never raises: a ctypes callback that raises returns False, which aborts the load."""
    try:
        with _lock:
            reporter, running, last = _by_name.get(name, (None, None, 0.0))
            if running is None or reporter is not _reporter or fraction < last:
                if running is not None:
                    running.end(False)
                reporter, running = _reporter, _reporter.start(name, 1.0)
            running.update(fraction)
            _by_name[name] = (reporter, running, fraction)
            if fraction >= 1.0:
                del _by_name[name]
                running.end(True)
    except Exception:  # noqa: BLE001 - a display's failure must not abort what it shows
        pass
    return True


@contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Phases are shown by `reporter` inside the block. Leaving it ends the phases report_fraction
    left open (a failed or interrupted load) and puts the previous reporter back."""
    global _reporter
    previous, _reporter = _reporter, reporter
    try:
        yield reporter
    finally:
        with _lock:
            for name in [n for n, (r, _, _) in _by_name.items() if r is reporter]:
                _by_name.pop(name)[1].end(False)
        _reporter = previous


def on_stderr(console: Console, plain: bool = False) -> Reporter:
    """The live display on `console` (stderr) when it is a terminal, else plain lines on stderr;
    plain: lines always (--json's stderr is read as a log)."""
    if plain or not console.is_terminal or console.is_dumb_terminal:
        return PlainReporter()
    return RichReporter(console)


class PlainReporter(Reporter):
    """One line per event on stderr (looked up at each line, so a redirected stderr gets them), for
    the phases that run past quiet_s."""

    def __init__(self, quiet_s: float | None = None):
        self.quiet_s = quiet_s

    def start(self, name: str, total: float | None) -> Phase:
        return _PlainPhase(name, total, PLAIN_QUIET_S if self.quiet_s is None else self.quiet_s)


class _PlainPhase(Phase):
    def __init__(self, name: str, total: float | None, quiet_s: float):
        self.name, self.total = name, total
        self.completed = 0.0
        self.t0 = self.last_line = time.monotonic()
        self.shown_share = 0.0
        self.shown = self.ended = False
        self._lock = threading.Lock()
        self._timer = None
        if quiet_s <= 0:
            self._show()
        else:  # a daemon timer: the phase's own thread is busy in native code meanwhile
            self._timer = threading.Timer(quiet_s, self._show)
            self._timer.daemon = True
            self._timer.start()

    def _show(self) -> None:
        with self._lock:
            if not self.ended:
                self.shown = True
                _line(f"{self.name} ...")

    def advance(self, steps: float = 1) -> None:
        self.update(self.completed + steps)

    def update(self, completed: float) -> None:
        self.completed = completed
        if not self.total:
            return
        share = completed / self.total
        now = time.monotonic()
        if self.shown and share < 1.0 and share - self.shown_share >= PLAIN_SHARE_STEP and \
                now - self.last_line >= PLAIN_MIN_GAP_S:
            self.shown_share, self.last_line = share, now
            _line(f"{self.name}: {share:.0%}")

    def end(self, finished: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self.ended = True
            if finished and self.shown:  # else the error or `stop: interrupted` that follows says why
                _line(f"{self.name}: {time.monotonic() - self.t0:.1f} s")


def _line(text: str) -> None:
    sys.stderr.write(PREFIX + text + "\n")
    sys.stderr.flush()


class RichReporter(Reporter):
    """A transient rich display on a terminal console, one row per running phase."""

    def __init__(self, console: Console):
        self.console = console
        self._bar: Progress | None = None  # live while a phase runs
        self._running = 0
        self._lock = threading.Lock()

    def start(self, name: str, total: float | None) -> Phase:
        with self._lock:
            if self._bar is None:
                self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                     TaskProgressColumn(), TimeElapsedColumn(), console=self.console, transient=True)
                self._bar.start()
            self._running += 1
            return _RichPhase(self, self._bar, self._bar.add_task(name, total=total), name)

    def _end(self, bar: Progress, task: int, name: str, seconds: float | None) -> None:
        with self._lock:
            bar.remove_task(task)
            if seconds is not None and seconds >= KEEP_LINE_S:
                bar.console.print(Text(f"{name}: {seconds:.1f} s", style="dim"))
            self._running -= 1
            if self._running == 0 and self._bar is bar:
                bar.stop()
                self._bar = None


class _RichPhase(Phase):
    def __init__(self, reporter: RichReporter, bar: Progress, task: int, name: str):
        self.reporter, self.bar, self.task, self.name = reporter, bar, task, name
        self.t0 = time.monotonic()

    def advance(self, steps: float = 1) -> None:
        self.bar.advance(self.task, steps)

    def update(self, completed: float) -> None:
        self.bar.update(self.task, completed=completed)

    def end(self, finished: bool) -> None:
        self.reporter._end(self.bar, self.task, self.name, time.monotonic() - self.t0 if finished else None)
