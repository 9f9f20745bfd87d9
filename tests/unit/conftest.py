"""The unit tier: fast tests of pure code. A unit test must not load torch, Triton or SGLang
(tests/unit/test_unit_tier_is_light.py checks the imports; the fixture here catches a project
function that imports them lazily while a test runs)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

HEAVY = ("torch", "triton", "sglang")


@pytest.fixture(autouse=True)
def _loads_no_heavy_package(request: pytest.FixtureRequest) -> Iterator[None]:
    before = {name for name in HEAVY if name in sys.modules}
    yield
    loaded = sorted(name for name in HEAVY if name in sys.modules and name not in before)
    if loaded:
        pytest.fail(
            f"{request.node.nodeid} loaded {', '.join(loaded)}: a unit test must not "
            "(move it to tests/functional and mark it slow)",
            pytrace=False,
        )
