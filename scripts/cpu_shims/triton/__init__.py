"""CPU stand-in for the ``triton`` package (only used when the real one is not installed).

What it replaces: the Triton compiler wheel (about 1 GB, CUDA only).

Why: SGLang imports ``triton`` / ``triton.language`` at module level all over its kernel code
(``@triton.jit`` kernels are *defined* on import even where they are never *launched*), and torch
imports parts of it too once it believes Triton is installed. On a CPU engine no Triton kernel
is ever launched (torch-native attention, ``forward_native`` layers), so the definitions only
have to be syntactically valid. This package makes them so:

* ``@triton.jit``, ``@triton.autotune(...)``, ``@triton.heuristics(...)`` are pass-through
  decorators (the decorated Python function is returned unchanged);
* every other attribute or submodule (``triton.language.float32``, ``triton.runtime.jit``,
  ``from triton.language.extra import libdevice``) is a :class:`_Mock` module: lower-case names
  become child mock modules, CamelCase names become empty classes that can be subclassed
  (``class Foo(KernelInterface)``), and names ending in ``Error``/``Resources`` become exception
  classes (torch's ``except OutOfResources``).

SGLang ships a similar stub for macOS (``sglang/_platform_stubs.py``) but arms it only on
darwin/arm64, and that module cannot be reused from here: loading it imports the ``sglang``
package, whose ``__init__`` imports ``torch._dynamo``, which imports ``triton`` — this very
module, half-initialised — and its module-level ``Stream()`` imports torch as well. So the same
idea is written out here with no imports beyond the standard library.

How it is found: ``scripts/cpu_shims`` is put on ``sys.path`` *after* site-packages by the
``tandem_cpu_shims.pth`` file that ``scripts/install`` writes, so a real Triton (GPU machines)
always wins and this package is then never imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__version__ = "3.0.0"  # what sglang's own macOS stub claims; old enough to skip new-API paths
IS_TANDEM_CPU_STUB = True  # lets tests and diagnostics tell this stub from the real package


class _StubBase:
    """Base of every CamelCase stand-in class, so ``class K(triton.X):`` works."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs


def _passthrough(*args: Any, **kwargs: Any) -> Any:
    """A decorator usable bare (``@jit``) or with arguments (``@jit(...)``)."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    return decorate


def _make_class(module_name: str, name: str) -> type:
    base: type = Exception if name.endswith(("Error", "Exception", "Resources")) else _StubBase
    return type(name, (base,), {"__module__": module_name})


class _Mock(types.ModuleType):
    """A module whose every missing attribute is a child mock (see the module docstring)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package, so `import triton.x.y` may go deeper
        self.__spec__ = importlib.machinery.ModuleSpec(name, _LOADER, is_package=True)
        self.__loader__ = _LOADER

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child: Any
        if name[:1].isupper():
            child = _make_class(self.__name__, name)
        else:
            child = _module(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    # Used as a decorator (`@tl.extra.foo`) or called: behave like the pass-through decorator.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _passthrough(*args, **kwargs)

    # torch asks e.g. `"cpu" in triton.backends.backends`; nothing is ever supported.
    def __contains__(self, item: object) -> bool:
        return False

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __instancecheck__(self, instance: object) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<tandem triton stub {self.__name__!r}>"


def _module(fullname: str) -> _Mock:
    """The mock for *fullname*, created and registered in ``sys.modules`` on first use."""
    existing = sys.modules.get(fullname)
    if isinstance(existing, _Mock):
        return existing
    mod = _Mock(fullname)
    sys.modules[fullname] = mod
    # Attribute access (`triton.runtime.jit`) must reach the object `import` registered.
    parent_name, _, leaf = fullname.rpartition(".")
    parent = sys.modules[parent_name] if parent_name == __name__ else _module(parent_name)
    setattr(parent, leaf, mod)
    return mod


class _Loader(importlib.abc.Loader):
    """Makes ``import triton.<anything>`` produce a mock module instead of failing."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_LOADER = _Loader()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=True)


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


# --- the top-level API that SGLang and torch use by name ------------------------------------

jit = _passthrough
autotune = _passthrough
heuristics = _passthrough


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as ``triton.cdiv`` (used by host-side grid arithmetic)."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n, as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 1


class Config:
    """Stand-in for ``triton.Config`` (autotune configurations are built but never used)."""

    def __init__(
        self,
        kwargs: dict[str, Any] | None = None,
        num_warps: int = 4,
        num_stages: int = 2,
        **extra: Any,
    ) -> None:
        self.kwargs = kwargs or {}
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.extra = extra


class _Constexpr:
    """``tl.constexpr``: an annotation in kernel signatures and a value wrapper."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"constexpr({self.value!r})"


def _triton_key() -> str:
    return "tandem-triton-stub"


language = _module(__name__ + ".language")
language.constexpr = _Constexpr  # type: ignore[attr-defined]
_module(__name__ + ".runtime.cache").triton_key = _triton_key  # type: ignore[attr-defined]
_module(__name__ + ".compiler.compiler").triton_key = _triton_key  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    """Any other top-level name: a child mock (``triton.testing``) or a stub class."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    if name[:1].isupper():
        value: Any = _make_class(__name__, name)
    else:
        value = _module(f"{__name__}.{name}")
    globals()[name] = value
    return value
