"""A short soak (about 20 s, loopback) against the local app: zero failures, every slot free
at the end, and the RSS figures are there. The long one is `make soak` (docs/RELIABILITY.md)."""

from __future__ import annotations

from load.soak import soak


def test_short_soak_fails_nothing_and_leaks_no_slot(ngram_app):
    report = soak(ngram_app, concurrency=4, duration_s=20, max_requests=400, warmup_s=3)
    assert report["requests"] >= 20, report
    assert report["failures"] == 0, report["failure_examples"]
    assert report["ok"] > 0 and report["expected_4xx"] > 0
    assert report["free_slots"] == report["num_slots"]
    assert report["running_at_end"] == report["waiting_at_end"] == 0
    assert {"ProxyActor", "OpenAIIngress", "SpeculationUnit", "TargetRank"} <= set(report["rss_mb"])
