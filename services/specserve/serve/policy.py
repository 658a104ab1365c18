"""Per-request speculation decision: on or off, how far, and why.

Every decision carries a reason, returned to the client (``x-speculation`` header, the
``usage.speculation`` block) and counted in metrics. This module is pure: the unit calls it
with its own live state, so the load it reasons about is exact.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    enabled: bool
    reason: str
    method: str | None
    num_speculative_tokens: int  # K for this request; 0 when off

    def header(self) -> str:
        """The ``x-speculation`` header value, e.g. ``on; reason=default; method=ngram; k=4``."""
        state = "on" if self.enabled else "off"
        parts = [state, f"reason={self.reason}"]
        if self.enabled:
            parts += [f"method={self.method}", f"k={self.num_speculative_tokens}"]
        return "; ".join(parts)


def decide(options: dict | None, *, method: str | None, default_k: int,
           draft_available: bool) -> Decision:
    """The decision for one request.

    ``options``: the request's ``speculation`` extension (enabled / num_speculative_tokens /
    method), or None. ``method``: the unit's proposer (None: the unit serves target-only).
    """
    options = options or {}
    k = options.get("num_speculative_tokens") or default_k
    if options.get("enabled") is False:
        return Decision(False, "client_override", method, 0)
    if method is None:
        return Decision(False, "not_configured", None, 0)
    if not draft_available:
        return Decision(False, "draft_unavailable", method, 0)
    reason = "client_override" if options.get("enabled") else "default"
    return Decision(True, reason, method, k)
