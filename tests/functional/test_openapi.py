"""/openapi.json describes every route the gateway serves (the test enumerates the app's router),
with well-formed operations whose references resolve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.config import load_config
from gateway.api.openapi import OPERATIONS, registered
from gateway.app import create_app
from tests.functional.gateway_fixtures import GatewayHandle

METHODS = {"get", "post", "put", "patch", "delete"}


async def test_every_route_of_the_app_is_documented(tiny_model_dir: Path) -> None:
    app = create_app(load_config(environ={}), "x" * 16, tiny_model_dir)
    documented = {(op.method, op.path) for op in OPERATIONS}
    served = registered(app)
    assert ("POST", "/v1/chat/completions") in served and ("GET", "/metrics") in served
    missing = sorted(served - documented)
    assert not missing, (
        f"routes without an OpenAPI description: {missing}; add an Op for each "
        "to gateway/api/openapi.py OPERATIONS"
    )


async def test_openapi_json_is_served_and_well_formed(
    gateway_without_engine: GatewayHandle,
) -> None:
    gw = gateway_without_engine
    async with gw.session.get(f"{gw.base_url}/openapi.json") as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] == "tandem"
    served = registered(gw.app)
    listed = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert listed == served  # everything served is described, nothing else is promised
    schemes = doc["components"]["securitySchemes"]
    operation_ids = set()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert method in METHODS
            assert op["summary"] and op["responses"]
            operation_ids.add(op["operationId"])
            for requirement in op["security"]:
                assert set(requirement) <= set(schemes)
            in_path = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert in_path == {part[1:-1] for part in path.split("/") if part.startswith("{")}
            for status, response in op["responses"].items():
                assert 200 <= int(status) < 600 and response["description"]
            if "429" in op["responses"]:
                assert "Retry-After" in op["responses"]["429"]["headers"]
    assert len(operation_ids) == len(listed)
    _check_refs(doc, doc)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    schema = _resolve(doc, chat["application/json"]["schema"]["$ref"])
    assert {"model", "messages", "max_tokens", "stream", "tier"} <= set(schema["properties"])
    quota = _resolve(doc, "#/components/schemas/Tenant")["properties"]["quota"]
    assert _resolve(doc, quota["$ref"])["properties"].keys() == {
        "requests_per_min",
        "tokens_per_min",
        "max_concurrent",
        "monthly_tokens",
    }


def _resolve(doc: dict[str, Any], ref: str) -> dict[str, Any]:
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    assert isinstance(node, dict)
    return node


def _check_refs(doc: dict[str, Any], node: Any) -> None:
    if isinstance(node, dict):
        if "$ref" in node:
            _resolve(doc, node["$ref"])
        for child in node.values():
            _check_refs(doc, child)
    elif isinstance(node, list):
        for child in node:
            _check_refs(doc, child)
