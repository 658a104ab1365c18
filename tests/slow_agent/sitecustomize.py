"""Put on ``PYTHONPATH`` by tests/test_ray_start.py: Python imports this module as it starts,
in every process of that test's Ray node. In a process whose command line holds a script named
in ``SPECSERVE_TEST_AGENT_DELAYS`` (``script=seconds,...``: Ray's agents, whose imports took
25-54 s on a busy 2-core machine) it waits that long first, and touches
``$SPECSERVE_TEST_AGENT_DELAYED.<n>`` (n: the script's place in the list) to say it did."""

import os
import time

_DELAYS = os.environ.get("SPECSERVE_TEST_AGENT_DELAYS")
if _DELAYS:
    with open("/proc/self/cmdline", "rb") as _cmdline:
        _argv = _cmdline.read()
    for _n, _entry in enumerate(_DELAYS.split(",")):
        _script, _seconds = _entry.rsplit("=", 1)
        if _script.encode() in _argv:
            open(f"{os.environ['SPECSERVE_TEST_AGENT_DELAYED']}.{_n}", "w").close()
            time.sleep(float(_seconds))
