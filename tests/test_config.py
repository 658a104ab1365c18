"""The shipped Serve config is a valid AppConfig, and config errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from specserve.app_config import AppConfig
from specserve.config import SpeculativeConfig, UnitConfig

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_serve_config_validates_and_spells_out_the_defaults():
    doc = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    [app] = doc["applications"]
    cfg = AppConfig.model_validate(app["args"])
    # Every router / adaptive value written in the file is the model's default, so the file
    # documents the behaviour a config without them gets.
    assert cfg.unit.router == type(cfg.unit.router)()
    spec = cfg.unit.engine.speculative
    assert spec.method == "suffix" and spec.suffix.max_cached_responses == 256
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


def test_a_model_free_proposer_in_front_of_a_model_is_speculative_first():
    """``first`` names a model-free proposer of the registry; ``ngram_first`` is first: ngram.
    Behind it the builder puts the model's proposer; n-gram lookup there matches 2+ tokens."""
    from specserve.engine.builder import build_proposer
    from specserve.engine.drafts.base import Proposer
    from specserve.engine.drafts.hybrid import HybridProposer

    class Model(Proposer):
        method = "eagle"

        def propose(self, requests):
            return []

    draft = {"source": "embedded-eagle"}
    old = SpeculativeConfig.model_validate({"method": "eagle", "ngram_first": True, "draft": draft})
    new = SpeculativeConfig.model_validate({"method": "eagle", "first": "ngram", "draft": draft})
    assert old.first_method == new.first_method == "ngram"
    built = build_proposer(new, Model())
    assert isinstance(built, HybridProposer) and built.first.min_n == 2 and built.method == "eagle"
    assert build_proposer(SpeculativeConfig(method="ngram")).min_n == 1  # alone: its own setting
    for bad, message in (({"method": "ngram", "first": "ngram"}, "first needs a draft model"),
                         ({"method": "eagle", "first": "eagle", "draft": draft}, "first"),
                         ({"method": "eagle", "ngram_first": True, "first": "ngram", "draft": draft}, None)):
        if message is None:
            SpeculativeConfig.model_validate(bad)  # the same thing said twice is fine
            continue
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.model_validate(bad)


@pytest.mark.parametrize("kv, ok", [
    ({"layout": "paged", "block_size": 16, "num_blocks": 127}, False),  # 2032 < 2048 positions
    ({"layout": "paged", "block_size": 16, "num_blocks": 128}, True),   # one sequence at most
    ({"layout": "paged"}, True),                                         # the slots' memory
    ({"layout": "slots", "num_blocks": 1}, True),                        # not paged: unused
])
def test_a_paged_pool_must_hold_one_sequence_of_max_model_len(kv, ok):
    """Preemption frees room for the oldest sequences down to one, which must then fit."""
    args = {"unit": {"engine": {"max_model_len": 2048, "kv_cache": kv}}}
    if ok:
        AppConfig.model_validate(args)
        return
    with pytest.raises(ValidationError, match="one sequence of max_model_len"):
        AppConfig.model_validate(args)


def test_the_kv_layout_is_paged_by_default_where_the_kernels_read_blocks():
    """``kv_cache.layout: auto`` (the default): paged on a CPU (every kernel reads block
    tables since issue 53), slots on CUDA until a GPU window measures paged against it; an
    explicit layout stays; on CUDA an unset block size is FlexAttention's key block (64);
    the unit, its groups and the router resolve it by the unit's placement
    (``target_device``)."""
    from specserve.config import EngineConfig, KVCacheConfig, UnitConfig
    from specserve.engine.runtime.kernels import KV_BLOCK
    from specserve.serve.placement import resolved_layout

    auto = KVCacheConfig()
    assert auto.layout == "auto"
    assert auto.resolved("cpu", "invariant").layout == "paged"
    assert auto.resolved("cpu", "library").layout == "paged"
    assert auto.resolved("cpu", "compiled").layout == "paged"
    assert auto.resolved("cuda:1", "auto").layout == "slots"
    paged = KVCacheConfig(layout="paged")
    assert (paged.resolved("cuda", "compiled").block_size, paged.resolved("cpu", "compiled").block_size,
            KVCacheConfig(layout="paged", block_size=128).resolved("cuda", "library").block_size
            ) == (KV_BLOCK, 16, 128)
    assert KVCacheConfig(layout="slots").resolved("cpu", "invariant").layout == "slots"
    engine = EngineConfig().for_device("cpu")
    assert engine.kv_cache.layout == "paged" and engine.draft_kv_cache is not None
    assert EngineConfig().for_device("cuda").draft_kv_cache is None
    on = {accelerator: resolved_layout(UnitConfig.model_validate({"accelerator": accelerator}))
          for accelerator in ("cpu", "gpu")}
    assert on["cpu"].engine.kv_cache.layout == "paged" and on["gpu"].engine.kv_cache.layout == "slots"


@pytest.mark.parametrize("unit, where", [
    ({"accelerator": "gpu"}, "shared"),                                     # the default
    ({"accelerator": "gpu", "draft_placement": "shared", "draft_gpu_fraction": 0.3}, "shared"),
    ({"accelerator": "gpu", "draft_placement": "own"}, "bundle"),
    ({"accelerator": "gpu", "draft_placement": "own", "draft_node_resource": "d"}, "node"),
    ({"accelerator": "cpu"}, "bundle"),                                     # no GPU to share
    ({"accelerator": "cpu", "draft_placement": "own", "draft_node_resource": "d"}, "node"),
    ({"accelerator": "gpu", "draft_node_resource": "d"}, None),             # shared, yet a node
    ({"accelerator": "gpu", "draft_gpu_fraction": 1.0}, None),              # a whole GPU: own
])
def test_where_the_draft_runs(unit, where):
    """``draft_placement``: shared (the default) puts the draft in target rank 0's bundle on a
    fraction of its GPU; own gives it a bundle of its own, or with ``draft_node_resource`` a
    node of its own. A unit without GPUs has nothing to share; a node of its own with shared,
    or a whole GPU's fraction, is refused."""
    engine = {"speculative": {"method": "draft_model", "draft": {"source": "d"}}}
    if where is None:
        with pytest.raises(ValidationError, match="draft_placement own|less than 1"):
            UnitConfig.model_validate({"engine": engine, **unit})
        return
    cfg = UnitConfig.model_validate({"engine": engine, **unit})
    found = ("shared" if cfg.draft_shares_gpu else "bundle" if cfg.draft_in_bundle
             else "node" if cfg.draft_node_resource else None)
    assert found == where
    assert not UnitConfig.model_validate(unit | {"engine": {}}).draft_shares_gpu  # no draft to share


@pytest.mark.parametrize("unit, here", [
    ({}, True),                                               # TP 1 on a CPU: in the unit
    ({"target_in_unit": False}, False),                       # asked for a rank actor
    ({"tensor_parallel_size": 2}, False),                     # a TP group: actors
    ({"accelerator": "gpu"}, False),                          # GPUs: actors
    ({"accelerator": "gpu", "target_in_unit": True}, None),   # refused: the unit has no GPU
    ({"tensor_parallel_size": 2, "target_in_unit": True}, None),
])
def test_the_target_runs_in_the_unit_only_at_tp_1_on_a_cpu(unit, here):
    """``target_in_unit`` (issue 71): one rank in the coordinator's process, where a Ray call
    a step buys nothing (TP 1, CPU); refused wherever the target needs a group or a GPU."""
    if here is None:
        with pytest.raises(ValidationError, match="target_in_unit"):
            UnitConfig.model_validate(unit)
    else:
        assert UnitConfig.model_validate(unit).target_here is here


@pytest.mark.parametrize("app, here", [
    ({}, True),                                                      # one CPU unit: in the ingress
    ({"unit_in_ingress": False}, False),                             # asked for its own replica
    ({"num_units": 2}, False),                                       # units behind a router
    ({"autoscaling": {"min_units": 1, "max_units": 2}}, False),      # units that come and go
    ({"unit": {"accelerator": "gpu"}}, False),                       # a GPU unit's ranks
    ({"unit": {"target_in_unit": False}}, False),                    # a rank actor anyway
    ({"ingress_node_resource": "specserve_head"}, False),            # the ingress has a node
    ({"num_units": 2, "unit_in_ingress": True}, None),               # refused
    ({"unit": {"tensor_parallel_size": 2}, "unit_in_ingress": True}, None),
])
def test_one_cpu_unit_runs_in_the_ingress_and_anything_more_has_replicas_of_its_own(app, here):
    """``unit_in_ingress``: a second replica for the one unit buys a Ray hop a token; the app
    is then one deployment, the ingress, holding the unit's placement group."""
    from deploy.app import build_app

    if here is None:
        with pytest.raises(ValidationError, match="unit_in_ingress"):
            AppConfig.model_validate(app)
        return
    from specserve.serve.placement import unit_bundles

    cfg = AppConfig.model_validate(app)
    assert cfg.unit_here is here
    ingress = build_app({"auth": {"enabled": False}} | app)._bound_deployment
    assert ingress.name == "OpenAIIngress"
    unit = ingress.init_kwargs["unit"]
    if here:
        assert unit is None
        assert ingress._replica_config.placement_group_bundles == unit_bundles(cfg.unit)
    else:
        assert unit._bound_deployment.name == "SpeculationUnit"
        assert ingress._replica_config.placement_group_bundles is None


@pytest.mark.parametrize("app, ok", [
    ({"direct_http": {"port": 8000}}, True),
    ({"direct_http": {"port": 8000}, "num_units": 2}, False),
    ({"direct_http": {"port": 8000}, "unit_in_ingress": False}, False),
])
def test_the_ingress_serves_http_itself_only_where_the_unit_runs_in_it(app, ok):
    """``direct_http``: the replica's own server is for the unit it holds (one replica, one
    port); the CLI sets it (``specserve serve``: tests/serve/test_server_process.py)."""
    if ok:
        assert AppConfig.model_validate(app).direct_http.host == "127.0.0.1"
        return
    with pytest.raises(ValidationError, match="direct_http"):
        AppConfig.model_validate(app)
