"""Waiting in tests: poll a condition until it holds; never sleep a fixed time and hope.

A fixed sleep is either too short (a flaky test on a loaded machine) or too long (a slow test on
an idle one). These helpers check the condition at once and then at short, growing intervals, so
a test waits exactly as long as the system needs, and fails with a message saying what never
happened when it takes longer than ``timeout_s``.

    record = await wait_until(lambda: latest_record(tenant), timeout_s=5, what="the usage record")
    wait_until_sync(lambda: not path.exists(), timeout_s=10, what="the socket file removed")

The predicate returns something truthy when the condition holds (that value is returned) and
something falsy otherwise; the async form also accepts a predicate that returns an awaitable.
Exceptions from the predicate propagate (a predicate that may fail transiently should catch
them itself and return a falsy value).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

FIRST_INTERVAL_S = 0.005
"""The first pause between two checks, seconds (then each pause is 1.5 times the previous)."""
MAX_INTERVAL_S = 0.1
"""The longest pause between two checks, seconds."""


@overload
async def wait_until(
    predicate: Callable[[], Awaitable[T | None]],
    timeout_s: float = ...,
    *,
    what: str | Callable[[], str] = ...,
    max_interval_s: float = ...,
) -> T: ...


@overload
async def wait_until(
    predicate: Callable[[], T | None],
    timeout_s: float = ...,
    *,
    what: str | Callable[[], str] = ...,
    max_interval_s: float = ...,
) -> T: ...


async def wait_until(
    predicate: Callable[[], Any],
    timeout_s: float = 10.0,
    *,
    what: str | Callable[[], str] = "the condition",
    max_interval_s: float = MAX_INTERVAL_S,
) -> Any:
    """Polls *predicate* until it returns something truthy, and returns that; fails the test
    (AssertionError naming *what* and the last value) after *timeout_s*. *what* may be a
    callable, asked at the timeout (to say what the state was then)."""
    deadline = time.monotonic() + timeout_s
    interval = FIRST_INTERVAL_S
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timeout(what, timeout_s, value)
        await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        interval = min(interval * 1.5, max_interval_s)


async def holds_within(predicate: Callable[[], Any], timeout_s: float) -> bool:
    """True as soon as *predicate* holds (polled like :func:`wait_until`), False once
    *timeout_s* has passed: for a best-effort wait after which the test goes on either way (and
    checks what it needs then)."""
    try:
        await wait_until(predicate, timeout_s)
    except _NotYet:
        return False
    return True


def wait_until_sync(
    predicate: Callable[[], T | None],
    timeout_s: float = 10.0,
    *,
    what: str | Callable[[], str] = "the condition",
    max_interval_s: float = MAX_INTERVAL_S,
) -> T:
    """:func:`wait_until` for synchronous tests (blocks the calling thread between checks)."""
    deadline = time.monotonic() + timeout_s
    interval = FIRST_INTERVAL_S
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timeout(what, timeout_s, value)
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        interval = min(interval * 1.5, max_interval_s)


class _NotYet(AssertionError):
    """The condition did not hold in time (an AssertionError: it fails the test)."""


def _timeout(what: str | Callable[[], str], timeout_s: float, value: object) -> AssertionError:
    text = what() if callable(what) else what
    return _NotYet(f"{text} did not happen within {timeout_s} s (last: {value!r})")
