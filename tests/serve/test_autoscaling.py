"""Unit autoscaling's rule (``serve/autoscaling.py``), on stand-ins for what the units report:
each signal drives it, the bounds hold, a noisy signal does not flap it, and the model of the
concurrency gate keeps it from scaling down into a load where speculation would turn off.

The policy runs as Serve runs it: wrapped by Serve's own ``_apply_autoscaling_config`` (the
delays, the scaling factors), with a real ``AutoscalingConfig`` and ``AutoscalingContext``
and a clock the test drives; only the units are stand-ins (their signals, as Serve would have
aggregated them)."""

from __future__ import annotations

import random

import pytest
from ray.serve import autoscaling_policy
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from specserve.app_config import AppConfig
from specserve.serve.autoscaling import NO_GATE, Fleet, UnitPolicy, wanted_units

DEPLOYMENT = DeploymentID(name="SpeculationUnit", app_name="scaling")


def fleet(seqs: float, *, units: int = 1, kv_used: float = 0.0, max_seqs: int = 8,
          gate_off_at: float = NO_GATE, speedup: float = 1.0) -> Fleet:
    return Fleet(units, seqs, kv_used, max_seqs, gate_off_at, speedup)


def test_each_signal_drives_the_count_within_the_bounds():
    want = lambda f, current=1: wanted_units(f, current, 1, 4, 0.7, 0.2)  # noqa: E731
    assert want(fleet(2)) == 1                    # 2 of 8 slots: 0.25
    assert want(fleet(8)) == 2                    # a full unit: 1.0 -> two at 0.5
    assert want(fleet(2, kv_used=1.3)) == 2       # the KV pool: 1.3 of a unit's blocks
    # Speculation's cost: 5 sequences are 0.625 of a unit's slots, but past its gate (4)
    # speculation is off and each costs its speedup (1.8): 1.125, so two units (2.5 each:
    # under the gate, speculation on again, 0.31).
    assert want(fleet(5, gate_off_at=4)) == 1
    assert want(fleet(5, gate_off_at=4, speedup=1.8)) == 2
    assert want(fleet(100)) == 4                  # the most allowed
    assert wanted_units(fleet(0), 3, 2, 4, 0.7, 0.2) == 2  # the fewest allowed


def test_fewer_units_only_below_the_hysteresis_band_and_not_into_the_gate():
    want = lambda f, current: wanted_units(f, current, 1, 4, 0.7, 0.2)  # noqa: E731
    assert want(fleet(5.0), 2) == 2   # one unit would run at 0.625: above 0.56, stay
    assert want(fleet(4.4), 2) == 1   # 0.55: one unit
    # Two units of 3 sequences each, speculation on; one unit would hold 6, past its gate
    # (4), at 1.5 its slots: it stays at two, though 6 of 8 slots is below the target.
    assert want(fleet(6, gate_off_at=4, speedup=2.0), 2) == 2
    assert want(fleet(6), 2) == 2     # (0.75 without the gate: above the target too)
    assert want(fleet(3.5, gate_off_at=4, speedup=2.0), 2) == 1  # under the gate on one


def test_fleet_of_serves_metrics_waits_for_every_signal():
    r = [ReplicaID(unique_id=f"u{i}", deployment_id=DEPLOYMENT) for i in range(2)]
    metrics = {"seqs": {r[0]: 3.0, r[1]: 5.0}, "max_seqs": {r[0]: 8.0, r[1]: 8.0},
               "kv_used": {r[0]: 0.2, r[1]: 0.4}, "gate_off_at": {r[0]: 6.0, r[1]: 6.0},
               "speedup": {r[0]: 1.5, r[1]: 1.7}}
    f = Fleet.of(metrics)
    assert (f.units, f.seqs, f.max_seqs, f.gate_off_at) == (2, 8.0, 8.0, 6.0)
    assert f.kv_used == pytest.approx(0.6) and f.speedup == pytest.approx(1.6)
    assert Fleet.of({**metrics, "speedup": {}}) is None  # a unit that has not reported yet
    assert Fleet.of({}) is None


def context(metrics: dict, *, current: int, target: int, config: AutoscalingConfig,
            state: dict, now: float) -> AutoscalingContext:
    replicas = [ReplicaID(unique_id=f"u{i}", deployment_id=DEPLOYMENT) for i in range(current)]
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
        current_num_replicas=current, target_num_replicas=target, running_replicas=replicas,
        total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics={name: {r: value / (current if name in ("seqs", "kv_used") else 1)
                                   for r in replicas} for name, value in metrics.items()},
        raw_metrics={}, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state=state,
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=config)


def run(signal, seconds: int, *, upscale_delay_s=10.0, downscale_delay_s=30.0):
    """Serve's control loop, once a second for ``seconds``, over the units' summed signals
    ``signal(t)``; the units follow the decision at once. Returns the count before each tick
    and the last policy state. (Serve's delays read ``time.time()``: the test's clock.)"""
    clock = [1000.0]
    patch = pytest.MonkeyPatch()
    patch.setattr(autoscaling_policy.time, "time", lambda: clock[0])
    try:
        return _ticks(signal, seconds, clock, upscale_delay_s, downscale_delay_s)
    finally:
        patch.undo()


def _ticks(signal, seconds, clock, upscale_delay_s, downscale_delay_s):
    config = AutoscalingConfig(min_replicas=1, max_replicas=2, upscale_delay_s=upscale_delay_s,
                               downscale_delay_s=downscale_delay_s)
    policy = _apply_autoscaling_config(UnitPolicy(target_utilization=0.7, hysteresis=0.2))
    units, state, counts = 1, {}, []
    for t in range(seconds):
        clock[0] = 1000.0 + t
        counts.append(units)
        ctx = context(signal(t), current=units, target=units, config=config, state=state,
                      now=clock[0])
        units, state = policy(ctx)
    return counts, state


def signals(seqs: float, **extra) -> dict:
    return {"seqs": seqs, "max_seqs": 8, "kv_used": 0.0, "gate_off_at": NO_GATE,
            "speedup": 1.0, **extra}


def test_the_ramp_scales_up_after_its_delay_and_down_after_its_own():
    load = lambda t: signals(8 if 20 <= t < 80 else 1)  # noqa: E731
    counts, state = run(load, 140)
    assert counts[:31] == [1] * 31     # up at the tick 10 s after the signal crossed (t = 20)
    assert counts[31:111] == [2] * 80  # down at the tick 30 s after it fell (t = 80)
    assert counts[111:] == [1] * 29
    assert state["specserve_wanted"] == 1 and state["specserve_signal"] == pytest.approx(0.125)


def test_a_noisy_signal_around_the_target_does_not_flap():
    noise = random.Random(0)
    load = lambda t: signals(noise.uniform(4.7, 6.5))  # noqa: E731  (0.59..0.81 of one unit)
    counts, _ = run(load, 600, upscale_delay_s=0.0, downscale_delay_s=0.0)
    changes = sum(a != b for a, b in zip(counts, counts[1:]))
    assert changes == 1 and counts[-1] == 2, counts  # up once, never down (below the band)
    # Without the band (hysteresis 0) the same noise flaps: the test above can fail.
    flapping = [wanted_units(fleet(noise.uniform(4.7, 6.5)), current, 1, 2, 0.7, 0.0)
                for current in [2] * 50]
    assert 1 in flapping


def test_an_app_with_autoscaling_starts_within_its_bounds():
    args = {"autoscaling": {"min_units": 1, "max_units": 2}}
    assert AppConfig.model_validate({**args, "num_units": 2}).autoscaling.max_units == 2
    with pytest.raises(ValueError, match="outside autoscaling"):
        AppConfig.model_validate({**args, "num_units": 3})
    with pytest.raises(ValueError, match="min_units 3 exceeds"):
        AppConfig.model_validate({"autoscaling": {"min_units": 3, "max_units": 2}, "num_units": 3})
