"""The import graph follows the data path: the simulator and the policies are leaves that never
reach the live side (session, engine, CLI), and no module loads another through importlib."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "orchestrator"
# what the decision side may import: plain data, the policies and their estimator/balancer
DECISION_SIDE = ("orchestrator.plan", "orchestrator.policies", "orchestrator.estimator", "orchestrator.balancer")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def orchestrator_imports(path: Path) -> set[str]:
    """Every orchestrator.* module a file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orchestrator"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from orchestrator import native`
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("orchestrator"))
    return out


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


@pytest.mark.parametrize("leaf, allowed", [
    # model_sizes: a GGUF's sizes from its header (it imports gguf only)
    ("orchestrator.sim", DECISION_SIDE + ("orchestrator.sim", "orchestrator.model_sizes")),
    ("orchestrator.policies", DECISION_SIDE),
])
def test_leaves_import_only_the_decision_side(leaf, allowed):
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name != leaf and not name.startswith(leaf + "."):
            continue
        for imp in orchestrator_imports(path):
            if _is_module(imp) and not any(imp == a or imp.startswith(a + ".") for a in allowed):
                bad.append(f"{name} imports {imp}")
    assert not bad, "\n".join(bad)


def test_no_module_is_loaded_through_importlib():
    users = [module_name(p) for p in sorted(PACKAGE.rglob("*.py")) if "import_module(" in p.read_text()]
    assert not users, users
