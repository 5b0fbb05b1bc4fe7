"""No import circles among rannc_fx's modules, read from the source (no module is imported).

Every ``import`` counts: at module level, under ``TYPE_CHECKING`` and inside functions (a
lazy import that dodges a circle is still one). Importing ``a.b`` runs ``a/__init__`` too,
but that implicit edge is not counted: a package's ``__init__`` re-exporting its own modules
would otherwise close a circle with every module inside it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import rannc_fx

ROOT = Path(rannc_fx.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("rannc_fx", *path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once a session (several tests read every module)."""
    return ast.parse(path.read_text())


def import_graph() -> dict[str, set[str]]:
    """Module -> the rannc_fx modules it imports (the deepest that exists of each target)."""
    return {name: set(deps) for name, deps in _import_graph().items()}


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "rannc_fx.plan.plan" in graph["rannc_fx.runtime.executor"]
    assert "rannc_fx.search" in graph["rannc_fx.planner.driver"]


def test_the_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back():
    assert circles(import_graph()) == []


def _external(name: str) -> set[str]:
    """The modules outside rannc_fx that ``name`` imports, anywhere in its source."""
    path, _ = _modules()[name]
    out: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return {m for m in out if not m.startswith("rannc_fx")}


FOLDERS = ["capture", "shapes", "profile", "group", "search", "planner", "plan", "split",
           "startup", "schedules", "runtime", "state"]


def test_the_runtime_imports_only_the_plan_the_schedules_and_itself():
    for name, deps in import_graph().items():
        if name.startswith("rannc_fx.runtime"):
            outside = {d for d in deps if not d.startswith(
                ("rannc_fx.runtime", "rannc_fx.plan.", "rannc_fx.schedules."))}
            assert not outside, (name, outside)


def test_the_schedules_are_data_below_the_runtime_and_the_planner():
    """No module of ``schedules/`` imports torch, the runtime, the planner or the search: a
    schedule and its lowering are data the planner and every rank read alike."""
    for name, deps in import_graph().items():
        if name.startswith("rannc_fx.schedules"):
            outside = {d for d in deps if not d.startswith(("rannc_fx.schedules", "rannc_fx.plan."))}
            assert not outside, (name, outside)
            assert not {m for m in _external(name) if m.split(".")[0] == "torch"}, name


def test_the_plan_imports_no_pass_no_runtime_and_no_schedule_lowering():
    for name, deps in import_graph().items():
        if name.startswith("rannc_fx.plan."):
            outside = {d for d in deps if not d.startswith("rannc_fx.plan.")
                       and d != "rannc_fx.schedules.kinds"}
            assert not outside, (name, outside)


def test_the_folders_tell_the_pipeline_in_order():
    """``rannc_fx/__init__`` lists the folders in the order a model goes through them, and each
    folder's docstring starts with its place in that order."""
    doc = rannc_fx.__doc__ or ""
    listed = [line.split()[0] for line in doc.splitlines()
              if line.startswith("    ") and line.split()[0] in FOLDERS]
    assert listed == FOLDERS
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(FOLDERS)
    for k, folder in enumerate(FOLDERS, 1):
        first = (ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text())) or "")
        assert first.startswith(f"{k}. "), (folder, first[:40])
