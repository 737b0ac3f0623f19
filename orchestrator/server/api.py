"""OpenAI's request bodies (the fields spac uses, strictly typed), its error shape, and the
response objects: chat.completion(.chunk), text_completion, usage and llama-server's `timings`.

Fields a client may send that spac does not use (user, logprobs, tools, ...) are accepted and
ignored, as llama-server does; a field spac uses with a wrong type or value is a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.decoding.metrics import RunMetrics


class ApiError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}} with a status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unavailable(message: str, retry_after: int | None = None) -> ApiError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return ApiError(503, message, "unavailable_error", code="unavailable", headers=headers)


# ----------------------------------------------------------------------------- requests

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str = ""


class Message(_Strict):
    role: str
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict:
        """{"role", "content": str} for the chat template (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content if p.type == "text")
        return {"role": self.role, "content": content or ""}


class _Generation(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)  # OpenAI's newer name for max_tokens

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str]

    @property
    def limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int]


def parse(model: type[BaseModel], body: Any) -> Any:
    """The request object, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        kind = "missing" if first["type"] == "missing" else "invalid"
        message = f"{param}: {first['msg']}" if param else first["msg"]
        raise ApiError(400, message, param=param, code=f"{kind}_field") from None


# ----------------------------------------------------------------------------- responses

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def finish_reason(metrics: RunMetrics, aborted: bool = False) -> str:
    """OpenAI's finish_reason; "abort" (as vLLM says) when the server stopped the generation."""
    if aborted:
        return "abort"
    return FINISH_REASONS.get(metrics.stop_reason, "stop")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(m: RunMetrics) -> dict:
    return {"prompt_tokens": m.n_prompt_tokens, "completion_tokens": m.n_tokens,
            "total_tokens": m.n_prompt_tokens + m.n_tokens,
            "prompt_tokens_details": {"cached_tokens": m.n_prompt_cached}}


def _rate(n: int, seconds: float) -> tuple[float | None, float | None]:
    """(ms per token, tokens per second)."""
    if n <= 0 or seconds <= 0:
        return None, None
    return seconds * 1e3 / n, n / seconds


def timings(m: RunMetrics) -> dict:
    """llama-server's `timings` (cache_n: prompt tokens reused from the KV cache, prompt_n: the
    ones computed for this request; draft_n, draft_n_accepted) and spac's own numbers."""
    prompt_n = m.n_prompt_tokens - m.n_prompt_cached
    prompt_ms_tok, prompt_tps = _rate(prompt_n, m.prefill_s)
    pred_ms_tok, pred_tps = _rate(m.n_tokens, m.decode_s)
    return {
        "cache_n": m.n_prompt_cached, "prompt_n": prompt_n, "prompt_ms": m.prefill_s * 1e3,
        "prompt_per_token_ms": prompt_ms_tok, "prompt_per_second": prompt_tps,
        "predicted_n": m.n_tokens, "predicted_ms": m.decode_s * 1e3,
        "predicted_per_token_ms": pred_ms_tok, "predicted_per_second": pred_tps,
        "draft_n": m.n_drafted, "draft_n_accepted": m.n_accepted,
        # spac
        "mode": m.mode, "verify_steps": m.n_steps, "acceptance_rate": m.acceptance_rate,
        "tokens_per_step": m.tokens_per_step, "ttft_ms": m.ttft_s * 1e3 if m.ttft_s is not None else None,
        "device_share": m.device_share, "bytes_copied": m.bytes_copied, "n_copies": m.n_copies,
        "n_evictions": m.n_evictions, "n_prefetch_late": m.n_prefetch_late, "stop_reason": m.stop_reason,
    }


def chat_chunk(cid: str, model: str, created: int, delta: dict, finish: str | None = None) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_chunk(cid: str, model: str, created: int, text: str, finish: str | None = None) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_response(cid: str, model: str, created: int, text: str, m: RunMetrics, aborted: bool) -> dict:
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason(m, aborted)}],
            "usage": usage(m), "timings": timings(m)}


def completion_response(cid: str, model: str, created: int, text: str, m: RunMetrics, aborted: bool) -> dict:
    out = completion_chunk(cid, model, created, text, finish_reason(m, aborted))
    return {**out, "usage": usage(m), "timings": timings(m)}
