"""Whether the ports a local ``specserve serve`` listens on are free, and who holds one that
is not: checked before Ray starts, so a taken port is one line of ours instead of Ray's
start-up dying 30 s later.

Two ports matter. The HTTP port (``--port``) is bound by Serve's proxy; the metrics port
(``--metrics-port``) by Ray's dashboard agent, whose death then takes the raylet with it
(the node "timed out during startup"). The probe binds each the way its owner does, with
``SO_REUSEADDR``: a connection in TIME_WAIT does not make a port taken, an active listener
does. It sets no ``SO_REUSEPORT``, which Serve's proxy does set: a second proxy on the same
port would otherwise bind beside the first and the kernel would split the requests between
two servers.

Who holds a port is read from /proc (Linux): the listening socket's inode in
``/proc/net/tcp{,6}``, the process whose ``/proc/PID/fd`` links to it. A Ray worker is named
with the process that started its cluster, which is the one a user recognises.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import NamedTuple

from specserve.errors import SpecServeError

LISTEN = "0A"  # a socket's state in /proc/net/tcp: TCP_LISTEN


class PortInUse(SpecServeError):
    """A port that ``specserve serve`` needs is taken or cannot be bound."""


def bind_error(host: str, port: int) -> OSError | None:
    """Why ``port`` cannot be listened on at ``host`` (None: it can)."""
    with socket.socket(address_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
    return None


def address_family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET  # as Serve's proxy chooses


def require_free(flag: str, host: str, port: int) -> None:
    """Raise :class:`PortInUse` naming ``flag`` when ``port`` cannot be listened on at ``host``:
    ``--port 8000 on 127.0.0.1 is in use (pid 1234: ...); pick another with --port``."""
    exc = bind_error(host, port)
    if exc is None:
        return
    if exc.errno == errno.EADDRINUSE:
        raise PortInUse(f"{flag} {port} on {host} is in use ({holder_words(port)}); "
                        f"pick another with {flag}")
    raise PortInUse(f"{flag} {port} on {host} cannot be listened on: {exc.strerror}")


def first_free(host: str, start: int, tries: int = 20) -> int:
    """The first port from ``start`` on that is free at ``host`` (a neighbour of a default is
    easier to find than a random one); else one the kernel picks."""
    for port in range(start, start + tries):
        if bind_error(host, port) is None:
            return port
    with socket.socket(address_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def holder_words(port: int) -> str:
    """``pid N: command`` of the process listening on ``port``, or why it is not known."""
    pid = port_holder(port)
    if pid is None:
        return "the process holding it is not visible here"
    words = f"pid {pid}: {command(pid)}"
    starter = cluster_starter(pid)
    if starter is not None:
        words += f", in the Ray cluster of pid {starter}: {command(starter)}"
    return words


def port_holder(port: int) -> int | None:
    """The pid of a process listening on TCP ``port`` (any address), where /proc tells."""
    inodes = listening_inodes(port)
    if not inodes:
        return None
    links = {f"socket:[{inode}]" for inode in inodes}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if any(_link(f"/proc/{pid}/fd/{fd}") in links for fd in _listdir(f"/proc/{pid}/fd")):
            return pid
    return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # another user's process, or one gone meanwhile
        return []


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:  # an fd closed meanwhile (listing the fds opens and closes one)
        return None


def listening_inodes(port: int) -> set[str]:
    """Inodes of the listening TCP sockets on ``port``, from /proc/net/tcp and tcp6.

    A line reads ``sl local_address rem_address st ... inode``, the address in hex:
    ``0: 0100007F:1F90 00000000:0000 0A ... 123456`` is 127.0.0.1:8080, listening."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        inodes |= {row[9] for row in rows
                   if row[3] == LISTEN and int(row[1].rsplit(":", 1)[1], 16) == port}
    return inodes


def command(pid: int, width: int = 80) -> str:
    """A process's command line, shortened: no interpreter, no directories on the program
    (``/venv/bin/python -m specserve.cli serve`` reads ``specserve.cli serve``)."""
    argv = _argv(pid)
    if argv[1:] and os.path.basename(argv[0]).startswith("python"):
        if argv[1] == "-m":
            argv = argv[2:]
        elif not argv[1].startswith("-"):  # a script
            argv = argv[1:]
    if argv:
        argv[0] = os.path.basename(argv[0])
    text = " ".join(argv) or "?"
    return text if len(text) <= width else text[:width - 3] + "..."


def cmdline(pid: int) -> str:
    """Process ``pid``'s command line, its arguments joined by spaces ("" where it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").replace("\0", " ")
    except OSError:
        return ""


def _argv(pid: int) -> list[str]:
    return cmdline(pid).split()


def cluster_starter(pid: int) -> int | None:
    """For a Ray process (a worker, the raylet, the dashboard agent), the nearest ancestor
    that is not one: the process that started its cluster (``ray.init``'s caller)."""
    if not is_ray(pid):
        return None
    while is_ray(pid):
        pid = parent(pid)
        if pid <= 1:
            return None
    return pid


def is_ray(pid: int) -> bool:
    """Whether ``pid`` is one of Ray's processes: a worker (``ray::ProxyActor``), a Ray
    binary (raylet, gcs_server) or a script of Ray's package (its agents)."""
    argv = _argv(pid)[:3]
    program = os.path.basename(argv[0]) if argv else ""
    return program.startswith("ray::") or program in ("raylet", "gcs_server") or any(
        a.endswith(".py") and f"{os.sep}ray{os.sep}" in a for a in argv)


def parent(pid: int) -> int:
    """The parent's pid (0 when unknown)."""
    stat = proc_stat(pid)
    return stat[1] if stat is not None else 0


class ProcStat(NamedTuple):
    """What :func:`proc_stat` reads of ``/proc/PID/stat``."""

    state: str
    ppid: int
    pgrp: int
    session: int
    exit_status: int  # field 52: a wait status, a zombie's included
    comm: str
    cpu_ticks: int    # utime + stime, in clock ticks (``os.sysconf("SC_CLK_TCK")`` a second)


def proc_stat(pid: int, thread: int | None = None) -> ProcStat | None:
    """``/proc/PID/stat``'s fields that the server and its tools read (of one ``thread`` of
    it: ``/proc/PID/task/TID/stat``); None where there is no such process. The file reads
    ``pid (comm) state ppid ...``, and ``comm`` may hold spaces and parentheses: the fields
    are split after its last ``)``."""
    try:
        with open(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat") as f:
            text = f.read()
        rest = text[text.rindex(")") + 2:].split()
        return ProcStat(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[49]),
                        text[text.index("(") + 1:text.rindex(")")], int(rest[11]) + int(rest[12]))
    except (OSError, IndexError, ValueError):
        return None
