"""`spac serve`: an OpenAI-compatible HTTP server over one speculative session.

    worker.py     one Session on its own thread, a bounded FIFO queue of jobs
    api.py        request schemas, OpenAI's error shape, response objects, `timings`
    app.py        the Starlette app (endpoints, SSE streaming, API key)
    telemetry.py  Prometheus counters and the verification-step histogram

`serve` runs it under uvicorn until SIGINT/SIGTERM: the server stops accepting, the running
generation ends at its next verification step and its stream gets a last chunk
(finish_reason "abort") and `[DONE]`, waiting requests get 503, the session is freed, and
`serve` returns (the command exits 0).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from orchestrator.decoding.speculative import Session
from orchestrator.server.app import Defaults, create_app
from orchestrator.server.worker import SessionWorker

__all__ = ["Defaults", "SessionWorker", "create_app", "serve"]


def serve(open_session: Callable[[], Session], model_id: str, host: str = "127.0.0.1", port: int = 8080,
          api_key: str | None = None, defaults: Defaults | None = None, queue_size: int = 16,
          log_level: str = "warning") -> str:
    """Run until a signal; returns "" after a clean stop, or why the models failed to load."""
    worker = SessionWorker(open_session, queue_size=queue_size)
    app = create_app(worker, model_id, api_key, defaults)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                    timeout_graceful_shutdown=30), worker)

    def failed(message: str) -> None:
        server.should_exit = True

    worker.on_failed = failed
    server.run()
    return worker.error


class _Server(uvicorn.Server):
    """uvicorn's Server whose SIGINT/SIGTERM handling also ends the running generation, and
    which does not re-raise the signal after the graceful shutdown (uvicorn does, which would
    turn a clean stop into exit status 130/143)."""

    def __init__(self, config: uvicorn.Config, worker: SessionWorker) -> None:
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        try:  # not from inside the signal handler: the worker's lock may be held right here
            asyncio.get_running_loop().call_soon_threadsafe(self.worker.shutdown)
        except RuntimeError:  # no loop running yet
            self.worker.shutdown()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            sys.stderr.write(f"spac serve: listening on http://{host}:{port}\n")
            sys.stderr.flush()
