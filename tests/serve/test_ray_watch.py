"""The server's watch on its Ray (:mod:`specserve.serve.ray_watch`) without a Ray: the words
of a death as Ray's logs state it, the start-again rule, the bounds from Ray's settings, and
the exit status and session kill on real processes. tests/serve/test_server_process.py kills
the Ray of real servers."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
from specserve.serve import ray_watch
from specserve.serve.ray_watch import (
    POLL_S,
    RAY_DEFAULTS,
    Death,
    cause,
    exit_status,
    kill_session,
    node_death_bound_s,
    ray_setting,
    raylet_health,
    retry_words,
    session_pids,
)

# As Ray 2.60 wrote them (a fresh clone's logs, and a port held by hand here).
GRPC_BIND = ("E1129 12:14:50.616161    3458 add_port.cc:83] Failed to add port to server: No "
             "address added out of total 1 resolved for '127.0.0.1:42875' (Error in bind for "
             "address '[::ffff:127.0.0.1]:42875': Address already in use)\n"
             "RuntimeError: Failed to bind to address 127.0.0.1:42875; set GRPC_VERBOSITY=debug "
             "environment variable to see detailed error message.\n")
AIOHTTP_BIND = ("OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', "
                "8080): address already in use\n")
AGENT_FAILED = ("[2026-11-29 12:14:50,833 E 3434 3459] (raylet) agent_manager.cc:87: The raylet "
                "exited immediately because one Ray agent failed, agent_name = dashboard_agent.\n")


def test_a_port_an_agent_could_not_bind_is_a_port_race(tmp_path):
    (tmp_path / "dashboard_agent.err").write_text(GRPC_BIND)
    (tmp_path / "raylet.out").write_text(AGENT_FAILED)
    assert cause(tmp_path, "raylet", "exited with status 1") == Death(
        "Ray's dashboard agent could not bind 127.0.0.1:42875 (in use)", port_race=True)
    (tmp_path / "dashboard_agent.err").unlink()
    (tmp_path / "runtime_env_agent.log").write_text(AIOHTTP_BIND)
    assert cause(tmp_path, "raylet", "exited with status 1") == Death(
        "Ray's runtime-env agent could not bind 127.0.0.1:8080 (in use)", port_race=True)


def test_other_deaths_name_what_ray_says(tmp_path):
    (tmp_path / "raylet.out").write_text(AGENT_FAILED)
    assert cause(tmp_path, "raylet", "exited with status 1") == Death(
        f"Ray's dashboard agent failed, and its raylet with it (see {tmp_path}/dashboard_agent.log)")
    (tmp_path / "raylet.out").write_text("... The node with node id: ab has been marked dead ...\n")
    assert cause(tmp_path, "raylet", "exited with status 1").words == (
        "the GCS marked Ray's node dead; its raylet exited with status 1")
    assert cause(None, "raylet", "was killed by SIGKILL") == Death("Ray's raylet was killed by SIGKILL")
    assert cause(tmp_path, "gcs_server", "exited with status 1") == Death(
        f"Ray's GCS server exited with status 1 (its log: {tmp_path}/gcs_server.out)")


@pytest.mark.parametrize(("start", "serving", "words"), [
    (1, False, "; starting again (try 2 of 3)"),
    (2, False, "; starting again (try 3 of 3)"),
    (3, False, "; gave up after 3 tries"),
    (1, True, ""),  # a serving server's Ray lost no race at start-up: it exits, never again
])
def test_a_port_race_starts_again_only_at_start_up_and_at_most_three_times(
        monkeypatch, start, serving, words):
    monkeypatch.setenv(ray_watch.TRY_ENV, str(start))
    race = Death("Ray's dashboard agent could not bind 127.0.0.1:1 (in use)", port_race=True)
    assert retry_words(race, serving) == words
    assert retry_words(Death("Ray's raylet was killed by SIGKILL"), serving) == ""


def test_the_defaults_are_rays_own():
    """The guardian imports no Ray: what it reads for each setting (``RAY_<name>``, else its
    copy of Ray's default) is what Ray reads, in this process's environment (where
    specserve.serve.local set some), for the settings Ray's Python exposes
    (``agent_register_timeout_ms`` it does not)."""
    from ray._raylet import Config

    for name in RAY_DEFAULTS:
        if hasattr(Config, name):
            assert getattr(Config, name)() == ray_setting(name), name


def test_the_death_bound_is_rays_own_health_checks(monkeypatch):
    """Ray's defaults: 5 checks, each 3 s after the last answer or 10 s without one (65 s),
    one period more for the watch's own look, and a poll. Set, they are what Ray reads."""
    assert node_death_bound_s() == pytest.approx(65 + 3 + POLL_S)
    for name, value in {"period_ms": "2000", "timeout_ms": "5000", "failure_threshold": "3"}.items():
        monkeypatch.setenv(f"RAY_health_check_{name}", value)
    assert node_death_bound_s() == pytest.approx(3 * 7 + 2 + POLL_S)


def test_exit_status_reads_a_zombie_and_leaves_it_to_its_owner():
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert exit_status(killed.pid) is None  # running
    killed.kill()
    _until(lambda: exit_status(killed.pid) is not None)
    assert exit_status(killed.pid) == "was killed by SIGKILL"
    assert killed.wait() == -signal.SIGKILL  # still the Popen's to reap
    assert exit_status(killed.pid) == "exited"  # reaped: gone
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    _until(lambda: exit_status(failed.pid) is not None)
    assert exit_status(failed.pid) == "exited with status 3" and failed.wait() == 3


def test_raylet_health_tells_silent_from_closed(monkeypatch):
    """A port that takes connections and never answers (what a stopped raylet's is: the
    kernel accepts for it) is ``silent``; a port nobody listens on is ``closed``."""
    monkeypatch.setenv("RAY_health_check_timeout_ms", "500")
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        port = mute.getsockname()[1]
        assert raylet_health(port) == "silent"
    assert raylet_health(port) == "closed"


def test_kill_session_leaves_nothing_of_the_session():
    """A session leader and its grandchild (what a raylet's workers are to the server)."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
         "'-c', 'import time; time.sleep(60)']); time.sleep(60)"], start_new_session=True)
    _until(lambda: len(session_pids(leader.pid)) == 2)
    assert kill_session(leader.pid) == 2
    leader.wait()
    _until(lambda: not session_pids(leader.pid))
    assert session_pids(leader.pid) == []


def _until(condition, bound_s: float = 60) -> None:
    """Poll ``condition`` (a bound against a hang, not a timing)."""
    deadline = time.monotonic() + bound_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
