"""The unit tier imports no torch, Triton or SGLang: those take seconds to import and belong to
tests that need the engine's machinery (tests/functional, marked `slow`).

Three checks, each catching what the others cannot:

* statically, every import statement in tests/unit (at any depth: also inside a fixture or a
  test), and ``importorskip``/``import_module`` of a literal name;
* in a fresh interpreter, importing each tests/unit module, with the heavy packages blocked, so
  that an import through a project module (``backend.sglang_ext.hooks`` imports SGLang) is named
  with the test module that caused it;
* at run time, tests/unit/conftest.py fails a unit test after which one of them is loaded and
  was not before (a project function that imports them lazily).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("torch", "triton", "sglang")
UNIT_DIR = Path(__file__).resolve().parent
REPO_ROOT = UNIT_DIR.parents[1]
_IMPORT_CALLS = ("importorskip", "import_module", "__import__")


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if (
                name in _IMPORT_CALLS
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                found.append((node.lineno, first.value))
    return found


def test_no_unit_test_names_a_heavy_package() -> None:
    offenders = [
        f"tests/unit/{path.name}:{line}: {name}"
        for path in sorted(UNIT_DIR.glob("*.py"))
        for line, name in _imported_names(ast.parse(path.read_text(), filename=str(path)))
        if name.split(".")[0] in FORBIDDEN
    ]
    assert offenders == [], (
        "unit tests import heavy packages (move them to tests/functional):\n"
        + ("\n".join(offenders))
    )


_PROBE = """
import importlib, json, sys
FORBIDDEN = {forbidden!r}
current = [None]
attempts = {{}}

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            attempts.setdefault(current[0], []).append(name)
            raise ModuleNotFoundError(f"{{name}} is blocked in the unit tier")
        return None

sys.meta_path.insert(0, Block())
errors = {{}}
for module in {modules!r}:
    current[0] = module
    try:
        importlib.import_module(module)
    except Exception as exc:
        errors[module] = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps({{"attempts": attempts, "errors": errors}}))
"""


def test_no_unit_test_module_loads_a_heavy_package() -> None:
    modules = [f"tests.unit.{p.stem}" for p in sorted(UNIT_DIR.glob("*.py"))]
    code = _PROBE.format(forbidden=FORBIDDEN, modules=modules)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    attempts = {m: sorted(set(names)) for m, names in result["attempts"].items()}
    assert attempts == {}, f"unit test modules load heavy packages (through): {attempts}"
    assert result["errors"] == {}, result["errors"]
    assert len(modules) > 40  # the glob found the tier
