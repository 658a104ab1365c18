"""OpenAIIngress: the OpenAI-compatible HTTP API (FastAPI under Serve).

Everything a request can get wrong is checked here, before it reaches a unit: the model
name, the JSON and its types, the bounds, the chat messages, and whether the prompt plus the
requested output fits the context. Errors are OpenAI-shaped
(``{"error": {"message", "type", "code", "param"}}``); a full unit answers 429 with
``Retry-After``. Every response carries ``x-speculation: on|off; reason=...``.
"""

# No `from __future__ import annotations` here: FastAPI must see the real ``Request`` type
# on the class-based routes, not a string it cannot resolve.
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError

from specserve.config import AppConfig
from specserve.engine.loader import load_tokenizer, resolve
from specserve.engine.tokenizer import encode_chat, encode_prompt
from specserve.errors import CapacityError, InvalidRequestError, SpecServeError
from specserve.serve.metrics import (
    exposition,
    get_hub,
    initialize_request_metrics,
    record_finish,
    record_request,
)
from specserve.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body

log = logging.getLogger(__name__)
app = FastAPI(title="specserve", description="OpenAI-compatible API with speculative decoding")
RETRY_AFTER_S = "1"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, code, param)


@app.middleware("http")
async def _count_requests(request: Request, call_next):
    """``specserve:requests_total{route, status}``: every response, errors included (an error
    inside an already-started stream is reported in-band and counted as the 200 it began as)."""
    response = await call_next(request)
    route = request.scope.get("route")
    record_request(getattr(route, "path", "unmatched"), response.status_code)
    return response


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if exc.status == 429 else None
    return JSONResponse(exc.body, status_code=exc.status, headers=headers)


def _from_validation(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    message = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def _from_engine(exc: BaseException) -> APIError:
    """Map an exception from a unit (re-raised by Serve as the same type) to an API error."""
    if isinstance(exc, (CapacityError, BackPressureError)):
        return APIError(429, str(exc) or "the service is at capacity; retry shortly",
                        "rate_limit_error", "capacity_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), code=exc.code)
    if isinstance(exc, SpecServeError):
        return APIError(exc.status_code, str(exc), exc.type, exc.code)
    log.exception("unexpected error from a unit", exc_info=exc)
    return APIError(500, "internal error", "internal_error")


def _class_key(req, chat: bool) -> str:
    """The request's acceptance class for the router: route / tenant (OpenAI's ``user``) /
    ``speculation.traffic_class``."""
    cls = req.speculation.traffic_class if req.speculation else None
    return f"{'chat' if chat else 'completions'}|{req.user or ''}|{cls or ''}"


def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _chunk(rid: str, model: str, created: int, chat: bool, delta, finish: str | None) -> dict:
    if chat:
        choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def _response(rid: str, model: str, chat: bool, text: str, finish: str, usage: dict) -> dict:
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage}


# Helpers above this line: @serve.ingress serializes the app when the class is decorated,
# so functions defined after the class would be missing in the replica.
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, unit, config: dict) -> None:
        self.cfg = AppConfig.model_validate(config, context={"check_files": False})
        self.unit = unit.options(stream=True)
        self.unit_calls = unit
        target = self.cfg.unit.engine.target
        src = resolve(target.source, target.cache_dir)
        self.tokenizer = load_tokenizer(src)
        self.model_name = self.cfg.served_model_name or src.name
        self.max_model_len = self.cfg.unit.engine.max_model_len
        self.created = int(time.time())
        initialize_request_metrics()
        self.app_name = serve.get_replica_context().app_name
        self.hub = get_hub(self.app_name)

    # -- endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "specserve",
                                            "max_model_len": self.max_model_len}]}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus exposition: this ingress's request metrics and every unit's numbers."""
        from prometheus_client import CONTENT_TYPE_LATEST

        try:
            units = await self.hub.snapshot.remote()
        except Exception:  # noqa: BLE001  the hub was lost: start a new one, units re-report
            log.warning("metrics hub unavailable; recreating it", exc_info=True)
            self.hub, units = get_hub(self.app_name), {}
        return PlainTextResponse(exposition(units), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/units/stats")
    async def unit_stats(self) -> dict:
        """One unit's live numbers (running, waiting, free slots, draft state)."""
        return await self.unit_calls.stats.remote()

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        prompt = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], str) \
            else req.prompt
        ids = list(prompt) if isinstance(prompt, list) else encode_prompt(self.tokenizer, prompt)
        return await self._run(req, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            ids = encode_chat(self.tokenizer, messages)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        return await self._run(req, ids, chat=True)

    # -- shared path --------------------------------------------------------------------------
    async def _parse(self, request: Request, model):
        body = await request.body()
        try:
            req = model.model_validate_json(body)
        except ValidationError as exc:
            if exc.errors()[0]["type"] == "json_invalid":
                raise APIError(400, "the request body is not valid JSON") from exc
            raise _from_validation(exc) from exc
        if req.model != self.model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                                f"'{self.model_name}'", code="model_not_found", param="model")
        return req

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} "
                                f"tokens; the prompt has {prompt_len}", code="context_length_exceeded",
                           param="messages")
        if requested is None:
            return min(room, self.cfg.max_tokens_cap)
        if requested > self.cfg.max_tokens_cap:
            raise APIError(400, f"max_tokens: at most {self.cfg.max_tokens_cap}", param="max_tokens")
        if requested > room:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} "
                                f"tokens; you requested {prompt_len + requested} ({prompt_len} in "
                                f"the prompt, {requested} for the completion)",
                           code="context_length_exceeded", param="max_tokens")
        return requested

    async def _run(self, req, prompt_ids: list[int], *, chat: bool) -> Response:
        served = self.cfg.unit.engine.speculative.method
        asked = req.speculation.method if req.speculation else None
        if asked is not None and asked != served:
            raise APIError(400, f"speculation.method '{asked}' is not served here; this deployment "
                                f"runs '{served}'", param="speculation.method")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        requested = req.requested_max_tokens if chat else req.max_tokens
        max_tokens = self._max_tokens(requested, len(prompt_ids))
        payload = {"prompt_token_ids": prompt_ids,
                   "params": req.sampling_params(max_tokens).model_dump(),
                   "speculation": req.speculation.model_dump() if req.speculation else None,
                   "stream": req.stream,
                   "class_key": _class_key(req, chat)}
        stream = self.unit.generate.remote(payload)
        try:
            start = await stream.__anext__()
        except Exception as exc:
            raise _from_engine(exc) from exc
        headers = {"x-speculation": start["speculation"]["header"]}
        route = "/v1/chat/completions" if chat else "/v1/completions"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._sse(stream, rid, chat, include_usage, route),
                                     media_type="text/event-stream", headers=headers)
        text, finish, usage = await self._collect(stream, route)
        return JSONResponse(_response(rid, self.model_name, chat, text, finish, usage),
                            headers=headers)

    @staticmethod
    async def _collect(stream, route: str) -> tuple[str, str, dict]:
        parts: list[str] = []
        try:
            async for chunk in stream:
                parts.append(chunk["text"])
                if chunk["finish_reason"] is not None:
                    record_finish(route, chunk)
                    return "".join(parts), chunk["finish_reason"], chunk["usage"]
        except Exception as exc:
            raise _from_engine(exc) from exc
        finally:
            stream.cancel()  # no-op when finished; frees the slot when the client went away
        raise APIError(500, "the unit ended the stream without finishing", "internal_error")

    async def _sse(self, stream, rid: str, chat: bool, include_usage: bool,
                   route: str) -> AsyncIterator[str]:
        created = int(time.time())
        try:
            if chat:
                yield _sse_line(_chunk(rid, self.model_name, created, chat, {"role": "assistant",
                                                                         "content": ""}, None))
            async for chunk in stream:
                if chunk["text"] or chunk["finish_reason"]:
                    delta = {"content": chunk["text"]} if chat else chunk["text"]
                    yield _sse_line(_chunk(rid, self.model_name, created, chat, delta,
                                      chunk["finish_reason"]))
                if chunk["finish_reason"] is not None:
                    record_finish(route, chunk)
                if chunk["finish_reason"] is not None and include_usage:
                    body = _chunk(rid, self.model_name, created, chat, None, None)
                    body["choices"], body["usage"] = [], chunk["usage"]
                    yield _sse_line(body)
        except Exception as exc:  # headers are gone: report in-band, as OpenAI does
            yield _sse_line(_from_engine(exc).body)
        finally:
            stream.cancel()  # a client that disconnects mid-stream frees its slot
        yield "data: [DONE]\n\n"

