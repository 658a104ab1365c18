"""OpenAIIngress: the OpenAI-compatible HTTP API (FastAPI under Serve).

Everything a request can get wrong is checked here, before it reaches a unit: the model
name, the JSON and its types, the bounds, the chat messages, and whether the prompt plus the
requested output fits the context. Errors are OpenAI-shaped
(``{"error": {"message", "type", "code", "param"}}``); a full unit answers 429 with
``Retry-After``. Every response carries ``x-speculation: on|off; reason=...``.

An error body helps and leaks nothing. A 4xx names what was wrong (``param`` is the field). A
5xx says in one sentence what happened and gives the request id; the detail (a unit's
exception arrives wrapped by Ray, whose text is the remote traceback with pids, actor ids and
host paths) goes to the server log under that id. Nothing, not even a bug, answers with a
traceback or a plain-text "Internal Server Error".

In front of that, per request: the API key (:mod:`specserve.serve.guard`; ``/health`` is
always open, ``/metrics`` optionally closed), whether the app is draining (503 with
``Retry-After``; ``/health`` says ``draining``), the key's request rate and requests in
flight (429 with ``Retry-After``), the body size (413) and, after tokenizing, the prompt
length. A request that runs past ``limits.request_timeout_s`` is cancelled, which frees its
slot, and ends with a 504 (in-band once a stream has started). Prompts and outputs are not
logged unless ``limits.log_request_content`` says so.

The app runs one ingress replica, so the per-key limits and the drain state are exact.
"""

# No `from __future__ import annotations` here: FastAPI must see the real ``Request`` type
# on the class-based routes, not a string it cannot resolve.
import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.config import AppConfig
from specserve.engine.grammar import GrammarCompiler, GrammarSpec
from specserve.engine.loader import load_tokenizer, resolve
from specserve.engine.tokenizer import encode_chat, encode_prompt
from specserve.errors import CapacityError, InvalidRequestError, SpecServeError
from specserve.serve.guard import Guard, Lease, Refusal
from specserve.serve.metrics import (
    exposition,
    get_hub,
    initialize_request_metrics,
    record_finish,
    record_request,
)
from specserve.serve.protocol import (
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    StreamDelta,
    StreamStart,
    UnitRequest,
    error_body,
)
from specserve.serve.tools import ToolPlan, render_messages

log = logging.getLogger(__name__)
# openapi_url=None: the replica serves its own /openapi.json (below), with the request bodies
# and the served model name, which FastAPI's generated one cannot know.
app = FastAPI(title="specserve", description="OpenAI-compatible API with speculative decoding",
              openapi_url=None, docs_url=None, redoc_url=None)
RETRY_AFTER_S = "1"
ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
    (413, "Request body too large"), (429, "Rate limit, concurrency limit or capacity; see "
                                           "Retry-After"),
    (500, "A failure on the server's side; the message carries the request id that the "
          "server logged the detail under"),
    (503, "Draining, or the target group failed; see Retry-After"),
    (504, "The request ran past limits.request_timeout_s"))}
# What a client is told when its request failed on the server's side, by error code, else by
# status; the message ends with the request id, under which the server logged the detail.
TARGET_FAILED = "the target group failed or is restarting and the request was cancelled; retry shortly"
FAILURES = {
    "target_unavailable": TARGET_FAILED,
    "engine_failed": TARGET_FAILED,
    "unit_unavailable": "the unit serving the request is gone and the request was cancelled; "
                        "retry shortly",
    "request_failed": "the server failed while generating this request's output",
    503: "the service is unavailable for a moment and the request was cancelled; retry shortly",
    500: "the server failed to process this request",
}
# Union members pydantic names in an error's location (``prompt.str``, ``stop.list[str]``).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, code, param)
        self.retry_after_s = retry_after_s

    @classmethod
    def refused(cls, refusal: Refusal) -> "APIError":
        return cls(refusal.status, refusal.message, refusal.type, refusal.code,
                   retry_after_s=refusal.retry_after_s)

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.retry_after_s is not None or self.status in (429, 503):
            headers["Retry-After"] = str(self.retry_after_s or RETRY_AFTER_S)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return headers


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers() or None)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug: an OpenAI-shaped 500 with the request id, the traceback in the log."""
    rid = getattr(request.state, "request_id", None) or "req-" + uuid.uuid4().hex
    return _error_response(_server_error(exc, rid))


@app.middleware("http")
async def _count_requests(request: Request, call_next):
    """``specserve:requests_total{route, status}``: every response, errors included (an error
    inside an already-started stream is reported in-band and counted as the 200 it began as).
    An exception that no handler took is answered here, so it is counted as the 500 it is and
    does not reach Serve, which would log it again."""
    try:
        response = await call_next(request)
    except Exception as exc:  # noqa: BLE001
        response = _unexpected(request, exc)
    route = request.scope.get("route")
    record_request(getattr(route, "path", "unmatched"), response.status_code)
    return response


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return _error_response(exc)


@app.exception_handler(Exception)
async def _any_error(request: Request, exc: Exception) -> JSONResponse:
    """The last line, should the middleware above itself fail."""
    return _unexpected(request, exc)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404) and wrong methods (405), OpenAI-shaped like every other error."""
    message = {404: "Unknown URL; the API is under /v1 (see /openapi.json)",
               405: "Method not allowed on this URL"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(error_body(message, "invalid_request_error", None, None),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return _error_response(_from_errors(exc.errors()))


def _param(loc: tuple) -> str | None:
    """``messages[0].content`` from pydantic's location, without the union members it names."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part not in _TYPE_TAGS and "[" not in part and not part[:1].isupper():
            param += f".{part}" if param else part
    return param or None


def _from_errors(errors: list[dict]) -> APIError:
    """A 400 for one of pydantic's errors: one line, ``param`` naming the field. The deepest
    is the most precise: a value that fits no member of a union gets one error per member,
    and the one that went furthest (``stop[0]`` of a list) says what to fix."""
    err = max(errors, key=lambda e: len(e["loc"]))
    param = _param(err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == UNSUPPORTED:  # the message names the feature already
        return APIError(400, message, code=UNSUPPORTED, param=param)
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def _cause(exc: BaseException) -> BaseException:
    """The exception a unit raised. Serve re-raises it as a ``RayTaskError`` (also an instance
    of the cause's class, hence the unwrapping) whose text is the remote traceback, pid and
    host paths; one unit calling a group's actor can wrap it twice."""
    while isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        exc = exc.cause
    return exc


def _from_engine(exc: BaseException, rid: str) -> APIError:
    """Map an exception from a unit to an API error: our own 4xx with their message, every
    other cause a 5xx that says what happened (:func:`_server_error`)."""
    cause = _cause(exc)
    if isinstance(cause, (CapacityError, BackPressureError)):
        message = str(cause) if isinstance(cause, CapacityError) else ""
        return APIError(429, message or "the service is at capacity; retry shortly",
                        "rate_limit_error", "capacity_exceeded")
    if isinstance(cause, SpecServeError) and cause.status_code < 500:
        return APIError(cause.status_code, str(cause), cause.type, cause.code,
                        param=getattr(cause, "param", None))
    return _server_error(exc, rid)


def _server_error(exc: BaseException, rid: str) -> APIError:
    """A 5xx: one sentence and the request id for the client; the detail, with Ray's remote
    traceback when there is one, in the log."""
    cause = _cause(exc)
    if isinstance(cause, SpecServeError):
        status, type_, code = cause.status_code, cause.type, cause.code  # 503: Retry-After
    elif isinstance(cause, (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError)):
        status, type_, code = 503, "service_unavailable", "unit_unavailable"
    else:
        status, type_, code = 500, "internal_error", "internal_error"
    log.error("request %s failed (%d %s)", rid, status, code, exc_info=exc)
    what = FAILURES.get(code) or FAILURES.get(status) or FAILURES[500]
    return APIError(status, f"{what} (request id {rid})", type_, code)


def _class_key(req, chat: bool, key_id: str, prompt_len: int) -> str:
    """The request's acceptance class for the router: route / API key / OpenAI's ``user`` /
    ``speculation.traffic_class`` / shape. ``user`` is whatever a client sends: without the
    key, one tenant could drag another's class below break-even and so switch its speculation
    off. The shape separates traffic of one route whose acceptance differs: the prompt's
    length (under 128, 512, 2048 tokens, or more) and, for chat, whether the conversation
    carries earlier answers (a later turn often revises or quotes them). (Only ``user`` may
    contain ``|``, so the key stays unambiguous.)"""
    cls = req.speculation.traffic_class if req.speculation else None
    size = next((f"p<{n}" for n in (128, 512, 2048) if prompt_len < n), "p>=2048")
    turns = "multi" if chat and any(m.role == "assistant" for m in req.messages) else "single"
    return f"{'chat' if chat else 'completions'}|{key_id}|{req.user or ''}|{cls or ''}|{size},{turns}"


def _request_id(request: Request, prefix: str) -> str:
    """A new request id, also kept on the request for :func:`_unexpected`."""
    rid = prefix + uuid.uuid4().hex
    request.state.request_id = rid
    return rid


def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


LOGPROB_FLOOR = -9999.0  # OpenAI's logprob of a token the distribution excludes (JSON has no -inf)


def _logprobs(tokenizer, items: list | None, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's ``logprobs`` object of a choice (or a chunk) from the unit's
    ``(token, logprob, [(token, logprob), ...])`` items. Chat: ``content`` entries with the
    token's text, bytes and ``top_logprobs``; completions: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (dicts that always hold the chosen token, as OpenAI's do) and
    ``text_offset`` from ``offset``."""
    if items is None:
        return None
    text = {t: tokenizer.decode([t]) for t, _, top in items for t in (t, *(a for a, _ in top))}
    if chat:
        def entry(token: int, logprob: float) -> dict:
            return {"token": text[token], "logprob": max(logprob, LOGPROB_FLOOR),
                    "bytes": list(text[token].encode("utf-8"))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                            for t, lp, top in items], "refusal": None}
    offsets = []
    for t, _, _ in items:
        offsets.append(offset)
        offset += len(text[t])
    # an echoed prompt's first token has no logprob: null, as OpenAI's
    return {"tokens": [text[t] for t, _, _ in items],
            "token_logprobs": [None if lp is None else max(lp, LOGPROB_FLOOR) for _, lp, _ in items],
            "top_logprobs": [None if lp is None else
                             {text[a]: max(b, LOGPROB_FLOOR) for a, b in [*top, (t, lp)]}
                             for t, lp, top in items],
            "text_offset": offsets}


def _echoed(echo: tuple[str, list[int]] | None, prompt_logprobs: list | None,
            items: list | None) -> tuple[str, list | None]:
    """What an ``echo`` completion puts before its output: the prompt's text, and with
    logprobs the prompt's items (its first token with none) before the output's."""
    if echo is None:
        return "", items
    text, ids = echo
    if items is None:
        return text, None
    scored = prompt_logprobs or [(None, None)] * (len(ids) - 1)
    return text, [(ids[0], None, []), *((t, lp, top or []) for t, (lp, top) in zip(ids[1:], scored)),
                  *items]


def _joined(items: list | None, more: list | None) -> list | None:
    """Logprobs items of two chunks, in order (None: none asked for)."""
    return more if items is None else items + (more or [])


def _chunk(rid: str, model: str, created: int, chat: bool, delta, finish: str | None,
           logprobs: dict | None = None, index: int = 0) -> dict:
    if chat:
        choice = {"index": index, "delta": delta or {}, "finish_reason": finish,
                  "logprobs": logprobs}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    choice = {"index": index, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


@dataclass
class _Choice:
    """One choice of a response, as :meth:`SpecServeAPI._collect` gathers it."""

    parts: list[str] = field(default_factory=list)
    items: list | None = None   # logprobs items
    scored: list | None = None  # the prompt's, for echo
    finish: str | None = None


def _response(rid: str, model: str, chat: bool, choices: list[dict], usage: dict) -> dict:
    """The whole response; ``choices``: each one's ``text``, ``finish``, ``logprobs`` and
    (chat) ``tool_calls``."""
    created = int(time.time())
    if chat:
        body = [{"index": i, "message": {"role": "assistant", "content": c["text"],
                                         **({"tool_calls": c["tool_calls"]} if c["tool_calls"] else {})},
                 "finish_reason": c["finish"], "logprobs": c["logprobs"]}
                for i, c in enumerate(choices)]
        obj = "chat.completion"
    else:
        body = [{"index": i, "text": c["text"], "finish_reason": c["finish"],
                 "logprobs": c["logprobs"]} for i, c in enumerate(choices)]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": body,
            "usage": usage}


def _cancel(stream) -> None:
    """Cancel a unit stream: a no-op once it finished, and it frees the slot of one that has
    not. Serve re-raises a request's routing error (e.g. BackPressureError) from ``cancel``
    when the request never reached a unit; that error is being answered already."""
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001
        pass


def _close(stream, lease: Lease) -> None:
    """End a request: cancel its unit stream and give back its lease."""
    _cancel(stream)
    lease.release()


class RequestTimeout(Exception):
    """The request ran past ``limits.request_timeout_s``."""


async def _until(stream, deadline: float) -> AsyncIterator[StreamStart | StreamDelta]:
    """``stream``'s chunks, raising :class:`RequestTimeout` once ``deadline`` (monotonic) passes."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RequestTimeout
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), left)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError as exc:
            raise RequestTimeout from exc
        yield chunk


def _timeout_error(timeout_s: float) -> APIError:
    return APIError(504, f"the request did not finish within {timeout_s:g} s "
                         "(limits.request_timeout_s); it was cancelled", "timeout_error",
                    "request_timeout")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it passes ``limit`` bytes (declared or sent)."""
    too_large = APIError(413, f"the request body is larger than {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def _openapi(model_name: str) -> dict:
    """The API's OpenAPI document with the request bodies the handlers parse themselves (so
    schemathesis and client generators see them) and ``model`` fixed to the served one."""
    doc = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest),
                        ("/v1/chat/completions", ChatCompletionRequest)):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schema["properties"]["model"] = {"type": "string", "enum": [model_name]}
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


# Helpers above this line: @serve.ingress serializes the app when the class is decorated,
# so functions defined after the class would be missing in the replica.
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, unit, config: dict) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.unit = unit.options(stream=True)
        self.unit_calls = unit
        target = self.cfg.unit.engine.target
        src = resolve(target.source, target.cache_dir)
        self.tokenizer = load_tokenizer(src)
        self.model_name = self.cfg.served_model_name or src.name
        self.max_model_len = self.cfg.unit.engine.max_model_len
        self.created = int(time.time())
        self.limits = self.cfg.limits
        self.guard = Guard(self.cfg.auth, self.limits)  # no keys while auth is on: fails here
        if self.guard.keys is None:
            log.warning("specserve: authentication is OFF (auth.enabled: false): anyone who can "
                        "reach this port can use the API")
        self.draining = False
        eos = self.tokenizer.eos_token_id  # (what a grammar compiles to is the unit's business)
        self.grammars = GrammarCompiler(self.tokenizer, len(self.tokenizer), [eos or 0])
        self.openapi_doc = _openapi(self.model_name)
        initialize_request_metrics()
        self.app_name = serve.get_replica_context().app_name
        self.hub = get_hub(self.app_name)

    # -- endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        """Always open. 200 while serving; 503 ``draining`` once a drain has begun."""
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": RETRY_AFTER_S})
        return JSONResponse({"status": "ok"})

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> dict:
        """The OpenAPI document: request bodies from the pydantic models, ``model`` fixed to the
        served one, every error status with the OpenAI error object."""
        return self.openapi_doc

    @app.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
    async def models(self, request: Request) -> dict:
        self._authenticate(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "specserve",
                                            "max_model_len": self.max_model_len}]}

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Prometheus exposition: this ingress's request metrics and every unit's numbers."""
        from prometheus_client import CONTENT_TYPE_LATEST

        if self.cfg.auth.protect_metrics:
            self._authenticate(request)
        try:
            units = await self.hub.snapshot.remote()
        except Exception:  # noqa: BLE001  the hub was lost: start a new one, units re-report
            log.warning("metrics hub unavailable; recreating it", exc_info=True)
            self.hub, units = get_hub(self.app_name), {}
        return PlainTextResponse(exposition(units), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/units/stats", responses={401: ERROR_RESPONSES[401]})
    async def unit_stats(self, request: Request) -> dict:
        """One unit's live numbers (running, waiting, free slots, draft state)."""
        self._authenticate(request)
        return await self.unit_calls.stats.remote()

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(self, request: Request) -> Response:
        rid = _request_id(request, "cmpl-")
        lease = self._admit(request)
        try:
            req = await self._parse(request, CompletionRequest)
            prompt = req.prompt
            if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):  # a batch of one
                prompt = prompt[0]
            ids = list(prompt) if isinstance(prompt, list) else encode_prompt(self.tokenizer, prompt)
            echo = None
            if req.echo:
                echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids), ids)
            return await self._run(req, ids, lease, rid, chat=False, echo=echo)
        finally:
            lease.release()  # no-op once a stream owns it

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(self, request: Request) -> Response:
        rid = _request_id(request, "chatcmpl-")
        lease = self._admit(request)
        try:
            req = await self._parse(request, ChatCompletionRequest)
            plan = req.tool_plan()
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if plan else None
            messages = render_messages([m.model_dump(exclude_none=True) for m in req.messages], tools)
            try:
                ids = encode_chat(self.tokenizer, messages)
            except InvalidRequestError as exc:
                raise APIError(400, str(exc), param="messages") from exc
            return await self._run(req, ids, lease, rid, chat=True, tools=plan)
        finally:
            lease.release()

    # -- lifecycle (Serve handle calls) -------------------------------------------------------
    def drain(self) -> dict:
        """Stop taking generation requests (503 with Retry-After; /health says draining) and
        let the ones in flight finish. Returns :meth:`drain_status`."""
        if not self.draining:
            log.info("draining: %d request(s) in flight", self.guard.requests_in_flight)
        self.draining = True
        return self.drain_status()

    def drain_status(self) -> dict:
        return {"draining": self.draining, "in_flight": self.guard.requests_in_flight}

    # -- shared path --------------------------------------------------------------------------
    def _authenticate(self, request: Request) -> str:
        kid = self.guard.authenticate(request.headers.get("authorization"))
        if isinstance(kid, Refusal):
            raise APIError.refused(kid)
        return kid

    def _admit(self, request: Request) -> Lease:
        """Key, drain state, then the key's rate and requests in flight; a lease or an error."""
        kid = self._authenticate(request)
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica or shortly",
                           "service_unavailable", "draining")
        lease = self.guard.admit(kid)
        if isinstance(lease, Refusal):
            raise APIError.refused(lease)
        return lease

    async def _parse(self, request: Request, model):
        body = await _read_body(request, self.limits.max_request_bytes)
        try:
            req = model.model_validate_json(body)
        except ValidationError as exc:
            if exc.errors()[0]["type"] in ("json_invalid", "json_type"):
                raise APIError(400, "the request body is not valid JSON (or not an object)") from exc
            raise _from_errors(exc.errors()) from exc
        if req.model != self.model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                                f"'{self.model_name}'", code="model_not_found", param="model")
        refused = req.refusal()
        if refused is not None:
            raise APIError(400, refused[0], param=refused[1])
        return req

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        cap = self.limits.max_prompt_tokens
        if cap is not None and prompt_len > cap:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this server accepts at most "
                                f"{cap} (limits.max_prompt_tokens)", code="context_length_exceeded",
                           param="messages")
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

    async def _run(self, req, prompt_ids: list[int], lease: Lease, rid: str, *,
                   chat: bool, echo: tuple[str, list[int]] | None = None,
                   tools: ToolPlan | None = None) -> Response:
        """``echo``: the prompt's text and ids, returned before the output (completions);
        ``tools``: the chat request's tools, whose calls are parsed out of each reply."""
        deadline = time.monotonic() + self.limits.request_timeout_s
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
        max_n = self.cfg.unit.engine.max_num_seqs
        if req.n > max_n:
            raise APIError(400, f"n: at most {max_n} (the unit's max_num_seqs: the choices are "
                                "sampled side by side)", param="n")
        grammar = await self._grammar(req)
        payload = UnitRequest(prompt_token_ids=prompt_ids, params=req.sampling_params(max_tokens),
                              speculation=req.speculation, stream=req.stream,
                              class_key=_class_key(req, chat, lease.key_id, len(prompt_ids)),
                              n=req.n, grammar=grammar)
        route = "/v1/chat/completions" if chat else "/v1/completions"
        if self.limits.log_request_content:
            log.info("request %s (%s): prompt %r", rid, lease.key_id, req.model_dump().get(
                "messages" if chat else "prompt"))
        stream = self.unit.generate.remote(payload)
        chunks = _until(stream, deadline)
        try:
            start = await chunks.__anext__()
        except RequestTimeout:
            _cancel(stream)
            raise _timeout_error(self.limits.request_timeout_s) from None
        except Exception as exc:
            _cancel(stream)
            raise _from_engine(exc, rid) from exc
        headers = {"x-speculation": start.decision.header()}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            lease = lease.hand_over()
            body = self._sse(stream, chunks, rid, chat, include_usage, route, lease, echo, req.n,
                             tools)
            # A client gone before the body starts never runs the generator's ``finally``:
            # free the slot and the lease when the generator is dropped.
            weakref.finalize(body, _close, stream, lease)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        collected, usage = await self._collect(stream, chunks, route, rid, req.n)
        choices = []
        for choice in collected:
            prefix, items = _echoed(echo, choice.scored, choice.items)
            text, calls = prefix + "".join(choice.parts), []
            if tools is not None:
                text, calls = tools.parse(text)
            choices.append({"text": text, "finish": "tool_calls" if calls else choice.finish,
                            "logprobs": _logprobs(self.tokenizer, items, chat), "tool_calls": calls})
        return JSONResponse(_response(rid, self.model_name, chat, choices, usage), headers=headers)

    async def _grammar(self, req) -> GrammarSpec | None:
        """The request's structured output, compiled here once so that a schema the grammar
        library refuses is a 400 naming the field before any unit is involved (the unit
        compiles it again for its model: milliseconds, and cached)."""
        try:
            asked = req.grammar()
        except InvalidRequestError as exc:
            field = req.grammar_fields()[0]
            raise APIError(400, f"{field}: {exc}", param=field) from None
        if asked is None:
            return None
        spec, field = asked
        try:
            await asyncio.to_thread(self.grammars.compile, spec)
        except InvalidRequestError as exc:
            raise APIError(400, f"{field}: {exc}", param=field) from None
        return spec

    async def _collect(self, stream, chunks, route: str, rid: str, n: int
                       ) -> tuple[list[_Choice], dict]:
        """Every choice's chunks, until all ``n`` finished; and the usage (on the last)."""
        choices = [_Choice() for _ in range(n)]
        unfinished = n
        try:
            async for chunk in chunks:
                choice = choices[chunk.index]
                choice.parts.append(chunk.text)
                if chunk.logprobs is not None:
                    choice.items = (choice.items or []) + chunk.logprobs
                if chunk.prompt_logprobs is not None:
                    choice.scored = chunk.prompt_logprobs
                if chunk.finish_reason is not None:
                    choice.finish = chunk.finish_reason
                    unfinished -= 1
                if unfinished == 0:
                    record_finish(route, chunk)
                    self._log_output(rid, "".join(p for c in choices for p in c.parts))
                    return choices, chunk.usage
        except RequestTimeout:
            raise _timeout_error(self.limits.request_timeout_s) from None
        except Exception as exc:
            raise _from_engine(exc, rid) from exc
        finally:
            _cancel(stream)  # no-op when finished; frees the slot when the client went away
        raise _server_error(RuntimeError("the unit ended the stream without finishing"), rid)

    async def _sse(self, stream, chunks, rid: str, chat: bool, include_usage: bool,
                   route: str, lease: Lease, echo: tuple[str, list[int]] | None = None,
                   n: int = 1, tools: ToolPlan | None = None) -> AsyncIterator[str]:
        """The SSE body. With ``tools``, a choice's text is held until it finishes and then
        sent as its content or its ``tool_calls`` (a call is parsed whole)."""
        created = int(time.time())
        held: list[tuple[str, list | None]] = [("", None)] * n  # with tools: text, logprobs so far
        parts: list[str] = []  # kept only to log the output (limits.log_request_content)
        offsets = [0] * n  # per choice, completions' text_offset of its next token
        echoes = [echo] * n  # per choice, the prompt still to send before its text
        unfinished = n
        try:
            if chat:
                for i in range(n):
                    yield _sse_line(_chunk(rid, self.model_name, created, chat,
                                           {"role": "assistant", "content": ""}, None, index=i))
            async for chunk in chunks:
                i, text, items = chunk.index, chunk.text, chunk.logprobs
                if echoes[i] is not None:  # the prompt goes out with the choice's first chunk
                    prefix, items = _echoed(echoes[i], chunk.prompt_logprobs, items)
                    text, echoes[i] = prefix + text, None
                finish = chunk.finish_reason
                delta = {"content": text} if chat else text
                if tools is not None:
                    text, items = held[i][0] + text, _joined(held[i][1], items)
                    held[i] = (text, items)
                    if finish is None:
                        continue
                    content, calls = tools.parse(text)
                    delta = {"content": content}
                    if calls:
                        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                        finish = "tool_calls"
                if text or finish or items:
                    logprobs = _logprobs(self.tokenizer, items, chat, offsets[i])
                    if logprobs is not None and not chat:
                        offsets[i] += sum(len(t) for t in logprobs["tokens"])
                    yield _sse_line(_chunk(rid, self.model_name, created, chat, delta,
                                           finish, logprobs, index=i))
                    if self.limits.log_request_content:
                        parts.append(text)
                unfinished -= chunk.finish_reason is not None
                if unfinished == 0:
                    record_finish(route, chunk)
                    self._log_output(rid, "".join(parts))
                    if include_usage:
                        body = _chunk(rid, self.model_name, created, chat, None, None)
                        body["choices"], body["usage"] = [], chunk.usage
                        yield _sse_line(body)
        except RequestTimeout:
            yield _sse_line(_timeout_error(self.limits.request_timeout_s).body)
        except Exception as exc:  # headers are gone: report in-band, as OpenAI does
            yield _sse_line(_from_engine(exc, rid).body)
        finally:
            _close(stream, lease)  # a client that disconnects mid-stream frees its slot
        yield "data: [DONE]\n\n"

    def _log_output(self, rid: str, text: str) -> None:
        if self.limits.log_request_content:
            log.info("request %s: output %r", rid, text)
