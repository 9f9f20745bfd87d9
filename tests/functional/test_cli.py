"""The `tandem` command line against a real SQLite database, as an operator types it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def tandem(*args: str, db: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TANDEM_DATABASE__URL=f"sqlite:///{db}")
    result = subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "cli.db"
    out = json.loads(tandem("db", "upgrade", db=path).stdout)
    assert out["revision"]
    return path


def test_tenant_and_key_creation(db: Path) -> None:
    tenant = json.loads(
        tandem(
            "admin",
            "tenant",
            "create",
            "chat",
            "--tier",
            "rt",
            "--ttft-ms",
            "300",
            "--tpot-ms",
            "50",
            db=db,
        ).stdout
    )
    assert tenant["id"].startswith("ten_") and tenant["slo"]["ttft_ms"] == 300
    by_name = json.loads(tandem("admin", "key", "create", "chat", db=db).stdout)
    by_id = json.loads(tandem("admin", "key", "create", tenant["id"], db=db).stdout)
    assert by_name["key"].startswith("tdm_") and by_name["key"] != by_id["key"]
    assert by_name["tenant_id"] == tenant["id"]
    listed = json.loads(tandem("admin", "tenant", "list", db=db).stdout)
    assert [t["name"] for t in listed] == ["chat"]
    revoked = json.loads(tandem("admin", "key", "revoke", by_id["id"], db=db).stdout)
    assert revoked["revoked_at"] is not None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["admin", "tenant", "create", "x", "--tier", "rt"], "--ttft-ms"),
        (["admin", "key", "create", "nobody"], "no tenant with id or name 'nobody'"),
        (["admin", "key", "revoke", "key_nope"], "no key with id 'key_nope'"),
    ],
)
def test_bad_input_is_one_clear_line(db: Path, args: list[str], message: str) -> None:
    result = tandem(*args, db=db, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: error:") and message in lines[0]


def test_duplicate_tenant_is_one_clear_line(db: Path) -> None:
    tandem("admin", "tenant", "create", "dup", "--tier", "be", db=db)
    result = tandem("admin", "tenant", "create", "dup", "--tier", "be", db=db, check=False)
    assert result.returncode == 2 and "dup" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unmigrated_database_says_what_to_do(tmp_path: Path) -> None:
    result = tandem("admin", "tenant", "list", db=tmp_path / "fresh.db", check=False)
    assert result.returncode == 2 and "tandem db upgrade" in result.stderr


def test_bad_config_value_names_the_key(tmp_path: Path) -> None:
    env = dict(os.environ, TANDEM_GATEWAY__PORT="eighty")
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "db", "upgrade"],
        env=env,
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 2 and "gateway.port" in result.stderr
