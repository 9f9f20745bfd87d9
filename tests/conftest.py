"""Shared fixtures: the store (SQLite and PostgreSQL), the real engine (one per session) and
the gateway in front of it; and the test process's exit (below)."""

import atexit
import os
import sys

import pytest

from tests.functional.engine_fixtures import engine_server  # noqa: F401
from tests.functional.gateway_fixtures import (  # noqa: F401
    gateway,
    gateway_without_engine,
    tiny_model_dir,
)
from tests.functional.store_fixtures import (  # noqa: F401
    empty_db_url,
    pg_server,
    store,
    store_engine,
)

_exit_status: int | None = None
"""pytest's exit status, once the session has finished."""


_FUNCTIONAL = os.path.join(os.path.dirname(__file__), "functional")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks `serial` the functional tests marked `slow`: they start the real engine or
    gateway processes, and some compare timings within a run, so `make test` runs them one at
    a time with the machine to themselves, after everything else has run on every core."""
    for item in items:
        if item.get_closest_marker("slow") is not None and str(item.path).startswith(_FUNCTIONAL):
            item.add_marker(pytest.mark.serial)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


def _exit_without_finalizing() -> None:
    """The last exit handler (registered first): ends the test process with pytest's own exit
    status before the interpreter tears its modules down.

    The suite imports SGLang's modules into this process (tests/functional/test_sglang_seams.py,
    the plugin's tests), and with them xgrammar's tvm_ffi. In 2 of 3 clean-clone runs of the
    whole suite on 2026-11-28 the interpreter's teardown then crashed after every test had
    passed and pytest had printed its summary ("Fatal Python error: Segmentation fault … <no
    Python frame> … Extension modules: sentencepiece._sentencepiece, tvm_ffi.core,
    setproctitle._setproctitle"), and `make test` failed with status 2. Every other exit
    handler has run by now (they run last registered first), and nothing of the tests is left
    to do."""
    if _exit_status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


atexit.register(_exit_without_finalizing)
