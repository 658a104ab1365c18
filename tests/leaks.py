"""What an error body must never carry: server internals a client has no use for and an
attacker would (tracebacks, pids, actor ids, host paths, Ray's class names).

``tests/conftest.py`` checks every error response of the suite against these; tests that look
at bodies themselves (fuzzing, hostile values) call :func:`leaks` directly.
"""

from __future__ import annotations

import json
import re

LEAK_PATTERNS: dict[str, re.Pattern[str]] = {
    "traceback": re.compile(r"Traceback \(most recent call last\)|File \"[^\"]*\", line \d+"),
    "pid": re.compile(r"\bpid\s*[=:]\s*\d+", re.IGNORECASE),
    # A request id (``chatcmpl-`` + 32 hex digits) is meant to be there: a hex run after ``-``
    # is not an actor id.
    "actor id": re.compile(r"actor_id|ActorID\(|(?<![\w-])[0-9a-f]{32,}(?![\w-])"),
    "host path": re.compile(r"/home/|/tmp/|/work/|/usr/|/root/|site-packages|\.py\""),
    "Ray class": re.compile(r"RayTaskError|RayActorError|ActorDiedError|ray\.exceptions|ray\.serve"),
}
# The part of a 404 that repeats the model name the client sent: whatever that holds is theirs.
_ECHOED_MODEL = re.compile(r"the model '.*' does not exist", re.DOTALL)


def leaks(body: str) -> list[str]:
    """The names of the patterns ``body`` (an error response's text) matches."""
    body = _ECHOED_MODEL.sub("the model '' does not exist", body)
    return [name for name, pattern in LEAK_PATTERNS.items() if pattern.search(body)]


def sse_errors(text: str) -> list[str]:
    """The in-band error events of an SSE body (``data: {"error": ...}``), as JSON text."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            try:
                if "error" in json.loads(line[6:]):
                    events.append(line[6:])
            except ValueError:
                continue
    return events
