"""A local Ray node starts however slowly its dashboard agent does (issue 50).

Ray's raylet used to wait a fixed 15 s for the agent to report its ports and then abort the
node, which is what stopped `specserve serve` (and the lifecycle tests) on a busy 2-core
machine; specserve.serve.local now chooses those ports before Ray starts. Here the agent of a
real node is held longer than that wait (a ``sitecustomize`` in tests/serve/slow_agent) and the
node must come up and run a task.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SLOW_AGENT = Path(__file__).parent / "slow_agent"
AGENT_DELAY_S = 20  # longer than the raylet's fixed 15 s
START = ("from specserve.serve.local import start_local_ray\n"
         "start_local_ray(num_cpus=1, metrics_export_port=None)\n"
         "import ray\n"
         "print('a task ran:', ray.get(ray.remote(lambda: 1).remote()))\n")
# A bound against a hang: the node's start waits on nothing of the agent's now, but a busy
# machine is slow at everything.
BOUND_S = 10 * 60


def test_a_node_comes_up_while_its_dashboard_agent_is_slower_than_rays_wait(tmp_path):
    delayed = tmp_path / "agent-delayed"
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    path = os.pathsep.join(filter(None, [str(SLOW_AGENT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "RAY_TMPDIR": ray_tmp,
           "SPECSERVE_TEST_AGENT_DELAY_S": str(AGENT_DELAY_S),
           "SPECSERVE_TEST_AGENT_DELAYED": str(delayed)}
    try:
        run = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True,
                             text=True, timeout=BOUND_S)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run.returncode == 0 and "a task ran: 1" in run.stdout, run.stdout + run.stderr[-3000:]
    assert delayed.exists()  # the premise: the agent was held
