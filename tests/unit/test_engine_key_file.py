"""The engine's API key never shows on its command line: it goes to SGLang in a file only this
user can read, removed at exit — and, when `tandem serve` was SIGKILLed before its exit
handlers ran, by the next one."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from backend.launch.sglang import KEY_DIR_PREFIX, api_key_args, remove_orphaned_key_dirs


def test_the_key_is_in_a_private_file_not_on_the_command_line() -> None:
    argv = api_key_args("s3cret-key")
    assert argv[0] == "--config" and "s3cret-key" not in argv
    path = Path(argv[1])
    assert path.read_text() == 'api-key: "s3cret-key"\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.parent.name.startswith(f"{KEY_DIR_PREFIX}{os.getpid()}-")


def test_key_dirs_of_processes_that_died_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    orphan = tmp_path / f"{KEY_DIR_PREFIX}{dead.stdout.strip()}-abc"
    live = tmp_path / f"{KEY_DIR_PREFIX}{os.getpid()}-def"
    unnamed = tmp_path / f"{KEY_DIR_PREFIX}xyz"  # an older layout without a pid: not ours to judge
    for directory in (orphan, live, unnamed):
        directory.mkdir()
        (directory / "api-key.yaml").write_text("api-key: x\n")
    assert remove_orphaned_key_dirs(tmp_path) == [orphan]
    assert not orphan.exists() and live.exists() and unnamed.exists()
