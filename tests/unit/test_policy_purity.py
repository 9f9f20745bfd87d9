"""backend/policy is the pure scheduling core: importing it loads no torch, sglang, aiohttp or
sqlalchemy (checked in a fresh interpreter, since this test process may have loaded them)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import backend.policy

FORBIDDEN = ("torch", "sglang", "aiohttp", "sqlalchemy")


def test_policy_imports_nothing_heavy() -> None:
    modules = [m.name for m in pkgutil.walk_packages(backend.policy.__path__, "backend.policy.")]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"backend.policy loaded {out.stdout.strip()}"
    assert "backend.policy.types" in modules and "backend.policy.latency" in modules
