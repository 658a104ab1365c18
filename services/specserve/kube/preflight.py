"""Whether a cluster can hold a deployment, before ``helm install`` (``specserve preflight``).

Pure functions over the ``kubernetes`` client's own model objects (``V1Node``,
``V1CustomResourceDefinition``, ``V1StorageClass``, ``V1Secret``) and the values' needs
(``needs.py``); each check returns findings, one line each. What they catch is what otherwise
fails silently after the install: a unit's pods that fit no node (the RayService stays
pending, its Serve app never healthy), KubeRay or Prometheus Operator CRDs missing or older
than the fields the chart renders, a GPU pool whose taint the values do not tolerate, a
StorageClass or a secret that does not exist.

Placement is decided the way the scheduler decides it for these pods: a node must be Ready
and schedulable and carry every label of the group's ``nodeSelector``, the group's
``tolerations`` must tolerate every ``NoSchedule`` / ``NoExecute`` taint of the node, and the
node's allocatable GPUs, CPU and memory must hold the pod's requests. Units are then placed one after
the other, each its target pod and (with a draft method) its draft pod, first fit on the
allocatable left: an upper bound, since pods already running are not counted. Affinity is not
evaluated (the chart's default sets none).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.kube.needs import GPU, CRDNeed, Needs, PodShape, memory_bytes, quantity

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # GPU feature discovery: MiB per GPU
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"


@dataclass(frozen=True)
class Finding:
    ok: bool
    message: str
    fatal: bool = True  # a failed finding that keeps the deployment from coming up

    def line(self) -> str:
        mark = "ok  " if self.ok else ("FAIL" if self.fatal else "warn")
        return f"{mark} {self.message}"


@dataclass
class _Free:
    """What a node has left as units are placed on it."""

    name: str
    gpus: int
    cpu: float
    memory: int


# -- nodes ------------------------------------------------------------------------------------
def node_gpus(node) -> int:
    return int(quantity(_allocatable(node, GPU)))


def _allocatable(node, resource: str):
    return (node.status.allocatable or {}).get(resource, 0)


def why_not(node, pod: PodShape) -> str | None:
    """Why ``pod`` cannot go on ``node`` whatever else runs there (None: it can)."""
    if node.spec is not None and node.spec.unschedulable:
        return "cordoned (unschedulable)"
    if not _ready(node):
        return "not Ready"
    labels = node.metadata.labels or {}
    missing = {k: v for k, v in pod.node_selector.items() if labels.get(k) != v}
    if missing:
        return "lacks the nodeSelector label(s) " + ", ".join(f"{k}={v}" for k, v in missing.items())
    untolerated = [t for t in (node.spec.taints or []) if t.effect in ("NoSchedule", "NoExecute")
                   and not any(_tolerates(tol, t) for tol in pod.tolerations)]
    if untolerated:
        return "has the taint(s) " + ", ".join(_taint(t) for t in untolerated) + \
            f" that {pod.group}.tolerations do not tolerate"
    allocatable = node.status.allocatable or {}
    if node_gpus(node) < pod.gpus:
        return f"has {node_gpus(node)} allocatable {GPU}, the {pod.group} pod asks {pod.gpus}"
    if quantity(allocatable.get("cpu", 0)) < pod.cpu:
        return f"has {allocatable.get('cpu', 0)} allocatable CPU, the {pod.group} pod asks {pod.cpu:g}"
    if memory_bytes(allocatable.get("memory", 0)) < pod.memory:
        return (f"has {_gib(memory_bytes(allocatable.get('memory', 0)))} allocatable memory, the "
                f"{pod.group} pod asks {_gib(pod.memory)}")
    gpu_mib = labels.get(GPU_MEMORY_LABEL)
    if pod.gpus and pod.gpu_memory_gib and gpu_mib and int(gpu_mib) / 1024 < pod.gpu_memory_gib:
        return (f"has GPUs of {int(gpu_mib) / 1024:.0f} GiB ({labels.get(GPU_PRODUCT_LABEL, 'GPU')}); "
                f"the release is sized for {pod.gpu_memory_gib:g} GiB ({pod.group}.gpuMemoryGiB)")
    return None


def _ready(node) -> bool:
    conditions = (node.status.conditions or []) if node.status is not None else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions) or not conditions


def _tolerates(toleration: dict, taint) -> bool:
    """Kubernetes' rule: key matches (empty key with Exists: every key), value matches unless
    Exists, effect matches unless empty."""
    op = toleration.get("operator", "Equal")
    if toleration.get("effect") and toleration["effect"] != taint.effect:
        return False
    if not toleration.get("key"):
        return op == "Exists"
    if toleration["key"] != taint.key:
        return False
    return op == "Exists" or toleration.get("value", "") == (taint.value or "")


def _taint(taint) -> str:
    return f"{taint.key}{'=' + taint.value if taint.value else ''}:{taint.effect}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.0f}Gi"


def place(nodes: list, needs: Needs) -> tuple[list[Finding], int]:
    """Findings on where each group's pods can go, and how many units fit (module docstring)."""
    findings = []
    shapes = {p.group: p for p in needs.pods}
    eligible: dict[str, set[str]] = {}  # group -> the nodes that can take its pods
    for pod in needs.pods:
        fits = [n.metadata.name for n in nodes if why_not(n, pod) is None]
        eligible[pod.group] = set(fits)
        if fits:
            names = ", ".join(fits[:5]) + (" ..." if len(fits) > 5 else "")
            findings.append(Finding(True, f"{pod.group} pods ({_ask(pod)}) fit on {len(fits)} "
                                          f"node(s): {names}"))
        else:
            findings.append(Finding(False, f"no node can hold a {pod.group} pod ({_ask(pod)}): "
                                           + _closest(nodes, pod)))
    free = [_Free(n.metadata.name, node_gpus(n), quantity(_allocatable(n, "cpu")),
                  memory_bytes(_allocatable(n, "memory"))) for n in nodes]
    if not _take(free, shapes["head"], eligible["head"]):
        return findings, 0
    units = 0
    unit_pods = [shapes[g] for g in ("target", "draft") if g in shapes]
    while units < needs.units and all(_take(free, p, eligible[p.group]) for p in unit_pods):
        units += 1
    return findings, units


def _ask(pod: PodShape) -> str:
    parts = [f"{pod.gpus} GPU" + ("s" if pod.gpus != 1 else "")] if pod.gpus else ["no GPU"]
    parts += [f"{pod.cpu:g} CPU"] if pod.cpu else []
    parts += [_gib(pod.memory)] if pod.memory else []
    return ", ".join(parts)


def _closest(nodes: list, pod: PodShape) -> str:
    """The node that comes nearest (most GPUs, then most memory), and what it lacks."""
    if not nodes:
        return "the cluster has no nodes"
    best = max(nodes, key=lambda n: (node_gpus(n), _allocatable(n, "memory")))
    return f"the biggest node, {best.metadata.name}, {why_not(best, pod)}"


def _take(free: list[_Free], pod: PodShape, eligible: set[str]) -> bool:
    """Put one ``pod`` on the first eligible node with room left (False: none has)."""
    for node in free:
        if node.name in eligible and node.gpus >= pod.gpus and node.cpu >= pod.cpu \
                and node.memory >= pod.memory:
            node.gpus -= pod.gpus
            node.cpu -= pod.cpu
            node.memory -= pod.memory
            return True
    return False


# -- CRDs, storage, secrets --------------------------------------------------------------------
def check_crds(crds: list, needs: Needs) -> list[Finding]:
    """Each custom resource the chart renders: installed, serving the version the chart
    writes, and (where the CRD carries a schema) knowing the ``spec`` fields it sets."""
    return [_check_crd(crds, need) for need in needs.crds]


def _check_crd(crds: list, need: CRDNeed) -> Finding:
    crd = next((c for c in crds if c.spec.group == need.group and c.spec.names.kind == need.kind), None)
    name = f"{need.kind} ({need.group}/{need.version})"
    if crd is None:
        return Finding(False, f"{name}: the CRD is not installed; install {need.why}")
    version = next((v for v in crd.spec.versions if v.name == need.version and v.served), None)
    if version is None:
        served = ", ".join(v.name for v in crd.spec.versions if v.served) or "none"
        return Finding(False, f"{name}: the installed CRD serves {served}, not {need.version}; "
                              f"upgrade to {need.why}")
    props = _spec_properties(version)
    missing = [f for f in need.spec_fields if props is not None and f not in props]
    if missing:
        return Finding(False, f"{name}: the installed CRD is older than the chart (its spec lacks "
                              f"{', '.join(missing)}); upgrade to {need.why}")
    return Finding(True, f"{name}: installed")


def _spec_properties(version) -> set[str] | None:
    schema = version.schema.open_apiv3_schema if version.schema is not None else None
    spec = (schema.properties or {}).get("spec") if schema is not None else None
    if spec is None or spec.properties is None or spec.x_kubernetes_preserve_unknown_fields:
        return None  # no structural schema: nothing to check against
    return set(spec.properties)


def check_storage(classes: list, needs: Needs) -> list[Finding]:
    """The model cache's claim: its StorageClass, or a default one, exists."""
    if needs.storage_class is None:
        return []
    if needs.storage_class:
        if any(c.metadata.name == needs.storage_class for c in classes):
            return [Finding(True, f"StorageClass {needs.storage_class} (modelCache) exists")]
        names = ", ".join(c.metadata.name for c in classes) or "none"
        return [Finding(False, f"StorageClass {needs.storage_class} (modelCache.storageClassName) does "
                               f"not exist; the cluster has: {names}")]
    default = [c.metadata.name for c in classes
               if (c.metadata.annotations or {}).get(DEFAULT_CLASS) == "true"]
    if default:
        return [Finding(True, f"the model cache's claim gets the default StorageClass {default[0]}")]
    return [Finding(False, "the model cache's claim names no StorageClass and the cluster has no default "
                           "one: set modelCache.storageClassName (or modelCache.existingClaim, or "
                           "modelCache.enabled: false)")]


def check_secrets(secrets: dict, needs: Needs, namespace: str) -> list[Finding]:
    """Every secret the values refer to exists in ``namespace`` with the key the pods read
    (``secrets``: name -> ``V1Secret`` or None where the API said 404)."""
    out = []
    for need in needs.secrets:
        secret = secrets.get(need.name)
        if secret is None:
            out.append(Finding(False, f"secret {namespace}/{need.name} ({need.why}) does not exist"))
        elif need.key and need.key not in (secret.data or {}) and need.key not in (secret.string_data or {}):
            out.append(Finding(False, f"secret {namespace}/{need.name} ({need.why}) has no key {need.key}"))
        else:
            out.append(Finding(True, f"secret {namespace}/{need.name} ({need.why}) exists"))
    return out


# -- GPU memory ---------------------------------------------------------------------------------
SEQS = "specserve.unit.engine.max_num_seqs"


def check_gpu_memory(needs: Needs) -> list[Finding]:
    """Each GPU's memory estimate (``specserve.memory``) against the GPU memory its group was
    sized for (``target.gpuMemoryGiB``, ``draft.gpuMemoryGiB``): a target rank, and with a
    draft either target rank 0 and the draft together (``draft_placement: shared``) or the
    draft's own GPU. A model whose ``config.json`` cannot be had here (not published in
    :mod:`specserve.model_configs`, not a local directory) is a warning, not estimated."""
    from specserve.memory import (
        GIB,
        ModelShape,
        Workload,
        estimate,
        largest_num_seqs,
        largest_shared_num_seqs,
        shared_gpu,
    )
    from specserve.model_configs import model_config

    unit = needs.unit
    if unit is None or unit.accelerator != "gpu":
        return []
    engine = unit.engine.for_device("cuda")
    gib = {p.group: (p.gpu_memory_gib or 80e9 / GIB) * GIB for p in needs.pods}
    sized = {}
    for role, model in (("target", engine.target), ("draft", engine.speculative.draft)):
        if role == "draft" and not unit.has_draft_group:
            continue
        config = model_config(model.source)
        if config is None:
            return [Finding(False, f"GPU memory not estimated: no config.json for the {role} "
                                   f"{model.source} here (run `specserve memory-estimate --config` "
                                   "with it, docs/MEMORY.md)", fatal=False)]
        load = Workload.of(engine, tp=unit.tensor_parallel_size if role == "target" else 1,
                           draft=role == "draft")
        sized[role] = (ModelShape.from_config(config), load)
    out = []
    target = estimate(*sized["target"])
    if not target.fits(gib["target"]):
        most = largest_num_seqs(*sized["target"], gib["target"])
        return [Finding(False, f"a target rank needs about {target.total / GIB:.1f} GiB of its "
                               f"{gib['target'] / GIB:g} GiB GPU (at most 90%): lower {SEQS} to {most} "
                               "or less, or raise tensor_parallel_size")]
    out.append(Finding(True, f"a target rank: about {target.total / GIB:.1f} GiB, "
                             f"{target.total / gib['target']:.0%} of its {gib['target'] / GIB:g} GiB GPU"))
    if "draft" not in sized:
        return out
    if unit.draft_shares_gpu:
        both = shared_gpu(sized["target"], sized["draft"], gib["target"])
        if both.fits:
            return [*out, Finding(True, both.line())]
        most = largest_shared_num_seqs(*sized.values(), gib["target"])
        return [*out, Finding(False, f"{both.line()}: set specserve.unit.draft_placement: own (a GPU "
                                     f"of its own) or lower {SEQS} to {most} or less")]
    draft = estimate(*sized["draft"])
    ok = draft.fits(gib["draft"])
    fix = "" if ok else f": lower {SEQS} to {largest_num_seqs(*sized['draft'], gib['draft'])} or less"
    return [*out, Finding(ok, f"the draft on its own GPU: about {draft.total / GIB:.1f} GiB, "
                              f"{draft.total / gib['draft']:.0%} of {gib['draft'] / GIB:g} GiB{fix}")]


def preflight(needs: Needs, nodes: list, crds: list, classes: list, secrets: dict,
              namespace: str) -> tuple[list[Finding], int]:
    """Every finding, and how many of ``needs.units`` units fit."""
    findings, units = place(nodes, needs)
    findings += check_gpu_memory(needs)
    findings += check_crds(crds, needs) + check_storage(classes, needs)
    findings += check_secrets(secrets, needs, namespace)
    fit = units >= needs.units
    most = " (autoscaling's max_units)" if needs.autoscaled else ""
    findings.append(Finding(fit, f"{units} of {needs.units} unit(s){most} fit on the cluster's allocatable "
                                 "resources (pods already running not counted)", fatal=units == 0))
    return findings, units


def can_come_up(findings: list[Finding]) -> bool:
    return all(f.ok or not f.fatal for f in findings)

