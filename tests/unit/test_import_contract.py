"""The folders are the layers: every import between tandem's own packages points down.

    common → backend (policy · sim · kernels · sglang_ext · launch) → gateway → bench → tandem

`common/` holds the config structs and the wire types and imports only the standard library,
msgspec and yaml; `backend/policy/` is the pure core that every layer above may use;
`backend/sglang_ext/` is the only code that imports sglang; the gateway never imports the
engine's internals (simulator, SGLang adapter, launchers, kernels); the bench library sits on
the engine layers and reaches the gateway over HTTP only, while `bench/studies/` (the lab) may
time any layer below the console script; `tandem/` is the console script, the only place that
wires everything together. Each import statement is read from the source (function-local ones too),
so a lazy import cannot hide an arrow that points the wrong way.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "backend", "gateway", "bench", "tandem", "migrations")

# layer → the project layers it may import (besides itself). Layers are the first one or two
# components of a module name; the longest matching prefix wins.
ALLOWED: dict[str, frozenset[str]] = {
    "common": frozenset(),
    "backend.policy": frozenset({"common"}),
    "backend.kernels": frozenset(),
    "backend.sim": frozenset({"common", "backend.policy"}),
    "backend.sglang_ext": frozenset({"common", "backend.policy", "backend.kernels"}),
    "backend.launch": frozenset({"common", "backend.policy"}),
    "gateway": frozenset({"common", "backend.policy"}),
    "migrations": frozenset({"common", "gateway"}),
    "bench": frozenset(
        {"common", "backend.policy", "backend.sim", "backend.kernels", "backend.launch"}
    ),
    # the lab: one-off studies may time any layer below the console script, the gateway's and
    # the engine driver's too (on stand-ins: its modules import no SGLang)
    "bench.studies": frozenset(
        {
            "common",
            "backend.policy",
            "backend.sim",
            "backend.kernels",
            "backend.launch",
            "backend.sglang_ext",
            "gateway",
            "bench",
        }
    ),
    "tandem": frozenset(
        {
            "common",
            "backend.policy",
            "backend.sim",
            "backend.launch",
            "gateway",
            "bench",
            "migrations",
        }
    ),
}

# Third-party packages a layer may import; None: no restriction beyond the layer arrows.
THIRD_PARTY: dict[str, frozenset[str] | None] = {
    "common": frozenset({"msgspec", "yaml"}),
}

STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


def layer_of(module: str) -> str | None:
    """The layer a module of the project belongs to; None for a module outside the project."""
    parts = module.split(".")
    two = ".".join(parts[:2])
    if two in ALLOWED:
        return two
    return parts[0] if parts[0] in ALLOWED else None


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "versions" in path.parts and package == "migrations":
                continue  # Alembic revisions: plain SQL operations, no project imports
            yield module_name(path), path


def imports_of(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Every imported module name of *path*, with its line (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            yield name, node.lineno
            for alias in node.names:  # `from pkg import submodule`
                sub = f"{name}.{alias.name}"
                path_of_sub = REPO / sub.replace(".", "/")
                if path_of_sub.with_suffix(".py").is_file() or path_of_sub.is_dir():
                    yield sub, node.lineno


def wrong_arrows() -> list[str]:
    found = []
    for module, path in project_modules():
        if module.endswith("__main__") or module == "backend":
            continue  # an entry point (nothing imports it, it may wire anything); a bare folder
        source = layer_of(module)
        assert source is not None, f"{module} belongs to no layer"
        for name, line in imports_of(path, module):
            top = name.split(".")[0]
            target = layer_of(name)
            where = f"{path.relative_to(REPO)}:{line}"
            if target is not None:
                if target != source and target not in ALLOWED[source]:
                    found.append(f"{where}: {source} → {target} ({name})")
            elif top in PACKAGES or top == "kernels":
                found.append(f"{where}: {name} is no module of a layer")
            elif top not in STDLIB:
                allowed = THIRD_PARTY.get(source)
                if allowed is not None and top not in allowed:
                    found.append(f"{where}: {source} imports {top}")
    return found


def test_every_import_points_down_the_layers() -> None:
    assert wrong_arrows() == []


def test_no_two_modules_import_each_other() -> None:
    edges: dict[str, set[str]] = {}
    known = dict(project_modules())
    for module, path in known.items():
        for name, _ in imports_of(path, module):
            if name in known and name != module:
                edges.setdefault(module, set()).add(name)
    circles = sorted(
        f"{a} ↔ {b}"
        for a, targets in edges.items()
        for b in targets
        if a < b and a in edges.get(b, ())
    )
    # a package's __init__ that imports its own submodules is no circle worth the name
    circles = [c for c in circles if not _is_package_init_pair(c, known)]
    assert circles == []


def _is_package_init_pair(circle: str, known: dict[str, Path]) -> bool:
    a, b = circle.split(" ↔ ")
    return (known[a].name == "__init__.py" and b.startswith(a + ".")) or (
        known[b].name == "__init__.py" and a.startswith(b + ".")
    )


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_every_layer_exists(layer: str) -> None:
    assert (REPO / layer.replace(".", "/")).is_dir()
