"""Put on ``PYTHONPATH`` by tests/serve/test_server_process.py: Python imports this module as
it starts, in every process of that test's server. In the server itself (``specserve.cli
serve`` with ``SPECSERVE_SERVER=1``), on the starts listed in ``SPECSERVE_TEST_HELD_TRIES``
(``1,2``), Ray's dashboard agent is given ``SPECSERVE_TEST_HELD_PORT`` for its gRPC server: a
port the test holds, as another process did between the server's choice and the agent's bind
in a fresh clone's suite (docs/RELIABILITY.md, "Ray's death"). Everything after the choice is
Ray's own: the agent fails to bind, and the raylet, which fate-shares with it, exits."""

import os

_PORT = os.environ.get("SPECSERVE_TEST_HELD_PORT")
if _PORT and os.environ.get("SPECSERVE_SERVER") == "1" and os.environ.get(
        "SPECSERVE_START_TRY", "1") in os.environ.get("SPECSERVE_TEST_HELD_TRIES", "").split(","):
    with open("/proc/self/cmdline", "rb") as _cmdline:
        _argv = _cmdline.read().split(b"\0")
    if b"specserve.cli" in _argv and b"serve" in _argv:
        from specserve.serve import local

        _choose = local.agent_ports

        def _held_first(count: int, *args, **kwargs) -> list[int]:
            ports = _choose(count, *args, **kwargs)
            ports[local.AGENT_PORTS.index("metrics_agent_port")] = int(_PORT)
            return ports

        local.agent_ports = _held_first
