"""``specserve preflight`` (issue 39): whether a cluster can hold the chart's values, before
``helm install``.

The checks are pure functions over the official client's model objects, built here. No
Kubernetes API server can run here (no container runtime, no etcd): the listing layer and the
command are tested against a local HTTP server that answers the API's JSON for the lists they
read (``tests/kube/conftest.py``), through a kubeconfig that points at it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from specserve.cli import CHART, main
from specserve.kube.cluster import read_cluster
from specserve.kube.needs import load_values, needs_of
from specserve.kube.preflight import can_come_up, preflight, why_not

NS = "llm"
GPU_TAINT = k8s.V1Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule")


def node(name: str, gpus: int, *, cpu: str = "96", memory: str = "1000Gi", taints=(), labels=None,
         ready: bool = True) -> k8s.V1Node:
    allocatable = {"cpu": cpu, "memory": memory, "pods": "110"}
    if gpus:
        allocatable["nvidia.com/gpu"] = str(gpus)
    return k8s.V1Node(
        metadata=k8s.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name, **(labels or {})}),
        spec=k8s.V1NodeSpec(taints=list(taints) or None),
        status=k8s.V1NodeStatus(allocatable=allocatable, capacity=allocatable, conditions=[
            k8s.V1NodeCondition(type="Ready", status="True" if ready else "False")]))


def crd(kind: str, group: str, versions: tuple[str, ...] = ("v1",),
        spec_fields=None) -> k8s.V1CustomResourceDefinition:
    plural = kind.lower() + "s"
    schema = None
    if spec_fields is not None:
        schema = k8s.V1CustomResourceValidation(open_apiv3_schema=k8s.V1JSONSchemaProps(
            type="object", properties={"spec": k8s.V1JSONSchemaProps(
                type="object", properties={f: k8s.V1JSONSchemaProps(type="object") for f in spec_fields})}))
    return k8s.V1CustomResourceDefinition(
        metadata=k8s.V1ObjectMeta(name=f"{plural}.{group}"),
        spec=k8s.V1CustomResourceDefinitionSpec(
            group=group, scope="Namespaced",
            names=k8s.V1CustomResourceDefinitionNames(kind=kind, plural=plural),
            versions=[k8s.V1CustomResourceDefinitionVersion(name=v, served=True, storage=i == 0,
                                                            schema=schema)
                      for i, v in enumerate(versions)]))


KUBERAY_13 = crd("RayService", "ray.io", spec_fields=("serveConfigV2", "rayClusterConfig", "upgradeStrategy"))
PROMETHEUS = [crd(k, "monitoring.coreos.com") for k in ("ServiceMonitor", "PodMonitor", "PrometheusRule")]
DEFAULT_CLASS = k8s.V1StorageClass(provisioner="example.com/nfs", metadata=k8s.V1ObjectMeta(
    name="shared", annotations={"storageclass.kubernetes.io/is-default-class": "true"}))
CPU_NODES = [node("cpu-1", 0, cpu="16", memory="64Gi")]


@pytest.fixture(scope="module")
def flagship():
    """The chart's own values: Llama-3.1-70B on TP 4 with a 1B draft beside rank 0 (a 4-GPU
    target pod per unit, no draft pods), monitoring on."""
    return needs_of(load_values([], CHART))


def run(needs, nodes, crds=(KUBERAY_13, *PROMETHEUS), classes=(DEFAULT_CLASS,), secrets=None):
    findings, units = preflight(needs, list(nodes), list(crds), list(classes), secrets or {}, NS)
    return findings, units, [f.line() for f in findings]


def test_the_flagship_values_fit_a_cluster_of_8_gpu_nodes(flagship):
    assert (flagship.tensor_parallel_size, flagship.units) == (4, 1)
    assert [(p.group, p.gpus) for p in flagship.pods] == [("head", 0), ("target", 4)]
    findings, units, lines = run(flagship, CPU_NODES + [node("gpu-a", 8, taints=[GPU_TAINT])])
    assert units == 1 and can_come_up(findings), lines
    assert lines[-1].startswith("ok   1 of 1 unit(s) fit")


def test_how_many_units_fit_counts_gpus_left_after_each_unit(flagship, tmp_path):
    """Two 8-GPU nodes hold four units whose drafts share rank 0's GPU; with drafts on GPUs of
    their own, three units of 4 + 1 GPUs (15 of their 16), not five: a fourth target pod finds
    no node with 4 GPUs left."""
    gpu_nodes = [node(f"gpu-{i}", 8, taints=[GPU_TAINT]) for i in range(2)]
    _, units, _ = run(replace(flagship, units=5), CPU_NODES + gpu_nodes)
    assert units == 4
    own = tmp_path / "own.yaml"
    own.write_text("specserve: {unit: {draft_placement: own}}\n")
    needs = needs_of(load_values([own], CHART))
    assert [(p.group, p.gpus) for p in needs.pods] == [("head", 0), ("target", 4), ("draft", 1)]
    findings, units, lines = run(replace(needs, units=5), CPU_NODES + gpu_nodes)
    assert units == 3 and any(line.startswith("ok   draft pods") for line in lines)


def test_with_autoscaling_the_cluster_is_counted_for_max_units(tmp_path):
    values = tmp_path / "scaling.yaml"
    values.write_text("specserve:\n  autoscaling: {min_units: 1, max_units: 3}\n")
    needs = needs_of(load_values([values], CHART))
    assert needs.units == 3 and needs.autoscaled
    gpu_nodes = [node(f"gpu-{i}", 8, taints=[GPU_TAINT]) for i in range(2)]
    findings, units, lines = run(needs, CPU_NODES + gpu_nodes)
    assert units == 3 and lines[-1].startswith("ok   3 of 3 unit(s) (autoscaling's max_units) fit")
    _, units, lines = run(needs, CPU_NODES + gpu_nodes[:1])
    assert units == 2 and lines[-1].startswith("warn 2 of 3 unit(s) (autoscaling's max_units)")


def test_no_node_with_four_gpus_names_the_biggest_node_and_what_it_lacks(flagship):
    findings, units, lines = run(flagship, CPU_NODES + [node("gpu-a", 2, taints=[GPU_TAINT]),
                                                        node("gpu-b", 3, taints=[GPU_TAINT])])
    assert units == 0 and not can_come_up(findings)
    bad = next(line for line in lines if "target pod" in line)
    assert bad.startswith("FAIL no node can hold a target pod (4 GPUs, 16 CPU, 256Gi)")
    assert "the biggest node, gpu-b, has 3 allocatable nvidia.com/gpu, the target pod asks 4" in bad


def test_gpu_memory_is_estimated_per_gpu_and_a_shared_split_that_does_not_fit_is_refused(
        flagship, tmp_path):
    """Each GPU's estimate against the GPU memory the values were sized for: a target rank,
    then target rank 0 and its shared draft together. At 40 slots each fits a GPU alone and
    the two together do not: one FAIL line naming the two values that fix it, and either
    fix passes. A draft whose config cannot be had here is a warning, not a failure."""
    nodes = CPU_NODES + [node("gpu-a", 8, taints=[GPU_TAINT])]
    findings, _, lines = run(flagship, nodes)
    assert "ok   a target rank: about 55.1 GiB, 70% of its 79 GiB GPU" in lines
    assert ("ok   target rank 0 + draft on one GPU: 55.06 + 10.01 = 65.07 GiB, 82% of 79.0 GiB: "
            "fits (at most 90%); draft_gpu_fraction 0.15") in lines
    forty = tmp_path / "forty.yaml"
    forty.write_text("specserve: {unit: {engine: {max_num_seqs: 40}}}\n")
    findings, _, lines = run(needs_of(load_values([forty], CHART)), nodes)
    assert not can_come_up(findings)
    [bad] = [line for line in lines if line.startswith("FAIL")]
    assert bad.endswith("does NOT fit (at most 90%); draft_gpu_fraction 0.20: set "
                        "specserve.unit.draft_placement: own (a GPU of its own) or lower "
                        "specserve.unit.engine.max_num_seqs to 30 or less"), bad
    fixes = {"specserve: {unit: {draft_placement: own}}": "ok   the draft on its own GPU: about",
             "specserve: {unit: {engine: {max_num_seqs: 30}}}": "ok   target rank 0 + draft on one GPU"}
    for fix, line in fixes.items():
        fixed = tmp_path / "fix.yaml"
        fixed.write_text(fix + "\n")
        findings, _, lines = run(needs_of(load_values([forty, fixed], CHART)), nodes)
        assert can_come_up(findings) and any(found.startswith(line) for found in lines), lines
    local = tmp_path / "local.yaml"
    local.write_text("specserve: {unit: {engine: {speculative: {draft: {source: /models/d}}}}}\n")
    findings, _, lines = run(needs_of(load_values([local], CHART)), nodes)
    assert can_come_up(findings)
    assert any(line.startswith("warn GPU memory not estimated: no config.json for the draft /models/d")
               for line in lines), lines


def test_a_gpu_pool_whose_taint_the_values_do_not_tolerate(flagship, tmp_path):
    taint = k8s.V1Taint(key="dedicated", value="llm", effect="NoSchedule")
    nodes = CPU_NODES + [node("gpu-a", 8, taints=[GPU_TAINT, taint])]
    findings, units, lines = run(flagship, nodes)
    assert units == 0 and not can_come_up(findings)
    assert any("has the taint(s) dedicated=llm:NoSchedule that target.tolerations do not tolerate" in line
               for line in lines), lines
    tolerate = tmp_path / "tolerate.yaml"  # the fix the message points at
    tolerate.write_text(yaml.safe_dump({g: {"tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}]}
        for g in ("target", "draft")}))
    findings, units, _ = run(needs_of(load_values([tolerate], CHART)), nodes)
    assert units == 1 and can_come_up(findings)


def test_node_selector_cordon_and_gpu_memory_are_read_from_the_node(flagship):
    target = next(p for p in flagship.pods if p.group == "target")
    assert why_not(node("a", 8, taints=[GPU_TAINT], ready=False), target) == "not Ready"
    cordoned = node("b", 8, taints=[GPU_TAINT])
    cordoned.spec.unschedulable = True
    assert why_not(cordoned, target) == "cordoned (unschedulable)"
    small = node("c", 8, taints=[GPU_TAINT], labels={"nvidia.com/gpu.memory": "40960",
                                                      "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"})
    assert "GPUs of 40 GiB (NVIDIA-A100-SXM4-40GB); the release is sized for 79 GiB" in why_not(small, target)
    pinned = replace(target, node_selector={"pool": "h100"})
    assert why_not(node("d", 8, taints=[GPU_TAINT]), pinned) == "lacks the nodeSelector label(s) pool=h100"
    assert why_not(node("e", 8, taints=[GPU_TAINT], labels={"pool": "h100"}), pinned) is None


@pytest.mark.parametrize("crds, expected", [
    ((), "RayService (ray.io/v1): the CRD is not installed; install the KubeRay operator, v1.3 or newer"),
    ((crd("RayService", "ray.io", ("v1alpha1",)),),
     "RayService (ray.io/v1): the installed CRD serves v1alpha1, not v1"),
    ((crd("RayService", "ray.io", spec_fields=("serveConfigV2", "rayClusterConfig")),),
     "RayService (ray.io/v1): the installed CRD is older than the chart (its spec lacks upgradeStrategy)"),
])
def test_missing_or_old_kuberay_crds(flagship, crds, expected):
    nodes = CPU_NODES + [node("gpu-a", 8, taints=[GPU_TAINT])]
    findings, _, lines = run(flagship, nodes, crds=(*crds, *PROMETHEUS))
    assert not can_come_up(findings)
    assert any(line.startswith("FAIL " + expected) for line in lines), lines


def test_monitoring_crds_are_asked_for_only_where_the_values_turn_them_on(tmp_path):
    off = tmp_path / "off.yaml"
    off.write_text(yaml.safe_dump({"monitoring": {k: {"enabled": False} for k in
                                                  ("serviceMonitor", "podMonitor", "prometheusRule")}}))
    nodes = CPU_NODES + [node("gpu-a", 8, taints=[GPU_TAINT])]
    findings, _, lines = run(needs_of(load_values([], CHART)), nodes, crds=(KUBERAY_13,))
    assert not can_come_up(findings)
    assert ("FAIL ServiceMonitor (monitoring.coreos.com/v1): the CRD is not installed; install the "
            "Prometheus Operator (or set monitoring.serviceMonitor.enabled: false)") in lines
    findings, _, _ = run(needs_of(load_values([off], CHART)), nodes, crds=(KUBERAY_13,))
    assert can_come_up(findings)


def test_a_missing_secret_and_a_secret_without_its_key(tmp_path):
    values = tmp_path / "secrets.yaml"
    values.write_text(yaml.safe_dump({"hubToken": {"existingSecret": "hf", "key": "token"},
                                      "apiKeys": {"existingSecret": "keys"}}))
    needs = needs_of(load_values([values], CHART))
    nodes = CPU_NODES + [node("gpu-a", 8, taints=[GPU_TAINT])]
    keys = k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="keys"), data={"other": "eA=="})
    findings, _, lines = run(needs, nodes, secrets={"hf": None, "keys": keys})
    assert not can_come_up(findings)
    assert f"FAIL secret {NS}/hf (hubToken.existingSecret) does not exist" in lines
    assert f"FAIL secret {NS}/keys (apiKeys.existingSecret) has no key api-keys" in lines


def test_the_model_cache_needs_its_storage_class_or_a_default(flagship, tmp_path):
    nodes = CPU_NODES + [node("gpu-a", 8, taints=[GPU_TAINT])]
    findings, _, lines = run(flagship, nodes, classes=())
    assert not can_come_up(findings) and any("no default one" in line for line in lines)
    named = tmp_path / "named.yaml"
    named.write_text(yaml.safe_dump({"modelCache": {"storageClassName": "fast-rwx"}}))
    findings, _, lines = run(needs_of(load_values([named], CHART)), nodes)
    assert ("FAIL StorageClass fast-rwx (modelCache.storageClassName) does not exist; the cluster "
            "has: shared") in lines


# -- the listing layer and the command, against the stand-in API server --------------------------
def serve_cluster(fake_api, nodes, crds=(KUBERAY_13, *PROMETHEUS), classes=(DEFAULT_CLASS,)) -> None:
    fake_api.serve("/api/v1/nodes", k8s.V1NodeList(items=list(nodes)))
    fake_api.serve("/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                   k8s.V1CustomResourceDefinitionList(items=list(crds)))
    fake_api.serve("/apis/storage.k8s.io/v1/storageclasses", k8s.V1StorageClassList(items=list(classes)))


def test_the_listing_layer_reads_what_the_checks_read(fake_api, flagship):
    nodes = CPU_NODES + [node("gpu-a", 8, taints=[GPU_TAINT])]
    serve_cluster(fake_api, nodes)
    fake_api.serve(f"/api/v1/namespaces/{NS}/secrets/hf",
                   k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="hf"), data={"token": "eA=="}))
    view = read_cluster(fake_api.api_client(), NS, ["hf", "gone"])
    assert [n.metadata.name for n in view.nodes] == ["cpu-1", "gpu-a"]
    assert view.nodes[1].spec.taints[0].key == "nvidia.com/gpu"
    assert view.crds[0].spec.versions[0].schema.open_apiv3_schema.properties["spec"].properties.keys() \
        == {"serveConfigV2", "rayClusterConfig", "upgradeStrategy"}
    assert view.secrets["hf"].data == {"token": "eA=="} and view.secrets["gone"] is None
    findings, units = preflight(flagship, view.nodes, view.crds, view.storage_classes, view.secrets, NS)
    assert units == 1 and can_come_up(findings)


def test_preflight_command_says_one_line_per_finding_and_exits_by_verdict(fake_api, tmp_path, capsys):
    kubeconfig = fake_api.kubeconfig(tmp_path / "kubeconfig")
    serve_cluster(fake_api, CPU_NODES + [node("gpu-a", 8, taints=[GPU_TAINT])])
    assert main(["preflight", "--kubeconfig", kubeconfig, "-n", NS]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "specserve: the deployment can come up (1 of 1 unit(s) fit)"
    assert all(line.startswith("ok ") for line in out[:-1]), out
    serve_cluster(fake_api, CPU_NODES + [node("gpu-a", 2, taints=[GPU_TAINT])])
    assert main(["preflight", "--kubeconfig", kubeconfig, "-n", NS]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "specserve: the deployment cannot come up (0 of 1 unit(s) fit)"


def test_preflight_errors_are_one_line(fake_api, tmp_path, capsys):
    kubeconfig = fake_api.kubeconfig(tmp_path / "kubeconfig")
    fake_api.deny("/api/v1/nodes", message='nodes is forbidden: User "dev" cannot list resource "nodes"')
    assert main(["preflight", "--kubeconfig", kubeconfig]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ('specserve: error: the Kubernetes API answered 403 Forbidden (nodes is forbidden: '
                   'User "dev" cannot list resource "nodes")')
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"specserve": {"unit": {"tensor_parallel_size": 3}}}))
    assert main(["preflight", "-f", str(bad), "--kubeconfig", kubeconfig]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specserve: error: unit.tensor_parallel_size") and "\n" not in err
    assert main(["preflight", "--kubeconfig", str(Path(tmp_path) / "absent")]) == 2
    assert capsys.readouterr().err.startswith("specserve: error: cannot reach a cluster through")
