"""The session worker: one `Session`, one request at a time, from a bounded FIFO queue.

The HTTP side turns a request into a `Job` (prompt tokens, limits, sampling) and `submit`s it;
a full queue is refused at once (`QueueFull`, answered 503 with Retry-After). One thread owns
the session: it loads the models (the server answers /health 503 meanwhile), then runs the jobs
in order. A job's text and its end travel back to the event loop of the request as `Event`s.

A job is cancelled (client gone, server stopping) through `Job.cancel`: the session's
`on_verify_step` hook raises at the end of the current verification step, so the generation
stops within one step and the KV caches stay a valid prefix for the next request.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.decoding.metrics import RunMetrics
from orchestrator.decoding.sampling import SamplingParams
from orchestrator.decoding.speculative import Session


class QueueFull(RuntimeError):
    """Every place in the queue is taken."""


class NotAccepting(RuntimeError):
    """The worker is still loading, failed to load, or is shutting down."""


class Cancelled(Exception):
    """Raised from the session's step hook to end a cancelled job."""


@dataclass(frozen=True)
class Event:
    kind: str                        # "text", "done" (metrics), "error" (message in text)
    text: str = ""
    status: int = 500                # of an error
    metrics: RunMetrics | None = None
    aborted: bool = False            # "done" because the server is stopping


SHUTTING_DOWN = Event("error", "the server is shutting down", status=503)


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    stop: list[str]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _aborted: bool = False

    def cancel(self, aborted: bool = False) -> None:
        """Stop at the end of the current verification step (or skip the job if it waits).
        aborted: the server is stopping, the client still listens and gets a clean end."""
        self._aborted = self._aborted or aborted
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        """From the worker thread to the request's event loop (dropped if that loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass


class SessionWorker:
    """open_session: builds the Session (called on the worker thread). queue_size: jobs that may
    wait behind the running one. on_step(seconds): every verification step; on_done(metrics):
    every finished job; on_failed(message): loading failed (the server should stop)."""

    def __init__(self, open_session: Callable[[], Session], queue_size: int = 16,
                 on_step: Callable[[float], None] | None = None,
                 on_done: Callable[[RunMetrics], None] | None = None,
                 on_failed: Callable[[str], None] | None = None) -> None:
        self._open_session = open_session
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="spac-worker", daemon=True)
        self.on_step, self.on_done, self.on_failed = on_step, on_done, on_failed
        self.session: Session | None = None
        self.state = "loading"       # → "ready" | "failed"; "stopping" once shutdown began
        self.error = ""
        self.current: Job | None = None
        self.n_queued = 0

    # -- HTTP side ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.state != "ready":
                raise NotAccepting(self.state)
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                raise QueueFull() from None
            self.n_queued += 1

    def shutdown(self) -> None:
        """Accept nothing more, end the running job cleanly (its stream gets its last chunk),
        refuse the waiting ones; the thread then frees the session. Safe to call twice."""
        with self._lock:
            if self.state == "stopping":
                return
            self.state = "stopping"
            current = self.current
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.emit(SHUTTING_DOWN)
            self.n_queued = 0
            self._jobs.put_nowait(None)  # room: the queue was just emptied and nothing more gets in
        if current is not None:
            current.cancel(aborted=True)

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- worker thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            session = self._open_session()
        except BaseException as e:  # noqa: BLE001 — any load failure ends the server with its message
            self.error = " ".join(str(e).split()) or type(e).__name__
            with self._lock:
                self.state = "failed"
            if self.on_failed is not None:
                self.on_failed(self.error)
            return
        self.session = session
        with self._lock:
            if self.state == "loading":
                self.state = "ready"
        try:
            while (job := self._jobs.get()) is not None:
                with self._lock:
                    self.n_queued -= 1
                    self.current = job
                    stopping = self.state == "stopping"  # taken off the queue just before shutdown drained it
                try:
                    if stopping:
                        job.emit(SHUTTING_DOWN)
                    elif not job.cancelled:
                        self._serve(session, job)
                finally:
                    with self._lock:
                        self.current = None
        finally:
            session.close()

    def _serve(self, session: Session, job: Job) -> None:
        def step_hook(seconds: float) -> None:
            if self.on_step is not None:
                self.on_step(seconds)
            if job.cancelled:
                raise Cancelled()

        session.on_verify_step = step_hook
        chunks = session.generate(job.prompt, job.max_tokens, job.stop, job.sampling)
        try:
            for text in chunks:
                job.emit(Event("text", text))
        except Cancelled:
            session.last_metrics.stop_reason = "abort" if job._aborted else "cancelled"
        except Exception as e:  # noqa: BLE001 — reported to the client, the worker serves on
            job.emit(Event("error", " ".join(str(e).split()) or type(e).__name__))
            return
        finally:
            session.on_verify_step = None
        metrics = session.last_metrics
        if self.on_done is not None:
            self.on_done(metrics)
        job.emit(Event("done", metrics=metrics, aborted=job._aborted))

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "processing": int(self.current is not None), "queued": self.n_queued}
