"""The guardian of a ``specserve serve`` server: a dead Ray, or a dead supervisor, ends it.

``specserve serve`` starts Ray in its own process (:mod:`specserve.serve.local`): the GCS
server and the raylet are its children, Ray's agents and workers theirs, all in the server's
process session. Nothing of Ray's ends the server when that Ray dies: ``ray.init`` has often
returned by then, ``serve.run`` reports the app ready on a dead node, and the server waited
for a signal for ever, serving nothing (docs/RELIABILITY.md, "Ray's death").

The watch cannot be a thread of the server. Ray's calls hold the interpreter lock while they
wait on a raylet that hangs (seen here: a raylet stopped during ``serve.start``, and the
server's every other thread stood still), and a signal's Python handler waits for the same
lock. So the watch is a small process of its own, the **guardian**: the server's child, in its
session, started before Ray, with no Ray in it. It reads what the server tells it on a pipe
(:class:`Lifeline`: Ray is up, serving, standing down) and looks, every
:data:`POLL_S`, at:

- **Ray's processes.** The GCS server and the raylet, the server's children, read in /proc: an
  exited one waits there as a zombie with its exit status. The raylet fate-shares with its
  agents, so an agent that fails (a port it could not bind) ends the raylet too, at once.
- **The raylet's answers.** A raylet that hangs does not exit. The guardian asks it the gRPC
  health check the GCS asks, with the GCS's settings (``health_check_period_ms``,
  ``health_check_timeout_ms``, ``health_check_failure_threshold``), and calls it dead when the
  GCS would.
- **The start-up.** Ray must be up within the sum of Ray's own registration waits
  (:func:`startup_bound_s`).
- **The supervisor.** When it dies, the server gets SIGTERM (``PR_SET_PDEATHSIG``) and drains;
  one that does not serve yet is ended at once, one that does gets its drain and the
  node-death bound.
- **The server.** When it exits, whatever of its session is left is killed.

On a death the guardian prints one line naming the cause as Ray's logs state it
(:func:`cause`), writes the exit status it chose where the supervisor asked for it
(:data:`VERDICT_ENV`), and kills the whole session, the server included: :data:`RETRY_EXIT`
where the cause is a port that another process took between its choice and its bind, at
start-up (the supervisor starts the server again, at most :data:`START_TRIES` times in all),
1 otherwise.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.serve.ports import parent, proc_stat

POLL_S = 0.5  # how often the guardian looks: /proc reads, a few a second
RETRY_EXIT = 75  # EX_TEMPFAIL: "try again" (the supervisor starts the server again)
START_TRIES = 3  # starts of a server whose Ray lost a port race, at most
TRY_ENV = "SPECSERVE_START_TRY"  # which start this is ("2"), set by the supervisor
VERDICT_ENV = "SPECSERVE_VERDICT"  # a file for the exit status the guardian chose
WATCHED = ("gcs_server", "raylet")  # the server's children whose exit is Ray's death
# The agents, by the names of their logs, as a line names them.
AGENT_WORDS = {"dashboard_agent": "Ray's dashboard agent",
               "runtime_env_agent": "Ray's runtime-env agent"}


def node_death_bound_s() -> float:
    """How long Ray may take to find its node dead, from its own settings, plus one look of
    ours: ``health_check_failure_threshold`` checks, each ``health_check_period_ms`` after the
    last answer or ``health_check_timeout_ms`` without one, then one period more (68.5 s with
    Ray's defaults). A process that exits is seen within :data:`POLL_S`."""
    period, timeout = ray_setting("health_check_period_ms"), ray_setting("health_check_timeout_ms")
    checks_ms = ray_setting("health_check_failure_threshold") * (period + timeout)
    return (checks_ms + period) / 1000 + POLL_S


def startup_bound_s() -> float:
    """How long ``ray.init`` may take on a live node, from Ray's own waits: the GCS connection
    (``py_gcs_connect_timeout_s``), the agents' registration (``agent_register_timeout_ms``)
    and the first workers' (``worker_register_timeout_seconds``), then the node-death bound."""
    return (ray_setting("py_gcs_connect_timeout_s") + ray_setting("agent_register_timeout_ms") / 1000
            + ray_setting("worker_register_timeout_seconds") + node_death_bound_s())


# Ray 2.60's defaults (ray_config_def.h), read as Ray reads them: RAY_<name> overrides each.
RAY_DEFAULTS = {"health_check_period_ms": 3000, "health_check_timeout_ms": 10000,
                "health_check_failure_threshold": 5, "py_gcs_connect_timeout_s": 30,
                "agent_register_timeout_ms": 30000, "worker_register_timeout_seconds": 60}


def ray_setting(name: str) -> int:
    """A Ray setting as a Ray process started now reads it: ``RAY_<name>``, else Ray's default
    (the guardian imports no Ray; tests/serve/test_ray_watch.py holds these to Ray's own)."""
    return int(os.environ.get(f"RAY_{name}") or RAY_DEFAULTS[name])


@dataclass(frozen=True)
class Death:
    """What ended Ray, as one clause (``Ray's raylet was killed by SIGKILL``); ``port_race``
    where another process held a port Ray had been given (starting again may succeed)."""

    words: str
    port_race: bool = False


class Lifeline:
    """The server's end: starts its guardian, and tells it what it could not see itself."""

    def __init__(self, drain_timeout_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.serve.ray_watch", str(os.getpid()),
             str(os.getppid()), str(drain_timeout_s)], stdin=subprocess.PIPE)

    def ray_up(self) -> None:
        self._tell("ray-up")

    def serving(self) -> None:
        self._tell("serving")

    def stand_down(self) -> None:
        """The server stops Ray itself from here on: nothing that follows is a death."""
        self._tell("stand-down")

    def failed(self, exc: BaseException) -> None:
        """Ray's start-up raised. The guardian ends the server with the death behind it where
        one shows within a few looks (the raylet may still be exiting), else with the
        exception's first line. Never returns."""
        first = (str(exc).strip().splitlines() or [""])[0]
        line = f"specserve: error: the start-up failed: {type(exc).__name__}: {first}"
        if self._tell(f"failed {line}"):
            time.sleep(20 * POLL_S)  # (the guardian kills this process meanwhile)
        print(line, file=sys.stderr, flush=True)
        os._exit(1)

    def _tell(self, line: str) -> bool:
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError):  # the guardian is gone
            return False


class Guardian:
    """The loop of the guardian process (see the module's docstring)."""

    def __init__(self, server: int, supervisor: int, drain_timeout_s: float) -> None:
        self.server, self.supervisor, self.drain_timeout_s = server, supervisor, drain_timeout_s
        self.started_at = time.monotonic()
        self.port: int | None = None  # the raylet's gRPC port (its command line's)
        self.up = False  # ray.init has returned
        self.failed: tuple[float, str] | None = None  # when the start-up raised, and its line
        self.serving = self.standing_down = False
        self.orphaned_at: float | None = None
        self.answered = False  # whether the raylet has answered a health check yet
        self.missed = 0  # health checks it missed in a row since
        self.checked_at = 0.0
        self._pids: dict[str, int] = {}  # WATCHED name -> pid, once seen
        self._logs: Path | None = None

    def run(self) -> int:
        while True:
            if not self._read(POLL_S) or not _alive(self.server):  # the server has exited
                self._server_gone()
            if self.standing_down:
                continue
            death = self._dead_process() or self._hung() or self._late()
            if death is not None:
                self._end(death)
            if self.failed and time.monotonic() - self.failed[0] > 4 * POLL_S:
                self._end_session(self.failed[1], 1)  # no death behind the start-up's error
            self._orphaned()

    def _server_gone(self) -> None:
        """The server exited: of itself (stopped, or ended by Ray's core worker, which exits
        its process when the raylet stops answering it) or killed. What is left of the
        session goes; an exit it did not announce is said, with its Ray's state."""
        deadline = time.monotonic() + node_death_bound_s()  # the pipe closes as it exits
        while _alive(self.server) and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
        if self.standing_down or self.failed:
            self._end_session(None, None)  # (a stop or its own error: its status stands)
        health = raylet_health(self.port) if self.port else "unknown"
        death = self._dead_process() or (None if health in ("ok", "unknown") else Death(
            f"Ray's raylet does not answer its health check ({health})"))
        self._end_session("specserve: error: the server exited unexpectedly" +
                    (f"; {death.words}" if death else ""), 1)

    def _read(self, wait_s: float) -> bool:
        """The server's lines, waiting at most ``wait_s``; False at the pipe's end."""
        ready, _, _ = select.select([sys.stdin.buffer], [], [], wait_s)
        if not ready:
            return True
        data = os.read(sys.stdin.fileno(), 4096)
        for line in data.decode().splitlines():
            word, _, arg = line.partition(" ")
            self.up |= word == "ray-up"
            if word == "failed":
                self.failed = (time.monotonic(), arg)
            self.serving |= word == "serving"
            self.standing_down |= word == "stand-down"
        return bool(data)

    def _dead_process(self) -> Death | None:
        """The first WATCHED process that has exited, as its death; None while all live."""
        if len(self._pids) < len(WATCHED):
            for pid, name in children(self.server):
                if name in WATCHED and name not in self._pids:
                    self._pids[name] = pid
                    self._logs = self._logs or log_dir(pid)
                    self.port = self.port or (flag(pid, "node_manager_port") if name == "raylet" else None)
        for name, pid in self._pids.items():
            status = exit_status(pid)
            if status is not None:
                return cause(self._logs, name, status)
        return None

    def _hung(self) -> Death | None:
        """The raylet's health check, as the GCS asks it: dead after the threshold of misses
        in a row."""
        period_s = ray_setting("health_check_period_ms") / 1000
        if not self.port or time.monotonic() - self.checked_at < period_s:
            return None
        health = raylet_health(self.port)
        self.answered |= health == "ok"
        # A miss counts where the raylet's port takes connections and it does not answer, or
        # once it has answered: a closed port before that is a raylet still starting.
        counts = health == "silent" or (health == "closed" and self.answered)
        self.missed = self.missed + 1 if counts else 0
        self.checked_at = time.monotonic()
        if self.missed < ray_setting("health_check_failure_threshold"):
            return None
        return Death(f"Ray's raylet did not answer {self.missed} health checks in a row (hung)")

    def _late(self) -> Death | None:
        if not self.up and time.monotonic() - self.started_at > startup_bound_s():
            return Death(f"Ray's node did not come up in {startup_bound_s():.0f} s (the sum of "
                         "Ray's own registration waits)")
        return None

    def _orphaned(self) -> None:
        """The supervisor gone: a server that does not serve yet has nothing to drain; one that
        does gets its drain and the node-death bound to stop."""
        if self.orphaned_at is None and parent(self.server) != self.supervisor:
            self.orphaned_at = time.monotonic()
        if self.orphaned_at is None:
            return
        if not self.serving:
            self._end_session("specserve: stopped: its supervisor died before it served", 1)
        if time.monotonic() - self.orphaned_at > self.drain_timeout_s + node_death_bound_s():
            self._end(Death("the server did not stop after its supervisor died"))

    def _end(self, death: Death) -> None:
        retry = death.port_race and not self.serving and start_try() < START_TRIES
        self._end_session(f"specserve: error: {death.words}{retry_words(death, self.serving)}",
                          RETRY_EXIT if retry else 1)

    def _end_session(self, line: str | None, code: int | None) -> None:
        """Print ``line`` (if any), leave ``code`` where the supervisor reads it (None: the
        server's own exit status stands), kill every other process of this session (the
        server, Ray's GCS, raylet, agents and workers), and exit. With no supervisor left to
        read it, the file is removed instead."""
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        verdict = os.environ.get(VERDICT_ENV)
        if verdict and not _alive(self.supervisor):
            Path(verdict).unlink(missing_ok=True)
        elif verdict and code is not None:
            Path(verdict).write_text(str(code))
        kill_session(os.getsid(0), but=os.getpid())
        os._exit(code or 0)


def retry_words(death: Death, serving: bool) -> str:
    """What the supervisor does next, as the end of a death's line."""
    if not death.port_race or serving:
        return ""
    if start_try() < START_TRIES:
        return f"; starting again (try {start_try() + 1} of {START_TRIES})"
    return f"; gave up after {START_TRIES} tries"


def start_try() -> int:
    """Which start of the server this is (1 unless the supervisor started it again)."""
    return int(os.environ.get(TRY_ENV, "1"))


def raylet_health(port: int) -> str:
    """``ok`` where the raylet on ``port`` answers the gRPC health check (``grpc.health.v1``,
    the one the GCS asks) within ``health_check_timeout_ms``; ``silent`` where its port takes
    the connection and nothing answers (a hung raylet: the kernel accepts for it); ``closed``
    where nothing listens (a raylet not started yet, or gone)."""
    import socket

    import grpc

    timeout_s = ray_setting("health_check_timeout_ms") / 1000
    try:
        socket.create_connection(("127.0.0.1", port), timeout=timeout_s).close()
    except OSError:
        return "closed"
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=bytes, response_deserializer=bytes)
        try:
            return "ok" if check(b"", timeout=timeout_s) == SERVING else "silent"
        except grpc.RpcError:
            return "silent"


SERVING = b"\x08\x01"  # HealthCheckResponse{status: SERVING}, serialized


def kill_session(sid: int, but: int | None = None) -> int:
    """SIGKILL every process of session ``sid`` (but ``but``); how many there were."""
    pids = [pid for pid, stat in _stats() if stat[3] == sid and pid != but]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (zombies excluded: they have exited)."""
    return [pid for pid, stat in _stats() if stat[3] == sid and stat[0] != "Z"]


def children(ppid: int) -> list[tuple[int, str]]:
    """(pid, name) of the children of ``ppid``, those that have exited and wait to be reaped
    included (a raylet killed at once is one)."""
    return [(pid, stat.comm) for pid, stat in _stats() if stat.ppid == ppid]


def _alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def _stats() -> list[tuple[int, tuple]]:
    """(pid, :func:`~specserve.serve.ports.proc_stat`) of every process."""
    found = []
    for entry in os.scandir("/proc"):
        stat = proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None:
            found.append((int(entry.name), stat))
    return found


def exit_status(pid: int) -> str | None:
    """How process ``pid`` ended (``was killed by SIGKILL``, ``exited with status 1``), read
    from its zombie; ``exited`` once reaped; None while it runs."""
    stat = proc_stat(pid)
    if stat is None:
        return "exited"
    if stat[0] != "Z":
        return None
    status = stat[4]
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def log_dir(pid: int) -> Path | None:
    """The session's log folder, from a Ray process's ``--log_dir=`` flag."""
    value = flag(pid, "log_dir")
    return Path(value) if value else None


def flag(pid: int, name: str):
    """The value of ``--NAME=`` on process ``pid``'s command line (an int where it is one),
    or None."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    value = next((a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")), None)
    return int(value) if value and value.isdigit() else value


# A port an agent could not bind, as gRPC (``Failed to bind to address 127.0.0.1:36653``) and
# aiohttp (``[Errno 98] error while attempting to bind on address ('127.0.0.1', 8080)``) say it.
_BIND_FAILED = (re.compile(r"Failed to bind to address (\S+?:\d+)"),
                re.compile(r"Errno 98\][^(]*\('([^']+)', (\d+)\)"))
_AGENT_FAILED = re.compile(r"raylet exited immediately because one Ray agent failed, "
                           r"agent_name = (\w+)")
_MARKED_DEAD = "has been marked dead"


def cause(logs: Path | None, name: str, status: str) -> Death:
    """Why the WATCHED process ``name`` ended, as Ray's logs in ``logs`` state it, else its
    exit ``status``: an agent's port taken (a port race), an agent that failed, a node the
    GCS marked dead."""
    process = "GCS server" if name == "gcs_server" else "raylet"
    if logs is not None and name == "raylet":
        for agent, words in AGENT_WORDS.items():
            address = _bind_failure(logs, agent)
            if address:
                return Death(f"{words} could not bind {address} (in use)", port_race=True)
        raylet_out = _read(logs / "raylet.out")
        failed = _AGENT_FAILED.search(raylet_out)
        if failed:
            agent = AGENT_WORDS.get(failed[1], f"Ray's {failed[1]}")
            return Death(f"{agent} failed, and its raylet with it (see {logs / failed[1]}.log)")
        if _MARKED_DEAD in raylet_out:
            return Death(f"the GCS marked Ray's node dead; its raylet {status}")
    return Death(f"Ray's {process} {status}" + (f" (its log: {logs / (name + '.out')})"
                                                 if logs is not None and "status" in status else ""))


def _bind_failure(logs: Path, agent: str) -> str | None:
    for suffix in ("err", "log", "out"):
        text = _read(logs / f"{agent}.{suffix}")
        for pattern in _BIND_FAILED:
            found = pattern.search(text)
            if found:
                return ":".join(found.groups())
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def main(argv: list[str]) -> int:
    """``python -m specserve.serve.ray_watch SERVER_PID SUPERVISOR_PID DRAIN_TIMEOUT_S``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the supervisor's to hand on
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server, supervisor, drain_timeout_s = int(argv[0]), int(argv[1]), float(argv[2])
    return Guardian(server, supervisor, drain_timeout_s).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
