"""The package's shape (issue 38), read from its source with ``ast``: nothing is imported or run,
so these take milliseconds.

- no module of ``services/`` over 600 lines, no class over 300;
- no import loop between modules, and none between the engine's rooms (its folders
  ``kv/``, ``runtime/``, ``step/``, ``drafts/`` and its loose modules, as ``farm-studio look``
  draws them): the engine is a stack, no folder holds more than 15 files, and the step's
  parts (scheduler, draft link, K planner) import none of each other (issue 51);
- the names the project retired stay retired, and every ``specserve.<module>`` a docstring or
  a doc names exists.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "services" / "specserve"
MAX_MODULE_LINES, MAX_CLASS_LINES = 600, 300


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports (``from a import b`` counts ``a.b`` where
    that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else ".".join(
                name.split(".")[:-node.level] + [node.module])
            out |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            out.add(base)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_module_or_class_is_too_long_to_read_in_one_sitting():
    long = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(ROOT)}: class {node.name}, "
                            f"{node.end_lineno - node.lineno + 1} lines")
    assert not long


def test_no_import_loop_between_modules_or_the_engines_folders():
    graph = _graph()
    loops = sorted(m for m in graph if m in _reach(graph, m))
    assert not loops, f"modules in an import loop: {loops}"
    rooms = {room: set() for room in map(_room, graph) if room.startswith("specserve.engine.")}
    for module, imported in graph.items():
        if _room(module) in rooms:
            rooms[_room(module)] |= {_room(m) for m in imported if _room(m) in rooms} - {_room(module)}
    room_loops = sorted(r for r in rooms if r in _reach(rooms, r))
    assert not room_loops, f"engine folders in an import loop: {room_loops}"
    parts = {"specserve.engine.step.scheduler", "specserve.engine.drafts.draft_link",
             "specserve.engine.step.k_planner"}
    assert not [(m, i) for m in parts for i in _reach(graph, m) & parts], "the step's parts import each other"
    crowded = [d for d in (PACKAGE / "engine").rglob("*") if d.is_dir() and d.name != "__pycache__"
               and sum(1 for f in d.iterdir() if f.is_file()) > 15]
    assert not crowded, f"folders of more than 15 files: {crowded}"


def _room(module: str) -> str:
    """An engine module's room: its folder below ``specserve.engine``, or itself."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 and parts[:2] == ["specserve", "engine"] else module


def test_the_loop_check_catches_a_planted_loop():
    """Planted: ``verification`` importing a proposer again (as before issue 38)."""
    graph = _graph()
    graph["specserve.engine.step.verification"].add("specserve.engine.drafts.base")
    proposers = [m for m in graph if m.startswith("specserve.engine.drafts.")]
    below = set().union(*(_reach(graph, p) for p in proposers)) - set(proposers)
    assert "specserve.engine.step.verification" in below
    assert any(i.startswith("specserve.engine.drafts") for i in graph["specserve.engine.step.verification"])


# Names issue 38 retired: what each stood for now has one name (engine/__init__.py's glossary).
RETIRED = [r"self\.core\b", r"spec-coordinator", r"SpecServeAPI", r":mod:`\.coordinator`",
           r":mod:`\.groups`", r"specserve\.draft\b", r"proposers\.base import (Proposal|TopK|DraftRequest)",
           r"verification import masked",
           r"SpecDecodeEngine\._(constrain|plan|schedule|admit|propose|fork|release|draft_lost|match|preempt)\b"]
DOC_FILES = ["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _texts() -> dict[str, str]:
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "load").rglob("*.py"),
             *(ROOT / "deploy").rglob("*.py"), *(ROOT / d for d in DOC_FILES)]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths
            if p.name != "test_house.py" and "helm" not in p.parts}  # (helm: values paths)


@pytest.mark.parametrize("pattern", RETIRED)
def test_a_retired_name_is_nowhere(pattern):
    found = [name for name, text in _texts().items() if re.search(pattern, text)]
    assert not found, f"{pattern!r} in {found}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_specserve_name_in_code_and_docs_exists():
    """``specserve.engine.step.proposal.TopK`` in a docstring or a doc names something real (the
    package's modules are imported to check). Checked: names under a module or package of
    ``specserve`` (or one it had); a Helm values path or template (``specserve.auth.enabled``,
    ``specserve.fullname``), a logger's or a file's name is no module path."""
    tops = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    tops |= {"draft", "coordinator", "groups"}  # modules it had: a mention must not come back
    missing = sorted({f"{name}: {m.group(0)}" for name, text in _texts().items()
                      for m in re.finditer(r"(?<![\w/-])specserve(?:\.[A-Za-z_]\w*)+", text)
                      if m.group(0).split(".")[1] in tops and not _resolves(m.group(0))})
    assert not missing
