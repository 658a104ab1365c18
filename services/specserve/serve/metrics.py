"""Prometheus metrics of the ingress process (``/metrics``), named as in ../DESIGN "Metrics".

Units report what they decided and did in each response's stream (the decision first, the K
per decode step and the estimated speedup with the last chunk), and the ingress counts it
here: one process sees every request, so the counters are exact without collecting from
replicas. Labels stay low-cardinality: decision, reason.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ROUTER_DECISIONS = Counter(
    "specserve:router_decisions", "Speculation decisions per request, by outcome and reason.",
    ["decision", "reason"])
SPECULATION_LENGTH = Histogram(
    "specserve:speculation_length",
    "K drafted per sequence per decode step (0: that step ran target-only).",
    buckets=tuple(range(17)))
ESTIMATED_SPEEDUP = Gauge(
    "specserve:estimated_speedup",
    "The coordinator's predicted throughput at its current K over K = 0 (last finished request).")


def record_decision(speculation: dict) -> None:
    ROUTER_DECISIONS.labels("on" if speculation["enabled"] else "off", speculation["reason"]).inc()


def record_finish(chunk: dict) -> None:
    """The last chunk of a request: its steps per K and the unit's speedup estimate."""
    for k, steps in (chunk.get("k_counts") or {}).items():
        for _ in range(steps):
            SPECULATION_LENGTH.observe(k)
    speedup = (chunk.get("usage") or {}).get("speculation", {}).get("estimated_speedup")
    if speedup is not None:
        ESTIMATED_SPEEDUP.set(speedup)
