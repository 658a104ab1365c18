"""The API's errors: :class:`APIError` (an OpenAI error object with its status and headers),
the table of error statuses the OpenAPI document lists, and the mappings to it from pydantic's
validation errors, a unit's exceptions and the request timeout.

A 4xx names what was wrong (``param`` is the field). A 5xx says in one sentence what happened
and gives the request id; the detail (a unit's exception arrives wrapped by Ray, whose text is
the remote traceback with pids, actor ids and host paths) goes to the server log under that id.
"""

import logging

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)

from specserve.errors import CapacityError, SpecServeError
from specserve.serve.guard import Refusal
from specserve.serve.protocol import UNSUPPORTED, ErrorResponse, error_body

log = logging.getLogger(__name__)
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


def _param(loc: tuple) -> str | None:
    """``messages[0].content`` from pydantic's location, without the union members it names."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part not in _TYPE_TAGS and "[" not in part and not part[:1].isupper():
            param += f".{part}" if param else part
    return param or None


def from_validation_errors(errors: list[dict]) -> APIError:
    """A 400 for one of pydantic's errors: one line, ``param`` naming the field. The deepest
    is the most precise: a value that fits no member of a union gets one error per member,
    and the one that went furthest (``stop[0]`` of a list) says what to fix."""
    err = max(errors, key=lambda e: len(e["loc"]))
    param = _param(err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == UNSUPPORTED:  # the message names the feature already
        return APIError(400, message, code=UNSUPPORTED, param=param)
    return APIError(400, f"{param}: {message}" if param else message, param=param)


# pydantic's JSON parser refuses a body nested deeper than this (arrays and objects, the
# body's own object counted): a schema in response_format or a tool's parameters can reach it.
JSON_MAX_DEPTH = 201
# Where a request's own structure ends and a client's JSON (a schema) begins.
_SCHEMA_KEYS = ("schema", "parameters")


def from_unparsable(body: bytes, errors: list[dict]) -> APIError:
    """A 400 for a body pydantic could not parse: too deep (naming the parameter that
    holds the depth), or not JSON at all."""
    if "recursion limit" in errors[0]["msg"]:
        param = _deep_param(body.decode("utf-8", "replace"))
        where = f"{param}: " if param else ""
        return APIError(400, f"{where}nested too deep: a request's JSON may nest at most "
                             f"{JSON_MAX_DEPTH} levels, the body's own counted", code="json_too_deep",
                        param=param)
    return APIError(400, "the request body is not valid JSON (or not an object)")


def _deep_param(text: str) -> str | None:
    """The parameter whose value nests past :data:`JSON_MAX_DEPTH`: its path in the body
    (``response_format.json_schema.schema``, ``tools[0].function.parameters``), cut where
    the request's structure ends (a schema) or after three steps."""
    stack: list[list] = []  # per open container: its kind, and the key or index in it now
    last, i = None, 0
    while i < len(text):
        c = text[i]
        if c == '"':  # a string: skip it (escapes too), remember it as a key
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            last, i = text[i + 1:j], j + 1
            continue
        if c in "{[":
            if len(stack) >= JSON_MAX_DEPTH:
                return _path(stack)
            stack.append(["{", None] if c == "{" else ["[", 0])
        elif c in "}]" and stack:
            stack.pop()
        elif c == ":" and stack and stack[-1][0] == "{":
            stack[-1][1] = last
        elif c == "," and stack and stack[-1][0] == "[":
            stack[-1][1] += 1
        i += 1
    return None


def _path(stack: list[list]) -> str | None:
    parts = []
    for kind, at in stack[:8]:
        if at is None:
            break
        parts.append(f"[{at}]" if kind == "[" else ("." if parts else "") + str(at))
        if at in _SCHEMA_KEYS:
            break
    path = "".join(parts if any(k in _SCHEMA_KEYS for _, k in stack[:8]) else parts[:3])
    return path or None


def _cause(exc: BaseException) -> BaseException:
    """The exception a unit raised. Serve re-raises it as a ``RayTaskError`` (also an instance
    of the cause's class, hence the unwrapping) whose text is the remote traceback, pid and
    host paths; one unit calling a group's actor can wrap it twice."""
    while isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        exc = exc.cause
    return exc


def from_unit_error(exc: BaseException, rid: str) -> APIError:
    """Map an exception from a unit to an API error: our own 4xx with their message, every
    other cause a 5xx that says what happened (:func:`server_error`)."""
    cause = _cause(exc)
    if isinstance(cause, (CapacityError, BackPressureError)):
        message = str(cause) if isinstance(cause, CapacityError) else ""
        return APIError(429, message or "the service is at capacity; retry shortly",
                        "rate_limit_error", "capacity_exceeded")
    if isinstance(cause, SpecServeError) and cause.status_code < 500:
        return APIError(cause.status_code, str(cause), cause.type, cause.code,
                        param=getattr(cause, "param", None))
    return server_error(exc, rid)


def server_error(exc: BaseException, rid: str) -> APIError:
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


def timeout_error(timeout_s: float) -> APIError:
    """The 504 of a request that ran past ``limits.request_timeout_s`` (it was cancelled)."""
    return APIError(504, f"the request did not finish within {timeout_s:g} s "
                         "(limits.request_timeout_s); it was cancelled", "timeout_error",
                    "request_timeout")
