"""The house stays in order (issue 19): no import circle, no stage reaching into
another's privates, no big room without a reason.

* ``python ../shared/tools/import_cycles.py --max-lines 900`` (the workplace's
  checker, beside the clone) exits 0: no circle in ``lowering/``, ``tasks/``,
  ``flows/`` and no room over 900 lines.  Skipped where the checker is absent.
* No module of ours imports a ``_private`` name of another module of ours: what
  two rooms share is public in the lower one.
* A room over 700 lines says why in its module docstring, in a sentence that
  starts with "Why one room:".
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lowering", "tasks", "flows")
CHECKER = ROOT.parent / "shared" / "tools" / "import_cycles.py"


def rooms() -> list[Path]:
    """Every source file of the product, generated code left out."""
    return sorted(
        p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
        if "generated" not in p.parts and "__pycache__" not in p.parts
    )


def test_no_import_circle_and_no_room_over_900_lines():
    if not CHECKER.is_file():
        pytest.skip(f"{CHECKER} is not here")
    done = subprocess.run([sys.executable, str(CHECKER), "--max-lines", "900"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "big room" not in done.stdout, done.stdout


def _private_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        ours = node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
        for alias in node.names if ours else ():
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}")
    return found


def test_no_module_imports_another_modules_private_names():
    found = [line for path in rooms() for line in _private_imports(path)]
    assert not found, "\n".join(found)


def test_a_room_over_700_lines_says_why():
    unexplained = []
    for path in rooms():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 700 and "Why one room:" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not unexplained, "rooms over 700 lines without a 'Why one room:' sentence: " + ", ".join(unexplained)
