"""The HTTP application: OpenAI's and llama-server's endpoints over one `SessionWorker`.

    GET  /health                      503 while the models load, then 200
    GET  /v1/models                   the target model
    POST /v1/chat/completions         streaming (SSE, ends with `data: [DONE]`) or not
    POST /v1/completions              idem
    GET  /metrics                     Prometheus
    POST /tokenize, /detokenize       llama-server's

Every error is OpenAI's JSON shape. With an API key, every endpoint but /health and /v1/models
wants `Authorization: Bearer KEY` (or `X-Api-Key: KEY`), else 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.decoding.sampling import SamplingParams
from orchestrator.decoding.speculative import Session
from orchestrator.server import api
from orchestrator.server.api import ApiError
from orchestrator.server.worker import SessionWorker, Job, NotAccepting, QueueFull
from orchestrator.server.telemetry import CONTENT_TYPE, Telemetry


@dataclass
class Defaults:
    """What a request gets for the fields it leaves out (the command line's options)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None    # None: until the context is full (chat), 16 (completions, as OpenAI)


COMPLETIONS_MAX_TOKENS = 16
RETRY_AFTER_S = 1


def create_app(worker: SessionWorker, model_id: str, api_key: str | None = None, defaults: Defaults | None = None) -> Starlette:
    """The app; its lifespan starts the session worker (which loads the models) and stops it."""
    defaults = defaults or Defaults()
    telemetry = Telemetry(worker.status)
    worker.on_step, worker.on_done = telemetry.step_seconds.observe, telemetry.finished

    def session() -> Session:
        if worker.state == "loading":
            raise api.unavailable("Loading model", RETRY_AFTER_S)
        if worker.state == "failed":
            raise api.unavailable(f"the model failed to load: {worker.error}")
        if not worker.ready or worker.session is None:
            raise api.unavailable("the server is shutting down")
        return worker.session

    # -- plumbing ----------------------------------------------------------------------------

    def endpoint(fn: Callable[[Request], Awaitable[Response]], name: str, public: bool = False):
        async def handle(request: Request) -> Response:
            try:
                if not public:
                    authorize(request)
                response = await fn(request)
            except ApiError as e:
                response = JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            telemetry.requests.labels(name, str(response.status_code)).inc()
            return response
        return handle

    def authorize(request: Request) -> None:
        if not api_key:
            return
        given = request.headers.get("x-api-key", "")
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given = token.strip()
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(401, "Invalid API key", "authentication_error", code="invalid_api_key")

    async def body(request: Request) -> object:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_id, "spac"):
            raise ApiError(404, f"The model `{name}` does not exist (this server has `{model_id}`)",
                           param="model", code="model_not_found")

    def check_tokens(s: Session, tokens: list[int], param: str) -> None:
        bad = next((t for t in tokens if not 0 <= t < s.target.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"token {bad} is not in the vocabulary (0..{s.target.n_vocab - 1})", param=param)

    def make_job(s: Session, req: api.ChatRequest | api.CompletionRequest, prompt: list[int], default_max: int | None,
                 param: str) -> Job:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param=param)
        if len(prompt) >= s.n_ctx:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; the context holds {s.n_ctx}",
                           param=param, code="context_length_exceeded")
        room = s.n_ctx - len(prompt)
        limit = req.limit if req.limit is not None else defaults.max_tokens or default_max or room
        d = defaults.sampling
        sampling = SamplingParams(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_k=d.top_k if req.top_k is None else req.top_k,
            top_p=d.top_p if req.top_p is None else req.top_p,
            seed=d.seed if req.seed is None else req.seed)
        stop = req.stop_list if req.stop is not None else list(defaults.stop)
        job = Job(prompt, min(limit, room), stop, sampling, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull:
            raise api.unavailable("the server is busy: the queue is full, retry later", RETRY_AFTER_S) from None
        except NotAccepting as e:
            raise api.unavailable(f"the server is not accepting requests ({e})") from None
        return job

    async def run(request: Request, job: Job, req, chat: bool) -> Response:
        cid, created = api.new_id("chatcmpl" if chat else "cmpl"), api.now()
        if req.stream:
            return JobStream(job, stream(job, req, chat, cid, created))
        watch = asyncio.create_task(cancel_on_disconnect(request, job))
        try:
            text = []
            while (ev := await job.events.get()).kind == "text":
                text.append(ev.text)
        finally:
            watch.cancel()
            job.cancel()  # a no-op once it finished; stops it if this handler was cancelled
        if ev.kind == "error":
            raise ApiError(ev.status, ev.text, "server_error" if ev.status == 500 else "unavailable_error")
        make = api.chat_response if chat else api.completion_response
        return JSONResponse(make(cid, model_id, created, "".join(text), ev.metrics, ev.aborted))

    async def cancel_on_disconnect(request: Request, job: Job) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    async def stream(job: Job, req, chat: bool, cid: str, created: int) -> AsyncIterator[str]:
        """SSE chunks; the last one has finish_reason and `timings`, then `data: [DONE]`."""
        def chunk(text: str, finish: str | None = None) -> dict:
            if chat:
                return api.chat_chunk(cid, model_id, created, {"content": text} if finish is None else {}, finish)
            return api.completion_chunk(cid, model_id, created, text, finish)

        if chat:
            yield sse(api.chat_chunk(cid, model_id, created, {"role": "assistant", "content": ""}))
        while (ev := await job.events.get()).kind == "text":
            yield sse(chunk(ev.text))
        if ev.kind == "error":
            yield sse(ApiError(ev.status, ev.text, "server_error" if ev.status == 500 else "unavailable_error").body())
        else:
            last = chunk("", api.finish_reason(ev.metrics, ev.aborted))
            last["timings"] = api.timings(ev.metrics)
            yield sse(last)
            if req.include_usage:
                yield sse({**last, "choices": [], "usage": api.usage(ev.metrics)})
        yield "data: [DONE]\n\n"

    # -- endpoints ---------------------------------------------------------------------------

    async def health(request: Request) -> Response:
        session()
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        meta = {}
        if worker.session is not None:
            s = worker.session
            meta = {"n_ctx": s.n_ctx, "n_vocab": s.target.n_vocab, "mode": s.mode,
                    "draft": s.draft.path.name if s.draft is not None else None, "engine": s.engine is not None}
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "spac", "meta": meta}]})

    async def chat_completions(request: Request) -> Response:
        req = api.parse(api.ChatRequest, await body(request))
        check_model(req.model)
        s = session()
        try:  # off the event loop: a long conversation takes a while to render and tokenize
            prompt = await asyncio.to_thread(s.chat_tokens, [m.as_template_input() for m in req.messages])
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await run(request, make_job(s, req, prompt, None, "messages"), req, chat=True)

    async def completions(request: Request) -> Response:
        req = api.parse(api.CompletionRequest, await body(request))
        check_model(req.model)
        s = session()
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = await asyncio.to_thread(s.tokenize, prompt) if prompt else []
        else:
            tokens = list(prompt)
            check_tokens(s, tokens, "prompt")
        return await run(request, make_job(s, req, tokens, COMPLETIONS_MAX_TOKENS, "prompt"), req, chat=False)

    async def metrics(request: Request) -> Response:
        return Response(telemetry.render(), media_type=CONTENT_TYPE)

    async def tokenize(request: Request) -> Response:
        req = api.parse(api.TokenizeRequest, await body(request))
        s = session()
        tokens = s.target.tokenize(req.content, add_special=req.add_special, parse_special=True)
        if req.with_pieces:
            pieces = [{"id": t, "piece": s.target.piece(t).decode(errors="replace")} for t in tokens]
            return JSONResponse({"tokens": pieces})
        return JSONResponse({"tokens": tokens})

    async def detokenize(request: Request) -> Response:
        req = api.parse(api.DetokenizeRequest, await body(request))
        s = session()
        check_tokens(s, req.tokens, "tokens")
        return JSONResponse({"content": s.target.detokenize(req.tokens)})

    routes = []
    for paths, fn, methods, public in (
            (("/health", "/v1/health"), health, ["GET"], True),
            (("/v1/models", "/models"), models, ["GET"], True),
            (("/v1/chat/completions", "/chat/completions"), chat_completions, ["POST"], False),
            (("/v1/completions", "/completions"), completions, ["POST"], False),
            (("/metrics",), metrics, ["GET"], False),
            (("/tokenize",), tokenize, ["POST"], False),
            (("/detokenize",), detokenize, ["POST"], False)):
        handler = endpoint(fn, paths[0], public)
        routes += [Route(p, handler, methods=methods) for p in paths]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        e = ApiError(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                     "invalid_request_error")
        return JSONResponse(e.body(), status_code=e.status, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        e = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
        return JSONResponse(e.body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        worker.start()
        try:
            yield
        finally:
            worker.shutdown()
            await asyncio.to_thread(worker.join)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.worker, app.state.telemetry = worker, telemetry
    return app


class JobStream(StreamingResponse):
    """An SSE response that cancels its job however it ends: a client that goes away (even
    before the first chunk) stops the generation at the next verification step."""

    def __init__(self, job: Job, chunks: AsyncIterator[str]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
