"""The connection cap against the process's open-file limit (gateway/server.py): past that limit
`accept()` fails and the gateway stops accepting anyone, so the cap is lowered to fit it."""

from __future__ import annotations

import resource

import pytest

from common.config import load_config
from gateway import server


def limit(monkeypatch: pytest.MonkeyPatch, soft: int, hard: int) -> list[tuple[int, int]]:
    raised: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, hard))

    def refuse(_: int, limits: tuple[int, int]) -> None:
        raised.append(limits)
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    return raised


def test_the_cap_is_kept_when_the_file_limit_allows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    limit(monkeypatch, 65536, 65536)
    assert server.connection_cap(load_config(environ={})) == 4096


def test_the_cap_fits_a_low_file_limit_and_the_soft_limit_is_raised_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raised = limit(monkeypatch, 1024, 4096)
    cap = server.connection_cap(load_config(environ={}))
    assert raised == [(4096, 4096)]  # tried: the hard limit
    assert 0 < cap <= 1024 - 512  # the gateway's own sockets keep their share


def test_a_huge_request_bound_still_leaves_half_the_files_to_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limit(monkeypatch, 20000, 20000)
    env = {"TANDEM_GATEWAY__MAX_REQUESTS_IN_FLIGHT": "1000000"}
    assert server.connection_cap(load_config(environ=env)) == 4096
    env["TANDEM_GATEWAY__MAX_CONNECTIONS"] = "50000"
    assert server.connection_cap(load_config(environ=env)) == 10000
