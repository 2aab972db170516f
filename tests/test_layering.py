"""Imports point down only: cli/config -> pipelines -> stages (the only Ray code) -> training (torch/DeepSpeed
training machinery) -> algorithms -> models/data."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "raycurate"

# For each layer, the top-level modules it must never import.
FORBIDDEN = {
    "algorithms": {"ray", "raycurate.stages", "raycurate.training", "raycurate.pipelines", "raycurate.cli", "deepspeed",
                   "vllm"},
    "models": {"ray", "raycurate.stages", "raycurate.training", "raycurate.pipelines", "raycurate.cli",
               "raycurate.algorithms"},
    "data": {"ray", "raycurate.stages", "raycurate.training", "raycurate.pipelines", "raycurate.cli",
             "raycurate.algorithms", "raycurate.models"},
    "training": {"ray", "raycurate.stages", "raycurate.pipelines", "raycurate.cli", "vllm"},
    "stages": {"raycurate.pipelines", "raycurate.cli"},
    "pipelines": {"ray", "raycurate.cli"},
    "report": {"ray", "raycurate.stages", "raycurate.training", "raycurate.pipelines", "raycurate.cli"},
    # Config sections are plain dataclasses: they may use models/data/errors/rundir-level modules only.
    "config": {"ray", "raycurate.stages", "raycurate.training", "raycurate.pipelines", "raycurate.cli",
               "raycurate.algorithms", "raycurate.report"},
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


@pytest.mark.parametrize("layer, heavy", [("algorithms", ("ray", "deepspeed")), ("training", ("ray",))])
def test_layer_modules_import_no_ray_at_runtime(layer, heavy):
    """Importing every module of ``layer`` in a fresh interpreter loads none of ``heavy`` (nor their submodules)."""
    modules = sorted(".".join(p.relative_to(PACKAGE / layer).with_suffix("").parts)
                     for p in (PACKAGE / layer).rglob("*.py") if p.stem != "__init__")
    assert modules, f"no {layer} modules found"
    assert layer != "algorithms" or "bridge.fidelity.proxies" in modules  # sub-packages are walked too
    code = (
        "import sys\n"
        + "".join(f"import raycurate.{layer}.{m}\n" for m in modules)
        + f"bad = [m for m in sys.modules if m.split('.')[0] in {heavy!r}]\n"
        + "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_import_raycurate_is_cheap():
    code = "import sys, raycurate; heavy = {'torch', 'ray', 'transformers', 'deepspeed'} & set(sys.modules); " \
           "assert not heavy, heavy"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)




def private_imports(path: Path) -> list[str]:
    """``module._name`` for every ``from raycurate.module import _name`` in a file (dunder names excepted)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "raycurate":
            found.extend(f"{node.module}.{alias.name}" for alias in node.names
                         if alias.name.startswith("_") and not alias.name.startswith("__"))
    return found


def test_no_module_imports_a_private_name_of_another():
    problems = [f"{path.relative_to(PACKAGE.parent)} imports {name}"
                for path in sorted(PACKAGE.rglob("*.py")) for name in private_imports(path)]
    assert not problems, "private names imported across modules (make them public helpers):\n" + "\n".join(problems)


MAX_MODULE_LINES = 600


def test_long_modules_say_why_they_are_one_module():
    """A module over MAX_MODULE_LINES lines is split, or its docstring gives the reason ("Why one ...")."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if text.count("\n") <= MAX_MODULE_LINES:
            continue
        if "Why one" not in (ast.get_docstring(ast.parse(text)) or ""):
            problems.append(f"{rel}: {text.count(chr(10))} lines")
    assert not problems, "split these modules or explain at the top why they are one:\n" + "\n".join(problems)
def test_python_api_is_lazy_and_cheap():
    """``raycurate.ingest`` & co. import raycurate/api.py on first use, and that import pulls in no heavy module."""
    code = ("import sys, raycurate\n"
            "assert 'raycurate.api' not in sys.modules\n"
            "assert callable(raycurate.bridge_select) and 'raycurate.api' in sys.modules\n"
            "assert {'ingest', 'train', 'evaluate'} <= set(dir(raycurate))\n"
            "heavy = {'torch', 'ray', 'transformers', 'deepspeed'} & set(sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
