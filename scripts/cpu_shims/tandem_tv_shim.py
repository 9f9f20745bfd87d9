"""CPU stand-in for torchvision's compiled operators (imported by tandem_cpu_shims.pth).

What it replaces: the ``torchvision::nms`` / ``torchvision::qnms`` operator schemas that
torchvision's ``_C`` extension normally registers.

Why: PyPI has no CPU build of torchvision 0.28.0; its ``_C.so`` is built against CUDA torch and
fails to load next to torch 2.13.0+cpu. torchvision then crashes while importing
``torchvision._meta_registrations`` ("operator torchvision::nms does not exist"). SGLang imports
``torchvision.transforms`` at start-up (``srt/multimodal/internvl_utils.py``), so without this the
engine cannot start. tandem never calls these operators; the schemas only let the import finish.

How: a meta-path finder that, just before ``torchvision._meta_registrations`` is imported, defines
the missing schemas — only if ``_C`` did not load them. It does nothing in processes that never
import torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_library_keepalive: list[object] = []


def _define_missing_schemas() -> None:
    import torch

    missing = [name for name in _SCHEMAS if not _has_op(torch, name)]
    if not missing:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        lib.define(_SCHEMAS[name])
    _library_keepalive.append(lib)  # the definitions live as long as the Library object


def _has_op(torch: ModuleType, name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == _TARGET:
            sys.meta_path.remove(self)
            _define_missing_schemas()
        return None  # let the normal finders import the module


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
