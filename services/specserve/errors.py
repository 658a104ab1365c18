"""Errors with a message meant for the person who caused them.

The API turns these into OpenAI-shaped errors (``{"error": {"message", "type", "code"}}``);
the command line prints the message on one line. Anything else is a bug and a 500.
"""

from __future__ import annotations


class SpecServeError(Exception):
    """Base class. ``type`` and ``code`` follow the OpenAI error object."""

    type = "internal_error"
    code: str | None = None
    status_code = 500


class ConfigError(SpecServeError, ValueError):
    """The deployment or engine configuration is invalid (found when it is built)."""

    type = "invalid_request_error"
    code = "invalid_config"
    status_code = 400


class ModelNotFoundError(ConfigError):
    """A model path does not exist, or a hub id could not be fetched."""

    code = "model_not_found"
    status_code = 404


class InvalidRequestError(SpecServeError, ValueError):
    """A request the engine refuses before touching the model (prompt too long, ...);
    ``param``: the API field at fault, where one is (the error object's ``param``)."""

    type = "invalid_request_error"
    code = "invalid_request"
    status_code = 400

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # (in __dict__: it survives pickling to another process)


class ContextLengthExceeded(InvalidRequestError):
    """The prompt (with ``max_tokens``) does not fit the model's context length."""

    code = "context_length_exceeded"


class RequestFailed(SpecServeError):
    """A step failed for this request alone (the unit stepped each row on its own to find
    out); the other requests of the unit go on. The detail is in the server log."""

    type = "internal_error"
    code = "request_failed"
    status_code = 500


class CapacityError(SpecServeError):
    """No free KV slot / the queue is full. The API answers 429 with Retry-After."""

    type = "rate_limit_error"
    code = "capacity_exceeded"
    status_code = 429


class ProposerUnavailable(SpecServeError):
    """The draft group died or timed out. Never reaches a client: the unit falls back to
    target-only decoding (reason ``draft_unavailable``) until the draft is back."""

    code = "draft_unavailable"
    status_code = 503


class TargetUnavailable(SpecServeError):
    """The target group failed (a rank died, or a step ran past ``target_step_timeout_s``)
    or is being restarted. Requests in flight end with it; new ones get it until the group is
    back. 503 with ``Retry-After``."""

    type = "service_unavailable"
    code = "target_unavailable"
    status_code = 503
