"""Put on ``PYTHONPATH`` by tests/serve/test_ray_start.py: Python imports this module as it
starts, in every process of that test's Ray node. In Ray's dashboard agent alone it waits
``SPECSERVE_TEST_AGENT_DELAY_S`` seconds first (the agent's imports took 25-46 s on a busy
2-core machine) and touches ``SPECSERVE_TEST_AGENT_DELAYED`` to say it did."""

import os
import time

_DELAY_S = os.environ.get("SPECSERVE_TEST_AGENT_DELAY_S")
if _DELAY_S:
    with open("/proc/self/cmdline", "rb") as _cmdline:
        if b"dashboard/agent.py" in _cmdline.read():
            open(os.environ["SPECSERVE_TEST_AGENT_DELAYED"], "w").close()
            time.sleep(float(_DELAY_S))
