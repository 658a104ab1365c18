"""The FastAPI app that :class:`~specserve.serve.ingress.OpenAIIngress` registers its routes
on, and what every route shares: the request-count middleware, the exception handlers (every
error OpenAI-shaped, a bug a 500 with the request id), the request id, the request body read
under its size limit (413), and the OpenAPI document.

Everything registered on the app is registered here, at import, before the ingress class is
decorated: ``@serve.ingress(app)`` copies the app then, and the replica serves that copy.
"""

import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.serve.api_errors import APIError, from_validation_errors, server_error
from specserve.serve.metrics import record_request
from specserve.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)

# openapi_url=None: the replica serves its own /openapi.json (openapi_document), with the
# request bodies and the served model name, which FastAPI's generated one cannot know.
app = FastAPI(title="specserve", description="OpenAI-compatible API with speculative decoding",
              openapi_url=None, docs_url=None, redoc_url=None)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers() or None)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug: an OpenAI-shaped 500 with the request id, the traceback in the log."""
    rid = getattr(request.state, "request_id", None) or "req-" + uuid.uuid4().hex
    return _error_response(server_error(exc, rid))


class _CountRequests:
    """``specserve:requests_total{route, status}``: every response, errors included (an error
    inside an already-started stream is reported in-band and counted as the 200 it began as).
    An exception that no handler took before the response began is answered here, so it is
    counted as the 500 it is and does not reach Serve, which would log it again.

    Plain ASGI, not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` relays a
    streamed body through a memory channel between two tasks, a handoff for every chunk."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = None

        async def sent(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        except Exception as exc:  # noqa: BLE001
            if status is not None:  # begun: the status is on the wire, the error is a bug
                raise
            await _unexpected(Request(scope, receive), exc)(scope, receive, sent)
        finally:
            if status is not None:  # not a request cancelled before its response began
                record_request(getattr(scope.get("route"), "path", "unmatched"), status)


app.add_middleware(_CountRequests)


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
    return _error_response(from_validation_errors(exc.errors()))


def request_id(request: Request, prefix: str) -> str:
    """A new request id, also kept on the request for the 500 of a bug (``_unexpected``)."""
    rid = prefix + uuid.uuid4().hex
    request.state.request_id = rid
    return rid


async def read_body(request: Request, limit: int) -> bytes:
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


def openapi_document(model_name: str) -> dict:
    """The API's OpenAPI document with the request bodies the handlers parse themselves (so
    schemathesis and client generators see them) and ``model`` fixed to the served one."""
    doc = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest),
                        ("/v1/chat/completions", ChatCompletionRequest),
                        ("/tokenize", TokenizeRequest), ("/detokenize", DetokenizeRequest)):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schema["properties"]["model"] = {"type": "string", "enum": [model_name]}
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
