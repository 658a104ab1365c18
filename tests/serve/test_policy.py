"""The per-request speculation policy with synthetic load, acceptance and a driven clock
(no Ray): each reason, the concurrency hysteresis, and recovery after low acceptance."""

from __future__ import annotations

import pytest
from specserve.config import SpeculationPolicyConfig, UnitConfig
from specserve.serve.policy import UNCALIBRATED_BREAK_EVEN, SpeculationPolicy
from specserve.serve.protocol import SpeculationOptions
from specserve.serve.unit_messages import Decision


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def router(method="draft_model", max_num_seqs=8, adaptive=True, **cfg) -> tuple[SpeculationPolicy, Clock]:
    clock = Clock()
    return SpeculationPolicy(SpeculationPolicyConfig(**cfg), method=method, default_k=4, adaptive=adaptive,
                             max_num_seqs=max_num_seqs, clock=clock), clock


def decide(r: SpeculationPolicy, options=None, *, max_tokens=256, load=0, key="chat||",
           draft_available=True) -> Decision:
    options = SpeculationOptions(**options) if options is not None else None
    return r.decide(options, max_tokens=max_tokens, load=load, key=key,
                    draft_available=draft_available)


def test_default_is_on_with_adaptive_k():
    d = decide(router("ngram")[0])
    assert (d.enabled, d.reason, d.num_speculative_tokens, d.adaptive) == (True, "default", 4, True)
    assert d.header() == "on; reason=default; method=ngram; k=4; k_mode=adaptive"


def test_short_output():
    r, _ = router(short_output_tokens=64)
    assert (decide(r, max_tokens=63).reason, decide(r, max_tokens=63).enabled) == ("short_output", False)
    assert decide(r, max_tokens=64).reason == "default"
    assert decide(router(short_output_tokens=0)[0], max_tokens=1).reason == "default"


def test_client_override_wins_both_ways_and_fixes_k():
    r, _ = router()
    off = decide(r, {"enabled": False}, max_tokens=500)
    assert (off.enabled, off.reason) == (False, "client_override")
    assert off.header() == "off; reason=client_override"
    on = decide(r, {"enabled": True, "num_speculative_tokens": 2}, max_tokens=8, load=99)
    assert (on.enabled, on.reason, on.num_speculative_tokens, on.adaptive) == \
        (True, "client_override", 2, False)


def test_requested_k_caps_an_adaptive_request():
    d = decide(router()[0], {"num_speculative_tokens": 2})
    assert (d.reason, d.num_speculative_tokens, d.adaptive) == ("default", 2, True)


def test_not_configured_and_draft_unavailable():
    assert decide(router(method=None)[0]).reason == "not_configured"
    d = decide(router()[0], {"enabled": True}, draft_available=False)
    assert (d.enabled, d.reason) == (False, "draft_unavailable")


def test_high_concurrency_turns_off_and_resumes_after_the_load_drops():
    r, clock = router(high_concurrency_threshold=16, high_concurrency_resume=8, min_dwell_s=2.0)
    assert decide(r, load=15).enabled
    d = decide(r, load=16)
    assert (d.enabled, d.reason) == (False, "high_concurrency")
    clock.now += 5
    assert decide(r, load=9).reason == "high_concurrency"   # between the thresholds: stays off
    assert decide(r, load=8).reason == "default"            # at the resume threshold: back on


def test_no_flapping_under_a_load_oscillating_around_the_threshold():
    """Load alternating 15 / 16 / 17 around the off threshold: one flip, not one per request."""
    r, clock = router(high_concurrency_threshold=16, high_concurrency_resume=8, min_dwell_s=2.0)
    seen = []
    for i in range(300):
        clock.now += 0.05
        seen.append(decide(r, load=15 + i % 3).enabled)
    assert r.gate.flips == 1 and not any(seen[2:])


def test_dwell_bounds_flips_when_load_swings_across_both_thresholds():
    """Load swinging 2 <-> 20 on every request for 30 s flips at most once per dwell (2 s)."""
    r, clock = router(high_concurrency_threshold=16, high_concurrency_resume=8, min_dwell_s=2.0)
    for i in range(600):
        clock.now += 0.05
        decide(r, load=20 if i % 2 else 2)
    assert 2 <= r.gate.flips <= 30 / 2.0 + 1


def test_without_dwell_the_same_swing_flips_every_request():
    """Power check for the one above: with no dwell, the gate follows every swing."""
    r, clock = router(high_concurrency_threshold=16, high_concurrency_resume=8, min_dwell_s=0.0)
    for i in range(100):
        clock.now += 0.05
        decide(r, load=20 if i % 2 else 2)
    assert r.gate.flips >= 99


def feed(r: SpeculationPolicy, key: str, rate: float, n: int, break_even=0.2) -> None:
    for _ in range(n):
        d = decide(r, key=key)
        r.observe(key, d, 100, int(100 * rate), break_even)


def test_low_acceptance_turns_a_class_off_but_keeps_probing():
    r, _ = router(probe_share=0.1, acceptance_min_requests=3)
    feed(r, "chat|tenant-a|code", rate=0.02, n=3)
    decisions = [decide(r, key="chat|tenant-a|code") for _ in range(50)]
    assert {d.reason for d in decisions} == {"low_acceptance", "probe"}
    probes = [d for d in decisions if d.reason == "probe"]
    assert len(probes) == 5 and all(d.enabled and not d.adaptive for d in probes)
    assert decide(r, key="chat|tenant-b|code").reason == "default"  # other classes unaffected


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_model_free_proposer_is_not_switched_off_where_per_step_k_saves_the_cost(method):
    """Adaptive K drafts nothing where a model-free proposer finds nothing or is rejected:
    its classes and its short requests stay on (and measured); with a fixed K the switches
    act again."""
    r, _ = router(method=method, acceptance_min_requests=3)
    feed(r, "chat|tenant-a|", rate=0.02, n=5)
    assert r.acceptance.classes["chat|tenant-a|"].low
    assert {decide(r, key="chat|tenant-a|").reason for _ in range(20)} == {"default"}
    assert decide(r, max_tokens=8).reason == "default"  # a short answer costs nothing more either
    fixed, _ = router(method=method, adaptive=False, acceptance_min_requests=3)
    feed(fixed, "chat|tenant-a|", rate=0.02, n=5)
    assert decide(fixed, key="chat|tenant-a|").reason in ("low_acceptance", "probe")
    assert decide(fixed, max_tokens=8).reason == "short_output"


def test_low_acceptance_recovers_through_probes():
    r, _ = router(probe_share=0.25, acceptance_min_requests=3, acceptance_ewma_weight=0.3)
    key = "completions||summarize"
    feed(r, key, rate=0.02, n=3)
    assert decide(r, key=key).reason in ("low_acceptance", "probe")
    recovered_after = None
    for i in range(200):
        d = decide(r, key=key)
        if d.reason == "default":
            recovered_after = i
            break
        if d.enabled:  # only speculated requests measure acceptance
            r.observe(key, d, 100, 70, 0.2)
    assert recovered_after is not None and recovered_after < 60


def test_acceptance_between_break_even_and_hysteresis_does_not_recover():
    r, _ = router(probe_share=1.0, acceptance_min_requests=1, acceptance_hysteresis=0.05,
                  acceptance_ewma_weight=1.0)
    feed(r, "k", rate=0.1, n=1, break_even=0.2)
    feed(r, "k", rate=0.22, n=20, break_even=0.2)   # above 0.2, below 0.25
    assert r.acceptance.classes["k"].low
    feed(r, "k", rate=0.3, n=1, break_even=0.2)
    assert not r.acceptance.classes["k"].low


def test_break_even_comes_from_the_cost_model_unless_configured():
    assert router()[0].break_even(None) == UNCALIBRATED_BREAK_EVEN
    assert router()[0].break_even(0.07) == 0.07
    assert router(low_acceptance_threshold=0.4)[0].break_even(0.07) == 0.4


def test_unspeculated_requests_do_not_feed_acceptance():
    r, _ = router()
    off = decide(r, {"enabled": False})
    r.observe("k", off, 0, 0, 0.2)
    assert "k" not in r.acceptance.classes


def test_classes_are_bounded():
    r, _ = router(max_classes=4, acceptance_min_requests=1)
    for i in range(10):
        feed(r, f"chat|user-{i}|", rate=0.5, n=1)
    assert list(r.acceptance.classes) == [f"chat|user-{i}|" for i in range(6, 10)]


def test_default_thresholds_follow_the_slots():
    """Off once as many requests wait as run (2 x max_num_seqs), on again at half that."""
    r, _ = router(max_num_seqs=8)
    assert (r.gate.off_at, r.gate.on_at) == (16, 8)
    assert SpeculationPolicyConfig(high_concurrency_threshold=10).concurrency_thresholds(8) == (10, 5)


def test_thresholds_are_validated():
    with pytest.raises(ValueError, match="hysteresis"):
        UnitConfig(router={"high_concurrency_threshold": 8, "high_concurrency_resume": 8})
    with pytest.raises(ValueError, match="hysteresis"):  # resume 40 vs the default 2 x 8
        UnitConfig(router={"high_concurrency_resume": 40})
    with pytest.raises(ValueError):
        SpeculationPolicyConfig(probe_share=1.5)
