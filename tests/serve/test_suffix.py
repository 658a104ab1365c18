"""Suffix decoding through the Serve path, as `make serve` runs it (tiny model, real HTTP): greedy
output is the target's, the router speculates by default and says so, the unit's response
cache learns from what it served and is reported on /metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import deployed, unit_args
from tests.serve.test_http import PROMPTS, greedy_equals_target_only


@pytest.fixture(scope="module")
def apps(ray_cluster, tiny_models) -> dict[str, str]:
    """Both apps of the module, deployed side by side (one wait, not two); K fixed: on a
    random tiny model the cost model could choose K = 0 (test_policy.py and the benchmarks
    cover adaptive K); these tests are about the path and the cache."""
    chain = unit_args(tiny_models[0], speculative={
        "method": "suffix", "num_speculative_tokens": 8, "suffix": {"max_cached_responses": 4},
        "adaptive": {"enabled": False}})
    tree = unit_args(tiny_models[0], speculative={
        "method": "suffix", "num_speculative_tokens": 8,
        "suffix": {"tree": True, "min_token_prob": 0.01}, "adaptive": {"enabled": False}})
    yield from deployed({"suffix": ("/suffix", chain), "suffix-tree": ("/suffix-tree", tree)})


@pytest.fixture(scope="module")
def suffix_app(apps) -> str:
    return apps["suffix"]


@pytest.fixture(scope="module")
def suffix_tree_app(apps) -> str:
    return apps["suffix-tree"]


@pytest.fixture(scope="module")
def model_name(tiny_models):
    from pathlib import Path

    return Path(tiny_models[0]).name


def cache_state(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["name"]: s.value for s in families["specserve:proposer_state"].samples
            if s.labels["method"] == "suffix"}


def test_greedy_output_is_the_targets_and_the_cache_learns_what_it_served(
        suffix_app, tiny_models, model_name):
    """Every prompt twice: the second time the cache holds the first answer, so the drafts
    are long and accepted, and the text is still the target's alone."""
    import time

    prompts = PROMPTS[:3]
    first = greedy_equals_target_only(suffix_app, model_name, tiny_models[2], prompts, 24, "suffix")
    again = greedy_equals_target_only(suffix_app, model_name, tiny_models[2], prompts, 24, "suffix")
    accepted = [b["usage"]["speculation"]["num_accepted_tokens"] for b in again]
    assert sum(accepted) > sum(b["usage"]["speculation"]["num_accepted_tokens"] for b in first)
    deadline = time.monotonic() + 60  # units report every second
    while (state := cache_state(suffix_app)).get("suffix_cache_responses") != 4 \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert state["suffix_cache_responses"] == 4  # six answers, bounded at four
    assert 0 < state["suffix_cache_tokens"] and 0 < state["suffix_cache_bytes"]
    # the acceptance per drafting proposer, on /metrics: here suffix decoding alone
    text = httpx.get(suffix_app + "/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    drafted = {s.labels["proposer"]: s.value for s in families["specserve:proposer_num_draft_tokens"].samples
               if s.labels["method"] == "suffix" and s.name.endswith("_total")}
    assert set(drafted) == {"suffix"} and drafted["suffix"] > 0


def test_a_unit_in_the_ingress_is_scraped_where_it_runs_with_no_metrics_hub(suffix_app, model_name):
    """The app's one unit runs in its ingress (the default for one CPU unit, as ``make serve``
    runs it): no metrics hub actor is started for it, a Ray worker process whose wake-ups
    would be taken from the forward's cores, and a scrape reads the unit's numbers as they
    are at that moment, so they equal the unit's stats right after a request, with no
    report to wait for."""
    import ray
    from ray import serve
    from specserve.serve.metrics import HUB_NAMESPACE, hub_name

    assert "SpeculationUnit" not in serve.status().applications["suffix"].deployments
    with pytest.raises(ValueError):
        ray.get_actor(hub_name("suffix"), namespace=HUB_NAMESPACE)
    body = {"model": model_name, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    assert httpx.post(suffix_app + "/v1/completions", json=body, timeout=120).status_code == 200
    stats = httpx.get(suffix_app + "/v1/units/stats", timeout=60).json()
    text = httpx.get(suffix_app + "/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    admitted = [s.value for s in families["specserve:requests_admitted"].samples
                if s.name.endswith("_total")]
    assert admitted == [stats["requests_admitted"]] and admitted[0] >= 1

def test_token_trees_through_the_target_group(suffix_tree_app, tiny_models, model_name):
    """suffix.tree: true over the Serve path (issue 20): trees are verified by the target
    ranks, each accepted path compacted with the slot's next forward; the text is the
    target's alone."""
    prompts = PROMPTS[:3]
    for _ in range(2):  # the second pass finds the first's answers in the cache
        greedy_equals_target_only(suffix_tree_app, model_name, tiny_models[2], prompts, 24, "suffix")
    stats = httpx.get(suffix_tree_app + "/v1/units/stats", timeout=60).json()
    assert stats["spec_tree_drafts"] > 0 and stats["spec"]["num_accepted_tokens"] > 0
