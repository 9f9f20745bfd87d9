"""`tandem admin …` manages a running gateway over its admin REST API, as an operator types it:
from any directory (issue 17: it opened `tandem.db` relative to the working directory and made an
empty one there), with `--url` / $TANDEM_URL and $TANDEM_ADMIN_TOKEN, and one clear line for
every failure (gateway down, bad token, a refusal of the API)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.cli import main as tandem
from tests.gateway.harness import ADMIN_TOKEN, Gateway, closed_port

REPO = Path(__file__).resolve().parents[2]


class Cli:
    """`tandem` run in this process (in a thread: the gateway serves in this event loop), from
    an empty directory, with the gateway in $TANDEM_URL and the admin token in the
    environment."""

    def __init__(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cwd: Path
    ) -> None:
        self._capsys = capsys
        self.cwd = cwd
        monkeypatch.chdir(cwd)
        monkeypatch.setenv("TANDEM_ADMIN_TOKEN", ADMIN_TOKEN)
        monkeypatch.delenv("TANDEM_URL", raising=False)
        self._monkeypatch = monkeypatch

    def use(self, url: str) -> None:
        self._monkeypatch.setenv("TANDEM_URL", url)

    def token(self, value: str | None) -> None:
        if value is None:
            self._monkeypatch.delenv("TANDEM_ADMIN_TOKEN")
        else:
            self._monkeypatch.setenv("TANDEM_ADMIN_TOKEN", value)

    async def run(self, *args: str) -> tuple[int, str, str]:
        """(exit status, stdout, stderr)."""
        self._capsys.readouterr()
        code = await asyncio.to_thread(tandem, list(args))
        out, err = self._capsys.readouterr()
        return code, out, err

    async def json(self, *args: str) -> Any:
        code, out, err = await self.run(*args)
        assert code == 0, err
        assert err == ""
        return json.loads(out)

    async def fails(self, *args: str, status: int = 2) -> str:
        """The one error line of a command that must fail with *status*."""
        code, out, err = await self.run(*args)
        lines = err.strip().splitlines()
        assert code == status, (code, out, err)
        assert len(lines) == 1 and lines[0].startswith("tandem: error: "), err
        return lines[0]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Cli:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return Cli(capsys, monkeypatch, elsewhere)


async def test_tenants_contracts_quotas_and_keys_through_the_gateway(gw: Gateway, cli: Cli) -> None:
    cli.use(gw.base_url)
    tenant = await cli.json(
        "admin", "tenant", "create", "chat", "--tier", "rt", "--ttft-ms", "300", "--tpot-ms",
        "50", "--requests-per-min", "5",
    )  # fmt: skip
    assert tenant["id"].startswith("ten_") and tenant["slo"]["ttft_ms"] == 300
    assert tenant["quota"]["requests_per_min"] == 5
    by_name = await cli.json("admin", "key", "create", "chat", "--name", "ci")
    by_id = await cli.json("admin", "key", "create", tenant["id"])
    assert by_name["key"].startswith("tdm_") and by_name["key"] != by_id["key"]
    assert by_name["tenant_id"] == tenant["id"] and by_name["name"] == "ci"
    # the key is the gateway's: it serves a request
    assert (await gw.chat(by_name["key"], max_tokens=2)).status == 200
    assert [t["name"] for t in await cli.json("admin", "tenant", "list")] == ["chat"]
    keys = await cli.json("admin", "key", "list", "chat")
    assert {k["id"] for k in keys} == {by_name["id"], by_id["id"]}
    assert all("key" not in k for k in keys)  # never the secret again
    revoked = await cli.json("admin", "key", "revoke", by_id["id"])
    assert revoked["revoked_at"] is not None
    assert (await gw.chat(by_id["key"], max_tokens=2)).status == 401

    # update: what is given changes, the rest of the contract and quota stays
    updated = await cli.json(
        "admin", "tenant", "update", "chat", "--tpot-ms", "80", "--requests-per-min", "none",
        "--tokens-per-min", "9000", "--on-unattainable", "downgrade",
    )  # fmt: skip
    assert updated["slo"]["ttft_ms"] == 300 and updated["slo"]["tpot_ms"] == 80
    assert updated["slo"]["on_unattainable"] == "downgrade"
    assert updated["quota"]["requests_per_min"] is None
    assert updated["quota"]["tokens_per_min"] == 9000
    api = await gw.admin("GET", f"/tenants/{tenant['id']}")
    assert api.body["slo"] == updated["slo"] and api.body["quota"] == updated["quota"]
    assert await cli.json("admin", "tenant", "get", tenant["id"]) == api.body
    deleted = await cli.json("admin", "tenant", "delete", "chat")
    assert deleted == {"id": tenant["id"], "object": "tenant", "deleted": True}
    assert await cli.json("admin", "tenant", "list") == []
    assert list(cli.cwd.iterdir()) == []  # no database, nothing, where the command ran


async def test_every_failure_is_one_clear_line(gw: Gateway, cli: Cli) -> None:
    cli.use(gw.base_url)
    await cli.json("admin", "tenant", "create", "dup", "--tier", "be")
    refusals = [
        (("tenant", "create", "dup", "--tier", "be"), "a tenant named 'dup' already exists"),
        (("tenant", "create", "x", "--tier", "rt"), "needs --ttft-ms and --tpot-ms"),
        (
            ("tenant", "create", "x", "--tier", "be", "--max-concurrent", "-1"),
            "--max-concurrent must be in [0, 2147483647], got -1",
        ),
        (("tenant", "update", "dup", "--weight", "0"), "--weight must be a positive number"),
        (("tenant", "update", "dup"), "nothing to change"),
        (("key", "create", "nobody"), "no tenant with id or name 'nobody'"),
        (("key", "revoke", "key_nope"), "key 'key_nope' not found"),
        (("usage", "--start", "yesterday"), "start must be an ISO 8601 date"),
        (("usage", "--tenant", "nobody"), "tenant 'nobody' not found"),
        (("requests", "--tenant", "nobody"), "no tenant with id or name 'nobody'"),
        (("requests", "--limit", "0"), "limit must be an integer in [1, 1000]"),
    ]
    for args, message in refusals:
        line = await cli.fails("admin", *args)
        assert message in line, (args, line)

    # a wrong token: the gateway refuses it, and the line says what to set
    cli.token("not-the-token")
    line = await cli.fails("admin", "tenant", "list")
    assert "refused the admin token" in line and "TANDEM_ADMIN_TOKEN" in line
    cli.token(None)
    line = await cli.fails("admin", "tenant", "list")
    assert "TANDEM_ADMIN_TOKEN must be set" in line

    # a gateway that is down: exit 1, naming the address
    cli.token(ADMIN_TOKEN)
    async with closed_port() as port:
        line = await cli.fails(
            "admin", "tenant", "list", "--url", f"http://127.0.0.1:{port}", status=1
        )
    assert f"cannot reach the gateway at http://127.0.0.1:{port}" in line
    assert list(cli.cwd.iterdir()) == []


async def test_the_usage_report_as_a_table_json_and_csv(gw: Gateway, cli: Cli) -> None:
    tenant_id, key = await gw.new_tenant("reported")
    for _ in range(3):
        assert (await gw.chat(key, max_tokens=3)).status == 200
    await gw.records(tenant_id, count=3)
    api = await gw.admin("GET", "/usage?group_by=hour&tenant=reported")
    (row,) = api.body["data"]
    assert row["requests"] == 3

    cli.use(gw.base_url)
    usage = ("admin", "usage", "--group-by", "hour")
    rows = await cli.json(*usage, "--tenant", "reported", "--format", "json")
    assert rows == api.body["data"]
    code, out, err = await cli.run(*usage, "--format", "csv")
    assert code == 0, err
    (line,) = list(csv.DictReader(io.StringIO(out)))
    assert line["tenant_name"] == "reported" and int(line["requests"]) == 3
    code, out, err = await cli.run(*usage)
    assert code == 0, err
    header, cells = (line.split() for line in out.strip().splitlines())
    assert header[:3] == ["period", "tenant", "requests"]
    assert cells[2] == "reported" and int(cells[3]) == 3  # the period is two words
    assert int(cells[4]) == row["prompt_tokens"] and int(cells[5]) == row["completion_tokens"]
    # one engine's figures: the requests it ran
    (record, *_) = await gw.records(tenant_id, count=3)
    for engine, requests in ((record["engine"], 3), ("http://127.0.0.1:1", 0)):
        rows = await cli.json(
            *usage, "--engine", engine, "--tenant", "reported", "--format", "json"
        )
        assert sum(r["requests"] for r in rows) == requests, (engine, rows)


async def test_the_latest_requests_as_a_table_and_json(gw: Gateway, cli: Cli) -> None:
    """`tandem admin requests`: the request log, newest first, one row each with the engine
    that ran it; `--tenant` takes a name, `--engine` one engine's requests."""
    tenant_id, key = await gw.new_tenant("logged")
    for max_tokens in (2, 3):
        assert (await gw.chat(key, max_tokens=max_tokens)).status == 200
    records = await gw.records(tenant_id, count=2)
    engine = records[0]["engine"]
    assert engine is not None and engine.startswith("http://127.0.0.1:")

    cli.use(gw.base_url)
    rows = await cli.json("admin", "requests", "--tenant", "logged", "--format", "json")
    assert rows == records
    assert [r["completion_tokens"] for r in rows] == [3, 2]  # newest first
    code, out, err = await cli.run("admin", "requests", "--tenant", "logged", "--limit", "1")
    assert code == 0, err
    header, cells = (line.split() for line in out.strip().splitlines())
    assert header[:4] == ["started", "tenant", "tier", "status"] and header[-1] == "engine"
    # the start is two words (date and time)
    assert cells[2:5] == ["logged", "rt", "ok"] and cells[-1] == engine
    assert int(cells[6]) == records[0]["prompt_tokens"] and int(cells[7]) == 3
    elsewhere = ("--engine", "http://127.0.0.1:1", "--tenant", "logged")
    code, out, err = await cli.run("admin", "requests", *elsewhere)
    assert code == 0, err
    assert out.strip().splitlines()[-1] == "(no requests)"


async def test_the_gateway_address_comes_from_url_then_env_then_config(
    gw: Gateway, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = gw.base_url.rsplit(":", 1)[1]
    async with closed_port() as down:
        # no --url, no TANDEM_URL: the config's gateway.host and gateway.port
        monkeypatch.setenv("TANDEM_GATEWAY__PORT", port)
        assert await cli.json("admin", "tenant", "list") == []
        # TANDEM_URL beats the config, --url beats TANDEM_URL
        cli.use(f"http://127.0.0.1:{down}")
        assert "cannot reach" in await cli.fails("admin", "tenant", "list", status=1)
        assert await cli.json("admin", "tenant", "list", "--url", gw.base_url) == []


async def test_a_console_in_another_directory_manages_the_gateway(
    gw: Gateway, tmp_path: Path
) -> None:
    """The console script itself, in a fresh process started elsewhere."""
    elsewhere = tmp_path / "operator-home"
    elsewhere.mkdir()
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        TANDEM_ADMIN_TOKEN=ADMIN_TOKEN,
        TANDEM_URL=gw.base_url,
    )
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tandem", "admin", "tenant", "create", "ops", "--tier", "be"],
        cwd=elsewhere,
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    created = json.loads(result.stdout)
    assert (await gw.admin("GET", f"/tenants/{created['id']}")).body["name"] == "ops"
    assert list(elsewhere.iterdir()) == []
