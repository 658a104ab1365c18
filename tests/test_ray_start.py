"""A local Ray node starts however slowly its agents do (issue 50).

Ray's raylet waits a fixed 15 s for its dashboard agent to report its ports, and 30 s
(``agent_register_timeout_ms``) for its runtime-env agent to answer, then gives up on the node:
what stopped `specserve serve` (and the lifecycle tests) on a busy 2-core machine, where
those Python processes took 25-150 s to import. specserve.serve.local chooses the agents'
ports before Ray starts (no file to wait for) and gives the runtime-env agent five minutes.
(It also prestarts no workers for the first driver, whose registration Ray holds until they
register: seen hung once under load, not reproduced here.)
Here a real node's agents are held longer than Ray's own waits (a ``sitecustomize`` in
tests/slow_agent), and the node must come up and run a task, which needs the runtime-env
agent (the workers get their environment through it).

Its own xdist group (it uses none of tests/serve's apps): it starts its Ray in a subprocess.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from specserve.serve.local import LOCAL_ENV

SLOW_AGENT = Path(__file__).parent / "slow_agent"
# Each beyond Ray's own wait for it: 15 s for the dashboard agent's port file, 30 s for the
# runtime-env agent (Ray's default agent_register_timeout_ms on Linux).
AGENT_DELAYS = {"dashboard/agent.py": 20, "runtime_env/agent/main.py": 35}
START = ("from specserve.serve.local import start_local_ray\n"
         "start_local_ray(num_cpus=1, metrics_export_port=None)\n"
         "import ray\n"
         "print('a task ran:', ray.get(ray.remote(lambda: 1).remote()))\n")
# A bound against a hang: past the agents' delays the node waits on nothing, but a busy
# machine is slow at everything.
BOUND_S = 10 * 60


def test_a_node_comes_up_while_its_agents_are_slower_than_rays_waits(tmp_path):
    assert int(LOCAL_ENV["RAY_agent_register_timeout_ms"]) > 1000 * AGENT_DELAYS["runtime_env/agent/main.py"]
    delayed = tmp_path / "delayed"
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    path = os.pathsep.join(filter(None, [str(SLOW_AGENT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "RAY_TMPDIR": ray_tmp,
           "SPECSERVE_TEST_AGENT_DELAYS": ",".join(f"{k}={v}" for k, v in AGENT_DELAYS.items()),
           "SPECSERVE_TEST_AGENT_DELAYED": str(delayed)}
    env.pop("RAY_agent_register_timeout_ms", None)  # the default under test
    env.pop("RAY_prestart_worker_first_driver", None)
    try:
        run = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True,
                             text=True, timeout=BOUND_S)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run.returncode == 0 and "a task ran: 1" in run.stdout, run.stdout + run.stderr[-3000:]
    assert all(Path(f"{delayed}.{n}").exists() for n in range(len(AGENT_DELAYS)))  # the premise
