"""``make gpu-check``: what a short loan of a GPU machine should bring back (issue 33).

Phases of steps, each step a subprocess under its own timeout writing one file into ``--out``
the moment it has something (``load/gpu/``: the steps and the harness's pieces):

    quick  env.json, tests.xml, identity.json       timeouts 60 + 210 + 240 s
    bench  bench.json, memory.json, profile.txt     timeouts 300 + 150 + 90 s
    step   step.json (the engine end to end)        timeout 450 s
    full   full.json (the host lines, whole 8B)     timeout 300 s
    paged  paged.json (issue 53)                    timeout 450 s
    shared shared.json (issue 73: a draft process    timeout 180 s
           beside the target's on one GPU)
    all    quick and bench, in that order
    next   full, paged and shared: what the open issues wait for, least measured first

with ``log.txt`` (every line, timestamped) and ``summary.json`` (each step's status, seconds
and one line, rewritten after every step): at most 8 files, the lent machine's limit. The
timeouts of a phase add up to less than 10 minutes (the machine's limit per command) and
``--budget`` caps the phase whatever they are: a step that would start with too little time
left is skipped, so ``all`` in one command gets what fits. docs/GPU.md has the commands for
the machine and what counts as a pass.

    python load/gpu_check.py --phase quick --out results/gpu
    python load/gpu_check.py --phase all --out /tmp/x --dry-run   # the CPU rehearsal (a test)

``--run STEP`` runs one step in this process (what the harness's subprocesses do).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "services", ROOT):  # the package is not installed on the GPU machine
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from load.gpu import preflight  # noqa: E402
from load.gpu.output import setup_logging  # noqa: E402
from load.gpu.runner import Outcome, Step, Summary, run_step  # noqa: E402

log = logging.getLogger("gpu-check")

PHASES = {"quick": ("env", "tests", "identity"), "bench": ("bench", "memory", "profile"),
          "step": ("step",), "paged": ("paged",), "full": ("full",), "shared": ("shared",)}
# Not step: all is at the lent machine's 8 files already (6 steps, log.txt, summary.json).
PHASES["all"] = PHASES["quick"] + PHASES["bench"]
# The next window's first command (docs/GPU.md "The next window"): full's host gap at the real
# depth, then paged, which no window has measured, then shared (about 180 + 230 + 80 s of the
# 550 s budget: last, so a budget cut short costs the least wanted); 5 files. step runs in the
# second command, on the warm machine.
PHASES["next"] = PHASES["full"] + PHASES["paged"] + PHASES["shared"]
IN_PROCESS = {"env": "load.gpu.env", "identity": "load.gpu.identity", "memory": "load.gpu.memory",
              "profile": "load.gpu.profiling", "step": "load.gpu.step", "paged": "load.gpu.paged",
              "full": "load.gpu.full", "shared": "load.gpu.shared"}
TEST_PATHS = ("tests/gpu", "tests/test_memory.py")
ENGINE = ("torch", "transformers", "numpy", "jinja2", "pydantic", "pydantic_core", "annotated_types",
          "typing_inspection")  # what importing specserve's engine and config takes
BUDGET_S = 550.0  # a phase's wall time at most: the machine's 10 minutes less start and margin
MIN_STEP_S = 20.0  # a step is not started with less time than this left in the budget
# A dry run rehearses on whatever CPU runs the suite, busy or not: the timeouts and the budget
# are the GPU machine's, and there they only stop a step that hangs, so the rehearsal gives
# every one of them this many times over (a busy AVX2 machine ran the 60 s env step past it).
DRY_RUN_SLACK = 10
# The dry run's pytest: without SPECSERVE_GPU_TESTS the gpu tests are collected and skipped
# (the command is checked, nothing runs); without this machine's dozen plugins it starts in
# half the time (8 s less of the CI's budget).
TESTS_DRY_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


# bench on the GPU: batch 1 and 4, where issue 52 asks a verify of 8 (T = 1 and 8 are measured
# first: 6 buckets of 32 layers, about 30 s each to compile; T = 5 shares T = 8's), and batch 8,
# which the first windows measured.
GPU_BENCH = ["--rows", "1,4,8"]


def step_table(out: Path, dry_run: bool) -> dict[str, Step]:
    """Every step, its command, timeout (on an H100; a dry run's are DRY_RUN_SLACK times
    these) and needs."""
    py, slack = sys.executable, DRY_RUN_SLACK if dry_run else 1

    def own(name: str, timeout_s: float, needs: tuple[str, ...], output: str) -> Step:
        argv = [py, str(Path(__file__)), "--run", name, "--out", str(out)] + ["--dry-run"] * dry_run
        return Step(name, argv, timeout_s * slack, needs, output)

    tiny = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--backend", "eager",
            "--rows", "1,2", "--ts", "1,5", "--reps", "1", "--context", "40", "--bandwidth-gib", "0.125"]
    return {
        "env": own("env", 60, ("torch",), "env.json"),
        "tests": Step("tests", tests_argv(py, out, dry_run), 210 * slack,
                      (*ENGINE, "pytest", "httpx", "requests", "safetensors", "tokenizers", "llguidance"),
                      "tests.xml",
                      env=TESTS_DRY_ENV if dry_run else {"SPECSERVE_GPU_TESTS": "1"}),
        "identity": own("identity", 240, ENGINE, "identity.json"),
        "bench": Step("bench", [py, str(ROOT / "load" / "bench_gpu.py"), "--out", str(out / "bench.json"),
                                *(tiny if dry_run else GPU_BENCH)], 300 * slack, ("torch", "transformers"),
                      "bench.json"),
        "memory": own("memory", 150, ENGINE, "memory.json"),
        "profile": own("profile", 90, ("torch", "transformers"), "profile.txt"),
        "step": own("step", 450, ENGINE, "step.json"),
        "paged": own("paged", 450, ENGINE, "paged.json"),
        "full": own("full", 300, ENGINE, "full.json"),
        "shared": own("shared", 180, ENGINE, "shared.json"),
    }


def tests_argv(py: str, out: Path, dry_run: bool) -> list[str]:
    """pytest over the GPU-marked tests, junit XML into ``out``; a hung test fails alone
    where pytest-timeout is installed (not in a dry run, where plugins stay unloaded)."""
    paths = [p for p in TEST_PATHS if (ROOT / p).exists()]
    timeout = not dry_run and not preflight.missing(["pytest_timeout"])
    per_test = ["--timeout=120"] if timeout else []
    return [py, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-v", *per_test,
            f"--junitxml={out / 'tests.xml'}", *paths]


def child_env(dry_run: bool) -> dict[str, str]:
    """The steps' environment: the repository importable, output unbuffered; a dry run on
    the CPU only, one thread (a busy 2-core machine stalls torch's parallel regions)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "services"), str(ROOT),
                                                    os.environ.get("PYTHONPATH")) if p)
    if dry_run:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def describe(step: Step, out: Path, rc: int) -> str:
    """One line on what an ended step found: the test counts of ``tests.xml``."""
    if step.name != "tests":
        return ""
    from xml.etree import ElementTree

    path = out / "tests.xml"
    if not path.exists():
        return "pytest wrote no tests.xml" if rc else ""
    suites = ElementTree.parse(path).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return (f"{passed} passed, {count['failures']} failed, {count['errors']} errors, "
            f"{count['skipped']} skipped (tests.xml)")


def run_phase(args, steps: list[Step], summary: Summary, deadline: float) -> None:
    """Each step in turn under min(its timeout, what the budget has left)."""
    env = child_env(args.dry_run)
    for step in steps:
        if summary.outcomes[step.name].status == "skipped":
            continue
        left = deadline - time.monotonic()
        if left < MIN_STEP_S:
            summary.record(Outcome(step.name, "skipped", 0.0, f"phase budget spent ({args.budget:.0f} s)",
                                   step.output))
            continue
        timeout = min(args.timeouts.get(step.name, step.timeout_s), left)
        summary.record(run_step(step, cwd=ROOT, out=args.out, env=env, timeout_s=timeout,
                                describe=describe))


def check_first(args, steps: list[Step], summary: Summary) -> bool:
    """The preflight (:mod:`load.gpu.preflight`): missing modules skip the steps that need
    them, with one line; no CUDA (outside a dry run) stops the phase. False: stop."""
    gone = preflight.missing([m for s in steps for m in s.needs])
    blocked = [s for s in steps if set(s.needs) & set(gone)]
    summary.header["preflight"] = {"missing": gone}
    if gone:
        log.info(preflight.missing_line(gone, [s.name for s in blocked]))
    for s in blocked:
        summary.outcomes[s.name] = Outcome(s.name, "skipped", 0.0,
                                           "missing " + ", ".join(m for m in s.needs if m in gone), s.output)
    if args.dry_run or "torch" in gone:
        summary.write()
        return True
    seen = preflight.cuda(sys.executable, child_env(False))
    summary.header["preflight"]["cuda"] = seen
    if not seen.get("available"):
        log.info(preflight.no_cuda_line(seen))
        for s in steps:
            if summary.outcomes[s.name].status == "pending":
                summary.outcomes[s.name] = Outcome(s.name, "skipped", 0.0, "no CUDA device", s.output)
        summary.write()
        return False
    log.info("preflight: %s, torch %s, CUDA %s", seen["name"], seen["torch"], seen["cuda"])
    summary.write()
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=sorted(PHASES), default="quick")
    p.add_argument("--out", type=Path, default=Path("results/gpu"))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (the CI's rehearsal)")
    p.add_argument("--steps", help="only these steps of the phase, comma-separated (a rerun)")
    p.add_argument("--timeout", action="append", default=[], metavar="STEP=SECONDS",
                   help="override one step's timeout (repeatable)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="the phase's seconds at most")
    p.add_argument("--run", choices=sorted(IN_PROCESS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.timeouts = {k: float(v) for k, v in (t.split("=", 1) for t in args.timeout)}
    if args.dry_run:
        args.budget *= DRY_RUN_SLACK
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:  # one step, here: its file is its result
        setup_logging()
        importlib.import_module(IN_PROCESS[args.run]).run(args.out, args.dry_run)
        return 0
    setup_logging(args.out / "log.txt")
    table = step_table(args.out, args.dry_run)
    names = [n for n in PHASES[args.phase] if not args.steps or n in args.steps.split(",")]
    steps = [table[n] for n in names]
    summary = Summary(args.out / "summary.json", {"phase": args.phase, "dry_run": args.dry_run,
                                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, steps)
    log.info("gpu-check phase %s%s: %s into %s", args.phase, " (dry run)" * args.dry_run,
             ", ".join(names), args.out)
    deadline = time.monotonic() + args.budget  # the preflight's seconds count too
    ready = check_first(args, steps, summary)
    if ready:
        run_phase(args, steps, summary, deadline)
    summary.header["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    summary.write()
    bad = {o.step: o.status for o in summary.outcomes.values() if o.status != "ok"}
    log.info("gpu-check phase %s: %s", args.phase, f"not ok: {bad}" if bad else "every step ok")
    return 2 if not ready else 1 if bad else 0


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown: a step spends 2 s here in torch's module cleanup (more
    # with a CUDA context) after its file is written and closed. Logs flushed first.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)
