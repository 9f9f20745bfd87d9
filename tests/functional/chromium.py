"""Headless Chromium driven over the DevTools protocol (a websocket; aiohttp is the client), for
tests of pages the gateway serves. Debian's `chromium` package (scripts/install-chromium)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.waiting import wait_until

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
"""How the issue says to start it (no network of its own, no sandbox: CI runs as root)."""
_BINARIES = ("chromium", "chromium-browser", "google-chrome")
_START_TIMEOUT_S = 30.0


def chromium_binary() -> str:
    """Path of the browser; fails the test (never skips) when it is not installed."""
    for name in _BINARIES:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "Chromium is not installed: run scripts/install-chromium (apt-get install "
        "chromium); .ci/run does it on CI"
    )


class Page:
    """One page target: send commands, collect console errors and exceptions."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self.errors: list[str] = []
        """Console errors, uncaught exceptions and error log entries, as text."""
        self._handlers: dict[str, Callable[[dict[str, Any]], None]] = {}
        self._spawned: set[asyncio.Task[dict[str, Any]]] = set()
        self._reader = asyncio.create_task(self._read())

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        await self._ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    def on(self, method: str, handler: Callable[[dict[str, Any]], None]) -> None:
        """Calls *handler* with the params of every *method* event (it must not block: to
        answer with a command, `spawn` it)."""
        self._handlers[method] = handler

    def spawn(self, method: str, **params: Any) -> None:
        """Sends a command without waiting for its reply (from an event handler)."""
        task = asyncio.create_task(self.send(method, **params))
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    def event(self, method: str) -> asyncio.Event:
        return self._events.setdefault(method, asyncio.Event())

    async def evaluate(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def _read(self) -> None:
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            method, params = data.get("method", ""), data.get("params", {})
            self._record_error(method, params)
            handler = self._handlers.get(method)
            if handler is not None:
                handler(params)
            self.event(method).set()

    def _record_error(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = [str(a.get("value", a.get("description", ""))) for a in params.get("args", [])]
            self.errors.append("console: " + " ".join(args))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"exception: {text}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} ({entry.get('url', '')})")


@contextlib.asynccontextmanager
async def chromium_page(
    profile_dir: Path, width: int = 1400, height: int = 1000
) -> AsyncIterator[Page]:
    """A fresh headless Chromium (its own profile in *profile_dir*) and its first page."""
    binary = chromium_binary()
    profile_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            binary,
            *FLAGS,
            "--remote-debugging-port=0",
            f"--user-data-dir={profile_dir}",
            f"--window-size={width},{height}",
            "--hide-scrollbars",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port = await _devtools_port(profile_dir, proc)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            page_target = next(t for t in targets if t.get("type") == "page")
            async with session.ws_connect(
                page_target["webSocketDebuggerUrl"], max_msg_size=64 * 1024 * 1024
            ) as ws:
                page = Page(ws)
                try:
                    for domain in ("Runtime", "Log", "Page", "Network"):
                        await page.send(f"{domain}.enable")
                    yield page
                finally:
                    await page.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _devtools_port(profile_dir: Path, proc: subprocess.Popen[bytes]) -> int:
    """The port Chromium chose (it writes it to DevToolsActivePort in the profile)."""
    marker = profile_dir / "DevToolsActivePort"

    def port() -> int | None:
        if proc.poll() is not None:
            pytest.fail(f"chromium exited at start-up with status {proc.returncode}")
        first = marker.read_text().splitlines()[:1] if marker.exists() else []
        return int(first[0]) if first and first[0].isdigit() else None

    return await wait_until(port, _START_TIMEOUT_S, what="chromium's DevTools port open")
