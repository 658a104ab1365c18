"""The ingress replica's own HTTP server (``AppConfig.direct_http``): the API served from the
process that runs the unit, beside Serve's proxy.

With the unit in the ingress (:mod:`specserve.serve.local_unit`), Serve's proxy is the last
hop between a step's chunk and the client's socket: each chunk is a Ray message from the
replica to the proxy, and on a small machine the CPU of Ray's and Serve's loops around it is
taken from the forward. Here the replica runs a uvicorn server on the same FastAPI app, on
Serve's user-code event loop, so a request reaches the same routes, admission and drain as
through the proxy, which keeps serving on its own port.

Serve's own direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS``) does this too, but is set for
a whole cluster by environment, allocates replica ports from a range, and holds each stopping
replica open 30 s by default; one replica on one known port needs none of that.

The socket is bound in the replica's constructor, so a port that cannot be had fails the
replica's start with one line. A replica that replaces another (Serve restarts an unhealthy
one) waits, within a bound, for the old one's socket to close.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import time

from specserve.serve.ports import address_family

# How long a replica's start waits for the port while another process listens on it: a
# replica being replaced stops within its drain (Serve's graceful stop), then its process ends.
REBIND_WAIT_S = 60.0
REBIND_POLL_S = 0.25


class DirectHTTPError(RuntimeError):
    """The replica's port cannot be listened on."""


def listen(host: str, port: int, wait_s: float = REBIND_WAIT_S) -> socket.socket:
    """A socket listening on ``host:port`` (``SO_REUSEADDR``, as uvicorn binds), waiting up to
    ``wait_s`` while another socket listens there; else :class:`DirectHTTPError`."""
    deadline = time.monotonic() + wait_s
    while True:
        sock = socket.socket(address_family(host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(2048)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise DirectHTTPError(f"the ingress replica cannot listen on {host}:{port}: "
                                      f"{exc.strerror}") from None
        time.sleep(REBIND_POLL_S)


class DirectHTTP:
    """A uvicorn server of ``asgi`` on ``host:port``, running on the caller's event loop (the
    replica's user-code loop: the constructor runs there)."""

    def __init__(self, asgi, host: str, port: int) -> None:
        import uvicorn

        self.address = f"{host}:{port}"
        sock = listen(host, port)
        config = uvicorn.Config(asgi, lifespan="off", access_log=False, log_config=None,
                                log_level="warning", timeout_keep_alive=60)
        self.server = uvicorn.Server(config)
        # Signals belong to the replica's process (Ray's worker), not to this server.
        self.server.capture_signals = contextlib.nullcontext
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))

    def check_health(self) -> None:
        """Raise if the server has stopped (Serve then replaces the replica)."""
        if self.task.done():
            cause = None if self.task.cancelled() else self.task.exception()
            raise RuntimeError(f"the ingress replica's HTTP server on {self.address} stopped"
                               + (f": {cause}" if cause else ""))

    def close(self) -> None:
        """Stop accepting and close the connections (after the drain: nothing is in flight)."""
        self.server.should_exit = True
