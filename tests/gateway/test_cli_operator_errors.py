"""An operator's mistakes on the `tandem` command line are one line, never a traceback (issue 17):
a reader that stops reading (`tandem batch list | head`), a URL that is not one, an output file
that cannot be written, a `--config` given before the subcommand (it was silently ignored: the
subcommand's default replaced it)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.harness import Gateway, closed_port
from tests.gateway.test_admin_cli import REPO, Cli
from tests.gateway.test_batches import chat_line, create_batch, jsonl, upload, wait_for


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Cli:
    """`tandem` in this process, from an empty directory (as in test_admin_cli)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return Cli(capsys, monkeypatch, elsewhere)


async def finished_batch(gw: Gateway) -> tuple[str, str]:
    """A tenant's key and the id of its batch, completed."""
    _, key = await gw.new_tenant("piped", "be")
    file = await upload(gw, key, jsonl([chat_line("a", "hello")]))
    batch = await create_batch(gw, key, file.body["id"])
    assert batch.status == 200, batch
    await wait_for(gw, key, batch.body["id"])
    return key, batch.body["id"]


async def test_batch_list_into_a_closed_pipe_exits_quietly(gw: Gateway, tmp_path: Path) -> None:
    """`tandem batch list | head -0`: the reader is gone before the first line is written."""
    key, _ = await finished_batch(gw)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away: every write gets EPIPE
    env = dict(os.environ, PYTHONPATH=str(REPO), TANDEM_API_KEY=key, TANDEM_URL=gw.base_url)
    try:
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "tandem", "batch", "list"],
            cwd=tmp_path,
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""  # before: a BrokenPipeError traceback
    assert result.returncode == 128 + signal.SIGPIPE


async def test_bad_urls_are_one_line(cli: Cli) -> None:
    for url in ("gateway:8000", "http://[::1", "ftp://gateway", "http://gateway:port"):
        for command in (("batch", "list", "--api-key", "k"), ("admin", "tenant", "list")):
            line = await cli.fails(*command, "--url", url)
            assert f"must be a URL like http://host:8000, got {url!r}" in line, line


async def test_results_into_an_unwritable_file_is_one_line(
    gw: Gateway, cli: Cli, tmp_path: Path
) -> None:
    key, batch_id = await finished_batch(gw)
    target = tmp_path / "no-such-dir" / "out.jsonl"
    line = await cli.fails(
        "batch", "results", batch_id, "--output", str(target), "--url", gw.base_url,
        "--api-key", key,
    )  # fmt: skip
    assert f"cannot write {target}: No such file or directory" in line


async def test_config_before_the_subcommand_is_used(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    for command in (("db", "upgrade"), ("model", "path"), ("batch", "list", "--api-key", "k")):
        line = await cli.fails("--config", str(missing), *command)
        assert f"config file not found: {missing}" in line, (command, line)
    assert list(cli.cwd.iterdir()) == []


async def test_an_unreachable_database_is_one_line(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with closed_port() as port:
        url = f"postgresql://operator:secret@127.0.0.1:{port}/tandem"
        monkeypatch.setenv("TANDEM_DATABASE__URL", url)
        line = await cli.fails("db", "upgrade", status=1)
    assert f"cannot migrate the database postgresql://operator:***@127.0.0.1:{port}/tandem" in line
    assert "secret" not in line
