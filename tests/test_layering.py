"""Imports point down only: cli/config -> pipelines -> stages (the only Ray code) -> algorithms -> models/data."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raycurate"

# For each layer, the top-level modules it must never import.
FORBIDDEN = {
    "algorithms": {"ray", "raycurate.stages", "raycurate.pipelines", "raycurate.cli", "deepspeed", "vllm"},
    "models": {"ray", "raycurate.stages", "raycurate.pipelines", "raycurate.cli", "raycurate.algorithms"},
    "data": {"ray", "raycurate.stages", "raycurate.pipelines", "raycurate.cli", "raycurate.algorithms",
             "raycurate.models"},
    "stages": {"raycurate.pipelines", "raycurate.cli"},
    "pipelines": {"ray", "raycurate.cli"},
    "report": {"ray", "raycurate.stages", "raycurate.pipelines", "raycurate.cli"},
}
# Single modules outside the layer folders, checked as the layer they sit at.
MODULE_LAYERS = {"api.py": "pipelines"}


def imported_modules(path: Path) -> set[str]:
    """Every module name imported anywhere in a file (top level or inside functions)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def violates(name: str, forbidden: set[str]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in forbidden)


def test_layers_import_downward_only():
    problems = []
    for layer, forbidden in FORBIDDEN.items():
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for name in imported_modules(path):
                if violates(name, forbidden):
                    problems.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    for module, layer in MODULE_LAYERS.items():
        for name in imported_modules(PACKAGE / module):
            if violates(name, FORBIDDEN[layer]):
                problems.append(f"raycurate/{module} imports {name}")
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_algorithm_modules_import_no_ray_at_runtime():
    modules = sorted(p.stem for p in (PACKAGE / "algorithms").glob("*.py") if p.stem != "__init__")
    assert modules, "no algorithm modules found"
    code = (
        "import sys\n"
        + "".join(f"import raycurate.algorithms.{m}\n" for m in modules)
        + "bad = [m for m in sys.modules if m == 'ray' or m.startswith('ray.') or m.startswith('deepspeed')]\n"
        + "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_import_raycurate_is_cheap():
    code = "import sys, raycurate; heavy = {'torch', 'ray', 'transformers', 'deepspeed'} & set(sys.modules); " \
           "assert not heavy, heavy"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_python_api_is_lazy_and_cheap():
    """``raycurate.ingest`` & co. import raycurate/api.py on first use, and that import pulls in no heavy module."""
    code = ("import sys, raycurate\n"
            "assert 'raycurate.api' not in sys.modules\n"
            "assert callable(raycurate.bridge_select) and 'raycurate.api' in sys.modules\n"
            "assert {'ingest', 'train', 'evaluate'} <= set(dir(raycurate))\n"
            "heavy = {'torch', 'ray', 'transformers', 'deepspeed'} & set(sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
