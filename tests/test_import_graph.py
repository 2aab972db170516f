"""The package's import graph has no circles and no module is over 700 lines.

The graph is read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for every import of a
raycurate module ``b`` anywhere in ``a``: at the top level, inside a function (a lazy import still makes a loop
between two modules that each need the other) and under ``if TYPE_CHECKING:`` (a loop of types is still a loop: the
shared type belongs in a module below both).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "raycurate"
MAX_LINES = 700
OVER_LENGTH_ALLOWED: set[str] = set()  # a module that must stay longer is listed here with the reason


def module_name(path: Path) -> str:
    """``raycurate/a/b.py`` -> ``raycurate.a.b``; a package's ``__init__.py`` -> the package's name."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth (function bodies and ``if TYPE_CHECKING:`` included)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def imported_names(name: str, path: Path, known: set[str]) -> set[str]:
    """The raycurate modules that module ``name`` (file ``path``) imports.

    ``from pkg import sub`` imports the submodule ``pkg.sub`` (not what ``pkg/__init__.py`` itself imports), so the
    edge goes to ``pkg.sub``; ``from mod import name`` of a function or class goes to ``mod``.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: from .x import y / from .. import y
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:  # from pkg import sub: the submodule; from mod import name: the module
            targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {target for target in targets if target in known and target != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the raycurate modules it imports."""
    found = modules()
    return {name: imported_names(name, path, set(found)) for name, path in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` when the graph has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_reports_a_loop_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imported_names_sees_lazy_type_only_and_submodule_imports(tmp_path):
    source = ("from raycurate.pipelines import sft\n"
              "def f():\n    from raycurate.training.engines import build\n"
              "if TYPE_CHECKING:\n    from raycurate.config.schema import JobConfig\n"
              "from raycurate.pipelines.sft import run_sft_pipeline\n")
    path = tmp_path / "mod.py"
    path.write_text(source)
    known = {"raycurate.pipelines", "raycurate.pipelines.sft", "raycurate.training.engines",
             "raycurate.config.schema", "raycurate.x"}
    assert imported_names("raycurate.x", path, known) == {"raycurate.pipelines.sft", "raycurate.training.engines",
                                                          "raycurate.config.schema"}


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50, f"found only {len(graph)} modules under {PACKAGE}"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or []) + (
        "; move what both sides need (a function, a type, a protocol) into a module "
        "below both")


def test_no_module_over_max_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and relative not in OVER_LENGTH_ALLOWED:
            long.append(f"{relative}: {lines} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them along their concerns):\n" + "\n".join(long)
