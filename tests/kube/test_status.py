"""``specserve status``: what the cluster is doing with a release (``kube/status.py``).

The checks are pure functions, tested here over objects built in the test: the RayService and
RayCluster as the plain dicts the client's ``CustomObjectsApi`` returns (KubeRay v1.3+ status
fields), the pods, Service and Ingresses as the client's own model objects. No Kubernetes API
server can run here (no container runtime, no etcd): for the command end to end, the FakeAPI
of ``conftest.py`` (a local HTTP server answering the API's JSON) stands in, and the tests
check the exact paths the client asks it for. No Ray, no models.
"""

from __future__ import annotations

from kubernetes import client
from specserve.cli import main
from specserve.kube.status import (
    StatusView,
    api_key_line,
    endpoint_lines,
    fullname,
    pod_state,
    report,
)

NS = "llm"
RELEASE = "specserve"
CLUSTER = "specserve-raycluster-7xk2p"
NEW_CLUSTER = "specserve-raycluster-9qz4m"
GPU_MESSAGE = ("0/3 nodes are available: 1 node(s) had untolerated taint {node-role: infra}, "
               "2 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: "
               "3 No preemption victims found for incoming pod.")


# -- builders ----------------------------------------------------------------------------------------
def rayservice(app="RUNNING", message="", *, ready=True, target=2, draft=0, cluster=CLUSTER,
               pending=None, pending_app=None, auth=True, deployments=None) -> dict:
    apps = {"specserve": {"status": app, "message": message,
                          "serveDeploymentStatuses": deployments if deployments is not None else {
                              "OpenAIIngress": {"status": "HEALTHY" if app == "RUNNING" else "UPDATING"},
                              "SpecUnit": {"status": "HEALTHY" if app == "RUNNING" else "UPDATING"}}}}
    workers = [{"groupName": "target", "replicas": target}]
    if draft:
        workers.append({"groupName": "draft", "replicas": draft})
    head = {"containers": [{"name": "ray-head", "env": [
        {"name": "SPECSERVE_API_KEYS_FILE", "value": "/etc/specserve/api-keys/api-keys"}] if auth else []}],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        + ([{"name": "api-keys", "secret": {"secretName": "specserve-api-keys"}}] if auth else [])}
    conditions = [
        {"type": "Ready", "status": "True" if ready else "False",
         "reason": "NonZeroServeEndpoints" if ready else "Initializing"},
        {"type": "UpgradeInProgress", "status": "True" if pending else "False",
         "reason": "BothActivePendingClustersExist" if pending else "NoPendingCluster"}]
    status = {"conditions": conditions, "serviceStatus": "Running" if ready else "",
              "numServeEndpoints": 1 if ready else 0,
              "activeServiceStatus": {"rayClusterName": cluster, "applicationStatuses": apps} if cluster
              else {}}
    if pending:
        status["pendingServiceStatus"] = {"rayClusterName": pending, "applicationStatuses": {
            "specserve": {"status": pending_app}} if pending_app else {}}
    return {"apiVersion": "ray.io/v1", "kind": "RayService",
            "metadata": {"name": "specserve", "namespace": NS},
            "spec": {"rayClusterConfig": {"headGroupSpec": {"template": {"spec": head}},
                                          "workerGroupSpecs": workers}},
            "status": status}


def raycluster(name=CLUSTER, state="ready", ready_workers=2, desired=2) -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": name, "namespace": NS},
            "status": {"state": state, "readyWorkerReplicas": ready_workers,
                       "desiredWorkerReplicas": desired,
                       "conditions": [{"type": "HeadPodReady", "status": "True",
                                       "reason": "HeadPodRunningAndReady"},
                                      {"type": "RayClusterProvisioned", "status": "True",
                                       "reason": "AllPodRunningAndReadyFirstTime"}]}}


def container(name="ray-worker", *, ready=True, restarts=0, waiting=None, waiting_message=None,
              terminated=None, last_terminated=None, exit_code=137):
    state = client.V1ContainerState(
        running=client.V1ContainerStateRunning() if waiting is None and terminated is None else None,
        waiting=client.V1ContainerStateWaiting(reason=waiting, message=waiting_message) if waiting else None,
        terminated=client.V1ContainerStateTerminated(reason=terminated, exit_code=exit_code)
        if terminated else None)
    last = client.V1ContainerState(terminated=client.V1ContainerStateTerminated(
        reason=last_terminated, exit_code=exit_code)) if last_terminated else None
    return client.V1ContainerStatus(name=name, image="ghcr.io/specserve/specserve:0.1.0", image_id="",
                                    ready=ready, restart_count=restarts, state=state, last_state=last)


def pod(name, role="target", *, ready=True, phase="Running", scheduled=True, unschedulable=None,
        containers=None, cluster=CLUSTER) -> client.V1Pod:
    conditions = [client.V1PodCondition(type="PodScheduled", status="True")] if scheduled else [
        client.V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable",
                              message=unschedulable)]
    if scheduled:
        conditions.append(client.V1PodCondition(type="Ready", status="True" if ready else "False"))
    labels = {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/name": "specserve",
              "specserve.io/role": role, "ray.io/cluster": cluster}
    statuses = containers if containers is not None else (
        [container("ray-head" if role == "head" else "ray-worker", ready=ready)] if scheduled else None)
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name, namespace=NS, labels=labels),
                        status=client.V1PodStatus(phase=phase if scheduled else "Pending",
                                                  conditions=conditions, container_statuses=statuses))


def healthy_pods(cluster=CLUSTER, targets=2) -> list:
    return [pod(f"{cluster}-head-abcde", "head", cluster=cluster)] + [
        pod(f"{cluster}-target-worker-{i}", cluster=cluster) for i in range(targets)]


def service(port=8000, kind="ClusterIP") -> client.V1Service:
    return client.V1Service(
        metadata=client.V1ObjectMeta(name="specserve", namespace=NS),
        spec=client.V1ServiceSpec(type=kind, cluster_ip="10.96.12.34",
                                  ports=[client.V1ServicePort(name="http", port=port, target_port="serve")]))


def view(rs, pods, *, clusters=None, svc=None, ingresses=()) -> StatusView:
    return StatusView(namespace=NS, release=RELEASE, rayservice=rs,
                      rayclusters=clusters if clusters is not None else {CLUSTER: raycluster()},
                      pods=list(pods), service=svc if svc is not None else service(),
                      ingresses=list(ingresses))


def rendered(result) -> str:
    return "\n".join(result.text())


# -- names -----------------------------------------------------------------------------------------
def test_fullname_follows_the_chart_helper():
    assert fullname("specserve") == "specserve"
    assert fullname("prod") == "prod-specserve"
    assert fullname("specserve-canary") == "specserve-canary"  # contains the chart's name
    long = fullname("a" * 35)  # 35 + "-specserve": cut at 40, then the trailing "-" goes
    assert len(long) <= 40 and not long.endswith("-") and long.startswith("a" * 35)
    assert fullname("x" * 39 + "-specserve") == "x" * 39


# -- verdicts --------------------------------------------------------------------------------------
def test_a_healthy_release_serves():
    result = report(view(rayservice(), healthy_pods()))
    text = rendered(result)
    assert result.serving
    assert "ok   RayService llm/specserve: Ready (NonZeroServeEndpoints), 1 serve endpoint(s)" in text
    assert f"ok   RayCluster {CLUSTER}: ready, 2 of 2 worker(s) ready" in text
    assert "ok   Serve app specserve: RUNNING (deployments: OpenAIIngress HEALTHY, SpecUnit HEALTHY)" in text
    assert "ok   head: 1 of 1 pod(s) ready" in text
    assert "ok   target: 2 of 2 pod(s) ready" in text
    assert "FAIL" not in text and "wait" not in text
    assert ("     API: Service specserve (ClusterIP 10.96.12.34), port 8000: kubectl -n llm port-forward "
            "svc/specserve 8000:8000, then http://127.0.0.1:8000/v1") in text
    assert ("     API key: export OPENAI_API_KEY=$(kubectl -n llm get secret specserve-api-keys "
            "-o jsonpath='{.data.api-keys}' | base64 -d | head -n1)") in text
    assert result.text()[-1] == "specserve: serving: app specserve RUNNING, 2 of 2 unit(s) ready"


def test_a_pod_the_scheduler_cannot_place_names_the_pod_and_the_message():
    pods = healthy_pods(targets=1) + [pod(f"{CLUSTER}-target-worker-x9", scheduled=False,
                                          unschedulable=GPU_MESSAGE)]
    result = report(view(rayservice(app="DEPLOYING", ready=False), pods))
    text = rendered(result)
    assert not result.serving
    line = next(line for line in result.text() if f"{CLUSTER}-target-worker-x9" in line)
    assert line.startswith("FAIL   target pod ")
    assert "cannot be scheduled: " + GPU_MESSAGE in line
    assert "no node has the GPUs free" in line and "target.tolerations" in line  # both causes named
    assert "FAIL target: 1 of 2 pod(s) ready" in text
    assert "wait Serve app specserve: DEPLOYING" in text
    assert "wait RayService llm/specserve: not Ready (Initializing), 0 serve endpoint(s)" in text
    assert result.text()[-1] == ("specserve: not serving yet: app specserve DEPLOYING, 1 of 2 unit(s) "
                                 "ready; 1 pod(s) will not come up by themselves (FAIL above)")


def test_an_image_that_cannot_be_pulled():
    bad = pod("w-1", ready=False, phase="Pending", containers=[container(
        ready=False, waiting="ImagePullBackOff",
        waiting_message='Back-off pulling image "ghcr.io/specserve/specserve:0.1.0"')])
    state, why = pod_state(bad)
    assert state == "fail"
    assert why == ('container ray-worker cannot pull its image ghcr.io/specserve/specserve:0.1.0 '
                   '(ImagePullBackOff: Back-off pulling image "ghcr.io/specserve/specserve:0.1.0")')
    state, why = pod_state(pod("w-2", ready=False, phase="Pending",
                               containers=[container(ready=False, waiting="ErrImagePull")]))
    assert state == "fail" and "(ErrImagePull)" in why
    assert not report(view(rayservice(), healthy_pods(targets=1) + [bad])).serving


def test_a_container_killed_for_memory():
    oom = pod("w-1", ready=False, containers=[container(
        ready=False, restarts=3, waiting="CrashLoopBackOff", last_terminated="OOMKilled")])
    state, why = pod_state(oom)
    assert state == "fail"
    assert why == ("container ray-worker was killed for using more memory than its limit (OOMKilled, "
                   "exit 137, 3 restart(s), CrashLoopBackOff): raise target.resources.limits.memory")
    crash = pod("w-2", ready=False, containers=[container(
        ready=False, restarts=5, waiting="CrashLoopBackOff", last_terminated="Error", exit_code=1)])
    state, why = pod_state(crash)
    assert state == "fail"
    assert why == ("container ray-worker keeps crashing (CrashLoopBackOff, 5 restart(s); last exit 1 "
                   "(Error)): read its log with kubectl logs w-2 -c ray-worker --previous")
    # Ready again after an OOM: ok, with the restart said.
    state, why = pod_state(pod("w-3", containers=[container(restarts=1, last_terminated="OOMKilled")]))
    assert (state, why) == ("ok", "ready (restarted 1 time(s), last: OOMKilled)")


def test_a_serve_app_that_failed_to_deploy_says_why():
    message = ("Deploying app 'specserve' failed with exception:\nTraceback (most recent call last):\n"
               '  File "deploy/app.py", line 40, in build_app\n'
               "specserve.errors.ModelNotFoundError: target model 'org/missing' not found on the hub\n")
    rs = rayservice(app="DEPLOY_FAILED", message=message, ready=False, deployments={})
    result = report(view(rs, healthy_pods()))
    text = rendered(result)
    assert not result.serving
    assert ("FAIL Serve app specserve: DEPLOY_FAILED: Deploying app 'specserve' failed with exception: ... "
            "specserve.errors.ModelNotFoundError: target model 'org/missing' not found on the hub") in text
    assert result.text()[-1].startswith("specserve: not serving yet: app specserve DEPLOY_FAILED, 2 of 2")


def test_an_unhealthy_deployment_is_named_with_its_message():
    rs = rayservice(app="UNHEALTHY", deployments={
        "OpenAIIngress": {"status": "HEALTHY"},
        "SpecUnit": {"status": "UNHEALTHY", "message": "The deployment failed health checks 3 times"}})
    lines = report(view(rs, healthy_pods())).text()
    assert ("FAIL Serve app specserve: UNHEALTHY (deployments: OpenAIIngress HEALTHY, SpecUnit UNHEALTHY)"
            in lines)
    assert "FAIL   deployment SpecUnit UNHEALTHY: The deployment failed health checks 3 times" in lines


def test_pods_starting_or_not_yet_created_wait():
    pods = [pod(f"{CLUSTER}-head-a", "head"),
            pod("t-0", ready=False, containers=[container(ready=False)]),
            pod("d-0", "draft", ready=False, phase="Pending",
                containers=[container(ready=False, waiting="ContainerCreating")])]
    result = report(view(rayservice(app="DEPLOYING", ready=False, target=2, draft=2), pods,
                         clusters={CLUSTER: None}))
    lines = result.text()
    assert not result.serving
    assert "wait target: 0 of 2 pod(s) ready, 1 not created yet" in lines
    assert ("wait   target pod t-0: running, not ready yet (Ray is starting; the readiness probe has "
            "not passed)") in lines
    assert "wait draft: 0 of 2 pod(s) ready, 1 not created yet" in lines
    assert "wait   draft pod d-0: starting (ContainerCreating)" in lines
    assert f"wait RayCluster {CLUSTER}: not found (being created or deleted)" in lines
    assert lines[-1] == "specserve: not serving yet: app specserve DEPLOYING, 0 of 2 unit(s) ready"


def test_a_first_install_before_the_operator_acts():
    rs = {"metadata": {"name": "specserve"}, "spec": {}, "status": {}}
    result = report(view(rs, [], clusters={}, svc=None))
    lines = result.text()
    assert not result.serving
    assert lines[0].startswith("wait RayService llm/specserve: no status yet")
    assert "wait RayCluster: none yet (the KubeRay operator has not created it)" in lines
    assert lines[-1] == "specserve: not serving yet: app not deployed yet, 0 of 0 unit(s) ready"


def test_an_upgrade_counts_the_serving_cluster_and_shows_the_new_one():
    rs = rayservice(pending=NEW_CLUSTER, pending_app="DEPLOYING")
    pods = healthy_pods() + [pod(f"{NEW_CLUSTER}-head-b", "head", cluster=NEW_CLUSTER),
                             pod(f"{NEW_CLUSTER}-target-worker-q", cluster=NEW_CLUSTER, scheduled=False,
                                 unschedulable=GPU_MESSAGE)]
    clusters = {CLUSTER: raycluster(), NEW_CLUSTER: raycluster(NEW_CLUSTER, state="", ready_workers=0)}
    result = report(view(rs, pods, clusters=clusters))
    lines = result.text()
    assert result.serving  # the old cluster still serves
    assert ("wait upgrade in progress: new RayCluster specserve-raycluster-9qz4m coming up "
            "(BothActivePendingClustersExist); traffic moves when it serves") in lines
    assert "ok   target: 2 of 2 pod(s) ready" in lines
    assert f"FAIL new cluster {NEW_CLUSTER}: target: 0 of 2 pod(s) ready, 1 not created yet" in lines
    assert "wait new cluster's Serve app specserve: DEPLOYING" in lines


def test_the_api_key_line_reads_the_secret_the_head_mounts():
    name = "prod-specserve"
    rs = rayservice()
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    head["volumes"][1]["secret"]["secretName"] = "team-keys"
    head["containers"][0]["env"][0]["value"] = "/etc/specserve/api-keys/keys.txt"
    assert api_key_line(rs, NS, name).render() == (
        "     API key: export OPENAI_API_KEY=$(kubectl -n llm get secret team-keys "
        "-o jsonpath='{.data.keys\\.txt}' | base64 -d | head -n1)")
    assert "WITHOUT a key" in api_key_line(rayservice(auth=False), NS, name).text
    assert "secret prod-specserve-api-keys " in api_key_line({"spec": {}}, NS, name).text


def test_endpoints_name_the_ingress_hosts_and_a_load_balancer():
    ing = client.V1Ingress(
        metadata=client.V1ObjectMeta(name="specserve"),
        spec=client.V1IngressSpec(tls=[client.V1IngressTLS(hosts=["llm.example.com"], secret_name="tls")],
                                  rules=[client.V1IngressRule(host="llm.example.com"),
                                         client.V1IngressRule(host="llm.internal")]),
        status=client.V1IngressStatus(load_balancer=client.V1IngressLoadBalancerStatus(
            ingress=[client.V1IngressLoadBalancerIngress(ip="203.0.113.7")])))
    svc = service(port=80, kind="LoadBalancer")
    svc.status = client.V1ServiceStatus(load_balancer=client.V1LoadBalancerStatus(
        ingress=[client.V1LoadBalancerIngress(hostname="lb.example.net")]))
    lines = [line.render() for line in endpoint_lines(svc, [ing], NS, "specserve")]
    assert lines == [
        "     API: Service specserve (LoadBalancer 10.96.12.34), port 80: http://lb.example.net:80/v1",
        "     Ingress specserve: https://llm.example.com/v1, http://llm.internal/v1 (address 203.0.113.7)"]
    missing = endpoint_lines(None, [], NS, "specserve")
    assert missing[0].render() == "wait API Service llm/specserve: not found"


# -- the command, against the FakeAPI -----------------------------------------------------------------
def serve_release(fake_api, rs, pods, *, svc=True) -> None:
    base = f"/api/v1/namespaces/{NS}"
    fake_api.serve(f"/apis/ray.io/v1/namespaces/{NS}/rayservices/specserve", rs)
    fake_api.serve(f"/apis/ray.io/v1/namespaces/{NS}/rayclusters/{CLUSTER}", raycluster())
    fake_api.serve(f"{base}/pods", client.V1PodList(items=pods))
    if svc:
        fake_api.serve(f"{base}/services/specserve", service())
    fake_api.serve(f"/apis/networking.k8s.io/v1/namespaces/{NS}/ingresses", client.V1IngressList(items=[]))


EXPECTED_PATHS = [f"/apis/ray.io/v1/namespaces/{NS}/rayservices/specserve",
                  f"/apis/ray.io/v1/namespaces/{NS}/rayclusters/{CLUSTER}",
                  f"/api/v1/namespaces/{NS}/pods",
                  f"/api/v1/namespaces/{NS}/services/specserve",
                  f"/apis/networking.k8s.io/v1/namespaces/{NS}/ingresses"]


def test_status_end_to_end_healthy(fake_api, tmp_path, capsys):
    serve_release(fake_api, rayservice(), healthy_pods())
    code = main(["status", "-n", NS, "--kubeconfig", fake_api.kubeconfig(tmp_path / "kc")])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert fake_api.requests == EXPECTED_PATHS
    assert out[0] == "ok   RayService llm/specserve: Ready (NonZeroServeEndpoints), 1 serve endpoint(s)"
    assert "ok   target: 2 of 2 pod(s) ready" in out
    assert any(line.startswith("     API: Service specserve (ClusterIP 10.96.12.34), port 8000")
               for line in out)
    assert out[-1] == "specserve: serving: app specserve RUNNING, 2 of 2 unit(s) ready"


def test_status_end_to_end_pending(fake_api, tmp_path, capsys):
    pods = healthy_pods(targets=1) + [pod("specserve-raycluster-7xk2p-target-worker-x9", scheduled=False,
                                          unschedulable=GPU_MESSAGE)]
    serve_release(fake_api, rayservice(app="DEPLOYING", ready=False), pods, svc=False)
    code = main(["status", RELEASE, "-n", NS, "--kubeconfig", fake_api.kubeconfig(tmp_path / "kc")])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert any(line.startswith("FAIL   target pod specserve-raycluster-7xk2p-target-worker-x9: cannot be "
                               "scheduled: 0/3 nodes are available") for line in out)
    assert "wait API Service llm/specserve: not found" in out  # a 404 there is a line, not an error


def test_status_without_the_release_is_one_line(fake_api, tmp_path, capsys):
    code = main(["status", "prod", "-n", NS, "--kubeconfig", fake_api.kubeconfig(tmp_path / "kc")])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert captured.err == ("specserve: error: no RayService prod-specserve in llm: is the release "
                            "installed?\n")
    assert fake_api.requests == [f"/apis/ray.io/v1/namespaces/{NS}/rayservices/prod-specserve"]


def test_status_api_errors_are_one_line(fake_api, tmp_path, capsys):
    serve_release(fake_api, rayservice(), healthy_pods())
    fake_api.deny(f"/api/v1/namespaces/{NS}/pods", message='pods is forbidden: User "dev" cannot list '
                                                           'resource "pods" in the namespace "llm"')
    code = main(["status", "-n", NS, "--kubeconfig", fake_api.kubeconfig(tmp_path / "kc")])
    err = capsys.readouterr().err
    assert code == 2
    assert err == ('specserve: error: the Kubernetes API answered 403 Forbidden (pods is forbidden: '
                   'User "dev" cannot list resource "pods" in the namespace "llm")\n')
    code = main(["status", "--kubeconfig", str(tmp_path / "absent")])
    assert code == 2
    assert capsys.readouterr().err.startswith("specserve: error: cannot reach a cluster through")


def test_status_watch_reprints_until_the_rounds_are_done(fake_api, tmp_path, capsys):
    kubeconfig = fake_api.kubeconfig(tmp_path / "kc")
    code = main(["status", "-n", NS, "--kubeconfig", kubeconfig, "--watch", "--interval", "0.01",
                 "--max-rounds", "2"])
    out = capsys.readouterr().out.splitlines()
    assert code == 2  # the last round's: still no RayService; --watch keeps going through it
    assert sum(line.startswith("--- ") for line in out) == 2
    assert out.count("specserve: error: no RayService specserve in llm: is the release installed?") == 2
    serve_release(fake_api, rayservice(), healthy_pods())
    code = main(["status", "-n", NS, "--kubeconfig", kubeconfig, "-w", "--interval", "0.01",
                 "--max-rounds", "2"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out.count("specserve: serving: app specserve RUNNING, 2 of 2 unit(s) ready") == 2


def test_status_watch_stops_cleanly_on_ctrl_c(fake_api, tmp_path, capsys, monkeypatch):
    serve_release(fake_api, rayservice(), healthy_pods())

    def interrupt(_):
        raise KeyboardInterrupt

    monkeypatch.setattr("specserve.cli.time.sleep", interrupt)
    code = main(["status", "-n", NS, "--kubeconfig", fake_api.kubeconfig(tmp_path / "kc"), "--watch"])
    assert code == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("specserve: serving")
