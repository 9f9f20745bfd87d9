"""The `tandem` command line against a real SQLite database, as an operator types it. (`tandem
admin …` talks to a running gateway: tests/gateway/test_admin_cli.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tandem(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=cwd,
        env={**environ, "PYTHONPATH": str(REPO), **env},
        text=True,
        capture_output=True,
        timeout=120,
    )


def test_db_upgrade_migrates_the_database_beside_the_config_from_any_directory(
    tmp_path: Path,
) -> None:
    # issue 17: a relative SQLite path was relative to the working directory, so a command run
    # elsewhere made (and migrated) a second, empty database there
    etc, elsewhere = tmp_path / "etc", tmp_path / "home"
    etc.mkdir()
    elsewhere.mkdir()
    (etc / "config.yaml").write_text("database:\n  url: sqlite+aiosqlite:///data/tandem.db\n")
    (etc / "data").mkdir()
    result = tandem("db", "upgrade", "--config", str(etc / "config.yaml"), cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["revision"] and out["database"].endswith(f"{etc.resolve()}/data/tandem.db")
    assert (etc / "data" / "tandem.db").is_file()
    assert list(elsewhere.iterdir()) == []


def test_bad_config_value_names_the_key(tmp_path: Path) -> None:
    result = tandem("db", "upgrade", cwd=tmp_path, TANDEM_GATEWAY__PORT="eighty")
    assert result.returncode == 2 and "gateway.port" in result.stderr
    assert list(tmp_path.iterdir()) == []
