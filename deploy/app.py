"""Serve application builder: ``build_app(args) -> Application``.

Validates the whole configuration with the same pydantic models the CLI and the Helm chart
use, then binds the units (with their placement group bundles and request router: prefix
affinity, least load) to the ingress. Used by ``serve run deploy.app:build_app``, ``serve
deploy`` with ``deploy/serve_config.yaml``, ``specserve serve`` and ``make serve``.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from specserve.app_config import AppConfig
from specserve.engine.builder import check_draft_files
from specserve.serve.autoscaling import UnitPolicy, requests_target
from specserve.serve.ingress import OpenAIIngress
from specserve.serve.placement import resolved_layout, unit_bundles
from specserve.serve.request_router import UnitRouter
from specserve.serve.unit import SpeculationUnit

ROUTING_STATS_PERIOD_S = 0.5


def build_app(args: dict) -> Application:
    """``args``: an :class:`AppConfig` as a dict (the ``args`` of a Serve config file). The
    draft's files are checked here, once, before any unit starts (no Ray needed: ``specserve
    serve`` builds the app before it starts Ray)."""
    cfg = AppConfig.model_validate(args)
    check_draft_files(cfg.unit.engine)
    capacity = cfg.unit.engine.max_num_seqs + cfg.unit.max_queue_len
    if cfg.unit_here:
        return _ingress_with_unit(cfg, capacity)
    most = cfg.num_units if cfg.autoscaling is None else cfg.autoscaling.max_units
    unit = serve.deployment(SpeculationUnit, name="SpeculationUnit").options(
        **_replicas(cfg),
        # One more than the unit holds: the overflow request reaches the unit, which answers
        # 429 itself, instead of waiting unbounded in a handle queue.
        max_ongoing_requests=capacity + 1,
        max_queued_requests=capacity * most,
        ray_actor_options={"num_cpus": cfg.unit.coordinator_cpus},
        placement_group_bundles=unit_bundles(cfg.unit),
        placement_group_strategy="STRICT_PACK",
        request_router_config=RequestRouterConfig(
            request_router_class=UnitRouter,
            request_router_kwargs=_router_kwargs(cfg),
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
        health_check_period_s=10,
        **_drain(cfg.drain_timeout_s),
    ).bind(cfg.unit.model_dump())
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=1, max_ongoing_requests=4 * capacity * most,
        ray_actor_options={"num_cpus": 0.1, **_on_node(cfg.ingress_node_resource)},
        **_drain(cfg.drain_timeout_s))
    # The ingress reads neither the units' count nor their scaling: a change to them leaves
    # it running (its streams with it), as it leaves the units (options only).
    return ingress.bind(unit=unit, config=cfg.model_dump(exclude={"num_units", "autoscaling"}))


def _ingress_with_unit(cfg: AppConfig, capacity: int) -> Application:
    """One replica, the ingress and the one unit in its process (``unit_in_ingress``): it
    reserves the unit's placement group (bundle 0, the coordinator's, is the replica's own)."""
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=1, max_ongoing_requests=4 * capacity,
        ray_actor_options={"num_cpus": cfg.unit.coordinator_cpus},
        placement_group_bundles=unit_bundles(cfg.unit),
        placement_group_strategy="STRICT_PACK",
        health_check_period_s=10,
        **_drain(cfg.drain_timeout_s))
    return ingress.bind(unit=None, config=cfg.model_dump(exclude={"num_units", "autoscaling"}))


def _replicas(cfg: AppConfig) -> dict:
    """``num_units`` fixed, or Serve's autoscaling between the bounds: this project's policy
    on the units' signals (``serve/autoscaling.py``), or Serve's own on ongoing requests at the
    same target utilisation of a unit's slots (``policy: requests``, for comparison). Serve
    holds a wanted count for the delay before it acts, and a unit it removes drains
    (:func:`_drain`)."""
    scaling = cfg.autoscaling
    if scaling is None:
        return {"num_replicas": cfg.num_units}
    config = {"min_replicas": scaling.min_units, "max_replicas": scaling.max_units,
              "initial_replicas": cfg.num_units, "upscale_delay_s": scaling.upscale_delay_s,
              "downscale_delay_s": scaling.downscale_delay_s,
              "look_back_period_s": scaling.look_back_s,
              "metrics_interval_s": scaling.metrics_interval_s}
    if scaling.policy == "requests":
        config["target_ongoing_requests"] = requests_target(cfg.unit.engine.max_num_seqs,
                                                            scaling.target_utilization)
    else:
        config["policy"] = {"policy_function": f"{UnitPolicy.__module__}:{UnitPolicy.__name__}",
                            "policy_kwargs": {"target_utilization": scaling.target_utilization,
                                              "hysteresis": scaling.hysteresis}}
    return {"autoscaling_config": config}


def _router_kwargs(cfg: AppConfig) -> dict:
    """Prefix affinity where the units cache prefixes (paged KV with prefix caching)."""
    kv = resolved_layout(cfg.unit).engine.kv_cache
    return {"prefix_affinity": (cfg.routing.prefix_affinity and kv.layout == "paged"
                                and kv.prefix_caching),
            "block_size": kv.block_size, "max_imbalance": cfg.routing.max_imbalance}


def _drain(timeout_s: float) -> dict:
    """Serve's graceful stop: a replica being replaced or removed gets no new requests and
    keeps serving the ones it has (streams included) for up to ``timeout_s``."""
    return {"graceful_shutdown_timeout_s": timeout_s, "graceful_shutdown_wait_loop_s": 0.5}


def _on_node(resource: str | None) -> dict:
    """Actor options pinning it to nodes that advertise ``resource`` (a sliver of it)."""
    return {"resources": {resource: 0.001}} if resource else {}
