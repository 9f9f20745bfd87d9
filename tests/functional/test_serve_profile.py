"""`tandem serve` and the engine's latency profile (engine.profile auto) on the real CPU engine:
the first start with an empty cache measures a profile and stores it under the engine's key,
the next start reuses it without measuring, also with --skip-profile. --skip-profile with no
stored profile (the bundled one, with a warning; the engine's /stats says it does not match) is
checked on test_serve.py's start, which runs that way: each start of the real engine costs
about 25 s of the suite."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.sockets import free_port
from tests.functional.serve_process import serving

pytestmark = pytest.mark.slow
ADMIN = "serve-profile-test-admin-token"
MEASURING = "measuring one (quick grid)"
STORED = "latency profile: the one measured for this engine"


def serve_once(tmp_path: Path, cache_dir: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """Starts `tandem serve`, waits until the gateway is ready, reads the engine's /stats, stops
    it with SIGINT (always); returns its output and those stats."""
    gw_port, engine_port = free_port(), free_port()
    socket_path = tmp_path / f"control-{engine_port}.sock"
    env = dict(
        os.environ,
        TANDEM_ADMIN_TOKEN=ADMIN,
        TANDEM_GATEWAY__PORT=str(gw_port),
        TANDEM_ENGINE__PORT=str(engine_port),
        TANDEM_ENGINE__CONTROL_SOCKET=str(socket_path),
        TANDEM_DATABASE__URL=f"sqlite:///{tmp_path / 'serve.db'}",
        TANDEM_MODEL__CACHE_DIR=str(tmp_path / "model-cache"),
        TANDEM_ENGINE__PROFILE_CACHE_DIR=str(cache_dir),
        TANDEM_ENGINE__LOG_FILE=str(tmp_path / "engine.log"),
    )
    with serving(env, tmp_path / f"serve-{gw_port}.log", *args, ready_timeout_s=300) as served:
        transport = httpx.HTTPTransport(uds=str(socket_path))
        with httpx.Client(transport=transport, timeout=10) as control:
            stats: dict[str, Any] = control.get("http://engine/stats").json()
    assert served.proc.returncode == 0, served.output()
    return served.output(), stats


def test_serve_measures_a_profile_once_then_reuses_it(tmp_path: Path) -> None:
    cache = tmp_path / "profiles"
    output, stats = serve_once(tmp_path, cache)
    assert MEASURING in output, output
    stored = list(cache.glob("*.json"))
    assert len(stored) == 1, output
    key = stored[0].stem
    assert f"stored {stored[0]}" in output
    assert "latency profile: prefill" in output  # progress, point by point
    assert stats["profile"] == f"auto-{key}" and stats["profile_matches"] is True
    written = stored[0].read_bytes()

    # --skip-profile never measures; a stored profile of this engine is still the one used
    output, stats = serve_once(tmp_path, cache, "--skip-profile")
    assert MEASURING not in output and STORED in output and key in output, output
    assert "bundled" not in output, output
    assert [p.name for p in cache.glob("*.json")] == [f"{key}.json"]
    assert stored[0].read_bytes() == written
    assert stats["profile"] == f"auto-{key}" and stats["profile_matches"] is True
