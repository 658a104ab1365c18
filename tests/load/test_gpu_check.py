"""``make gpu-check``'s harness (``load/gpu_check.py``, ``load/gpu/``) without a GPU.

The dry run is the same entry point with ``--dry-run``: every step of ``all`` at the tiny
shape on the CPU, each in its own subprocess, into a temporary folder; every file a phase
promises must be there with its keys, and at most 8 of them (the lent machine's limit). A
step killed at its timeout must be reported so and the next one run (the runner, with fake
steps: a second dry run would double the test's time), and a missing module must skip only
the steps that import it, with one line naming the fix.

The engine phases' dry runs (``step``, ``full``, ``paged``: each a whole engine phase, 50 s
together on a quiet 2-core machine, minutes of a loaded one's suite) are the rehearsal that
``make gpu-rehearsal`` runs before a GPU window (docs/GPU.md), not the suite: ``all``'s dry
run keeps the harness's plumbing, its files, budget and exit codes in every ``make test``.
``shared``'s step (issue 73: a draft in a process of its own) is seconds at its tiny shapes,
so the suite runs it, through the harness's ``--run`` in this process.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest

from load import gpu_check
from load.gpu import preflight
from load.gpu.runner import Step, Summary

ROOT = Path(__file__).resolve().parents[2]
# make gpu-rehearsal sets it: the engine phases' dry runs too.
rehearsal = pytest.mark.skipif(os.environ.get("SPECSERVE_GPU_REHEARSAL") != "1",
                               reason="an engine phase's dry run: `make gpu-rehearsal` (docs/GPU.md)")
FILES = {"env.json", "tests.xml", "identity.json", "bench.json", "memory.json", "profile.txt",
         "log.txt", "summary.json"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``load/gpu_check.py --phase all --dry-run`` once for the module: (folder, exit code)."""
    out = tmp_path_factory.mktemp("gpu")
    proc = subprocess.run([sys.executable, "load/gpu_check.py", "--phase", "all", "--dry-run",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=gpu_check.BUDGET_S * gpu_check.DRY_RUN_SLACK)  # a hang, not a slow CPU
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_dry_run_writes_every_file_and_no_more(dry_run):
    assert {p.name for p in dry_run.iterdir()} == FILES  # 8: the lent machine's limit
    summary = json.loads((dry_run / "summary.json").read_text())
    assert summary["phase"] == "all" and summary["dry_run"] and summary["finished"]
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [
        (name, "ok") for name in gpu_check.PHASES["all"]]
    assert all(s["seconds"] > 0 and s["file"] in FILES for s in summary["steps"])
    log = (dry_run / "log.txt").read_text()
    for name in gpu_check.PHASES["all"]:
        assert f"step {name}: start" in log and f"step {name}: ok" in log
    assert re.search(r"^\d\d:\d\d:\d\d ", log, re.M)  # timestamped


def test_env_names_the_machine(dry_run):
    env = json.loads((dry_run / "env.json").read_text())
    for key in ("gpu_name", "driver_version", "sm_count", "total_memory_bytes", "free_memory_bytes",
                "torch_cuda", "python", "packages"):
        assert key in env
    assert env["device"] == "cpu" and env["read_bandwidth_bytes_per_s"] > 0
    assert env["packages"]["torch"] and "triton" in env["packages"]


def test_tests_xml_is_junit(dry_run):
    root = ElementTree.parse(dry_run / "tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root[0]
    assert int(suite.get("tests")) >= 2 and int(suite.get("failures")) == int(suite.get("errors")) == 0


def test_identity_holds_on_the_cpu(dry_run):
    """The C kernels are row-invariant, so there a token's logits are bit-identical alone, in
    a verify and in a batch, and greedy speculation is exactly target-only."""
    report = json.loads((dry_run / "identity.json").read_text())
    assert set(report["kernels"]) == {"invariant", "library", "compiled"}
    for entry in report["kernels"].values():
        for way in ("verify_alone", "batch_decode", "batch_verify"):
            assert set(entry["row_invariance"][way]) == {"max_abs_diff", "argmax_flips", "rows",
                                                         "bit_identical"}
        spec = entry["speculation"]
        assert {"identical", "num_differ", "first_divergence", "acceptance_rate"} <= set(spec)
        assert spec["acceptance_rate"] > 0  # n-gram drafts were accepted: a real comparison
        assert spec["off_repeats"] and spec["accepted_tokens"] <= spec["draft_tokens"]
    invariant = report["kernels"]["invariant"]
    assert all(c["bit_identical"] and c["max_abs_diff"] == 0 for c in invariant["row_invariance"].values()
               if isinstance(c, dict))
    assert invariant["speculation"]["identical"] and invariant["speculation"]["num_differ"] == 0
    assert invariant["speculation"]["first_divergence"] is None


def test_bench_memory_and_profile(dry_run):
    bench = json.loads((dry_run / "bench.json").read_text())
    assert bench["complete"] and bench["cudagraph_skips"] == 0
    assert [(r["kernels"], r["rows"]) for r in bench["rows"]] == [
        ("library", 1), ("library", 2), ("compiled", 1), ("compiled", 2)]
    assert all(set(r["costs_s"]) == {"1", "5"} for r in bench["raw"])
    assert all(r["buckets_s"] for r in bench["raw"] if r["kernels"] == "compiled")
    memory = json.loads((dry_run / "memory.json").read_text())
    for entry in memory["kernels"].values():
        assert entry["estimate"]["total"] > 0 and set(entry["phases"]) == {"prefill", "verify"}
        assert entry["within_estimate"] is None and entry["workspace_ratio"] is None  # a CPU
    profile = (dry_run / "profile.txt").read_text()
    assert "kernels: compiled" in profile and "Name" in profile


STEP_ENTRIES = ("target_only", "host_gap", "target_only_batch", "host_profile", "launch_ahead_off",
                "suffix", "ngram", "seeded", "engine_loop", "self_draft", "eagle", "tp_world_1",
                "self_draft_compiled", "eagle_compiled")


def dry_phase(phase: str, out: Path) -> None:
    """``--phase PHASE --dry-run`` into ``out``: it exits 0 and leaves its one file, the log
    and the summary."""
    proc = subprocess.run([sys.executable, "load/gpu_check.py", "--phase", phase, "--dry-run",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=gpu_check.BUDGET_S * gpu_check.DRY_RUN_SLACK)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {f"{phase}.json", "log.txt", "summary.json"}


@rehearsal
def test_step_phase_runs_the_engine_end_to_end(tmp_path):
    """``--phase step --dry-run``: its own phase (``all`` is at the 8 files already), every
    entry of ``step.json`` measured, and on the CPU's row-invariant kernels every speculative
    run, greedy or seeded, in process or streamed through the engine loop, gives exactly
    target-only's tokens, with drafts made and accepted (a real comparison)."""
    dry_phase("step", tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [("step", "ok")]
    report = json.loads((tmp_path / "step.json").read_text())
    entries = report["entries"]
    assert tuple(entries) == STEP_ENTRIES
    for name, entry in entries.items():
        assert entry["status"] == "ok" or (entry["status"] == "skipped" and entry["reason"]), (name, entry)
        assert entry["device"] == "cpu"
    reference = entries["target_only"]
    assert reference["tokens"] == reference["num_prompts"] * report["settings"]["max_tokens"]
    assert reference["tokens_per_s"] > 0 and reference["step_s"] > 0
    for name in STEP_ENTRIES[1:]:
        if entries[name]["status"] == "ok":
            assert entries[name]["same_as_target_only"] is True, (name, entries[name])
    for part in (entries["suffix"]["first_pass"], entries["suffix"]["second_pass"], entries["ngram"],
                 entries["self_draft"], entries["eagle"]):
        assert 0 < part["accepted_tokens"] <= part["draft_tokens"]
    second = entries["suffix"]["second_pass"]
    assert second["acceptance_rate"] >= entries["suffix"]["first_pass"]["acceptance_rate"]
    assert entries["seeded"]["num_same"] == reference["num_prompts"]
    assert entries["engine_loop"]["same_as_generate"] is True
    tp = entries["tp_world_1"]  # gloo here: the all-reduce hooks' path
    assert tp["status"] == "ok" and tp["speculation"]["same_as_target_only"] is True, tp
    assert tp["speculation"]["draft_tokens"] > 0, tp
    assert reference["launch_ahead"] is False  # a CPU worker reads each step (TargetCalls)
    for name in ("self_draft", "eagle", "self_draft_compiled", "eagle_compiled"):
        assert entries[name]["draft"]["warm_up_s"] >= 0, entries[name]["draft"]  # as a draft actor
    assert entries["self_draft"]["draft"]["kernels"] != "compiled"  # what auto gives a draft
    for name in ("self_draft_compiled", "eagle_compiled"):
        assert entries[name]["draft"]["kernels"] == "compiled" and entries[name]["accepted_tokens"] > 0
    gap = entries["host_gap"]  # the profiler's busy time: torch's CPU operators here
    assert gap["busy_of"] == "CPU" and gap["intervals"] > 0 and 0 < gap["busy_s"] < gap["seconds"]
    assert gap["host_gap_ms_per_step"] > 0 and gap["same_as_target_only"] is True, gap
    host = entries["host_profile"]  # where a step's host time goes, per step
    assert len(host["top_own"]) >= 10 and host["same_as_target_only"] is True
    assert sum(r["own_ms"] for r in host["top_own"]) <= host["step_ms"], host
    assert any("spec_decode.py" in r["function"] for r in host["top_cumulative"]), host["top_cumulative"]
    for part in (entries["suffix"]["second_pass"], entries["self_draft"], entries["ngram"]):
        model = part["cost_model"]  # the cost model's prediction at the measured acceptance
        assert model["alpha"] == part["acceptance_rate"] and model["v"] > 0, part
        ratio, predicted = model["measured_over_predicted"], model["predicted_speedup"]
        # ratio x predicted is the speedup, within what rounding each to 3 decimals allows
        assert abs(ratio * predicted - part["speedup"]) <= 6e-4 * (1 + ratio + predicted), part


@rehearsal
def test_full_phase_runs_the_host_entries_in_one_slot(tmp_path):
    """``--phase full --dry-run``: step.py's host and suffix entries in one slot (on a GPU the
    whole 8B shape, where the device's part of a step outweighs the host's), every one run
    and each speculative or repeated pass target-only's tokens."""
    dry_phase("full", tmp_path)
    report = json.loads((tmp_path / "full.json").read_text())
    entries = report["entries"]
    assert tuple(entries) == ("target_only", "host_gap", "launch_ahead_off", "suffix", "host_profile")
    assert report["settings"]["batch"] == 1 and report["warm_up"] is not None
    for name in tuple(entries)[1:]:
        assert entries[name]["status"] == "ok" and entries[name]["same_as_target_only"] is True, entries[name]
    assert entries["suffix"]["second_pass"]["acceptance_rate"] > 0.5, entries["suffix"]


def test_shared_step_drafts_from_another_process(tmp_path):
    """``--run shared --dry-run`` (issue 73): a smaller draft model in a spawned process, the
    engine here drafting through the pipe. Drafts were made (else the comparison proves
    nothing), every prompt's greedy tokens are target-only's, nothing fell back, and the
    draft's process is gone after; memory is estimated but not measured on a CPU."""
    assert gpu_check.main(["--run", "shared", "--out", str(tmp_path), "--dry-run"]) == 0
    report = json.loads((tmp_path / "shared.json").read_text())
    entries = report["entries"]
    assert tuple(entries) == ("target_only", "shared_draft", "memory")
    assert all(e["status"] == "ok" for e in entries.values()), entries
    spec = entries["shared_draft"]
    assert spec["same_as_target_only"] is True and spec["num_same"] == report["settings"]["num_prompts"]
    assert spec["draft_tokens"] > 0 and spec["draft_fallbacks"] == 0 and spec["errors"] == 0, spec
    draft = report["draft"]
    assert draft["shape"] != report["settings"]["shape"] and draft["pid"] != os.getpid()
    assert not _alive(draft["pid"])
    memory = entries["memory"]
    assert memory["within_estimate"] is None and set(memory["device_used_gib"].values()) == {None}
    assert memory["estimate_gib"]["target"] > 0 and memory["estimate_gib"]["draft"] > 0


def test_the_devices_use_is_told_process_by_process(tmp_path, monkeypatch):
    """shared.json's ``processes_gib``: what the driver counts for each process, by role. No
    GPU here: a stand-in ``nvidia-smi`` prints the query's CSV as the driver's does (a
    container's "[N/A]" kept as said); none on the PATH gives None."""
    from load.gpu.shared import device_processes

    monkeypatch.setenv("PATH", str(tmp_path))
    assert device_processes({}) is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '101, 4096\\n202, 3072\\n303, [N/A]\\n'\n")
    smi.chmod(0o755)
    assert device_processes({101: "target", 202: "draft"}) == {"target": 4.0, "draft": 3.0, "303": "[N/A]"}


def test_union_of_intervals_counts_overlaps_once():
    """host_gap's device-busy time: nested and overlapping kernels count once, gaps not."""
    from load.gpu.step import union_us

    assert union_us([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (5.5, 5.6), (2.0, 2.5)]) == 4.0
    assert union_us([]) == 0.0


@rehearsal
def test_paged_phase_compares_the_layouts_end_to_end(tmp_path):
    """``--phase paged --dry-run`` (issue 53): every entry of ``paged.json`` measured on the
    compiled path over FlexAttention with a shuffled pool: the decode and verify logits the
    slot cache's bit for bit (the chunk's and the prefix hit's within eager FlexAttention's
    last bits: ``tests/engine/runtime/test_paged_compiled.py``), the greedy tokens the same, a real
    prefix hit, and the chunk-gap figures with their bound."""
    dry_phase("paged", tmp_path)
    report = json.loads((tmp_path / "paged.json").read_text())
    entries = report["entries"]
    assert tuple(entries) == ("logits", "greedy", "prefix", "chunk_gap")
    assert all(e["status"] == "ok" and e["device"] == "cpu" for e in entries.values()), entries
    kinds = entries["logits"]["kinds"]
    assert kinds["decode"]["bit_identical"] and kinds["verify"]["bit_identical"], kinds
    assert all(k["argmax_flips"] == 0 and k["max_abs_diff"] < 1e-4 for k in kinds.values()), kinds
    assert entries["greedy"]["num_same"] == report["settings"]["num_prompts"]
    prefix = entries["prefix"]
    assert prefix["hit_tokens"] == report["settings"]["prefix"] and prefix["argmax_flips"] == 0
    gap = entries["chunk_gap"]
    assert gap["largest_gap_s"] > 0 and gap["median_step_s"] > 0 and gap["chunks"] == 3
    assert gap["free_slots"] == report["settings"]["batch"] + 2  # every request ended


def _fake(name: str, code: str, output: str, timeout_s: float = 60) -> Step:
    return Step(name, [sys.executable, "-c", code], timeout_s, (), output)


def test_a_step_past_its_timeout_is_killed_and_the_next_runs(tmp_path):
    """The timeout override of one step, through the same loop a phase runs. The killed
    step's partial file stays; its child process dies with it. The step's timeout leaves a
    busy machine seconds to start Python and write the file (1.5 s did not, once, under
    load); the step would sleep for 10 minutes."""
    sleeper = ("import json, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
               "'import time; time.sleep(600)']); open(sys.argv[1], 'w').write(str(p.pid)); "
               "print('partial written', flush=True); time.sleep(600)")
    steps = [Step("slow", [sys.executable, "-c", sleeper, str(tmp_path / "slow.txt")], 60, (), "slow.txt"),
             _fake("next", f"open({str(tmp_path / 'next.txt')!r}, 'w').write('ran')", "next.txt")]
    args = gpu_check.parse_args(["--out", str(tmp_path), "--timeout", "slow=8"])
    summary = Summary(tmp_path / "summary.json", {"phase": "test"}, steps)
    start = time.monotonic()
    gpu_check.run_phase(args, steps, summary, deadline=time.monotonic() + 900)
    assert time.monotonic() - start < 300  # killed at its timeout, long before its 600 s
    outcomes = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [(o["step"], o["status"]) for o in outcomes] == [("slow", "timeout"), ("next", "ok")]
    assert "partial slow.txt kept" in outcomes[0]["reason"]
    assert not _alive(int((tmp_path / "slow.txt").read_text()))


def _alive(pid: int) -> bool:
    """Running, not a zombie (a killed orphan may wait for a reaper that never comes here)."""
    time.sleep(0.2)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_failed_step_says_why_in_one_line_and_the_budget_skips(tmp_path):
    steps = [_fake("boom", "raise SystemExit('ValueError: the reason')", "boom.txt"),
             _fake("late", "pass", None)]
    args = gpu_check.parse_args(["--out", str(tmp_path)])
    summary = Summary(tmp_path / "summary.json", {}, steps)
    gpu_check.run_phase(args, steps[:1], summary, deadline=time.monotonic() + 60)
    gpu_check.run_phase(args, steps[1:], summary, deadline=time.monotonic() + 5)  # < MIN_STEP_S
    got = {o.step: o for o in summary.outcomes.values()}
    assert got["boom"].status == "failed" and "ValueError: the reason" in got["boom"].reason
    assert got["late"].status == "skipped" and "budget" in got["late"].reason


def test_a_missing_module_skips_only_the_steps_that_need_it(tmp_path, caplog):
    steps = [_fake("needs", "pass", None), _fake("free", "pass", None)]
    steps[0] = Step("needs", steps[0].argv, 60, ("torch", "no_such_module_gpu_check"), None)
    args = gpu_check.parse_args(["--out", str(tmp_path), "--dry-run"])
    summary = Summary(tmp_path / "summary.json", {}, steps)
    with caplog.at_level("INFO", logger="gpu-check"):
        assert gpu_check.check_first(args, steps, summary)
    lines = [r.getMessage() for r in caplog.records if "missing" in r.getMessage()]
    assert len(lines) == 1 and "no_such_module_gpu_check" in lines[0] and "make gpu-wheels" in lines[0]
    assert summary.outcomes["needs"].status == "skipped" and summary.outcomes["free"].status == "pending"


def test_no_cuda_stops_the_phase_in_one_line(tmp_path, caplog, monkeypatch):
    steps = [_fake("a", "pass", None)]
    monkeypatch.setattr(preflight, "cuda", lambda *a, **k: {"available": False, "torch": "2.x", "cuda": None})
    args = gpu_check.parse_args(["--out", str(tmp_path)])
    summary = Summary(tmp_path / "summary.json", {}, steps)
    with caplog.at_level("INFO", logger="gpu-check"):
        assert not gpu_check.check_first(args, steps, summary)
    assert any("no CUDA device" in r.getMessage() for r in caplog.records)
    assert summary.outcomes["a"].status == "skipped"


def test_every_step_needs_what_its_modules_import():
    """The preflight's lists name modules that exist here (a typo would skip a step forever)."""
    table = gpu_check.step_table(Path("/tmp/x"), dry_run=False)
    assert set(table) == {name for steps in gpu_check.PHASES.values() for name in steps}
    assert not preflight.missing([m for s in table.values() for m in s.needs])
    # every phase leaves its steps' files, log.txt and summary.json: 8 at most (the machine's)
    assert all(len(set(steps)) + 2 <= 8 for steps in gpu_check.PHASES.values()), gpu_check.PHASES


def test_the_carried_wheels_are_the_tested_versions():
    """``make gpu-wheels`` pins what .venv has: the GPU machine runs what the suite tested."""
    makefile = (ROOT / "Makefile").read_text()
    pins = dict(re.findall(r"([a-z][a-z-]+)==([\w.]+)", makefile.split("GPU_WHEELS ?=")[1].split("\n\n")[0]))
    assert {"pydantic", "pydantic-core", "llguidance", "typing-extensions"} <= set(pins)
    assert {name: importlib.metadata.version(name) for name in pins} == pins


def test_first_divergence_is_the_earliest_token_then_the_lowest_prompt():
    from load.gpu.identity import first_divergence

    same = [[1, 2, 3], [4, 5, 6]]
    assert first_divergence(same, same) is None
    assert first_divergence(same, [[1, 2, 9], [4, 7, 6]]) == {"prompt": 1, "token": 1, "off": 5, "on": 7}
    assert first_divergence([[1, 2]], [[1, 2, 3]]) == {"prompt": 0, "token": 2, "off": -1, "on": 3}
