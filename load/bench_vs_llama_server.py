"""specserve's server against llama.cpp's ``llama-server``: server against server over HTTP.

A benchmark, not a test (``make bench-vs-llama-server``, issue 71). Both serve the same GGUF,
the embedded SmolLM2-135M-Instruct (Q4_1), on this machine, one after the other and never at
once, each with 2 threads, bound to 127.0.0.1 only:

- ``llama-server`` built once from the llama.cpp that llama-cpp-python's sdist vendors
  (``vendor/llama.cpp``), cached in ``.llama-server/<flavour>/bin/``, started with
  ``-m GGUF -t 2 -np 8 -c 16384``: 8 slots of 2,048 positions, as specserve's default unit
  (``max_num_seqs: 8``, ``max_model_len: 2048``); ready when ``GET /health`` answers 200;
- ``specserve serve --config ...`` as a user starts it, ready on its ``serving on`` line, once
  per config: ``off`` (``speculative.method: null``, target-only) and ``router`` (the default,
  ``deploy/serve_config.yaml``'s args, auth off), and on request (``--configs``) each of them
  on the float32-identical kernels (``off-invariant``, ``router-invariant``: ``kernels:
  invariant``; the default's are ``integer``).
  specserve's actors take the machine's cores (``os.cpu_count()``), so "2 threads each" holds
  on a 2-core machine, this project's kind; elsewhere the script says so.

The workload (``load/prompts/vs_llama_server.jsonl``): code edits, extraction, quoting, tables,
multi-turn revisions, agent tool calls as plain chat text, and open chat. Its ``{{SLOT1}}``
placeholders are filled per request from a per-run seed, and each request's first message
starts with a nonce line, so every request is fresh to both servers' caches (prefix caches,
specserve's suffix cache of earlier responses) while both servers get the very same requests.
Each server first gets one warm-up request per kind (its own fills).

Per concurrency level c (``--concurrency``, default 1,4,8,16) a pool of c clients sends the
level's requests (every prompt at least once, at least 3 per client) one after another, streamed
(``/v1/chat/completions``, greedy, ``max_tokens`` 128, ``stream_options.include_usage``). Per
(server, config, c): output tokens/s over the level's wall time, time to first token p50 / p95,
the mean gap between tokens (a stream's first-to-last content chunk over its tokens - 1; tokens
from the final ``usage.completion_tokens``, else the content chunks), and requests ok. Beside
specserve's gap, its forward as it ran in the same level (``fwd ms``): the unit's verify phase a
step over the steps that held no prompt, from ``/v1/units/stats`` (``times``) read before and
after the level; one token a step without speculation, so ``gap - fwd`` is what serving added
to those very tokens, not to a forward measured at another moment. At c = 1
also per prompt kind and for the repeating kinds together against chat. The clients run in
this process (asyncio, one thread) on the same cores, alike for both servers. Prints the tables, the
CPU flags and the ratios specserve / llama-server; writes ``results/bench_vs_llama_server.json``
and ``.csv``, and each server's log under ``results/bench_vs_llama_server-logs/``.

Then the kernels, once the servers have stopped (``--no-kernels`` skips them): specserve's
decode and its verifies of 7 and 8 drafts in-process (``python -m load.roofline``, in
specserve's environment), a decode's bytes over its time against torch's read bandwidth, and
beside it llama.cpp's own time a generated token at one stream, as its server reports it in
each stream's ``timings``, over the GGUF's bytes.

    make bench-vs-llama-server                                     # everything, this CPU's build
    make bench-vs-llama-server BENCH_VS_ARGS="--avx2"              # AVX2-only, both servers
    make bench-vs-llama-server BENCH_VS_ARGS="--build-only"        # build llama-server and stop

The default build takes every instruction set this CPU lists, as ``GGML_NATIVE`` would, but
AMX (see ``NO_AMX``). ``--avx2`` builds llama-server for AVX2 only (no AVX512, no VNNI) and
starts specserve with the Makefile's ``AVX2_ENV`` (passed by make as ``--avx2-env``): the AVX2
machines' code paths on an AVX512 one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `load` as a namespace package, run as a script or imported

from specserve.machine import cpu_flags, machine_label  # noqa: E402

from load.common import client_pool, format_table, post_sse, write_csv  # noqa: E402
from load.prompts import load_prompts  # noqa: E402
from load.sweep import percentile  # noqa: E402

HOST = "127.0.0.1"
# Below the kernel's ephemeral range (32768 on): Ray's own connections take ports from there,
# and one of them could hold a server's port by the time it binds (bench_http uses 18500).
BASE_PORT = 18600
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # pinned: every run measures the same llama.cpp
CACHE = ROOT / ".llama-server"
SLOTS, CONTEXT = 8, 16384  # 8 slots of 2,048 positions: specserve's default unit
PROMPT_SET = "vs_llama_server"
KINDS = ("code_edit", "extract", "quote", "table", "multi_turn", "agent", "chat")
REPEATING = tuple(k for k in KINDS if k != "chat")  # the answer copies the prompt or repeats itself
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni")
BUILD_TIMEOUT_S = 3600      # llama-server on 2 cores: minutes, not an hour
READY_TIMEOUT_S = {"llama-server": 120, "specserve": 900}  # specserve may build its kernels first
STOP_GRACE_S = 90           # specserve drains (drain_timeout_s 30) and stops Ray
KILL_WAIT_S = 30
REQUEST_TIMEOUT_S = 600


# -- building llama-server ------------------------------------------------------------------------
COMMON_CMAKE = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # No web UI: newer llama.cpp fetches its assets at build time, and nothing here is fetched.
    # (LLAMA_BUILD_UI is its newer name; cmake only warns about the one it does not know.)
    "-DLLAMA_BUILD_WEBUI=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary in the cache
)
# ggml/CMakeLists.txt's instruction-set options, by the /proc/cpuinfo flag that allows each.
GGML_ISA = (("GGML_SSE42", "sse4_2"), ("GGML_AVX", "avx"), ("GGML_AVX2", "avx2"),
            ("GGML_BMI2", "bmi2"), ("GGML_FMA", "fma"), ("GGML_F16C", "f16c"),
            ("GGML_AVX_VNNI", "avx_vnni"), ("GGML_AVX512", "avx512f"),
            ("GGML_AVX512_VBMI", "avx512vbmi"), ("GGML_AVX512_VNNI", "avx512_vnni"),
            ("GGML_AVX512_BF16", "avx512_bf16"))
# AMX stays off in every flavour. llama.cpp's AMX kernels request the tile state for the main
# thread only and load a tile config the compiler may drop, so a GGML_NATIVE build dies with
# SIGILL at its first `tilezero` on an AMX machine (seen here on a Sapphire Rapids VM whose own
# AMX test program runs; upstream: ggml-org/llama.cpp pull request 26954, open).
NO_AMX = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
ISA_PREFIXES = ("sse4_2", "avx", "bmi2", "fma", "f16c")  # cpu_flags() of these
AVX2_FLAGS = frozenset({"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c"})  # the AVX2 machines (AMD EPYC)


def flavour_cmake(flavour: str, flags: frozenset[str]) -> tuple[str, ...]:
    """``host``: every instruction set this CPU lists, as GGML_NATIVE would choose them, but
    AMX; ``avx2``: AVX2 and what comes with it on the AVX2 machines, nothing of AVX512,
    AVX-VNNI or AMX (``flags`` unused)."""
    allowed = flags if flavour == "host" else AVX2_FLAGS
    isa = tuple(f"-D{option}={'ON' if flag in allowed else 'OFF'}" for option, flag in GGML_ISA)
    return ("-DGGML_NATIVE=OFF", *isa, *NO_AMX)


def binary_path(flavour: str, cache: Path = CACHE) -> Path:
    return cache / flavour / "bin" / "llama-server"


def configure_argv(src: Path, build: Path, flavour: str, flags: frozenset[str]) -> list[str]:
    return ["cmake", "-S", str(src), "-B", str(build), *COMMON_CMAKE, *flavour_cmake(flavour, flags)]


def build_argv(build: Path) -> list[str]:
    return ["cmake", "--build", str(build), "--target", "llama-server", "-j", "2"]


def vendored_source(cache: Path) -> Path | None:
    """llama.cpp inside an extracted sdist under ``cache/src``, if there is one."""
    found = sorted((cache / "src").glob("*/vendor/llama.cpp/CMakeLists.txt"))
    return found[0].parent if found else None


def fetch_source(cache: Path) -> Path:
    """The llama.cpp source vendored in llama-cpp-python's sdist, downloaded and extracted once."""
    if (src := vendored_source(cache)) is not None:
        return src
    sdist = cache / "sdist"
    # --no-binary names the package alone: ":all:" would build its build tools from source
    # too (pip prepares the sdist's metadata with them: CMake itself, for half an hour)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                    LLAMA_CPP_PYTHON, "-d", str(sdist)], check=True, timeout=BUILD_TIMEOUT_S)
    archives = sorted(sdist.glob("*.tar.gz"))
    if not archives:
        raise SystemExit(f"bench-vs-llama-server: pip left no sdist in {sdist}")
    archive = archives[-1]
    with tarfile.open(archive) as tar:
        tar.extractall(cache / "src", filter="data")
    if (src := vendored_source(cache)) is None:
        raise SystemExit(f"bench-vs-llama-server: no vendor/llama.cpp in {archive.name}")
    return src


def ensure_llama_server(flavour: str, cache: Path = CACHE) -> Path:
    """The cached ``llama-server`` of ``flavour``, built first where it is missing."""
    binary = binary_path(flavour, cache)
    if binary.is_file():
        return binary
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"bench-vs-llama-server: building llama-server needs {', '.join(missing)}")
    src, build = fetch_source(cache), cache / flavour
    print(f"building llama-server ({flavour}) from {src}: minutes on 2 cores", flush=True)
    flags = frozenset(cpu_flags(ISA_PREFIXES))
    subprocess.run(configure_argv(src, build, flavour, flags), check=True, timeout=BUILD_TIMEOUT_S)
    subprocess.run(build_argv(build), check=True, timeout=BUILD_TIMEOUT_S)
    if not binary.is_file():
        raise SystemExit(f"bench-vs-llama-server: the build left no {binary}")
    return binary


# -- the servers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerSpec:
    """One server to measure: how to start it and how to tell it is ready."""

    server: str                 # "llama-server" or "specserve"
    config: str                 # "default" for llama-server; one of CONFIGS for specserve
    argv: list[str]
    env: dict[str, str] | None  # None: this process's environment
    port: int

    @property
    def label(self) -> str:
        return f"{self.server}-{self.config}"


def llama_server_argv(binary: Path, gguf: Path, port: int, threads: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(SLOTS),
            "-c", str(CONTEXT), "--host", HOST, "--port", str(port)]


def specserve_argv(config: Path, port: int) -> list[str]:
    specserve = Path(sys.executable).parent / "specserve"  # the .venv's, as `make serve` runs it
    return [str(specserve), "serve", "--config", str(config), "--host", HOST, "--port", str(port)]


CONFIGS = ("off", "router", "off-invariant", "router-invariant")


def specserve_configs(serve_config: Path = ROOT / "deploy" / "serve_config.yaml") -> dict[str, dict]:
    """AppConfig dicts by name: ``router``, the shipped default (auth off: loopback only),
    ``off``, the same with speculation off, and each on the float32-identical kernels
    (``router-invariant``, ``off-invariant``: the target's ``kernels: invariant``)."""
    import yaml

    args = yaml.safe_load(serve_config.read_text())["applications"][0]["args"]
    router = args | {"auth": {**args.get("auth", {}), "enabled": False}}

    def engine_with(config: dict, **fields) -> dict:
        engine = config["unit"]["engine"] | fields
        return config | {"unit": config["unit"] | {"engine": engine}}

    off = engine_with(router, speculative={"method": None})
    invariant = {"kernels": "invariant"}
    return {"off": off, "router": router,
            **{f"{name}-invariant": engine_with(config, target=config["unit"]["engine"]["target"] | invariant)
               for name, config in (("off", off), ("router", router))}}


def specserve_env(args) -> dict[str, str] | None:
    """specserve's environment: ``--avx2``'s settings over this one's, else this one (None)."""
    return (os.environ | parse_env(args.avx2_env)) if args.avx2 else None


def parse_env(words: str) -> dict[str, str]:
    """``"A=1 B=x"`` (the Makefile's ``AVX2_ENV`` as the shell expanded it) -> a dict."""
    return dict(word.split("=", 1) for word in words.split())


def free_ports(count: int, start: int = BASE_PORT) -> list[int]:
    """``count`` ports from ``start`` on that nothing listens on at 127.0.0.1 now."""
    from specserve.serve.ports import bind_error

    ports = [p for p in range(start, start + 100) if bind_error(HOST, p) is None][:count]
    if len(ports) < count:
        raise SystemExit(f"bench-vs-llama-server: no {count} free ports from {start} on")
    return ports


def server_specs(binary: Path, gguf: Path, args, config_dir: Path) -> list[ServerSpec]:
    """llama-server first, then specserve once per config, each on a port of its own."""
    names = args.configs.split(",")
    port, *ports = free_ports(1 + len(names))
    specs = [ServerSpec("llama-server", "default", llama_server_argv(binary, gguf, port, args.threads),
                        None, port)]
    env = specserve_env(args)
    configs = specserve_configs()
    for name, port in zip(names, ports):
        path = config_dir / f"specserve-{name}.json"  # JSON is YAML: `--config` reads it
        path.write_text(json.dumps(configs[name], indent=2))
        specs.append(ServerSpec("specserve", name, specserve_argv(path, port), env, port))
    return specs


def start(spec: ServerSpec, log: Path) -> subprocess.Popen:
    """The server in a session of its own (a Ctrl-C here reaches it once, from :func:`stop`).
    A SIGTERM to this tool exits it through its ``finally`` blocks, which stop the server: a
    session of its own does not get the tool's signals."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        return subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=spec.env, start_new_session=True)


def _exit_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def is_ready(spec: ServerSpec, log: Path) -> bool:
    if spec.server == "specserve":
        return "serving on" in log.read_text(errors="replace")
    import httpx

    try:
        return httpx.get(f"http://{HOST}:{spec.port}/health", timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(spec: ServerSpec, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S[spec.server]
    while not is_ready(spec, log):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            why = f"exited ({proc.returncode})" if proc.poll() is not None else "not ready in time"
            raise RuntimeError(f"{spec.label} {why}; the end of {log}:\n{tail}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's PID, SIGKILL after :data:`STOP_GRACE_S`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=KILL_WAIT_S)


def wait_port_closed(port: int, timeout_s: float = 60) -> None:
    """Until nothing answers on ``port`` (what the server left behind is gone), bounded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) != 0:
                return
        time.sleep(0.5)
    print(f"warning: 127.0.0.1:{port} still answers {timeout_s:.0f} s after its server stopped")


# -- the workload ---------------------------------------------------------------------------------
SLOT = re.compile(r"\{\{([A-Z]+)(\d+)\}\}")
POOLS: dict[str, tuple[str, ...]] = {
    "NAME": ("Ada Moreno", "Lin Chen", "Priya Nair", "Tomas Weber", "Grace Okafor", "Yuki Tanaka",
             "Omar Haddad", "Sofia Rossi", "Mateo Silva", "Hannah Berg", "Kofi Mensah",
             "Elena Petrova", "Ravi Kumar", "Nora Lindqvist", "Diego Alvarez", "Mei Wong"),
    "CITY": ("Lisbon", "Osaka", "Denver", "Nairobi", "Tallinn", "Porto", "Calgary", "Leeds",
             "Valencia", "Busan", "Adelaide", "Bergen", "Cork", "Lyon", "Austin", "Krakow"),
    "ITEM": ("USB-C dock", "desk lamp", "ergonomic chair", "label printer", "webcam",
             "monitor arm", "paper shredder", "standing mat", "router", "headset", "whiteboard",
             "toner cartridge", "keyboard", "projector", "space heater", "coffee grinder"),
    "WORD": ("invoice", "parcel", "ledger", "sensor", "booking", "ticket", "account", "shipment",
             "reading", "session", "voucher", "order", "payment", "report", "batch", "device"),
    "TOPIC": ("baking sourdough bread", "learning the cello", "composting at home",
              "running a first 10k", "a small vegetable garden", "public speaking",
              "touch typing", "birdwatching", "planning a trip on a budget",
              "saving energy at home", "starting a book club", "learning to juggle",
              "basic bike repair", "keeping a home aquarium", "bouldering",
              "writing a cover letter"),
}


@dataclass(frozen=True)
class Request:
    kind: str
    messages: list[dict]


def draw(kind: str, count: int, rng: random.Random) -> list[str]:
    """``count`` values for slots of ``kind``; distinct where drawn from a pool."""
    if kind in POOLS:
        return rng.sample(POOLS[kind], count)
    if kind == "NUM":
        return [str(rng.randint(2, 999)) for _ in range(count)]
    if kind == "PRICE":
        return [f"{rng.uniform(3, 480):.2f}" for _ in range(count)]
    if kind == "DATE":
        return [(date(2025, 1, 1) + timedelta(days=rng.randrange(720))).isoformat()
                for _ in range(count)]
    raise ValueError(f"unknown slot kind {kind!r}")


def slot_values(messages: list[dict], rng: random.Random) -> dict[str, str]:
    """A value per distinct ``{{KIND<n>}}`` in ``messages`` (the same slot, the same value)."""
    slots = sorted({m.group(0): m.group(1) for msg in messages
                    for m in SLOT.finditer(msg["content"])}.items())
    values: dict[str, str] = {}
    for kind in sorted({k for _, k in slots}):
        names = [name for name, k in slots if k == kind]
        values.update(zip(names, draw(kind, len(names), rng)))
    return values


def fill(template: dict, rng: random.Random) -> Request:
    """One fresh request from a template: its slots filled, a nonce line in front."""
    values = slot_values(template["messages"], rng)
    messages = [{**m, "content": SLOT.sub(lambda s: values[s.group(0)], m["content"])}
                for m in template["messages"]]
    messages[0]["content"] = f"Ref {rng.getrandbits(48):012x}.\n" + messages[0]["content"]
    return Request(template["category"], messages)


def requests_for(concurrency: int, n_templates: int, override: int = 0) -> int:
    """Every prompt at least once, and at least 3 per client so a level is not all ramp."""
    return override or max(n_templates, 3 * concurrency)


def level_requests(templates: list[dict], seed: int, level: str, n: int) -> list[Request]:
    return [fill(templates[i % len(templates)], random.Random(f"{seed}/{level}/{i}"))
            for i in range(n)]


def build_workload(templates: list[dict], seed: int, levels: list[int],
                   override: int = 0) -> dict[str, list[Request]]:
    """``warmup`` (the first prompt of each kind) and one list per level, all from ``seed``."""
    firsts = [next(t for t in templates if t["category"] == kind) for kind in KINDS]
    workload = {"warmup": level_requests(firsts, seed, "warmup", len(firsts))}
    for c in levels:
        workload[str(c)] = level_requests(templates, seed, str(c),
                                          requests_for(c, len(templates), override))
    return workload


# -- the client -----------------------------------------------------------------------------------
@dataclass
class Stream:
    """What one streamed request saw. Times are ``time.perf_counter()`` seconds."""

    kind: str
    start: float
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried content
    end: float | None = None
    usage_tokens: int | None = None  # the final usage.completion_tokens, where sent
    server_decode_ms: float | None = None  # llama-server's own time a generated token (its timings)
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def tokens(self) -> int:
        """Output tokens: the server's count, else one per content chunk (a lower bound)."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def token_gap(self) -> float | None:
        """Mean time between tokens after the first (chunks may carry several tokens)."""
        if not self.chunk_times or self.tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)

    @property
    def seconds(self) -> float:
        return (self.end or self.start) - self.start


def apply_chunk(stream: Stream, payload: str, now: float) -> bool:
    """Fold one ``data:`` payload into ``stream``; True when the stream is over."""
    if payload == "[DONE]":
        stream.end = now
        return True
    obj = json.loads(payload)
    if error := obj.get("error"):
        stream.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return True
    for choice in obj.get("choices") or []:
        if content := (choice.get("delta") or {}).get("content"):
            stream.chunk_times.append(now)
            stream.text += content
    if (usage := obj.get("usage")) and usage.get("completion_tokens") is not None:
        stream.usage_tokens = int(usage["completion_tokens"])
    if (per_token := (obj.get("timings") or {}).get("predicted_per_token_ms")) is not None:
        stream.server_decode_ms = float(per_token)
    return False


def request_body(model: str, request: Request, max_tokens: int) -> dict:
    return {"model": model, "messages": request.messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def stream_chat(client, url: str, kind: str, body: dict) -> Stream:
    """POST one streamed chat request and time its chunks; a failure lands in ``error``."""
    stream = Stream(kind=kind, start=time.perf_counter())
    stream.error = await post_sse(client, url, body, lambda data, now: apply_chunk(stream, data, now))
    if stream.end is None and stream.error is None:
        stream.error = "the stream ended without [DONE]"
    return stream


async def run_level(url: str, jobs: list[tuple[str, dict]], concurrency: int,
                    time_limit_s: float) -> tuple[list[Stream], float]:
    """``jobs`` (kind, body) from one shared queue, ``concurrency`` clients each sending one
    request after another; what runs at ``time_limit_s`` is cancelled (not counted ok)."""
    import httpx

    streams: list[Stream] = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False) as client:

        async def send(job: tuple[str, dict]) -> None:
            streams.append(await stream_chat(client, url, *job))

        return streams, await client_pool(jobs, concurrency, time_limit_s, send)


def unit_times(port: int) -> dict | None:
    """specserve's unit's step times so far (``/v1/units/stats``' ``times``); None from a
    server without them (llama-server) or that does not answer."""
    import httpx

    try:
        r = httpx.get(f"http://{HOST}:{port}/v1/units/stats", timeout=30, trust_env=False)
    except httpx.HTTPError:
        return None
    return r.json().get("times") if r.status_code == 200 else None


def served_forward_ms(before: dict | None, after: dict | None) -> float:
    """The unit's forward a step between two :func:`unit_times` readings: its verify phase
    (the forward as the engine waited for it, less the sampler) over the steps that held no
    prompt; NaN without both readings or such a step."""
    if not before or not after or "decode_steps" not in before:
        return math.nan
    steps = after["decode_steps"] - before["decode_steps"]
    return 1e3 * (after["decode_verify_s"] - before["decode_verify_s"]) / steps if steps > 0 else math.nan


def model_id(port: int) -> str:
    import httpx

    r = httpx.get(f"http://{HOST}:{port}/v1/models", timeout=30, trust_env=False)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# -- statistics (pure) ----------------------------------------------------------------------------
def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _ratio(num: float, den: float) -> float:
    return num / den if den and not math.isnan(den) else math.nan


def summarize(streams: list[Stream], wall_s: float, requested: int) -> dict:
    """One row: output tokens/s over the wall time, TTFT p50 / p95 and the mean gap between
    tokens (ms), requests ok, and the share of streams whose tokens the server counted."""
    ok = [s for s in streams if s.ok]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    errors = [s.error for s in streams if s.error]
    return {"requests": requested, "ok": len(ok), "tokens": sum(s.tokens for s in ok),
            "wall_s": wall_s, "tokens_per_s": _ratio(sum(s.tokens for s in ok), wall_s),
            "ttft_p50_ms": 1e3 * percentile(ttfts, 50), "ttft_p95_ms": 1e3 * percentile(ttfts, 95),
            "gap_ms": 1e3 * _mean([g for s in ok if (g := s.token_gap) is not None]),
            "usage_share": _ratio(sum(s.usage_tokens is not None for s in ok), len(ok)),
            "server_decode_ms": _mean([d for s in ok if (d := s.server_decode_ms) is not None]),
            "error": errors[0] if errors else ""}


def kind_rows(streams: list[Stream]) -> list[dict]:
    """At c = 1, per prompt kind and for the repeating kinds together: tokens over the summed
    request times (one request at a time, so that is the level's time spent on them)."""
    groups = {kind: (kind,) for kind in KINDS} | {"repeating": REPEATING}
    rows = []
    for group, kinds in groups.items():
        picked = [s for s in streams if s.kind in kinds]
        row = summarize(picked, sum(s.seconds for s in picked if s.ok), len(picked))
        rows.append({"group": group} | row)
    return rows


def ratio_rows(rows: list[dict], key: str = "concurrency") -> list[dict]:
    """specserve / llama-server per ``key`` (concurrency, or a kind group): tokens/s (above 1:
    specserve faster), TTFT p50 and gap between tokens (below 1: specserve faster)."""
    base = {r[key]: r for r in rows if r["server"] == "llama-server"}
    out = []
    for r in rows:
        if r["server"] == "specserve" and (b := base.get(r[key])):
            out.append({"config": r["config"], key: r[key],
                        "tokens_per_s": _ratio(r["tokens_per_s"], b["tokens_per_s"]),
                        "ttft_p50": _ratio(r["ttft_p50_ms"], b["ttft_p50_ms"]),
                        "gap": _ratio(r["gap_ms"], b["gap_ms"])})
    return out


def shown_flags(flags: list[str]) -> dict[str, bool]:
    return {flag: flag in flags for flag in SHOWN_FLAGS}


# -- one server -----------------------------------------------------------------------------------
def measure(spec: ServerSpec, workload: dict[str, list[Request]], args, logs: Path) -> tuple[list, list]:
    """Start ``spec``, warm it up, run every level, stop it: (level rows, c = 1 kind rows)."""
    log = logs / f"{spec.label}.log"
    proc = start(spec, log)
    try:
        wait_ready(spec, proc, log)
        return run_levels(spec, workload, args)
    finally:
        stop(proc)
        wait_port_closed(spec.port)


def run_levels(spec: ServerSpec, workload: dict[str, list[Request]], args) -> tuple[list, list]:
    url, model = f"http://{HOST}:{spec.port}/v1/chat/completions", model_id(spec.port)
    jobs = {level: [(r.kind, request_body(model, r, args.max_tokens)) for r in requests]
            for level, requests in workload.items()}
    asyncio.run(run_level(url, jobs.pop("warmup"), 1, args.level_timeout))
    rows, kinds = [], []
    labels = {"server": spec.server, "config": spec.config}
    for level, level_jobs in jobs.items():
        c = int(level)
        before = unit_times(spec.port) if spec.server == "specserve" else None
        streams, wall = asyncio.run(run_level(url, level_jobs, c, args.level_timeout))
        after = unit_times(spec.port) if before else None
        rows.append(labels | {"concurrency": c} | summarize(streams, wall, len(level_jobs))
                    | {"forward_ms": served_forward_ms(before, after)})
        print(format_table(rows[-1:], LEVEL_TABLE), flush=True)
        if c == 1:
            kinds += [labels | row for row in kind_rows(streams)]
    return rows, kinds


# -- output ---------------------------------------------------------------------------------------
LEVEL_TABLE = (("server", "server", 12, 0), ("config", "config", 7, 0), ("c", "concurrency", 3, 0),
               ("ok", "ok", 4, 0), ("of", "requests", 4, 0), ("tok/s", "tokens_per_s", 8, 1),
               ("TTFT p50", "ttft_p50_ms", 9, 0), ("TTFT p95", "ttft_p95_ms", 9, 0),
               ("gap ms", "gap_ms", 7, 1), ("fwd ms", "forward_ms", 7, 1), ("usage", "usage_share", 6, 2))
KIND_TABLE = (("server", "server", 12, 0), ("config", "config", 7, 0), ("kind", "group", 10, 0),
              ("ok", "ok", 4, 0), ("tok/s", "tokens_per_s", 8, 1), ("TTFT p50", "ttft_p50_ms", 9, 0),
              ("gap ms", "gap_ms", 7, 1))
RATIO_TABLE = (("config", "config", 7, 0), ("c", "concurrency", 3, 0),
               ("tok/s x", "tokens_per_s", 8, 2), ("TTFT x", "ttft_p50", 7, 2), ("gap x", "gap", 6, 2))
KIND_RATIO_TABLE = (("config", "config", 7, 0), ("kind", "group", 10, 0),
                    ("tok/s x", "tokens_per_s", 8, 2), ("TTFT x", "ttft_p50", 7, 2), ("gap x", "gap", 6, 2))
CSV_COLUMNS = ["server", "config", "concurrency", "requests", "ok", "tokens", "wall_s",
               "tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "gap_ms", "forward_ms", "usage_share",
               "server_decode_ms", "error"]


KERNEL_TABLE = (("server", "server", 12, 0), ("decode ms", "decode_ms", 9, 2), ("MB read", "mb_read", 8, 1),
                ("GB/s", "gbs", 6, 1), ("of bandwidth", "bandwidth_share", 12, 2),
                ("verify 7 x", "verify_7", 10, 2), ("verify 8 x", "verify_8", 10, 2))


def kernel_figures(args) -> dict | None:
    """``python -m load.roofline`` in specserve's environment (``--avx2``: the AVX2 build's),
    after the servers have stopped: its decode and verifies in-process, and the read bandwidth."""
    env = specserve_env(args)
    argv = [sys.executable, "-m", "load.roofline", "--threads", str(args.threads)]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=READY_TIMEOUT_S["specserve"])
    if done.returncode != 0:
        print(f"note: load.roofline failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def kernel_rows(figures: dict, rows: list[dict], gguf_bytes: int) -> list[dict]:
    """A decode against the read bandwidth, and a verify of 7 and 8 drafts (8 and 9 new tokens)
    in decodes: specserve's in-process forward (``load.roofline``), and beside it llama.cpp's own
    time a generated token at one stream as its server reports it (``timings``, sampling
    included) over the GGUF's bytes (its tied embedding is its LM head, read whole)."""
    bandwidth = figures["read_bandwidth_gbs"]
    ms = {int(t): v for t, v in figures["forward_ms"].items()}
    out = [{"server": "specserve", "decode_ms": ms[1], "mb_read": figures["decode_bytes"] / 1e6,
            "verify_7": ms[8] / ms[1], "verify_8": ms[9] / ms[1]}]
    llama = [r for r in rows if r["server"] == "llama-server" and r["concurrency"] == 1]
    if llama and not math.isnan(llama[0].get("server_decode_ms", math.nan)):
        out.append({"server": "llama-server", "decode_ms": llama[0]["server_decode_ms"],
                    "mb_read": gguf_bytes / 1e6, "verify_7": math.nan, "verify_8": math.nan})
    for row in out:
        row["gbs"] = row["mb_read"] / row["decode_ms"]
        row["bandwidth_share"] = row["gbs"] / bandwidth
    return out


def report(rows: list[dict], kinds: list[dict], meta: dict, out: Path) -> None:
    flags = meta["cpu_flags"]
    print(f"\n{meta['machine']}; " + " ".join(f"{f}={'yes' if on else 'no'}" for f, on in flags.items())
          + f"; llama-server {meta['flavour']} build, {meta['threads']} threads each")
    print(format_table(rows, LEVEL_TABLE))
    print("\nspecserve / llama-server (tok/s above 1, TTFT and gap below 1: specserve better)")
    print(format_table(ratio_rows(rows), RATIO_TABLE))
    print("\nc = 1 by prompt kind")
    print(format_table(kinds, KIND_TABLE))
    print(format_table(ratio_rows(kinds, key="group"), KIND_RATIO_TABLE))
    if kernels := meta.get("kernels"):
        print(f"\nkernels in-process, {kernels['threads']} threads, {kernels['kernels']} arithmetic; "
              f"read bandwidth {kernels['read_bandwidth_gbs']:.1f} GB/s (torch, best of two)")
        print(format_table(kernels["rows"], KERNEL_TABLE))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(meta | {"rows": rows, "ratios": ratio_rows(rows), "kinds": kinds,
                                      "kind_ratios": ratio_rows(kinds, key="group")}, indent=2))
    write_csv(rows, out.with_suffix(".csv"), CSV_COLUMNS)


def run_meta(args, flavour: str, seed: int, specs: list[ServerSpec]) -> dict:
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_label(),
            "cpu_flags": shown_flags(cpu_flags()), "flavour": flavour, "threads": args.threads,
            "seed": seed, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
            "prompt_set": PROMPT_SET, "argv": {s.label: s.argv for s in specs}}


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4,8,16", help="comma list of client pool sizes")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    p.add_argument("--configs", default="off,router", help=f"specserve configs: {', '.join(CONFIGS)}")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: every prompt once, at least 3 per client)")
    p.add_argument("--seed", type=int, help="the workload's seed (default: a fresh one per run)")
    p.add_argument("--level-timeout", type=float, default=1200, help="seconds per level at most")
    p.add_argument("--avx2", action="store_true",
                   help="AVX2-only llama-server; specserve under --avx2-env")
    p.add_argument("--avx2-env", default="",
                   help="'K=V ...' for specserve with --avx2 (make passes the Makefile's AVX2_ENV)")
    p.add_argument("--build-only", action="store_true", help="build llama-server and exit")
    p.add_argument("--no-kernels", dest="kernels", action="store_false",
                   help="skip the in-process decode and verify against the read bandwidth")
    p.add_argument("--out", default=str(ROOT / "results" / "bench_vs_llama_server.json"))
    args = p.parse_args(argv)
    if not set(args.configs.split(",")) <= set(CONFIGS):
        p.error(f"--configs: some of {', '.join(CONFIGS)}, not {args.configs!r}")
    if args.avx2 and not args.avx2_env:
        p.error("--avx2 needs --avx2-env (`make bench-vs-llama-server` passes the Makefile's AVX2_ENV)")
    return args


def main() -> None:
    args = parse_args()
    flavour = "avx2" if args.avx2 else "host"
    binary = ensure_llama_server(flavour)
    if args.build_only:
        print(binary)
        return
    if os.cpu_count() != args.threads:
        print(f"note: specserve takes all {os.cpu_count()} cores, llama-server {args.threads} threads")
    from specserve.engine.loader import embedded_gguf

    seed = args.seed if args.seed is not None else secrets.randbits(32)
    levels = [int(c) for c in args.concurrency.split(",")]
    workload = build_workload(load_prompts(PROMPT_SET), seed, levels, args.requests)
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="bench-vs-") as tmp:
        specs = server_specs(binary, embedded_gguf(), args, Path(tmp))
        rows, kinds = [], []
        for spec in specs:  # one after the other: each stopped before the next starts
            r, k = measure(spec, workload, args, out.parent / f"{out.stem}-logs")
            rows, kinds = rows + r, kinds + k
    meta = run_meta(args, flavour, seed, specs)
    if args.kernels and (figures := kernel_figures(args)):
        meta["kernels"] = figures | {"rows": kernel_rows(figures, rows, embedded_gguf().stat().st_size)}
    report(rows, kinds, meta, out)


if __name__ == "__main__":
    main()
