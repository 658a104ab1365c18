"""The shipped Serve config is a valid AppConfig, and config errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from specserve.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_serve_config_validates_and_spells_out_the_defaults():
    doc = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    [app] = doc["applications"]
    cfg = AppConfig.model_validate(app["args"])
    # Every router / adaptive value written in the file is the model's default, so the file
    # documents the behaviour a config without them gets.
    assert cfg.unit.router == type(cfg.unit.router)()
    spec = cfg.unit.engine.speculative
    assert spec.method == "eagle" and spec.ngram_first
    assert spec.adaptive == type(spec.adaptive)()


@pytest.mark.parametrize("router, message", [
    ({"high_concurrency_threshold": 4, "high_concurrency_resume": 4}, "hysteresis"),
    ({"high_concurrency_threshold": 0}, "high_concurrency_threshold"),
    ({"short_output_tokens": -1}, "short_output_tokens"),
    ({"probe_share": 2}, "probe_share"),
    ({"unknown": 1}, "unknown"),
])
def test_bad_router_config_is_refused(router, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate({"unit": {"router": router}})


@pytest.mark.parametrize("limits, ok", [
    ({"burst": 8}, False),  # a bucket size with no refill rate would limit nothing
    ({"burst": 8, "requests_per_minute": 60}, True),
    ({"requests_per_minute": 60}, True),
    ({}, True),
])
def test_burst_needs_a_rate(limits, ok):
    if ok:
        AppConfig.model_validate({"limits": limits})
        return
    with pytest.raises(ValidationError, match="burst needs limits.requests_per_minute"):
        AppConfig.model_validate({"limits": limits})
