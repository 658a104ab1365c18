"""Where a unit's actors run: the resource bundles of its placement group, and actor
options that put an actor in one of them (``deploy/app.py`` reserves the group; the target
and draft groups start their actors in it)."""

from __future__ import annotations

from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specserve.config import UnitConfig

ACTOR_NAMESPACE = "specserve"  # named target ranks and draft actors (fault-injection tests find them)
NODE_SLIVER = 0.001  # of a node-marking custom resource: many actors fit, only there


def target_device(cfg: UnitConfig) -> str:
    """The device every target rank loads onto, decided once by the unit's placement:
    ``auto`` is ``cuda`` in GPU bundles and ``cpu`` otherwise. Ranks never decide it from
    their own view of CUDA: one rank seeing no GPU would take gloo while the others took
    NCCL, and the group would hang (fake-GPU test clusters say ``device: cpu``)."""
    device = cfg.engine.target.device
    if device != "auto":
        return device
    return "cuda" if cfg.accelerator == "gpu" else "cpu"


def resolved_layout(cfg: UnitConfig) -> UnitConfig:
    """``cfg`` with ``kv_cache.layout: auto`` made definite for :func:`target_device` (paged
    on a CPU, slots on a GPU): the target and draft groups and the router read the same answer."""
    engine = cfg.engine.for_device(target_device(cfg))
    return cfg if engine is cfg.engine else cfg.model_copy(update={"engine": engine})


def process_group_backend(cfg: UnitConfig) -> str:
    """The target group's ``torch.distributed`` backend, the same for every rank: NCCL for
    ranks on GPUs, gloo for ranks on CPUs."""
    return "nccl" if target_device(cfg).startswith("cuda") else "gloo"


def in_bundle(cfg: UnitConfig, pg, index: int, gpus: float = 1.0) -> dict:
    """Actor options placing it in bundle ``index`` of the unit's placement group, with
    ``gpus`` of the bundle's GPU (where the unit has GPUs)."""
    options = {"num_cpus": cfg.cpus_per_actor, "num_gpus": gpus if cfg.accelerator == "gpu" else 0}
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index)
    return options


def unit_bundles(cfg: UnitConfig) -> list[dict]:
    """``[coordinator, (draft), target rank 0..N-1]`` resource bundles for one unit (the
    draft's only when it has a GPU of its own on the unit's node; see
    ``UnitConfig.draft_node_resource``). A draft that shares rank 0's GPU
    (``draft_gpu_fraction``) runs in rank 0's bundle, which holds both actors' CPUs."""
    gpu = {"GPU": 1} if cfg.accelerator == "gpu" else {}
    node = {cfg.target_node_resource: NODE_SLIVER} if cfg.target_node_resource else {}
    group = {"CPU": cfg.cpus_per_actor, **gpu}
    draft = [dict(group)] if cfg.draft_in_bundle else []
    ranks = [{**group, **node} for _ in range(cfg.tensor_parallel_size)]
    if cfg.draft_shares_gpu:
        ranks[0]["CPU"] = 2 * cfg.cpus_per_actor
    return [{"CPU": cfg.coordinator_cpus, **node}, *draft, *ranks]


def target_rank_gpus(cfg: UnitConfig, rank: int) -> float:
    """The share of its bundle's GPU a target rank takes: all of it, but rank 0's with a draft
    beside it (``draft_gpu_fraction``)."""
    return 1.0 - cfg.draft_gpu_fraction if rank == 0 and cfg.draft_shares_gpu else 1.0
