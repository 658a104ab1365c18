"""A local Ray cluster for ``make serve`` and the tests: in-process, loopback only.

Ray 2.60 enables token auth for local clusters and advertises the machine's interface
address by default; here everything binds and advertises 127.0.0.1 and auth is off (a
loopback-only laptop cluster). Nothing of this applies on Kubernetes, where KubeRay starts Ray.

Import this module **before** ``ray``: Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` (which
makes it advertise 127.0.0.1 instead of the interface address) once, when it is imported.
"""

from __future__ import annotations

import os

LOCAL_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "TOKENIZERS_PARALLELISM": "false",
    # Serve kills an HTTP proxy not ready within 5 s; on a busy laptop start-up takes longer.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


for _key, _value in LOCAL_ENV.items():
    os.environ.setdefault(_key, _value)

# What the node advertises; also where Ray's metrics agent listens (Ray's reporter agent binds
# the node's address when it is a loopback one, else every address).
NODE_IP = "127.0.0.1"
DEFAULT_METRICS_PORT = 8080  # Ray's metrics export port (deploy/prometheus/prometheus.yml)


def start_local_ray(*, num_cpus: int | None = None, num_gpus: int = 0,
                    metrics_export_port: int | None = DEFAULT_METRICS_PORT,
                    resources: dict[str, float] | None = None) -> None:
    """``ray.init`` on 127.0.0.1 with this process's environment passed to the workers.
    Ray's metrics (and the units' ``ray_specserve_*`` mirror) are served on
    ``metrics_export_port`` (None: Ray picks one)."""
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError("ray was imported before specserve.serve.local; it would advertise "
                           "a non-loopback address")
    ray.init(_node_ip_address=NODE_IP, num_cpus=num_cpus or os.cpu_count(), num_gpus=num_gpus,
             resources=resources,
             include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_export_port,
             runtime_env={"env_vars": {k: os.environ[k] for k in LOCAL_ENV}})


def start_serve(host: str = "127.0.0.1", port: int = 8000) -> None:
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, detached=False)


def stop_serve(app_name: str) -> None:
    """Stop the app, then Serve and this process's local Ray, without Ray reporting the stop
    as failures.

    Not ``serve.shutdown()``: Serve's controller kills itself there while calls of this
    process to it wait (``graceful_shutdown``, the long polls of its handles). The controller's
    calls are retried without limit, so this process's core worker reports each through the
    driver's error channel (which ``log_to_driver=False`` does not silence), as the yellow
    ``(raylet) Task ServeController.graceful_shutdown failed. There are infinite retries
    remaining ... killed by ray.kill``; then each fails for good and Serve ignores it.
    Deleting the app stops its replicas just as gracefully, and ``ray.shutdown()`` disconnects
    this process before it stops the cluster with Serve's actors in it: no call of ours waits
    on an actor that dies. Nothing else is silenced: an error still raises, and Ray's other
    messages still print."""
    import ray
    from ray import serve

    serve.delete(app_name)
    ray.shutdown()
