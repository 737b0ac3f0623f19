"""The import graph follows the data path: pyproject.toml's import-linter contracts (layers from
the front ends down to the policies and model files, no cycle between the modules of a package)
hold, and they fail on an upward import or a cycle; no module loads another through importlib."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "orchestrator"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the package under root, with root's pyproject.toml (no cache: a fresh graph)."""
    return subprocess.run([str(LINT_IMPORTS), "--config", "pyproject.toml", "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "broken" in out.stdout and ", 0 broken" in out.stdout, out.stdout


@pytest.mark.parametrize("module, line, contract", [
    # the simulator reaching up to the live session
    ("orchestrator/sim/trace.py", "import orchestrator.decoding.speculative", "layers"),
    # a policy importing the engine
    ("orchestrator/policies/plan.py", "from orchestrator.runtime import native", "layers"),
    # two modules of one package importing each other (native already imports pool)
    ("orchestrator/runtime/pool.py", "from orchestrator.runtime import native", "no import cycle"),
])
def test_the_contracts_fail_on_an_upward_import_or_a_cycle(tmp_path, module, line, contract):
    shutil.copytree(PACKAGE, tmp_path / "orchestrator", ignore=shutil.ignore_patterns("__pycache__", "*.gguf"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # noqa: E402\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0, out.stdout
    broken = [ln for ln in out.stdout.splitlines() if ln.endswith("BROKEN")]
    assert any(ln.startswith(contract) for ln in broken), out.stdout


def test_no_module_is_loaded_through_importlib():
    users = [p.relative_to(ROOT) for p in sorted(PACKAGE.rglob("*.py")) if "import_module(" in p.read_text()]
    assert not users, users


def test_long_modules_say_why_and_how_long_truthfully():
    """A module over 400 lines says why in its docstring ("Why ~N lines" or "Why one module of ~N
    lines"), with N within 15% of its length, so that the header cannot drift as the code grows."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        n = text.count("\n")
        said = re.search(r"Why (?:one module of )?~(\d+) lines", text)
        if said is None:
            if n > 400:
                wrong.append(f"{path.relative_to(ROOT)}: {n} lines, no 'Why ~N lines' in its docstring")
        elif abs(int(said.group(1)) - n) > 0.15 * n:
            wrong.append(f"{path.relative_to(ROOT)}: says ~{said.group(1)} lines, has {n}")
    assert not wrong, "\n".join(wrong)
