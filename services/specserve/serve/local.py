"""A local Ray cluster for ``make serve`` and the tests: in-process, loopback only.

Ray 2.60 enables token auth for local clusters and advertises the machine's interface
address by default; here everything binds and advertises 127.0.0.1 and auth is off (a
loopback-only laptop cluster). Nothing of this applies on Kubernetes, where KubeRay starts Ray.

Import this module **before** ``ray``: Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` (which
makes it advertise 127.0.0.1 instead of the interface address) once, when it is imported.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket

LOCAL_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "TOKENIZERS_PARALLELISM": "false",
    # Serve kills an HTTP proxy not ready within 5 s; on a busy laptop start-up takes longer.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    # The raylet exits when its runtime-env agent (a Python process, which every worker's
    # start goes through) does not answer within this; on a busy machine the agent's imports
    # alone can outlast Ray's default of 30 s. Its ports: _local_params.
    "RAY_agent_register_timeout_ms": "300000",
    # Ray holds the first driver's registration until the workers it prestarts for it have
    # registered; on a busy machine, behind a late runtime-env agent, they can fail to, and
    # `specserve serve` then waits for ever. No prestart (the first tasks start their
    # workers), and a worker gets five minutes to register.
    "RAY_prestart_worker_first_driver": "0",
    "RAY_worker_register_timeout_seconds": "300",
}

# What a serving cluster (`specserve serve`) adds. Serve's controller runs its control loop
# every 0.1 s by default: on a 2-core machine it and the GCS it calls took 65 ms of CPU a
# second, idle or not, from the cores the forward runs on, where each millisecond of it delays
# a token by about one (docs/BENCHMARKS.md, "Ray's background CPU"). Every 0.5 s: 31 ms a
# second less, and Serve reacts to a replica's start, death or load within half a second, not
# a tenth. Not for the tests' shared cluster, which deploys and deletes dozens of apps: each
# waits on the controller's loop (session 49 measured 1-1.5 s more a start, 1-2 s a stop).
SERVING_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


for _key, _value in LOCAL_ENV.items():
    os.environ.setdefault(_key, _value)

# What the node advertises; also where Ray's metrics agent listens (Ray's reporter agent binds
# the node's address when it is a loopback one, else every address).
NODE_IP = "127.0.0.1"
DEFAULT_METRICS_PORT = 8080  # Ray's metrics export port (deploy/prometheus/prometheus.yml)


def start_local_ray(*, num_cpus: int | None = None, num_gpus: int = 0,
                    metrics_export_port: int | None = DEFAULT_METRICS_PORT,
                    resources: dict[str, float] | None = None,
                    env: dict[str, str] | None = None) -> None:
    """``ray.init`` on 127.0.0.1 with this process's environment passed to the workers, and
    ``env`` (:data:`SERVING_ENV`, say) where this process does not set those already.
    Ray's metrics (and the units' ``ray_specserve_*`` mirror) are served on
    ``metrics_export_port`` (None: Ray picks one)."""
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError("ray was imported before specserve.serve.local; it would advertise "
                           "a non-loopback address")
    for key, value in (env or {}).items():
        os.environ.setdefault(key, value)  # the raylet, and the workers it starts, inherit it
    with _local_params():
        ray.init(_node_ip_address=NODE_IP, num_cpus=num_cpus or os.cpu_count(),
                 num_gpus=num_gpus, resources=resources, include_dashboard=False,
                 log_to_driver=False, _metrics_export_port=metrics_export_port,
                 runtime_env={"env_vars": {k: os.environ[k] for k in [*LOCAL_ENV, *(env or {})]}})


# The ports Ray's agents would pick themselves and report through a file in the session
# directory (``RayParams`` names; ``ray start``'s ``--dashboard-agent-grpc-port`` etc. set them),
# and the raylet's own gRPC port, which it would pick and report to no file: given, it is on
# the raylet's command line, where the server's guardian reads it to ask the raylet's health
# (specserve.serve.ray_watch). The metrics export port is the caller's where it gives one
# (``--metrics-port``).
AGENT_PORTS = ("metrics_agent_port", "dashboard_agent_listen_port", "runtime_env_agent_port",
               "metrics_export_port", "node_manager_port")


@contextlib.contextmanager
def _local_params():
    """``ray.init`` with its agents' ports chosen here, before Ray starts, and given to the
    raylet, so that it does not wait for the agents to report them; and without Ray's log
    monitor.

    The log monitor is a Python process that looks for new lines in every worker's log files
    ten times a second, to publish them to drivers (``log_to_driver``, off here) and the
    dashboard (not started here): nothing here reads what it publishes, and it took 13 ms of
    CPU a second, from the cores the forward runs on (docs/BENCHMARKS.md, "Ray's background
    CPU"). The workers' log files are written as before (``/tmp/ray/session_latest/logs``).

    Left to Ray, each agent binds port 0 (or its default) and writes the port it got to a file
    in the session directory, and the raylet waits for each file for a fixed 15 s
    (``WaitForPersistedPort``'s default in Ray 2.60, which no setting changes;
    ``agent_register_timeout_ms`` is another wait), then aborts the node: "The current node
    timed out during startup". The dashboard agent is a Python process whose imports alone
    can take longer than that on a busy machine (docs/RELIABILITY.md, "Tests that do not
    depend on the machine's speed"). Given the ports, the raylet does not wait: the agent
    registers when it is up.

    ``ray.init`` has no argument for these ports (``ray start`` has three of them), and Ray's
    Python never passes the raylet its ``--dashboard_agent_listen_port`` (it has the flag),
    so both are added here, for this call only: ``RayParams`` gets free ports, and the raylet's
    command line the agent's listen port, read from the agent's own command line in it. The
    ports are outside the range the kernel hands out (:func:`agent_ports`); one taken in
    between all the same ends the raylet, and the server is started again (its guardian,
    :mod:`specserve.serve.ray_watch`)."""
    from ray._private import parameter, ray_constants, services

    original_params, original_start = parameter.RayParams, services.start_ray_process

    class LocalParams(original_params):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for name, port in zip(AGENT_PORTS, agent_ports(len(AGENT_PORTS))):
                if name != "metrics_export_port" or self.metrics_export_port is None:
                    setattr(self, name, port)
            self.include_log_monitor = False

    def start_ray_process(command, process_type, *args, **kwargs):
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            command = [*command, *_listen_port_flag(command)]
        return original_start(command, process_type, *args, **kwargs)

    parameter.RayParams, services.start_ray_process = LocalParams, start_ray_process
    try:
        yield
    finally:
        parameter.RayParams, services.start_ray_process = original_params, original_start


def _listen_port_flag(raylet_command: list[str]) -> list[str]:
    """``--dashboard_agent_listen_port=N`` for a raylet whose dashboard agent is told
    ``--listen-port=N`` (none where the raylet has it already or the agent has no such flag)."""
    if any(arg.startswith("--dashboard_agent_listen_port=") for arg in raylet_command):
        return []
    agent = next((arg for arg in raylet_command if arg.startswith("--dashboard_agent_command=")),
                 "")
    port = re.search(r"--listen-port=(\d+)", agent)
    return [f"--dashboard_agent_listen_port={port.group(1)}"] if port else []


# Below this: Ray's workers' ports (10002-19999 unless set) and its fixed ones (6379, 8265...).
AGENT_PORTS_FROM = 20000


def agent_ports(count: int, tries: int = 200) -> list[int]:
    """``count`` distinct ports free on the loopback now, at random between
    :data:`AGENT_PORTS_FROM` and the kernel's ephemeral range. A process that binds port 0
    (Ray's own gRPC servers and workers, any client) is never handed one of these; a port the
    kernel had handed out here was, between this choice and the agent's bind: a fresh clone's
    suite saw the dashboard agent of one Ray cluster fail on a port another cluster's process
    had just been given (docs/RELIABILITY.md, "Ray's death"). Where that range is narrow (a
    machine that set ``ip_local_port_range`` wide), the kernel's free ports, as before."""
    from specserve.serve.ports import bind_error

    candidates = range(AGENT_PORTS_FROM, _ephemeral_low())
    chosen: list[int] = []
    rng = random.SystemRandom()
    for _ in range(tries if len(candidates) >= 1000 else 0):
        port = rng.choice(candidates)
        if port not in chosen and bind_error(NODE_IP, port) is None:
            chosen.append(port)
        if len(chosen) == count:
            return chosen
    return free_ports(count)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return AGENT_PORTS_FROM  # unknown: no range of our own


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on the loopback now (held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind((NODE_IP, 0))
        return [s.getsockname()[1] for s in socks]


def start_serve(host: str = "127.0.0.1", port: int = 8000) -> None:
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, detached=False)


def stop_serve(app_name: str, before_shutdown=lambda: None) -> None:
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
    messages still print. ``before_shutdown`` runs between the two (the server's guardian
    stands down there: Ray's exit from here on is no death)."""
    import ray
    from ray import serve

    serve.delete(app_name)
    before_shutdown()
    ray.shutdown()
