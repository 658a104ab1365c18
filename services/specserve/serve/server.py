"""The ``specserve serve`` process: a supervisor, and the server it runs in a session of its own.

The supervisor (what a user or a process manager starts) runs the server in a process session
of its own, hands it each stop signal once, starts it again where its Ray lost a port race at
start-up (:mod:`specserve.serve.ray_watch`), and, once it has exited, kills whatever of its
session outlived it. The server checks its ports, builds the app, starts its guardian (a
process that ends it when its Ray or its supervisor dies, :mod:`specserve.serve.ray_watch`),
then a local Ray and Serve, serves, and on a stop signal drains and stops in order.

What each exit means: 0, stopped on a signal; 1, its Ray died or its start-up failed (one
line says which); 2, bad input before Ray started (a taken port, a bad config).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from specserve.errors import SpecServeError
from specserve.serve.local import (
    DEFAULT_METRICS_PORT,
    NODE_IP,
    SERVING_ENV,
    free_ports,
    start_local_ray,
    start_serve,
    stop_serve,
)
from specserve.serve.ray_watch import RETRY_EXIT, TRY_ENV, VERDICT_ENV, Lifeline, kill_session


def _app_args(path: str | None) -> dict:
    """The AppConfig dict from a Serve config file (its first application's args) or an
    AppConfig file; {} for the defaults."""
    if not path:
        return {}
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except OSError as exc:
        raise SpecServeError(f"cannot read {path}: {exc.strerror}") from exc
    if "applications" in doc:
        return doc["applications"][0].get("args", {})
    return doc


LOCAL_DEFAULT = {"auth": {"enabled": False}}  # no --config: the local default, keys off


SERVER_ENV = "SPECSERVE_SERVER"  # "1" in the server process that `specserve serve` supervises


def serve(args) -> int:
    """``specserve serve``: the supervisor where it is not the server itself (Linux), else the
    server; its exit status."""
    if os.environ.get(SERVER_ENV) != "1" and sys.platform.startswith("linux"):
        return supervise(args.argv)
    metrics_port = _check_ports(args)  # the first thing the server does: a taken port is one line
    from specserve.app_config import AppConfig

    stop = threading.Event()  # a stop signal, from the first moment: one during start-up
    _stop_on_signal(stop)      # drains as soon as the app is up
    raw = _app_args(args.config) if args.config else LOCAL_DEFAULT
    cfg, proxy = _direct(AppConfig.model_validate(_default_draft_or_ngram(raw)), args)
    from deploy.app import build_app

    app = build_app(cfg.model_dump())  # validates and checks the draft's files: fail before Ray
    lifeline = Lifeline(cfg.drain_timeout_s)  # the guardian: Ray's death ends this process
    _start(app, args, proxy, metrics_port, stop, lifeline)
    lifeline.serving()
    if not cfg.auth.enabled:
        print("specserve: authentication is OFF (auth.enabled: false): anyone who reaches "
              f"{args.host}:{args.port} can use the API without a key", flush=True)
    print(f"specserve: {_speculation_line(cfg)}", flush=True)
    print(f"specserve: serving on http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops)",
          flush=True)
    if cfg.direct_http is not None:
        print(f"specserve: the ingress replica serves {args.host}:{args.port} itself; Serve's "
              f"proxy serves the same API on {proxy[0]}:{proxy[1]}", flush=True)
    stop.wait()
    drain("specserve", cfg.drain_timeout_s)  # (should Ray die meanwhile, the guardian ends it)
    stop_serve("specserve", before_shutdown=lifeline.stand_down)
    print("specserve: stopped", flush=True)
    return 0


def _direct(cfg, args) -> tuple:
    """The config to serve, and where Serve's proxy listens. With the unit in the ingress, the
    ingress replica serves ``--host``/``--port`` itself (``direct_http``: no proxy hop a token)
    and the proxy takes a free loopback port; otherwise (or ``--proxy-only``) the proxy serves
    ``--host``/``--port``."""
    from specserve.app_config import DirectHTTPConfig

    if not cfg.unit_here or args.proxy_only:
        return cfg, (args.host, args.port)
    direct = DirectHTTPConfig(host=args.host, port=args.port)
    return cfg.model_copy(update={"direct_http": direct}), (NODE_IP, free_ports(1)[0])


def _start(app, args, proxy: tuple, metrics_port: int, stop: threading.Event,
           lifeline: Lifeline) -> None:
    """A local Ray, Serve's proxy on ``proxy`` (host, port), and the app; a failure is one
    line and an exit (the guardian's where Ray died)."""
    from ray import serve

    try:
        start_local_ray(metrics_export_port=metrics_port, env=SERVING_ENV)
        lifeline.ray_up()
        _stop_on_signal(stop)  # ray.init put its own SIGTERM handler (it exits) in place
        start_serve(*proxy)
        serve.run(app, name="specserve", route_prefix="/")
    except Exception as exc:  # Ray's or Serve's: the death behind it, else its first line
        lifeline.failed(exc)
    _stop_on_signal(stop)


def _check_ports(args) -> int:
    """Check that the server's ports are free before Ray starts (on a taken metrics port Ray's
    start-up dies after 30 s with a traceback); the metrics port to use. A taken ``--port``,
    or a taken ``--metrics-port`` that was asked for, is an error naming the flag; the default
    metrics port, when taken (a second server on this machine), gives way to a free one."""
    from specserve.serve.ports import bind_error, first_free, holder_words, require_free

    require_free("--port", args.host, args.port)
    if args.metrics_port is not None:
        require_free("--metrics-port", NODE_IP, args.metrics_port)
        return args.metrics_port
    if bind_error(NODE_IP, DEFAULT_METRICS_PORT) is None:
        return DEFAULT_METRICS_PORT
    port = first_free(NODE_IP, DEFAULT_METRICS_PORT + 1)
    print(f"specserve: Ray's metrics port {DEFAULT_METRICS_PORT} is in use "
          f"({holder_words(DEFAULT_METRICS_PORT)}); Ray's metrics are on {port} instead "
          f"(deploy/prometheus/prometheus.yml scrapes {DEFAULT_METRICS_PORT}: point it at {port}, "
          "or pass --metrics-port)", flush=True)
    return port


def _default_draft_or_ngram(app_args: dict) -> dict:
    """The shipped EAGLE draft (``embedded-eagle``) is used when it is there; a checkout or
    install without it serves with the model-free proposer configured in front of it (n-gram
    lookup if none) instead, and says so."""
    from specserve.engine.drafts.draft_head import EMBEDDED_DRAFT, is_draft_dir

    spec = app_args.get("unit", {}).get("engine", {}).get("speculative", {})
    if (spec.get("draft") or {}).get("source") != EMBEDDED_DRAFT or is_draft_dir(EMBEDDED_DRAFT):
        return app_args
    free = spec.get("first") or "ngram"  # the model-free proposer in front of it, if any
    print(f"specserve: the default draft ({EMBEDDED_DRAFT}) is not installed (`make draft` trains "
          f"it); speculating with {free} alone instead", flush=True)
    spec = {k: v for k, v in spec.items() if k not in ("draft", "ngram_first", "first")} | {"method": free}
    engine = app_args["unit"]["engine"] | {"speculative": spec}
    return app_args | {"unit": app_args["unit"] | {"engine": engine}}


def _speculation_line(cfg) -> str:
    """Which proposer and which draft the app speculates with (and what the draft measured)."""
    from specserve.engine.drafts.draft_head import draft_path, is_draft_dir
    from specserve.methods import PROPOSERS

    spec = cfg.unit.engine.speculative
    if spec.method is None:
        return "speculation off (target-only)"
    k_mode = "chosen per step" if spec.adaptive.enabled else "fixed"
    if spec.draft is None:  # a model-free proposer
        return (f"speculation: {spec.method} ({PROPOSERS[spec.method].summary}), K up to "
                f"{spec.num_speculative_tokens}, {k_mode}{_cache_words(spec, spec.method)}")
    where = draft_path(spec.draft.source)
    first = (f", {spec.first_method} first ({PROPOSERS[spec.first_method].summary}"
             f"{_cache_words(spec, spec.first_method)})" if spec.first_method else "")
    line = (f"speculation: {spec.method}{first}, K up to {spec.num_speculative_tokens}, "
            f"{k_mode}, draft {spec.draft.source}")
    if is_draft_dir(spec.draft.source):
        line += f" ({where})"
        try:
            report = json.loads((where / "eval.json").read_text())
            e2e = report.get("end_to_end", {})
            first = report["greedy_acceptance"]["1"]["acceptance_rate"]
            line += (f"; on held-out prompts: first-token acceptance {first:.2f}, mean acceptance "
                     f"length {e2e['mean_acceptance_length']:.2f} at K={e2e['k']}, "
                     f"{e2e['speedup']:.2f}x at batch 1 (eval.json, {report.get('date', 'undated')})")
        except (OSError, ValueError, KeyError):
            pass
    return line


def _cache_words(spec, method: str) -> str:
    """Suffix decoding's global cache, as the start-up line tells it (what it keeps is user
    data: say so)."""
    if method != "suffix":
        return ""
    cache = spec.suffix
    if cache.max_cached_responses == 0:
        return "; no cache of earlier responses"
    seeded = f", started from {cache.cache_file}" if cache.cache_file else ""
    return (f"; caches the unit's last {cache.max_cached_responses} responses in memory (at most "
            f"{cache.max_cached_tokens} tokens{seeded})")


def drain(app_name: str, timeout_s: float, poll_s: float = 0.2) -> int:
    """Stop taking requests and wait (at most ``timeout_s``) for those in flight to finish;
    returns how many were still running at the end. /health answers 503 meanwhile."""
    import time

    from ray import serve

    ingress = serve.get_deployment_handle("OpenAIIngress", app_name=app_name)
    status = ingress.drain.remote().result()
    print(f"specserve: draining, {status['in_flight']} request(s) in flight "
          f"(at most {timeout_s:g} s)", flush=True)
    deadline = time.monotonic() + timeout_s
    while status["in_flight"] and time.monotonic() < deadline:
        time.sleep(poll_s)
        status = ingress.drain_status.remote().result()
    if status["in_flight"]:
        print(f"specserve: {status['in_flight']} request(s) still running after {timeout_s:g} s; "
              "stopping anyway", flush=True)
    return status["in_flight"]


def supervise(argv: list[str]) -> int:
    """Run the server in a session of its own and hand it each stop signal; its exit status.

    Ray starts its GCS server and raylet in the process group of whoever calls ``ray.init``.
    A signal to the group ``specserve serve`` was started in (``timeout``, systemd's
    ``KillMode=control-group``, a supervisor's ``kill -TERM -- -PGID``) would reach them too:
    the GCS died first and the drain then waited 60 s for it and failed. In a session of its
    own the server and its Ray get only the SIGTERM this process forwards (for SIGINT, SIGTERM
    or SIGHUP), drain, and stop in order; and the server gets SIGTERM too should this process
    die without forwarding it (``PR_SET_PDEATHSIG``): it drains if it serves, and its guardian
    (:mod:`specserve.serve.ray_watch`) ends it if it does not serve yet or its Ray is dead.

    A server whose Ray died is ended by its guardian, which leaves the exit status it chose
    in a file (the server itself was killed): ``RETRY_EXIT`` where Ray lost a port race at
    start-up (its line says so), and the server is started again, at most ``START_TRIES``
    times in all. Once the server has exited, whatever of its session outlived it is killed:
    nothing started here outlives ``specserve serve``."""
    import signal
    import subprocess

    stopping, code, start = False, RETRY_EXIT, 0
    server: subprocess.Popen | None = None

    def forward(*_) -> None:
        nonlocal stopping
        stopping = True
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    while code == RETRY_EXIT and not stopping:
        start += 1
        handle, name = tempfile.mkstemp(prefix="specserve-verdict-")
        os.close(handle)  # (the guardian writes it by name)
        verdict = Path(name)
        server = subprocess.Popen([sys.executable, "-m", "specserve.cli", *argv],
                                  env={**os.environ, SERVER_ENV: "1", TRY_ENV: str(start),
                                       VERDICT_ENV: str(verdict)},
                                  start_new_session=True, preexec_fn=_terminate_with_parent)
        code = server.wait()
        kill_session(server.pid)  # its session's id is its pid (start_new_session)
        code = int(verdict.read_text() or code)  # the guardian's, where it ended the server
        verdict.unlink()
    return code


def _terminate_with_parent() -> None:
    """In the server, before it runs: SIGTERM when the process that started it dies."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop_on_signal(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` (a backgrounded process ignores SIGINT: both count)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


