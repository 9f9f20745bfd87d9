"""The dashboard in a real headless Chromium: the page loads with data from a seeded database
(and the real engine's load samples), every chart renders, no console error, a screenshot."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import shutil
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from common.sockets import free_port
from gateway.engine.sampler import EngineSample
from gateway.state import METRICS, STORE
from gateway.store.types import UsageRecord
from tests.functional.chromium import chromium_page
from tests.functional.gateway_fixtures import ADMIN_TOKEN, GatewayHandle, start_gateway
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
CHARTS = ["chart-requests", "chart-tokens", "chart-ttft", "chart-tpot", "chart-be-rt", "chart-kv"]

_COLORED_PIXELS_JS = """JSON.stringify([...document.querySelectorAll('canvas')].map(c => {
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let colored = 0;
  for (let i = 0; i < d.length; i += 4) {
    const [r, g, b, a] = [d[i], d[i + 1], d[i + 2], d[i + 3]];
    if (a > 0 && Math.max(r, g, b) - Math.min(r, g, b) > 60) colored++;
  }
  return {id: c.id, points: Number(c.dataset.points || 0), colored};
}))"""


@pytest_asyncio.fixture
async def seeded_gateway(
    engine_server: Any, tmp_path: Path
) -> AsyncIterator[tuple[GatewayHandle, int]]:
    """A gateway on a fresh database holding six hours of usage of three tenants."""
    server, gw = await start_gateway(
        f"sqlite:///{tmp_path / 'dash.db'}",
        engine_server.port,
        engine_server.model_path,
        TANDEM_METRICS__ENGINE_POLL_S="0.3",
    )
    tenants = [
        await gw.new_tenant("chat-rt", "rt", ttft_ms=300, tpot_ms=50),
        await gw.new_tenant("agents-rt", "rt", ttft_ms=800, tpot_ms=120),
        await gw.new_tenant("nightly-be", "be", deadline_s=3600),
    ]
    rng = random.Random(3)
    now = datetime.now(UTC)
    records = []
    for minute in range(0, 6 * 60, 3):
        created = now - timedelta(minutes=6 * 60 - minute)
        for (tenant_id, _), (tier, ttft, tpot) in zip(
            tenants, [("rt", 180, 35), ("rt", 500, 90), ("be", 4000, 60)], strict=True
        ):
            for i in range(rng.randint(1, 4)):
                ok = rng.random() > 0.05
                t = ttft * rng.uniform(0.5, 1.8) if ok else None
                records.append(
                    UsageRecord(
                        request_id=f"seed-{tenant_id}-{minute}-{i}",
                        tenant_id=tenant_id,
                        tier=tier,
                        model="tandem-tiny",
                        endpoint="chat",
                        prompt_tokens=rng.randint(50, 900),
                        completion_tokens=rng.randint(20, 400) if ok else 0,
                        ttft_ms=t,
                        tpot_ms=tpot * rng.uniform(0.6, 1.6) if ok else None,
                        status="ok" if ok else "engine_error",
                        http_status=200 if ok else 400,
                        slo_met=ok and (tier == "be" or (t or 0) <= ttft * 1.2),
                        admission="admitted" if tier == "rt" else None,
                        engine=f"http://127.0.0.1:{engine_server.port}",  # the one it fronts
                        created_at=created,
                        finished_at=created + timedelta(seconds=2),
                    )
                )
    await gw.app[STORE].insert_usage(records)
    sampler = gw.app[METRICS].sampler
    assert sampler is not None
    # the engine history of a gateway up for six hours (it lives in memory), then the real
    # engine's load now
    sampler.history.clear()
    start_s = now.timestamp() - 6 * 3600
    for k in range(0, 6 * 3600, 300):
        kv = 0.35 + 0.3 * rng.random()
        sampler.history.append(
            EngineSample(
                time_s=start_s + k,
                up=True,
                running=rng.randint(2, 30),
                waiting=rng.randint(0, 12),
                kv_usage=kv,
                kv_capacity_tokens=16384,
                batch_lines_pending=rng.randint(0, 500),
            )
        )
    for _ in range(3):
        assert (await sampler.sample()).up
    yield gw, len(records)
    await gw.session.close()
    await server.close()


async def test_dashboard_renders_every_chart_without_console_errors(
    seeded_gateway: tuple[GatewayHandle, int], tmp_path: Path
) -> None:
    gw, seeded = seeded_gateway
    async with chromium_page(tmp_path / "chromium-profile", 1400, 1300) as page:
        await page.send(
            "Network.setExtraHTTPHeaders", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        loaded = page.event("Page.loadEventFired")
        loaded.clear()
        await page.send("Page.navigate", url=f"{gw.base_url}/admin/v1/dashboard")
        await _wait(loaded)
        state = await page.evaluate(
            "new Promise(resolve => { const s = document.getElementById('status');"
            " const check = () => s.dataset.state === 'loading' ? setTimeout(check, 50)"
            " : resolve(s.dataset.state + '|' + s.textContent); check(); })"
        )
        assert state.startswith("ready|"), state
        assert f"{seeded} requests" in state  # every seeded record is in the 6-hour window
        charts = {c["id"]: c for c in json.loads(await page.evaluate(_COLORED_PIXELS_JS))}
        assert sorted(charts) == sorted(CHARTS)
        for chart_id in CHARTS:
            assert charts[chart_id]["points"] > 0, f"{chart_id} drew no data"
            assert charts[chart_id]["colored"] > 300, f"{chart_id} has no coloured series"
        names = await page.evaluate(
            "[...document.querySelectorAll('#tenants tbody tr td:first-child')]"
            ".map(td => td.textContent)"
        )
        assert sorted(names) == ["agents-rt", "chat-rt", "nightly-be"]
        admission = await page.evaluate(
            "[...document.querySelectorAll('#admission tbody tr')]"
            ".map(tr => [...tr.children].map(td => td.textContent))"
        )
        judged = {row[0]: int(row[3]) + int(row[4]) for row in admission}
        assert judged["chat-rt"] > 0 and judged["agents-rt"] > 0 and judged["nightly-be"] == 0
        model_rows = await page.evaluate(
            "document.querySelectorAll('#latency-model tbody tr').length"
        )
        assert model_rows == 2  # the profile's error and the calibrated one
        (engine_row,) = await page.evaluate(
            "[...document.querySelectorAll('#engines tbody tr')]"
            ".map(tr => [...tr.children].map(td => td.textContent))"
        )
        # the engine ran every seeded request: their count, their errors, the SLO share met
        assert engine_row[1] == "up" and int(engine_row[7]) == seeded, engine_row
        assert 0 < int(engine_row[8]) < seeded and engine_row[9].endswith(" %"), engine_row
        shot = tmp_path / "dashboard.png"
        await page.screenshot(shot)
        assert shot.stat().st_size > 20_000
        if os.environ.get("TANDEM_TEST_ARTIFACTS"):
            shutil.copy(shot, Path(os.environ["TANDEM_TEST_ARTIFACTS"]) / "dashboard.png")
        assert page.errors == []
        # the error collection itself works: a console error on the page is seen
        await page.evaluate("console.error('probe from the test')")
        await wait_until(lambda: page.errors, timeout_s=5, what="the console error seen")
        assert page.errors == ["console: probe from the test"]


async def test_dashboard_asks_a_browser_for_the_admin_token(
    seeded_gateway: tuple[GatewayHandle, int],
) -> None:
    gw, _ = seeded_gateway
    url = f"{gw.base_url}/admin/v1/dashboard"
    async with gw.session.get(url) as resp:
        assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Basic")
        assert (await resp.json())["error"]["code"] == "invalid_admin_token"
    async with gw.session.get(url, headers=basic("ops", "wrong-token")) as resp:
        assert resp.status == 401
    async with gw.session.get(url, headers=basic("ops", ADMIN_TOKEN)) as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
    async with gw.session.get(url + "/data?hours=0", headers=gw.admin_headers) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "hours"


WAIT_FOR_DATA_JS = (
    "new Promise(resolve => { const s = document.getElementById('status');"
    " const check = () => s.dataset.state === 'loading' ? setTimeout(check, 50)"
    " : resolve(s.dataset.state + '|' + s.textContent); check(); })"
)
"""The page's status once its data request has ended: "ready|…" or "error|<message>"."""


@pytest_asyncio.fixture
async def plain_gateway(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[GatewayHandle]:
    """A gateway on a fresh SQLite database with one request recorded (its engine is down: the
    dashboard's charts need only the database)."""
    server, gw = await start_gateway(
        f"sqlite:///{tmp_path / 'auth.db'}", free_port(), tiny_model_dir
    )
    tenant_id, _ = await gw.new_tenant("browser-auth", "be")
    now = datetime.now(UTC)
    record = UsageRecord(
        request_id="tdm-browser-auth",
        tenant_id=tenant_id,
        tier="be",
        model="tandem-tiny",
        endpoint="chat",
        prompt_tokens=12,
        completion_tokens=34,
        status="ok",
        http_status=200,
        created_at=now - timedelta(minutes=5),
        finished_at=now - timedelta(minutes=5),
    )
    await gw.app[STORE].insert_usage([record])
    yield gw
    await gw.session.close()
    await server.close()


async def test_dashboard_opened_with_credentials_in_its_url_loads_its_data(
    plain_gateway: GatewayHandle, tmp_path: Path
) -> None:
    # http://user:TOKEN@host/…: Chromium refuses a fetch whose URL carries credentials, and a
    # relative URL resolved against this page's would
    host = plain_gateway.base_url.removeprefix("http://")
    async with chromium_page(tmp_path / "chromium-profile") as page:
        loaded = page.event("Page.loadEventFired")
        loaded.clear()
        await page.send("Page.navigate", url=f"http://ops:{ADMIN_TOKEN}@{host}/admin/v1/dashboard")
        await _wait(loaded)
        state = await page.evaluate(WAIT_FOR_DATA_JS)
        assert state.startswith("ready|") and "1 requests" in state, state
        loaded.clear()
        await page.send("Page.reload")  # a reload asks again, with what the browser kept
        await _wait(loaded)
        state = await page.evaluate(WAIT_FOR_DATA_JS)
        assert state.startswith("ready|"), state
        assert page.errors == []


async def test_dashboard_opened_through_the_password_prompt_loads_its_data(
    plain_gateway: GatewayHandle, tmp_path: Path
) -> None:
    async with chromium_page(tmp_path / "chromium-profile") as page:
        prompts: list[str] = []

        def answer_prompt(params: dict[str, Any]) -> None:
            # what a person typing into the browser's password prompt does
            prompts.append(params["request"]["url"])
            page.spawn(
                "Fetch.continueWithAuth",
                requestId=params["requestId"],
                authChallengeResponse={
                    "response": "ProvideCredentials",
                    "username": "ops",
                    "password": ADMIN_TOKEN,
                },
            )

        page.on("Fetch.authRequired", answer_prompt)
        page.on(
            "Fetch.requestPaused",
            lambda params: page.spawn("Fetch.continueRequest", requestId=params["requestId"]),
        )
        await page.send("Fetch.enable", handleAuthRequests=True)
        loaded = page.event("Page.loadEventFired")
        loaded.clear()
        await page.send("Page.navigate", url=f"{plain_gateway.base_url}/admin/v1/dashboard")
        await _wait(loaded)
        state = await page.evaluate(WAIT_FOR_DATA_JS)
        assert state.startswith("ready|") and "1 requests" in state, state
        assert prompts == [f"{plain_gateway.base_url}/admin/v1/dashboard"]  # asked once
        assert page.errors == []


def basic(user: str, password: str) -> dict[str, str]:
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {raw}"}


async def _wait(event: Any, timeout_s: float = 30.0) -> None:
    await asyncio.wait_for(event.wait(), timeout_s)
