"""What a Helm values file asks of a cluster, read as the chart renders it.

The chart (``helm/specserve``) makes one RayService whose cluster has a head pod (no GPU), one
**target** pod per unit (``tensor_parallel_size`` GPUs) and, for ``draft_model`` and ``eagle``,
one **draft** pod per unit (one GPU; none where the draft shares target rank 0's GPU,
``unit.draft_placement: shared``, the default), each with the group's ``resources``, ``nodeSelector`` and
``tolerations``. The ``specserve`` value is an ``AppConfig``, validated here by the same
pydantic model the Serve app parses, so a values file the app would refuse is refused before
the cluster is asked anything.

Values merge as Helm merges them: the chart's ``values.yaml``, then each ``-f`` file in order
(maps merge key by key, anything else is replaced).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specserve.app_config import AppConfig
from specserve.config import UnitConfig
from specserve.errors import ConfigError

DRAFT_METHODS = ("draft_model", "eagle")  # the chart's specserve.draftMethod
GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class PodShape:
    """One pod of a worker group (or the head), as the chart renders it."""

    group: str                      # head | target | draft
    replicas: int
    gpus: int
    cpu: float                      # cores requested
    memory: int                     # bytes requested
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)
    gpu_memory_gib: float | None = None  # what the release was sized for (docs/MEMORY.md)


@dataclass(frozen=True)
class CRDNeed:
    """A custom resource the chart renders: its kind, API group and version, and the fields
    of its ``spec`` that the rendered object uses (an older CRD may lack them)."""

    kind: str
    group: str
    version: str
    spec_fields: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class SecretNeed:
    name: str
    key: str | None  # the key the pods read; None: any
    why: str


@dataclass(frozen=True)
class Needs:
    units: int
    tensor_parallel_size: int
    method: str | None
    pods: list[PodShape]
    crds: list[CRDNeed]
    secrets: list[SecretNeed]
    storage_class: str | None  # the model cache's claim: "" = the cluster's default; None: no claim made
    autoscaled: bool = False   # units: autoscaling's max_units (the most the cluster must hold)
    unit: UnitConfig | None = None  # what each unit runs (its GPU memory: preflight.check_gpu_memory)


def load_values(files: list[Path], chart_dir: Path | None) -> dict:
    """The chart's values, then each file's, merged as Helm merges them."""
    merged: dict = {}
    paths = ([chart_dir / "values.yaml"] if chart_dir is not None else []) + list(files)
    for path in paths:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read values file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"values file {path}: not a map")
        merged = merge(merged, data)
    return merged


def merge(base: dict, over: dict) -> dict:
    """``over`` on ``base``: maps merge key by key, every other value replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def needs_of(values: dict) -> Needs:
    """What ``values`` (merged) asks of the cluster; a ``ConfigError`` or pydantic's
    ``ValidationError`` where the Serve app would refuse its ``specserve`` config."""
    spec = dict(values.get("specserve") or {})
    method = ((spec.get("unit") or {}).get("engine") or {}).get("speculative", {}).get("method")
    if method not in DRAFT_METHODS:  # the chart drops the default draft where no method reads it
        spec = _without_draft(spec)
    app = AppConfig.model_validate(spec)
    tp, scaling = app.unit.tensor_parallel_size, app.autoscaling
    units = app.num_units if scaling is None else scaling.max_units
    pods = [_pod("head", values.get("head") or {}, 1, 0)]
    pods.append(_pod("target", values.get("target") or {}, units, tp))
    if method in DRAFT_METHODS and not app.unit.draft_shares_gpu:  # else in the target pod
        pods.append(_pod("draft", values.get("draft") or {}, units, 1))
    return Needs(units=units, tensor_parallel_size=tp, method=method, pods=pods,
                 crds=_crds(values), secrets=_secrets(values), storage_class=_storage_class(values),
                 autoscaled=scaling is not None, unit=app.unit)


def _without_draft(spec: dict) -> dict:
    unit = dict(spec.get("unit") or {})
    engine = dict(unit.get("engine") or {})
    speculative = {k: v for k, v in (engine.get("speculative") or {}).items() if k != "draft"}
    return {**spec, "unit": {**unit, "engine": {**engine, "speculative": speculative}}}


def _pod(group: str, values: dict, replicas: int, gpus: int) -> PodShape:
    requests = ((values.get("resources") or {}).get("requests")) or {}
    return PodShape(group=group, replicas=int(values.get("replicas") or replicas), gpus=gpus,
                    cpu=quantity(requests.get("cpu", 0)), memory=memory_bytes(requests.get("memory", 0)),
                    node_selector=dict(values.get("nodeSelector") or {}),
                    tolerations=list(values.get("tolerations") or []),
                    gpu_memory_gib=values.get("gpuMemoryGiB"))


def _crds(values: dict) -> list[CRDNeed]:
    crds = [CRDNeed("RayService", "ray.io", "v1", ("serveConfigV2", "rayClusterConfig", "upgradeStrategy"),
                    "the KubeRay operator, v1.3 or newer")]
    monitoring = values.get("monitoring") or {}
    for key, kind in (("serviceMonitor", "ServiceMonitor"), ("podMonitor", "PodMonitor"),
                      ("prometheusRule", "PrometheusRule")):
        if (monitoring.get(key) or {}).get("enabled"):
            crds.append(CRDNeed(kind, "monitoring.coreos.com", "v1",
                                why=f"the Prometheus Operator (or set monitoring.{key}.enabled: false)"))
    return crds


def _secrets(values: dict) -> list[SecretNeed]:
    out = []
    hub = values.get("hubToken") or {}
    if hub.get("existingSecret"):
        out.append(SecretNeed(hub["existingSecret"], hub.get("key", "token"), "hubToken.existingSecret"))
    keys = values.get("apiKeys") or {}
    if keys.get("existingSecret"):
        out.append(SecretNeed(keys["existingSecret"], keys.get("key", "api-keys"), "apiKeys.existingSecret"))
    for i, pull in enumerate(values.get("imagePullSecrets") or []):
        out.append(SecretNeed(pull["name"], ".dockerconfigjson", f"imagePullSecrets[{i}]"))
    ingress = values.get("ingress") or {}
    if ingress.get("enabled"):
        for i, tls in enumerate(ingress.get("tls") or []):
            out.append(SecretNeed(tls["secretName"], "tls.crt", f"ingress.tls[{i}].secretName"))
    return out


def _storage_class(values: dict) -> str | None:
    cache = values.get("modelCache") or {}
    if not cache.get("enabled") or cache.get("existingClaim"):
        return None
    return cache.get("storageClassName") or ""


_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "m": 1e-3}


def quantity(value) -> float:
    """A Kubernetes quantity (``16Gi``, ``500m``, ``2``) as a number."""
    text = str(value).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * _SUFFIXES[suffix]
    return float(text)


def memory_bytes(value) -> int:
    return int(quantity(value))
