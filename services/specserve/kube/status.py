"""What the cluster is doing with a release, after ``helm install`` (``specserve status``).

The chart makes one KubeRay ``RayService`` named after the release's fullname; KubeRay makes a
``RayCluster`` for it (a second one while a changed cluster spec comes up), whose pods carry the
release's ``app.kubernetes.io/instance`` label and ``specserve.io/role`` (head, target, draft);
once the Serve application is RUNNING the head's proxy answers behind the Service
``<fullname>`` (and the Ingress, where the values enable one).

Pure functions over what the API returns: the RayService and RayCluster as the plain dicts
``CustomObjectsApi`` gives, the pods, Service and Ingresses as the client's model objects
(``V1Pod``, ``V1Service``, ``V1Ingress``). Each fact is one line, marked ``ok``, ``wait``
(coming up: nothing to do but wait), ``FAIL`` (it will not come up by itself: the line says
why, read from the object: a pod the scheduler cannot place and its message, an image that
cannot be pulled, a container killed for memory or crashing, a Serve application that failed
to deploy) or blank (where to reach it). ``read_status`` is the thin layer that lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kubernetes import client

from specserve.errors import ConfigError
from specserve.kube.cluster import one_line_errors, or_none

CHART = "specserve"          # Chart.yaml's name
APP = "specserve"            # the Serve application's name (templates/rayservice.yaml)
INSTANCE = "app.kubernetes.io/instance"
ROLE = "specserve.io/role"
RAY_CLUSTER = "ray.io/cluster"  # KubeRay's label on a RayCluster's pods
GROUPS = ("head", "target", "draft")
UNIT_GROUPS = ("target", "draft")
OK, WAIT, FAIL, INFO = "ok", "wait", "fail", "info"
_MARKS = {OK: "ok  ", WAIT: "wait", FAIL: "FAIL", INFO: "    "}
PULL_ERRORS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull")
CONFIG_ERRORS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
DEFAULT_KEY = "api-keys"     # values.yaml's apiKeys.key
KEYS_ENV = "SPECSERVE_API_KEYS_FILE"


def fullname(release: str, chart: str = CHART) -> str:
    """The chart's ``specserve.fullname``: the release name where it contains the chart's
    name, else ``<release>-<chart>``; cut at 40 characters, less one trailing ``-``."""
    name = release if chart in release else f"{release}-{chart}"
    return name[:40].removesuffix("-")


def pod_selector(release: str) -> str:
    """The release's Ray pods (not its hook Jobs): its instance label and a role."""
    return f"{INSTANCE}={release},{ROLE}"


@dataclass(frozen=True)
class Line:
    state: str  # ok | wait | fail | info
    text: str

    def render(self) -> str:
        return f"{_MARKS[self.state]} {self.text}"


@dataclass
class StatusView:
    """What ``specserve status`` reads of one release."""

    namespace: str
    release: str
    rayservice: dict
    rayclusters: dict = field(default_factory=dict)  # name -> dict, None where the API said 404
    pods: list = field(default_factory=list)         # V1Pod
    service: object = None                           # V1Service, None where absent
    ingresses: list = field(default_factory=list)    # V1Ingress

    @property
    def name(self) -> str:
        return fullname(self.release)


@dataclass
class Report:
    lines: list[Line]
    serving: bool  # the Serve app RUNNING and every pod of the serving cluster ready
    summary: str

    def text(self) -> list[str]:
        return [line.render() for line in self.lines] + [f"specserve: {self.summary}"]


def _get(obj, *keys, default=None):
    for key in keys:
        if not isinstance(obj, dict) or key not in obj or obj[key] is None:
            return default
        obj = obj[key]
    return obj


def _one_line(message: str | None, limit: int = 400) -> str:
    """A message on one line: a traceback's first line and its last (the exception)."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- the RayService and its RayCluster -----------------------------------------------------------
def cluster_names(rayservice: dict) -> tuple[str | None, str | None]:
    """The active RayCluster's name and the pending one's (None where there is none)."""
    status = rayservice.get("status") or {}
    return (_get(status, "activeServiceStatus", "rayClusterName") or None,
            _get(status, "pendingServiceStatus", "rayClusterName") or None)


def rayservice_lines(rayservice: dict, namespace: str) -> list[Line]:
    """The RayService's ``Ready`` and ``UpgradeInProgress`` conditions (KubeRay v1.3+), else
    its ``serviceStatus``."""
    name = _get(rayservice, "metadata", "name", default="?")
    status = rayservice.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    endpoints = status.get("numServeEndpoints", status.get("NumServeEndpoints"))
    served = f", {endpoints} serve endpoint(s)" if endpoints is not None else ""
    where = f"RayService {namespace}/{name}"
    out = []
    ready = conditions.get("Ready")
    if ready is not None:
        why = ready.get("reason") or ""
        if ready.get("status") == "True":
            out.append(Line(OK, f"{where}: Ready{f' ({why})' if why else ''}{served}"))
        else:
            message = _one_line(ready.get("message"))
            detail = ": ".join(p for p in (why, message) if p)
            state = FAIL if "fail" in why.lower() or "invalid" in why.lower() else WAIT
            out.append(Line(state, f"{where}: not Ready{f' ({detail})' if detail else ''}{served}"))
    elif status.get("serviceStatus"):
        value = status["serviceStatus"]
        out.append(Line(OK if value == "Running" else WAIT, f"{where}: {value}{served}"))
    else:
        out.append(Line(WAIT, f"{where}: no status yet (is the KubeRay operator running and "
                              "watching this namespace?)"))
    upgrade = conditions.get("UpgradeInProgress")
    active, pending = cluster_names(rayservice)
    if (upgrade is not None and upgrade.get("status") == "True") or (upgrade is None and active and pending):
        why = upgrade.get("reason") if upgrade else ""
        out.append(Line(WAIT, f"upgrade in progress: new RayCluster {pending or '(not created yet)'} "
                              f"coming up{f' ({why})' if why else ''}; traffic moves when it serves"))
    return out


def raycluster_lines(name: str | None, raycluster: dict | None, *, role: str = "") -> list[Line]:
    """A RayCluster's ``status.state``, and the conditions that say why it is not ready."""
    label = f"{role}RayCluster"
    if name is None:
        return [Line(WAIT, f"{label}: none yet (the KubeRay operator has not created it)")]
    if raycluster is None:
        return [Line(WAIT, f"{label} {name}: not found (being created or deleted)")]
    status = raycluster.get("status") or {}
    state = status.get("state") or ""
    workers = ""
    if status.get("desiredWorkerReplicas") is not None:
        workers = (f", {status.get('readyWorkerReplicas', 0)} of {status['desiredWorkerReplicas']} "
                   "worker(s) ready")
    problems = []
    mark = OK if state == "ready" else WAIT
    for c in status.get("conditions") or []:
        kind, value = c.get("type"), c.get("status")
        message = _one_line(c.get("message"))
        if kind == "RayClusterReplicaFailure" and value == "True":
            mark = FAIL
            problems.append(f"replica failure: {c.get('reason') or ''} {message}".strip())
        elif kind in ("HeadPodReady", "RayClusterProvisioned") and value == "False":
            why = c.get("reason")
            problems.append(f"{kind} False{f' ({why})' if why else ''}")
    if state == "failed":
        mark = FAIL
        problems.append(_one_line(status.get("reason")) or "failed")
    text = f"{label} {name}: {state or 'no state yet'}{workers}"
    if problems:
        text += "; " + "; ".join(problems)
    return [Line(mark, text)]


def applications(rayservice: dict, which: str = "activeServiceStatus") -> dict:
    return _get(rayservice, "status", which, "applicationStatuses", default={}) or {}


def app_lines(rayservice: dict) -> list[Line]:
    """Each Serve application's status (RUNNING, DEPLOYING, DEPLOY_FAILED, UNHEALTHY) and
    message, and each of its deployments that is not HEALTHY."""
    out = []
    new = "new cluster's " if cluster_names(rayservice)[0] else ""  # none serves yet: the first install
    for which, prefix in (("activeServiceStatus", ""), ("pendingServiceStatus", new)):
        for name, app in sorted(applications(rayservice, which).items()):
            status = app.get("status") or "unknown"
            mark = OK if status == "RUNNING" else FAIL if status in ("DEPLOY_FAILED", "UNHEALTHY") else WAIT
            deployments = app.get("serveDeploymentStatuses") or {}
            names = ", ".join(f"{d} {s.get('status', '?')}" for d, s in sorted(deployments.items()))
            text = f"{prefix}Serve app {name}: {status}"
            message = _one_line(app.get("message"))
            if message and status != "RUNNING":
                text += f": {message}"
            if names:
                text += f" (deployments: {names})"
            out.append(Line(mark, text))
            for d, s in sorted(deployments.items()):
                if s.get("status") not in ("HEALTHY", None) and s.get("message"):
                    out.append(Line(mark if mark != OK else WAIT,
                                    f"  deployment {d} {s['status']}: {_one_line(s['message'])}"))
    if not out:
        out.append(Line(WAIT, "Serve app: not deployed yet (no application status: the head pod is "
                              "starting or the operator has not submitted the app)"))
    return out


def app_running(rayservice: dict) -> bool:
    """The active cluster's app (the chart's, else every one there is) is RUNNING."""
    apps = applications(rayservice)
    if APP in apps:
        apps = {APP: apps[APP]}
    return bool(apps) and all(a.get("status") == "RUNNING" for a in apps.values())


# -- pods --------------------------------------------------------------------------------------
def _condition(pod, kind: str):
    return next((c for c in (pod.status.conditions or []) if c.type == kind), None) \
        if pod.status is not None else None


def pod_ready(pod) -> bool:
    ready = _condition(pod, "Ready")
    return (pod.status is not None and pod.status.phase == "Running" and ready is not None
            and ready.status == "True" and pod.metadata.deletion_timestamp is None)


def role(pod) -> str:
    return (pod.metadata.labels or {}).get(ROLE, "?")


def _placement_hint(message: str, group: str) -> str:
    hints = []
    if "Insufficient nvidia.com/gpu" in message:
        hints.append("no node has the GPUs free, see `specserve preflight`")
    if "untolerated taint" in message or "had taint" in message:
        hints.append(f"{group}.tolerations do not tolerate a node's taint")
    if "node affinity/selector" in message or "didn't match Pod's node" in message:
        hints.append(f"no node carries {group}.nodeSelector's labels")
    if "unbound immediate PersistentVolumeClaims" in message:
        hints.append("the model cache's claim is not bound")
    return f" ({'; '.join(hints)})" if hints else ""


def pod_state(pod) -> tuple[str, str]:
    """``(ok, "ready")``, or ``(wait|fail, why)`` read from the pod: the scheduler's message,
    a container's waiting reason, its last termination (OOMKilled)."""
    status = pod.status or client.V1PodStatus()
    group = role(pod)
    statuses = (status.init_container_statuses or []) + (status.container_statuses or [])
    restarts = sum(c.restart_count or 0 for c in statuses)
    if pod_ready(pod):
        last = [c.last_state.terminated for c in statuses if c.last_state and c.last_state.terminated]
        note = f" (restarted {restarts} time(s), last: {last[0].reason or last[0].exit_code})" \
            if restarts and last else ""
        return OK, f"ready{note}"
    if pod.metadata.deletion_timestamp is not None:
        return WAIT, "terminating"
    if status.phase in ("Failed", "Succeeded"):
        why = ": ".join(p for p in (status.reason, _one_line(status.message)) if p)
        return FAIL, f"{status.phase}{f' ({why})' if why else ''}"
    scheduled = _condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.status == "False":
        message = _one_line(scheduled.message) or scheduled.reason or "no reason given"
        return FAIL, f"cannot be scheduled: {message}{_placement_hint(message, group)}"
    for c in statuses:
        waiting = c.state.waiting if c.state is not None else None
        reason = waiting.reason if waiting is not None else None
        terminated = [t for t in (c.state.terminated if c.state else None,
                                  c.last_state.terminated if c.last_state else None) if t is not None]
        if reason in PULL_ERRORS:
            return FAIL, (f"container {c.name} cannot pull its image {c.image} ({reason}"
                          f"{': ' + _one_line(waiting.message) if waiting.message else ''})")
        oom = next((t for t in terminated if t.reason == "OOMKilled"), None)
        if oom is not None:
            return FAIL, (f"container {c.name} was killed for using more memory than its limit "
                          f"(OOMKilled, exit {oom.exit_code}, {c.restart_count or 0} restart(s)"
                          f"{', ' + reason if reason else ''}): raise {group}.resources.limits.memory")
        if reason == "CrashLoopBackOff":
            last = terminated[0] if terminated else None
            exit_ = (f"; last exit {last.exit_code}{f' ({last.reason})' if last.reason else ''}"
                     if last else "")
            return FAIL, (f"container {c.name} keeps crashing (CrashLoopBackOff, "
                          f"{c.restart_count or 0} restart(s){exit_}): read its log with "
                          f"kubectl logs {pod.metadata.name} -c {c.name} --previous")
        if reason in CONFIG_ERRORS:
            return FAIL, f"container {c.name}: {reason}: {_one_line(waiting.message)}"
    waiting = [c.state.waiting.reason for c in statuses
               if c.state is not None and c.state.waiting is not None and c.state.waiting.reason]
    if waiting:
        return WAIT, f"starting ({', '.join(dict.fromkeys(waiting))})"
    if status.phase == "Running":
        return WAIT, "running, not ready yet (Ray is starting; the readiness probe has not passed)"
    return WAIT, status.phase or "Pending"


def expected_replicas(rayservice: dict) -> dict[str, int]:
    """Pods per group the RayService asks for: one head, each worker group's replicas."""
    groups = _get(rayservice, "spec", "rayClusterConfig", "workerGroupSpecs", default=[]) or []
    out = {"head": 1}
    for g in groups:
        if g.get("groupName") in UNIT_GROUPS:
            out[g["groupName"]] = int(g.get("replicas") or 0)
    return out


@dataclass
class _Count:
    ready: int = 0
    total: int = 0
    expected: int = 0
    failing: int = 0


def pod_lines(pods: list, rayservice: dict) -> tuple[list[Line], dict[str, _Count]]:
    """One line per group of the serving cluster (ready of expected), one per pod that is not
    ready (why), and the same for a new cluster coming up beside it; the serving cluster's
    counts per group."""
    active, pending = cluster_names(rayservice)
    serving = active or pending
    expected = expected_replicas(rayservice)
    out: list[Line] = []
    counts: dict[str, _Count] = {}
    clusters = [(serving, "")]
    if active and pending:
        clusters.append((pending, f"new cluster {pending}: "))
    for cluster, prefix in clusters:
        mine = sorted((p for p in pods if (p.metadata.labels or {}).get(RAY_CLUSTER) in (None, cluster)
                       or cluster is None), key=lambda p: p.metadata.name)
        groups = [g for g in GROUPS if g in expected or any(role(p) == g for p in mine)]
        for group in groups:
            count = _Count(expected=expected.get(group, 0))
            details = []
            for pod in (p for p in mine if role(p) == group):
                state, why = pod_state(pod)
                count.total += 1
                count.ready += state == OK
                count.failing += state == FAIL
                if state != OK:
                    details.append(Line(state, f"  {group} pod {pod.metadata.name}: {why}"))
            want = max(count.expected, count.total)
            text = f"{prefix}{group}: {count.ready} of {want} pod(s) ready"
            missing = count.expected - count.total
            if missing > 0:
                text += f", {missing} not created yet"
            mark = FAIL if count.failing else OK if count.ready >= want and want else WAIT
            out.append(Line(mark, text))
            out.extend(details)
            if not prefix:
                counts[group] = count
    return out, counts


def units_ready(counts: dict[str, _Count]) -> tuple[int, int]:
    """Units whose every pod is ready, of the units asked for (a unit: a target pod and,
    with a draft method, a draft pod)."""
    groups = [counts[g] for g in UNIT_GROUPS if g in counts]
    if not groups:
        return 0, 0
    return min(c.ready for c in groups), max(max(c.expected, c.total) for c in groups)


# -- endpoints and the key ------------------------------------------------------------------------
def endpoint_lines(service, ingresses: list, namespace: str, name: str) -> list[Line]:
    """The API Service and its port (how to reach it), and each Ingress host."""
    if service is None:
        out = [Line(WAIT, f"API Service {namespace}/{name}: not found")]
    else:
        spec = service.spec
        port = next((p for p in spec.ports or [] if p.name == "http"), (spec.ports or [None])[0])
        number = port.port if port is not None else "?"
        text = f"API: Service {name} ({spec.type or 'ClusterIP'} {spec.cluster_ip or ''}".rstrip() + \
            f"), port {number}"
        lb = (service.status.load_balancer.ingress or []) \
            if service.status is not None and service.status.load_balancer is not None else []
        if spec.type == "LoadBalancer":
            addresses = [i.ip or i.hostname for i in lb if i.ip or i.hostname]
            text += f": http://{addresses[0]}:{number}/v1" if addresses else ": external address pending"
        else:
            text += f": kubectl -n {namespace} port-forward svc/{name} 8000:{number}, then http://127.0.0.1:8000/v1"
        out = [Line(INFO, text)]
    for ing in ingresses:
        tls_hosts = {h for t in ing.spec.tls or [] for h in t.hosts or []}
        hosts = [r.host for r in ing.spec.rules or [] if r.host]
        urls = ", ".join(f"http{'s' if h in tls_hosts else ''}://{h}/v1" for h in hosts) or "(no host)"
        lb = (ing.status.load_balancer.ingress or []) \
            if ing.status is not None and ing.status.load_balancer is not None else []
        addresses = [i.ip or i.hostname for i in lb if i.ip or i.hostname]
        where = f" (address {', '.join(addresses)})" if addresses else " (no address yet)"
        out.append(Line(INFO, f"Ingress {ing.metadata.name}: {urls}{where}"))
    return out


def api_key_line(rayservice: dict, namespace: str, name: str) -> Line:
    """How to read the key (NOTES.txt's command), with the Secret and key the head pod mounts;
    the chart's default names where the RayService does not show them."""
    template = _get(rayservice, "spec", "rayClusterConfig", "headGroupSpec", "template", "spec")
    secret, key = f"{name}-api-keys", DEFAULT_KEY
    if template is not None:
        volume = next((v for v in template.get("volumes") or [] if v.get("name") == "api-keys"), None)
        if volume is None:
            return Line(INFO, "API key: none; specserve.auth.enabled is false: the API takes requests "
                              "WITHOUT a key")
        secret = _get(volume, "secret", "secretName", default=secret)
        env = [e for c in template.get("containers") or [] for e in c.get("env") or []]
        path = next((e.get("value") for e in env if e.get("name") == KEYS_ENV and e.get("value")), None)
        key = path.rsplit("/", 1)[-1] if path else key
    key = key.replace(".", "\\.")  # jsonpath: a dot in a key is escaped
    return Line(INFO, f"API key: export OPENAI_API_KEY=$(kubectl -n {namespace} get secret {secret} "
                      f"-o jsonpath='{{.data.{key}}}' | base64 -d | head -n1)")


# -- all of it ----------------------------------------------------------------------------------
def report(view: StatusView) -> Report:
    """Every line, and whether the release serves: its Serve app RUNNING and every pod of the
    serving cluster ready (as many as the RayService asks for)."""
    rs = view.rayservice
    active, pending = cluster_names(rs)
    lines = rayservice_lines(rs, view.namespace)
    lines += raycluster_lines(active or pending, view.rayclusters.get(active or pending))
    if active and pending:
        lines += raycluster_lines(pending, view.rayclusters.get(pending), role="new ")
    lines += app_lines(rs)
    pods, counts = pod_lines(view.pods, rs)
    lines += pods
    lines += endpoint_lines(view.service, view.ingresses, view.namespace, view.name)
    lines.append(api_key_line(rs, view.namespace, view.name))
    ready, wanted = units_ready(counts)
    all_ready = bool(counts) and all(c.ready >= max(c.expected, c.total) for c in counts.values())
    running = app_running(rs)
    serving = running and all_ready and wanted > 0
    apps = applications(rs) or applications(rs, "pendingServiceStatus")  # the first install: not yet active
    app = APP if APP in apps else next(iter(sorted(apps)), None)
    app_state = f"app {app} {apps[app].get('status') or 'unknown'}" if app else "app not deployed yet"
    failing = sum(c.failing for c in counts.values())
    stuck = f"; {failing} pod(s) will not come up by themselves (FAIL above)" if failing else ""
    summary = (f"{'serving' if serving else 'not serving yet'}: {app_state}, {ready} of {wanted} "
               f"unit(s) ready{stuck}")
    return Report(lines, serving, summary)


# -- the thin layer that reads them ----------------------------------------------------------------
RAY_GROUP, RAY_VERSION = "ray.io", "v1"


def read_status(api: client.ApiClient, namespace: str, release: str) -> StatusView:
    """The release's RayService, its RayCluster(s), pods, Service and Ingresses; no
    RayService, or an API error, is one line (a ``ConfigError``)."""
    name = fullname(release)
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    with one_line_errors():
        rs = or_none(lambda: custom.get_namespaced_custom_object(RAY_GROUP, RAY_VERSION, namespace,
                                                                 "rayservices", name))
        if rs is None:
            raise ConfigError(f"no RayService {name} in {namespace}: is the release installed?")
        clusters = {c: or_none(lambda c=c: custom.get_namespaced_custom_object(
            RAY_GROUP, RAY_VERSION, namespace, "rayclusters", c)) for c in cluster_names(rs) if c}
        return StatusView(
            namespace=namespace, release=release, rayservice=rs, rayclusters=clusters,
            pods=core.list_namespaced_pod(namespace, label_selector=pod_selector(release)).items,
            service=or_none(lambda: core.read_namespaced_service(name, namespace)),
            ingresses=client.NetworkingV1Api(api).list_namespaced_ingress(
                namespace, label_selector=f"{INSTANCE}={release}").items)
