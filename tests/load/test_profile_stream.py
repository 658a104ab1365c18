"""The pure parts of ``load/profile_stream.py``: each process's CPU time and its role.

No server: this process and a child of it stand in for the server's processes.
"""

from __future__ import annotations

import subprocess
import sys
import time

from load import profile_stream as ps


def test_a_process_cpu_time_counts_its_work_and_a_gone_one_counts_zero():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ninput()"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while ps.cpu_s(child.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ps.cpu_s(child.pid) >= 0.25  # its busy loop, in whole clock ticks
    finally:
        child.communicate(b"\n")
    assert ps.cpu_s(child.pid) == 0.0  # reaped: nothing to read


def test_roles_come_from_the_command_line(monkeypatch):
    lines = {1: "ray::TargetRank.step", 2: "ray::ServeReplica:specserve:SpeculationUnit",
             3: "ray::ServeReplica:specserve:OpenAIIngress", 4: "ray::ProxyActor",
             5: "/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --x",
             6: "/venv/bin/python -m specserve.serve.ray_watch 12", 7: "/venv/bin/specserve serve",
             8: "ray::IDLE", 9: "", 10: "ray::MetricsHub", 11: "ray::DashboardAgent",
             12: "/venv/bin/python -u /venv/lib/python3.11/site-packages/ray/_private/log_monitor.py"}
    monkeypatch.setattr(ps, "cmdline", lines.get)
    assert [ps.role(pid) for pid in lines] == [
        "target rank (the forward)", "unit replica (and an in-unit target)",
        "ingress replica (and a unit in it)", "Serve proxy", "Ray GCS", "guardian",
        "server and supervisor", "other Ray processes", "other Ray processes",
        "metrics hub (an actor)", "Ray dashboard and agents", "Ray log monitor"]
