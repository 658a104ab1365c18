"""The Helm chart, rendered with the real helm 3.17 (``make install`` fetches it into .helm/).

No Kubernetes API server can be had on these machines (no kind, k3s or Docker daemon), so the
chart is checked by rendering: ``helm lint --strict``, ``helm template`` with every ``ci/``
values file, built-in kinds validated by ``kubernetes-validate --strict`` at a pinned
Kubernetes version, the CRD kinds (RayService, ServiceMonitor, PodMonitor, PrometheusRule)
with ``jsonschema`` against the schemas in ``helm/crd-schemas/``, and assertions on what the
objects say.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from specserve.app_config import AppConfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specserve"
HELM = ROOT / ".helm" / "bin" / "helm"
K8S_VERSION = "1.30.0"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
CRD_SCHEMAS = {kind: json.loads((ROOT / "helm" / "crd-schemas" / f"{kind.lower()}.schema.json").read_text())
               for kind in ("RayService", "ServiceMonitor", "PodMonitor", "PrometheusRule")}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    assert HELM.is_file(), "helm is missing: `make install` fetches it into .helm/bin"
    env = {**os.environ, **{f"HELM_{k}_HOME": str(ROOT / ".helm" / k.lower())
                            for k in ("CACHE", "CONFIG", "DATA")}}
    proc = subprocess.run([str(HELM), *args], capture_output=True, text=True, env=env, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def render(*values: Path, sets: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", "rel", str(CHART), "--namespace", "llm", "--kube-version", K8S_VERSION]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def app_args(docs: list[dict]) -> dict:
    [svc] = by_kind(docs, "RayService")
    serve_config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    [application] = serve_config["applications"]
    return application["args"]


def groups(docs: list[dict]) -> dict[str, dict]:
    [svc] = by_kind(docs, "RayService")
    return {g["groupName"]: g for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def test_lint_strict():
    """The defaults (a draft shared with rank 0's GPU) and a draft on a GPU of its own."""
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), "-f", str(CHART / "ci" / "draft-own-values.yaml"))


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_ci_values_render_and_validate(values, tmp_path):
    docs = render(values)
    builtin = [d for d in docs if d["kind"] not in CRD_SCHEMAS]
    manifest = tmp_path / "builtin.yaml"
    manifest.write_text(yaml.safe_dump_all(builtin))
    proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                           "--kubernetes-version", K8S_VERSION, str(manifest)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for doc in docs:
        if doc["kind"] in CRD_SCHEMAS:
            jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
    # The same pydantic model as deploy/ accepts what the chart renders.
    AppConfig.model_validate(app_args(docs))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_target_pods_ask_for_exactly_tp_gpus(tp):
    docs = render(sets=(f"specserve.unit.tensor_parallel_size={tp}",))
    target = groups(docs)["target"]
    [container] = target["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
    assert container["resources"]["requests"]["nvidia.com/gpu"] == tp
    assert target["rayStartParams"]["num-gpus"] == str(tp)
    assert "draft" not in groups(docs)  # the default draft shares rank 0's GPU
    assert app_args(docs)["unit"]["tensor_parallel_size"] == tp


def test_ngram_has_no_draft_group():
    docs = render(CHART / "ci" / "ngram-values.yaml")
    assert set(groups(docs)) == {"target"}
    assert [p["metadata"]["name"] for p in by_kind(docs, "PodDisruptionBudget")] == ["rel-specserve-target"]
    unit = app_args(docs)["unit"]
    assert "draft_node_resource" not in unit and unit["target_node_resource"] == "specserve_target"


def test_eagle_keeps_its_draft_and_shares_rank_0s_gpu():
    """method eagle, like draft_model, runs the draft as its own actor (the head reads the
    features rank 0 sends), by default beside rank 0 in the target pod; the app keeps the
    draft directory and ngram_first."""
    docs = render(CHART / "ci" / "eagle-values.yaml")
    assert set(groups(docs)) == {"target"}
    spec = app_args(docs)["unit"]["engine"]["speculative"]
    assert spec["method"] == "eagle" and spec["ngram_first"] is True
    assert spec["draft"]["source"] == "/models/drafts/llama-3.1-70b-eagle"
    assert "draft_node_resource" not in app_args(docs)["unit"]


SHARED, OWN = CHART / "ci" / "tp4-draft-values.yaml", CHART / "ci" / "draft-own-values.yaml"


def test_a_shared_draft_runs_in_the_target_pods_and_an_own_draft_in_its_group():
    """``unit.draft_placement``. shared (the default): the draft runs in the target pod, on a
    fraction of rank 0's GPU, so a speculative unit needs TP GPUs: no draft worker group or
    budget, no draft node resource, the target pods labelled as carrying it, the draft kept
    in the app. own: a draft group of one-GPU pods, pinned by its node resource. The
    preflight counts the pods the chart renders."""
    from specserve.kube.needs import load_values, needs_of

    docs = render(SHARED)
    assert set(groups(docs)) == {"target"}
    assert [p["metadata"]["name"] for p in by_kind(docs, "PodDisruptionBudget")] == ["rel-specserve-target"]
    labels = groups(docs)["target"]["template"]["metadata"]["labels"]
    assert labels["specserve.io/draft"] == "shared"
    unit = app_args(docs)["unit"]
    assert unit["draft_placement"] == "shared" and "draft_node_resource" not in unit
    assert unit["engine"]["speculative"]["draft"]["source"] == "meta-llama/Llama-3.2-1B-Instruct"
    assert AppConfig.model_validate(app_args(docs)).unit.draft_shares_gpu
    assert [p.group for p in needs_of(load_values([SHARED], CHART)).pods] == ["head", "target"]

    docs = render(OWN)
    draft = groups(docs)["draft"]
    [container] = draft["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1 == int(draft["rayStartParams"]["num-gpus"])
    assert "specserve.io/draft" not in groups(docs)["target"]["template"]["metadata"]["labels"]
    assert len(by_kind(docs, "PodDisruptionBudget")) == 2
    unit = app_args(docs)["unit"]
    assert unit["draft_placement"] == "own" and unit["draft_node_resource"] == "specserve_draft"
    assert not AppConfig.model_validate(app_args(docs)).unit.draft_shares_gpu
    assert [(p.group, p.gpus) for p in needs_of(load_values([OWN], CHART)).pods] == [
        ("head", 0), ("target", 1), ("draft", 1)]


def test_a_published_eagle3_head_by_hub_id_is_served_like_any_eagle_draft():
    """The hub id travels to the app as the draft's source (the target and draft pods read its
    config; the draft pod loads it); a draft group as for any EAGLE head."""
    docs = render(CHART / "ci" / "eagle3-values.yaml")
    spec = app_args(docs)["unit"]["engine"]["speculative"]
    assert spec["method"] == "eagle" and spec["draft"]["source"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


def test_groups_advertise_the_resources_the_unit_asks_for():
    docs = render(OWN)  # every group: head, target and draft
    unit = app_args(docs)["unit"]
    [svc] = by_kind(docs, "RayService")
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert app_args(docs)["ingress_node_resource"] == "specserve_head"
    assert json.loads(json.loads(head["resources"].strip("'"))) == {"specserve_head": 1000}
    assert head["num-gpus"] == "0"
    for name, group in groups(docs).items():
        resources = group["rayStartParams"]["resources"]
        assert unit[f"{name}_node_resource"] in resources
        assert json.loads(json.loads(resources.strip("'"))) == {f"specserve_{name}": 1000}


def test_ingress_carries_streaming_annotations_and_tls():
    docs = render(CHART / "ci" / "ingress-tls-values.yaml")
    [ingress] = by_kind(docs, "Ingress")
    notes = ingress["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert ingress["spec"]["tls"][0]["secretName"] == "llm-example-com-tls"
    [route] = by_kind(docs, "HTTPRoute")
    assert route["spec"]["rules"][0]["timeouts"]["request"] == "3600s"


def test_existing_secrets_are_referenced_not_inlined():
    docs = render(CHART / "ci" / "tp4-draft-values.yaml", CHART / "ci" / "ingress-tls-values.yaml")
    assert not by_kind(docs, "Secret")
    [svc] = by_kind(docs, "RayService")
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    env = {e["name"]: e for e in head["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "specserve-api-keys"


def test_inline_secret_values_become_secrets():
    docs = render(sets=("hubToken.value=hf_abcdefghijklmnop", "apiKeys.values[0]=sk-0123456789abcdef"))
    names = {s["metadata"]["name"] for s in by_kind(docs, "Secret")}
    assert names == {"rel-specserve-hub-token", "rel-specserve-api-keys"}


def test_api_keys_are_on_by_default_with_a_generated_key():
    """No keys given: the chart still turns auth on, with one random key in its Secret
    (``lookup`` keeps it across upgrades on a cluster), mounted where the app reads it."""
    docs = render()
    args = app_args(docs)
    assert args["auth"]["enabled"] is True
    assert AppConfig.model_validate(args).auth.enabled
    [secret] = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"] == "rel-specserve-api-keys"]
    key = secret["stringData"]["api-keys"]
    assert key.startswith("sk-") and len(key) == 43 and key[3:].isalnum()
    other = [s for s in by_kind(render(), "Secret") if s["metadata"]["name"] == "rel-specserve-api-keys"]
    assert other[0]["stringData"]["api-keys"] != key  # random per install (no cluster to look up)
    [svc] = by_kind(docs, "RayService")
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in head["containers"][0]["env"]}
    assert env["SPECSERVE_API_KEYS_FILE"] == "/etc/specserve/api-keys/api-keys"
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert mounts["api-keys"] == "/etc/specserve/api-keys"


def test_auth_off_is_explicit_and_mounts_no_keys():
    docs = render(sets=("specserve.auth.enabled=false",))
    assert app_args(docs)["auth"]["enabled"] is False
    assert not by_kind(docs, "Secret")
    [svc] = by_kind(docs, "RayService")
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "api-keys" not in {v["name"] for v in head["volumes"]}
    assert "SPECSERVE_API_KEYS_FILE" not in {e["name"] for e in head["containers"][0]["env"]}


def test_autoscaling_turns_on_kuberays_autoscaler_with_the_groups_bounded_by_units():
    """A unit is a target pod, and a draft pod where the draft has a GPU of its own: each
    group scales between the unit bounds; without autoscaling the groups are fixed at
    num_units (as before)."""
    docs = render(CHART / "ci" / "autoscaling-values.yaml")
    [svc] = by_kind(docs, "RayService")
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 120
    bounds = {name: (g["replicas"], g["minReplicas"], g["maxReplicas"]) for name, g in groups(docs).items()}
    assert bounds == {"target": (1, 1, 3)}  # the draft shares rank 0's GPU
    own = render(CHART / "ci" / "autoscaling-values.yaml", sets=("specserve.unit.draft_placement=own",))
    bounds = {name: (g["replicas"], g["minReplicas"], g["maxReplicas"]) for name, g in groups(own).items()}
    assert bounds == {"target": (1, 1, 3), "draft": (1, 1, 3)}
    scaling = AppConfig.model_validate(app_args(docs)).autoscaling
    assert (scaling.policy, scaling.min_units, scaling.max_units) == ("speculation", 1, 3)
    fixed = render(sets=("specserve.num_units=2",))
    assert by_kind(fixed, "RayService")[0]["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False
    assert {(g["minReplicas"], g["maxReplicas"]) for g in groups(fixed).values()} == {(2, 2)}


def test_limits_and_drain_reach_the_app():
    docs = render(sets=("specserve.limits.requests_per_minute=600",
                        "specserve.limits.max_concurrent_requests=8", "specserve.drain_timeout_s=120"))
    cfg = AppConfig.model_validate(app_args(docs))
    assert cfg.limits.requests_per_minute == 600 and cfg.limits.max_concurrent_requests == 8
    assert cfg.drain_timeout_s == 120


def test_dashboards_are_byte_identical_to_the_packaged_json():
    docs = render()
    maps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    for name in ("serving", "speculation"):
        cm = maps[f"rel-specserve-dashboard-{name}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        packaged = ROOT / "services" / "specserve" / "grafana" / f"{name}.json"
        assert cm["data"][f"{name}.json"] == packaged.read_text()


def test_prometheus_rule_is_deploy_prometheus_rules():
    docs = render()
    [rule] = by_kind(docs, "PrometheusRule")
    rules = ROOT / "deploy" / "prometheus" / "rules"
    expected = [g for f in ("recording", "alerts")
                for g in yaml.safe_load((rules / f"{f}.yml").read_text())["groups"]]
    assert rule["spec"]["groups"] == expected


def test_values_schema_is_fresh():
    proc = subprocess.run([sys.executable, str(ROOT / "helm" / "schema.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("sets, message", [
    (("target.replicas=-1",), "target.replicas"),
    (("specserve.num_units=0",), "num_units"),
    (("specserve.unit.tensor_parallel_size=3",), "tensor_parallel_size"),
    (("specserve.unit.engine.speculative.num_speculative_tokens=0",), "num_speculative_tokens"),
    (("specserve.unit.engine.speculative.method=medusa",), "method"),
    (("service.port=70000",), "service.port"),
    (("image.pullPolicy=Sometimes",), "pullPolicy"),
    (("ingress.hosts[0].paths[0].path=relative",), "path"),
    (("specserve.unit.router.probe_share=2",), "probe_share"),
    (("specserve.unit.typo_field=1",), "typo_field"),
    (("apiKeys.values[0]=short",), "apiKeys"),
    (("specserve.limits.max_request_bytes=10",), "max_request_bytes"),
    (("specserve.auth.enabled=maybe",), "enabled"),
])
def test_bad_values_are_refused_with_the_field_named(sets, message):
    proc = helm("template", "rel", str(CHART), *[a for s in sets for a in ("--set", s)], check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


# The preflight hook (templates/preflight.yaml; docs/CLUSTER.md, "Preflight before install").

PREFLIGHT = ("preflight.enabled=true",)
HOOK_KINDS = ("ConfigMap", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
              "Job")


def hooks(docs: list[dict]) -> list[dict]:
    return [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]


def hook(docs: list[dict], kind: str) -> dict:
    [doc] = by_kind(hooks(docs), kind)
    return doc


def validate_builtin(docs: list[dict], tmp_path: Path) -> None:
    """kubernetes-validate --strict over the built-in kinds, as test_ci_values_render_and_validate."""
    manifest = tmp_path / "builtin.yaml"
    manifest.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] not in CRD_SCHEMAS]))
    proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                           "--kubernetes-version", K8S_VERSION, str(manifest)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_preflight_is_off_by_default():
    docs = render()
    assert not hooks(docs)
    assert not by_kind(docs, "Job") and not by_kind(docs, "ClusterRole") and not by_kind(docs, "Role")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-preflight")]


def test_preflight_hook_runs_the_check_with_the_release_values_and_read_only_rbac():
    docs = render(sets=(*PREFLIGHT, "specserve.num_units=2", "specserve.unit.tensor_parallel_size=2",
                        "hubToken.value=hf_abcdefghijklmnop"))
    objects = hooks(docs)
    # No secret named by the values: no Role (one without rules is invalid).
    assert sorted(d["kind"] for d in objects) == sorted(set(HOOK_KINDS) - {"Role", "RoleBinding"})
    for doc in objects:
        notes = doc["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert notes["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
    weight = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in objects}
    assert all(weight[k] < weight["Job"] for k in weight if k != "Job")
    assert weight["ClusterRole"] < weight["ClusterRoleBinding"]

    # Read-only, on exactly what the check lists.
    role = hook(docs, "ClusterRole")
    assert "llm" in role["metadata"]["name"]  # cluster-scoped: unique per release and namespace
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted == {("", "nodes"), ("apiextensions.k8s.io", "customresourcedefinitions"),
                       ("storage.k8s.io", "storageclasses")}
    assert {v for rule in role["rules"] for v in rule["verbs"]} == {"get", "list"}
    binding = hook(docs, "ClusterRoleBinding")
    account = hook(docs, "ServiceAccount")["metadata"]["name"]
    assert account == "rel-specserve-preflight"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "llm"}]

    # The Job: the chart's image, the command, the values mounted where it reads them.
    job = hook(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["specserve", "preflight", "-f", "/etc/specserve-preflight/values.yaml",
                                    "--chart", "", "-n", "llm", "--in-cluster"]
    [svc] = by_kind(docs, "RayService")
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert container["image"] == head["image"]
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == account
    assert pod["automountServiceAccountToken"] is True
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] > 0
    assert container["resources"]["limits"]["memory"]
    [mount] = container["volumeMounts"]
    assert mount["mountPath"] == "/etc/specserve-preflight"
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = hook(docs, "ConfigMap")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]

    # The values it checks are the ones the RayService was rendered from (less inline secrets),
    # and the check's own reader takes them without the chart's defaults (--chart '').
    from specserve.kube.needs import needs_of

    values = yaml.safe_load(config_map["data"]["values.yaml"])
    args = app_args(docs)
    assert values["specserve"]["num_units"] == args["num_units"] == 2
    assert values["specserve"]["unit"]["tensor_parallel_size"] == args["unit"]["tensor_parallel_size"] == 2
    assert "hf_abcdefghijklmnop" not in config_map["data"]["values.yaml"]
    needs = needs_of(values)
    assert (needs.units, needs.tensor_parallel_size) == (2, 2)


@pytest.mark.parametrize("values, sets, names", [
    ((), ("hubToken.existingSecret=hf-token",), ["hf-token"]),
    ((CHART / "ci" / "ingress-tls-values.yaml",), ("imagePullSecrets[0].name=regcred",),
     ["specserve-api-keys", "regcred", "llm-example-com-tls"]),
])
def test_preflight_role_reads_only_the_named_secrets(values, sets, names):
    docs = render(*values, sets=(*PREFLIGHT, *sets))
    role = hook(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": names,
                              "verbs": ["get"]}]
    binding = hook(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-specserve-preflight",
                                    "namespace": "llm"}]


def test_preflight_image_can_be_overridden():
    docs = render(sets=(*PREFLIGHT, "preflight.image.tag=checks", "preflight.image.pullPolicy=Always"))
    [container] = hook(docs, "Job")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/specserve/specserve:checks"
    assert container["imagePullPolicy"] == "Always"


def test_preflight_hook_lints_and_validates(tmp_path):
    helm("lint", "--strict", str(CHART), "--set", "preflight.enabled=true")
    docs = render(CHART / "ci" / "ingress-tls-values.yaml", sets=PREFLIGHT)
    assert {d["kind"] for d in hooks(docs)} == set(HOOK_KINDS)
    validate_builtin(docs, tmp_path)
