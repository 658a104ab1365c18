"""Unit autoscaling: how many units the traffic wants, from what the units say.

Ray Serve's default signal, ongoing requests per replica (``target_ongoing_requests``),
prices every request the same. A speculative unit's capacity is not a request count: it is
bounded by its sequence slots and its KV blocks, and each sequence costs more unit time when
the unit's concurrency gate has turned speculation off (``serve/policy.py``,
``high_concurrency``): the same streams then take ``speedup`` times as many target steps.
So the rule prices the load as the units themselves see it.

Each unit reports (:meth:`SpeculationUnit.record_autoscaling_stats`, averaged by Serve over
``look_back_s``): ``seqs`` (running + waiting sequences), ``max_seqs`` (its slots),
``kv_used`` (the share of its KV blocks, or slots, in use), ``gate_off_at`` (the load at which
its gate turns speculation off) and ``speedup`` (what its speculation gives while on: the
coordinator's calibrated estimate, 1 before it has one). Summed over the units, the load of
``n`` units sharing that traffic is

    per_unit = seqs / n
    cost     = speedup  if per_unit >= gate_off_at  else 1
    load(n)  = max(kv_used / n, per_unit / max_seqs * cost)

that is, each unit's fuller resource: its KV pool, or its slots with the time a slot is
held priced at what speculation buys. The units wanted: the fewest ``n`` in the bounds with
``load(n) <= target_utilization``; fewer than now only where ``load(n) <= target_utilization
* (1 - hysteresis)``. The model knows the gate: it does not scale down into a load at which
speculation would turn off again and scale back up (the loop a rule blind to speculation
would flap in). Serve applies ``upscale_delay_s`` / ``downscale_delay_s`` (the wanted count
must hold that long) and the bounds, then starts or drains units: a unit being removed takes
no new requests and finishes its streams for up to ``drain_timeout_s`` (``deploy/app.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SIGNALS = ("seqs", "max_seqs", "kv_used", "gate_off_at", "speedup")
NO_GATE = 1e9  # gate_off_at of a unit whose speculation never turns off for load


@dataclass(frozen=True)
class Fleet:
    """The running units' signals: sums of ``seqs`` and ``kv_used``, and the per-unit
    ``max_seqs``, ``gate_off_at`` and ``speedup`` (means: the units run one configuration)."""

    units: int
    seqs: float
    kv_used: float
    max_seqs: float
    gate_off_at: float
    speedup: float

    @classmethod
    def of(cls, metrics: dict[str, dict[object, float]]) -> Fleet | None:
        """From Serve's aggregated custom metrics (``{signal: {replica: value}}``); None until
        every signal has a value from at least one unit."""
        if any(not metrics.get(name) for name in SIGNALS):
            return None
        units = set.intersection(*(set(metrics[name]) for name in SIGNALS))
        if not units:
            return None

        def total(name: str) -> float:
            return sum(float(metrics[name][u]) for u in units)

        n = len(units)
        return cls(n, total("seqs"), total("kv_used"), total("max_seqs") / n,
                   total("gate_off_at") / n, max(1.0, total("speedup") / n))

    @classmethod
    def of_unit(cls, signals: dict[str, float]) -> Fleet:
        """One unit's own (:meth:`SpeculationUnit.record_autoscaling_stats`)."""
        return cls.of({name: {0: value} for name, value in signals.items()})

    def load(self, n: int) -> float:
        """The load of each of ``n`` units sharing this traffic (the module's rule)."""
        per_unit = self.seqs / n
        cost = self.speedup if per_unit >= self.gate_off_at else 1.0
        return max(self.kv_used / n, per_unit / max(self.max_seqs, 1.0) * cost)


def wanted_units(fleet: Fleet, current: int, low: int, high: int, target: float,
                 hysteresis: float) -> int:
    """The units the rule wants (module docstring), within ``[low, high]``."""
    up = next((n for n in range(low, high + 1) if fleet.load(n) <= target), high)
    if up >= current:
        return up
    return next((n for n in range(low, current) if fleet.load(n) <= target * (1 - hysteresis)),
                current)


class UnitPolicy:
    """Serve's custom autoscaling policy for the units (``autoscaling.policy: speculation``):
    called by the Serve controller every control period with the deployment's context. What
    it sees goes to the dashboards through Ray's metrics port (:data:`GAUGES`, as
    ``ray_specserve_autoscaling_*``; a scale event is a change of ``units_target``) and into
    ``policy_state``."""

    def __init__(self, target_utilization: float = 0.7, hysteresis: float = 0.2) -> None:
        self.target, self.hysteresis = target_utilization, hysteresis
        self._gauges: dict | None = None

    def __call__(self, ctx) -> tuple[int, dict]:
        state = dict(ctx.policy_state or {})
        fleet = Fleet.of(ctx.aggregated_metrics or {})
        current = max(ctx.current_num_replicas, 1)
        wanted, signal = ctx.target_num_replicas, None  # no unit has reported yet: hold
        if fleet is not None:
            wanted = wanted_units(fleet, current, max(ctx.capacity_adjusted_min_replicas, 1),
                                  ctx.capacity_adjusted_max_replicas, self.target, self.hysteresis)
            signal = fleet.load(current)
            state.update(specserve_signal=round(signal, 4), specserve_wanted=wanted)
        self._export(ctx, wanted, signal)
        return wanted, state

    def _export(self, ctx, wanted: int, signal: float | None) -> None:
        if self._gauges is None:
            self._gauges = _gauges()
        tags = {"application": ctx.app_name or ""}
        values = {"units_running": ctx.current_num_replicas, "units_target": ctx.target_num_replicas,
                  "units_wanted": wanted, "signal": signal}
        for name, gauge in self._gauges.items():
            if values[name] is not None:
                gauge.set(float(values[name]), tags=tags)


GAUGES = {
    "units_running": "Units running now (Serve's replicas of the unit deployment).",
    "units_target": "Units Serve is scaling to: the policy's count once held for the up or down "
                    "delay (each change is a scale event).",
    "units_wanted": "Units the rule wants now, before the delays (serve/autoscaling.py).",
    "signal": "The load of each running unit by the rule: its fuller resource, KV blocks or "
              "slots priced at speculation's cost; held near target_utilization.",
}


def _gauges() -> dict:
    """Ray metrics for :data:`GAUGES` (in the Serve controller; none where Ray is not up)."""
    import ray
    from ray.util.metrics import Gauge

    if not ray.is_initialized():
        return {}
    return {name: Gauge(f"specserve_autoscaling_{name}", description=doc, tag_keys=("application",))
            for name, doc in GAUGES.items()}


def requests_target(max_num_seqs: int, target_utilization: float) -> float:
    """``target_ongoing_requests`` for Serve's own policy (``autoscaling.policy: requests``)
    at the same target utilisation of a unit's slots."""
    return max(1.0, math.floor(max_num_seqs * target_utilization))
