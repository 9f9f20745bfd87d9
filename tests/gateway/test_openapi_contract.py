"""The server keeps the contract /openapi.json states (issue 16): every method a path does not
list is refused with 405 and an `Allow` header naming the ones it does, and bodies the schema
allows are never answered with a 5xx."""

from __future__ import annotations

from typing import Any

from tests.gateway.harness import Gateway

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def concrete(path: str) -> str:
    """*path* with each `{param}` replaced by a made-up id."""
    return "/".join("x_1" if part.startswith("{") else part for part in path.split("/"))


async def test_every_other_method_gets_405_with_allow(gw: Gateway) -> None:
    doc: dict[str, Any] = (await gw.request("GET", "/openapi.json")).body
    checked = 0
    for path, operations in doc["paths"].items():
        documented = {method.upper() for method in operations}
        allowed = documented | ({"HEAD"} if "GET" in documented else set())
        for method in sorted(set(METHODS) - documented):
            reply = await gw.request(method, concrete(path), admin=True)
            assert reply.status == 405, (method, path, reply)
            assert reply.error["code"] == "method_not_allowed"
            allow = reply.headers.get("Allow")
            assert allow is not None, f"{method} {path}: 405 without Allow"
            assert {m.strip() for m in allow.split(",")} == allowed, (method, path, allow)
            checked += 1
    assert checked >= len(doc["paths"])
