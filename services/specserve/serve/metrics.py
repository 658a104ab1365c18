"""Prometheus metrics: vLLM's names under ``specserve:`` (``docs/METRICS.md`` lists them all).

Two sources, one ``/metrics`` (the ingress's):

- **Requests** (the ingress records them as they pass): HTTP requests by route and status,
  prompt and generation tokens, and the latency histograms. Latencies are the unit's own
  measurements, sent with each request's last chunk (``timing``), so a non-streaming request
  has a real time to first token and proxy time is not counted, as in vLLM.
- **Units** (running / waiting / free slots, speculation counters, router decisions, the K
  chosen per step, the estimated speedup, draft fallbacks): every unit sends a snapshot of
  its live numbers to a small :class:`MetricsHub` actor every ``REPORT_INTERVAL_S``; a scrape
  of ``/metrics`` reads the hub and exposes one series per unit (label ``unit``). Counters are
  the unit's own running totals, exact per step (in-flight requests included); a restarted
  unit starts again from 0, which ``rate()`` treats as a counter reset. A unit silent for
  ``STALE_AFTER_S`` is dropped. The one unit that runs in the ingress's own process
  (``unit_in_ingress``) has no hub: a scrape reads its numbers there and then. A hub is one
  Ray worker process more, whose core worker wakes every 10 ms: on a 2-core machine its CPU
  is taken from the forward's threads at one stream (docs/BENCHMARKS.md, "Ray's background
  CPU").

The same unit numbers also go through Ray's metrics port (``ray.util.metrics``; Ray names
them ``ray_specserve_...``, with ``_`` for ``:``), for clusters that scrape Ray's pods.
Labels stay low-cardinality: route, status, unit, method, decision, reason, position, K.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator

import ray
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from specserve.engine.step.stats import EngineCounters, SpecStats
from specserve.serve.unit_messages import StreamDelta, Timing, UnitSnapshot

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0
STALE_AFTER_S = 30.0
HUB_NAMESPACE = "specserve"
K_BUCKETS = tuple(range(17))
TREE_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TREE_DEPTH_BUCKETS = tuple(range(17))
TREE_RANK_BUCKETS = tuple(range(9))

# -- request metrics (ingress process) -----------------------------------------------------------
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
            5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUESTS = Counter("specserve:requests", "HTTP API requests by route and status code.",
                   ["route", "status"])
PROMPT_TOKENS = Counter("specserve:prompt_tokens", "Prompt tokens of finished requests.", ["route"])
GENERATION_TOKENS = Counter("specserve:generation_tokens", "Output tokens of finished requests.",
                            ["route"])
TTFT = Histogram("specserve:time_to_first_token_seconds",
                 "Arrival at the unit to the first output token.", ["route"], buckets=_LATENCY)
ITL = Histogram("specserve:inter_token_latency_seconds",
                "Gap between consecutive outputs of a request (one engine step; a speculative "
                "step can emit several tokens at once).", ["route"], buckets=_LATENCY)
TPOT = Histogram("specserve:time_per_output_token_seconds",
                 "Per request: (last token - first token) / (output tokens - 1); label "
                 "speculation: whether the request ran with it.", ["route", "speculation"],
                 buckets=_LATENCY)
E2E = Histogram("specserve:e2e_request_latency_seconds",
                "Arrival at the unit to the last output token.", ["route"], buckets=_LATENCY)


def initialize_request_metrics() -> None:
    """Create the series alerts compute ``increase()`` on, at 0: a counter series born at its
    first event (e.g. the first 429) would show no increase for that event."""
    for route in ("/v1/completions", "/v1/chat/completions"):
        for status in ("200", "400", "429", "500", "503"):
            REQUESTS.labels(route, status)


def record_request(route: str, status: int) -> None:
    REQUESTS.labels(route, str(status)).inc()


def record_finish(route: str, chunk: StreamDelta) -> None:
    """A request's last chunk from its unit: tokens and the unit-measured latencies."""
    usage = chunk.usage or {}
    PROMPT_TOKENS.labels(route).inc(usage.get("prompt_tokens", 0))
    GENERATION_TOKENS.labels(route).inc(usage.get("completion_tokens", 0))
    timing = chunk.timing or Timing()
    if timing.ttft_s is not None:
        TTFT.labels(route).observe(timing.ttft_s)
    for gap in timing.itl_s:
        ITL.labels(route).observe(gap)
    if timing.tpot_s is not None:
        speculated = (usage.get("speculation") or {}).get("enabled", False)
        TPOT.labels(route, "on" if speculated else "off").observe(timing.tpot_s)
    if timing.e2e_s is not None:
        E2E.labels(route).observe(timing.e2e_s)


# -- unit metrics: the hub ----------------------------------------------------------------------
@ray.remote(num_cpus=0)
class MetricsHub:
    """Latest snapshot per unit, for the ingress's scrapes: each kept as the bytes its unit
    pickled (:func:`packed`). The hub never reads one, so its process imports none of the
    engine; a :class:`UnitSnapshot` argument would import torch on the first report, a second
    of CPU beside the first requests' forwards on a small machine."""

    def __init__(self) -> None:
        self.units: dict[str, tuple[float, bytes]] = {}

    def report(self, unit: str, snapshot: bytes) -> None:
        self.units[unit] = (time.monotonic(), snapshot)

    def snapshot(self) -> dict[str, bytes]:
        now = time.monotonic()
        self.units = {u: v for u, v in self.units.items() if now - v[0] < STALE_AFTER_S}
        return {u: s for u, (_, s) in self.units.items()}


def packed(snapshot: UnitSnapshot) -> bytes:
    """A snapshot as the hub keeps it."""
    return pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)


def unpacked(snapshots: dict[str, bytes | UnitSnapshot]) -> dict[str, UnitSnapshot]:
    """The hub's snapshots, read (``MetricsHub.snapshot``'s answer). A unit of an earlier
    version, still running in a rolling update, reports the object itself: taken as it is."""
    return {unit: pickle.loads(raw) if isinstance(raw, bytes) else raw
            for unit, raw in snapshots.items()}


def hub_name(app: str) -> str:
    return f"metrics-{app}"


def get_hub(app: str):
    """The app's hub, created by whoever asks first (detached: it outlives a replica)."""
    return MetricsHub.options(name=hub_name(app), namespace=HUB_NAMESPACE, get_if_exists=True,
                              lifetime="detached").remote()


class UnitReporter:
    """A thread in the unit that sends ``snapshot()`` to the hub every ``interval_s`` (not
    ``to_hub``: a unit in the ingress, which has none) and mirrors the numbers into Ray's
    metrics. Failures are logged once and retried."""

    def __init__(self, app: str, unit: str, snapshot: Callable[[], UnitSnapshot],
                 interval_s: float = REPORT_INTERVAL_S, *, to_hub: bool = True) -> None:
        self.app, self.unit, self.snapshot, self.interval_s = app, unit, snapshot, interval_s
        self.to_hub = to_hub
        self._stop = threading.Event()
        self._ray = RayMirror(unit)
        self._thread = threading.Thread(target=self._run, name="metrics-reporter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        hub, failed = None, False
        while not self._stop.wait(self.interval_s):
            try:
                snap = self.snapshot()
                if self.to_hub:
                    hub = hub or get_hub(self.app)
                    hub.report.remote(self.unit, packed(snap))
                self._ray.update(snap)
                failed = False
            except Exception:  # noqa: BLE001  metrics must never take the unit down
                if not failed:
                    log.exception("metrics report failed; retrying every %.1fs", self.interval_s)
                hub, failed = None, True

    def stop(self) -> None:
        self._stop.set()


class RayMirror:
    """The unit's gauges and counters through ``ray.util.metrics`` (Ray's metrics port)."""

    def __init__(self, unit: str) -> None:
        from ray.util.metrics import Counter as RayCounter
        from ray.util.metrics import Gauge as RayGauge

        tags = ("unit", "method")
        self.unit = unit
        self.gauges = {name: RayGauge(f"specserve_{name}", doc, tag_keys=tags)
                       for name, doc in _GAUGES.items()}
        self.counters = {name: RayCounter(f"specserve_{name}", doc, tag_keys=tags)
                         for name, doc in COUNTER_DOCS.items()}
        self._last: dict[str, float] = {}

    def update(self, snap: UnitSnapshot) -> None:
        tags = {"unit": self.unit, "method": snap.method}
        for name in _GAUGES:
            self.gauges[name].set(float(getattr(snap, name)), tags)
        for name, value in _counter_values(snap).items():
            delta = value - self._last.get(name, 0.0)
            if delta > 0:
                self.counters[name].inc(delta, tags)
            self._last[name] = value


# Unit gauges and counters: snapshot key -> help text (names get the ``specserve:`` prefix;
# counters get ``_total`` in the exposition).
_GAUGES = {
    "num_requests_running": "Sequences decoding in the unit.",
    "num_requests_waiting": "Requests queued for a KV slot.",
    "free_slots": "Free KV slots.",
    "num_slots": "KV slots (max_num_seqs).",
    "draft_available": "1 while the unit's proposer answers, 0 in draft_unavailable fallback.",
    "estimated_speedup": "The coordinator's predicted throughput at its K over K = 0 "
                         "(1 until its cost model is calibrated).",
    "speculation_length_current": "The K the coordinator drafts for adaptive requests now.",
    "concurrency_gate_open": "1 while the router speculates new requests, 0 in high_concurrency.",
    "target_available": "1 while the target group serves, 0 while it is restarted after a failure.",
    "autoscaling_load": "The unit's load by unit autoscaling's rule (serve/autoscaling.py): its "
                        "fuller resource, KV blocks or slots priced at speculation's cost.",
    "kv_blocks_total": "KV blocks of a paged target (kv_cache.layout paged; 0 with slots).",
    "kv_blocks_free": "KV blocks no sequence holds (cached prefixes among them, reusable).",
}
_COUNTERS = {
    "requests_admitted": "Sequences the unit's engine accepted (a request of n choices: n).",
    "requests_aborted": "Sequences cancelled before they finished (client went away).",
    "target_restarts": "Restarts of the target group after a rank died or a step timed out.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache (vLLM's "
                            "prefix_cache_queries).",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache, not computed (hit rate: "
                         "rate(hits) / rate(queries)).",
}
# The engine's counters (``UnitSnapshot.engine``, an ``EngineCounters``): metric name ->
# (help text, its value in the counters).
_ENGINE_COUNTERS: dict[str, tuple[str, Callable[[EngineCounters], int]]] = {
    "spec_decode_num_drafts": ("Verified drafts (one per sequence per step that drafted).",
                               lambda c: c.spec.num_drafts),
    "spec_decode_num_draft_tokens": ("Drafted tokens.", lambda c: c.spec.num_draft_tokens),
    "spec_decode_num_accepted_tokens": ("Drafted tokens the target accepted.",
                                        lambda c: c.spec.num_accepted_tokens),
    "draft_fallbacks": ("Times the unit lost its draft group and decoded target-only.",
                        lambda c: c.num_draft_fallbacks),
    "prefill_tokens": ("Prompt tokens the target computed in prefills.", lambda c: c.num_prefill_tokens),
    "prefill_tokens_shared": ("Prompt tokens copied from a request's first choice to its others "
                              "(n > 1) instead of being computed again.", lambda c: c.num_forked_tokens),
    "prefill_chunks": ("Chunks of prompts prefilled (chunked_prefill_size), each in a step's forward.",
                       lambda c: c.num_prefill_chunks),
    "preemptions": ("Sequences sent back to wait because the paged KV pool ran short (recomputed "
                    "later).", lambda c: c.num_preemptions),
}


# Every unit counter's help text, the unit's own and the engine's.
COUNTER_DOCS = {**_COUNTERS, **{name: doc for name, (doc, _) in _ENGINE_COUNTERS.items()}}


def _counter_values(snap: UnitSnapshot) -> dict[str, float]:
    """Every counter of ``_COUNTERS`` and ``_ENGINE_COUNTERS``: its value in ``snap``."""
    return {**{name: float(getattr(snap, name)) for name in _COUNTERS},
            **{name: float(value(snap.engine)) for name, (_, value) in _ENGINE_COUNTERS.items()}}


# The spec_decode counters per drafting proposer (a hybrid's first and model parts): the
# SpecStats field of each, from ``EngineCounters.by_proposer``.
_BY_PROPOSER = (
    ("num_drafts", "Verified drafts, by the proposer that drafted them (a hybrid's parts)."),
    ("num_draft_tokens", "Drafted tokens, by the proposer that drafted them."),
    ("num_accepted_tokens", "Drafted tokens the target accepted, by the proposer that drafted them."),
)


def unit_families(units: dict[str, UnitSnapshot]) -> Iterator:
    """Metric families of every unit's snapshot (see :meth:`SpeculationUnit.metrics_snapshot`)."""
    labels = ["unit", "method"]
    gauges = {n: GaugeMetricFamily(f"specserve:{n}", doc, labels=labels) for n, doc in _GAUGES.items()}
    counters = {n: CounterMetricFamily(f"specserve:{n}", doc, labels=labels)
                for n, doc in COUNTER_DOCS.items()}
    per_pos = CounterMetricFamily(
        "specserve:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens by draft position (0 = the first drafted token).",
        labels=[*labels, "position"])
    decisions = CounterMetricFamily(
        "specserve:router_decisions", "Speculation decisions per request, by outcome and reason.",
        labels=[*labels, "decision", "reason"])
    proposer = GaugeMetricFamily(
        "specserve:proposer_state", "What the unit's proposer holds across requests "
        "(suffix decoding: its response cache's responses, tokens and bytes).",
        labels=[*labels, "name"])
    by_proposer = [CounterMetricFamily(f"specserve:proposer_{name}", doc, labels=[*labels, "proposer"])
                   for name, doc in _BY_PROPOSER]
    received = [CounterMetricFamily(f"specserve:unit_received_{name}", doc, labels=[*labels, "source"])
                for name, doc in (
                    ("bytes", "Bytes the unit's coordinator received from its target group "
                              "(rank 0: each row's kept tokens, never logits) and its draft group "
                              "(token ids and top-k q), by source."),
                    ("messages", "Replies the coordinator received, by source (one per verify "
                                 "forward or draft step): bytes / messages = bytes per step."))]
    k_hist = HistogramMetricFamily(
        "specserve:speculation_length",
        "K drafted per decoding sequence per step (0: that step ran target-only; for a tree "
        "proposer, the node budget).", labels=labels)
    tree_hists = [  # (family, its counts in the engine's SpecStats, bucket bounds)
        (HistogramMetricFamily("specserve:spec_decode_tree_size",
                               "Nodes of each verified token tree.", labels=labels),
         lambda spec: spec.tree_sizes, TREE_SIZE_BUCKETS),
        (HistogramMetricFamily("specserve:spec_decode_tree_accepted_depth",
                               "Depth the kept path of each verified token tree reached "
                               "(its accepted tokens; 0: no node kept).", labels=labels),
         lambda spec: spec.tree_depths, TREE_DEPTH_BUCKETS),
        (HistogramMetricFamily("specserve:spec_decode_tree_accepted_rank",
                               "Sibling rank of each kept tree node (0: its parent's first "
                               "drafted child; above 0: a branch a chain would not have had).",
                               labels=labels),
         _by_rank, TREE_RANK_BUCKETS),
    ]
    for unit, snap in sorted(units.items()):
        values = [unit, snap.method]
        for name, family in gauges.items():
            family.add_metric(values, float(getattr(snap, name)))
        for name, value in _counter_values(snap).items():
            counters[name].add_metric(values, value)
        engine = snap.engine
        for pos, n in enumerate(engine.spec.accepted_per_position):
            per_pos.add_metric([*values, str(pos)], float(n))
        for (decision, reason), n in sorted(snap.router_decisions.items()):
            decisions.add_metric([*values, decision, reason], float(n))
        for name, value in sorted(snap.proposer_state.items()):
            proposer.add_metric([*values, name], float(value))
        for name, stats in sorted(engine.by_proposer.items()):
            for family, (field, _) in zip(by_proposer, _BY_PROPOSER):
                family.add_metric([*values, name], float(getattr(stats, field)))
        for source, counts in sorted(snap.received.items()):
            for family, n in zip(received, counts):
                family.add_metric([*values, source], float(n))
        _add_histogram(k_hist, values, engine.k_counts, K_BUCKETS)
        for family, counts, bounds in tree_hists:  # zeros where no tree was verified
            _add_histogram(family, values, counts(engine.spec), bounds)
    yield from gauges.values()
    yield from counters.values()
    yield from (per_pos, decisions, proposer, *by_proposer, *received, k_hist,
                *(f for f, _, _ in tree_hists))


def _by_rank(spec: SpecStats) -> dict[int, int]:
    """Kept tree nodes per sibling rank, over every depth (the per-depth counts are in
    ``/v1/units/stats``; a depth label on /metrics would multiply its series)."""
    out: dict[int, int] = {}
    for (_, rank), n in spec.tree_ranks.items():
        out[rank] = out.get(rank, 0) + n
    return out


def _add_histogram(family: HistogramMetricFamily, values: list[str], counts: dict[int, int],
                   bounds: tuple[int, ...]) -> None:
    """One series of ``family`` from ``counts`` (observed value -> times; the values are
    integers, so bucket ``le = b`` holds every value up to b)."""
    buckets = [(str(float(bound)), float(sum(n for v, n in counts.items() if v <= bound)))
               for bound in bounds]
    buckets.append(("+Inf", float(sum(counts.values()))))
    family.add_metric(values, buckets, sum_value=float(sum(v * n for v, n in counts.items())))


class _Families:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return self.families


def exposition(units: dict[str, UnitSnapshot]) -> bytes:
    """The whole ``/metrics`` body: this process's request metrics, then the units'."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(unit_families(units))))
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY) + generate_latest(registry)
