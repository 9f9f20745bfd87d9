"""Fixtures of the reliability tier (tests/reliability): schemathesis and hypothesis over the
live gateway in front of the simulator, as an attacker would probe it. Every test here is marked
`reliability` (``-m reliability`` selects the tier).

* `live`: one gateway (with its simulator, in a background thread) per module and database —
  SQLite, and PostgreSQL (whose column types and text rules are stricter) — with an RT tenant and
  its key. The fuzz may change that tenant's quota and make other tenants, never the admin token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from backend.launch.tiny_model import ensure_tiny_model
from tests.functional.store_fixtures import BACKENDS, PgServer
from tests.reliability.live import LiveGateway, live_gateway

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.reliability)


@pytest_asyncio.fixture(scope="module", params=BACKENDS)
async def database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pg_server: PgServer
) -> str:
    """A new, empty database of each kind (plain sqlite:// / postgresql:// URL)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('reliability-db') / 'tandem.db'}"
    return await pg_server.new_database()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[LiveGateway]:
    """A live gateway on *database_url* in front of the simulator, with a tenant and its key."""
    model_dir = ensure_tiny_model(tmp_path_factory.mktemp("reliability-model"))
    folder = tmp_path_factory.mktemp("reliability-gateway")
    # A request without max_tokens stops at 16 tokens (OpenAI's legacy default) instead of the
    # gateway's 1,024: the fuzz probes the API surface, and at 1,024 the simulated generation of
    # the few hundred cases that set no cap took most of the tier's time (0.25 s each).
    with live_gateway(
        folder,
        model_dir,
        TANDEM_DATABASE__URL=database_url,
        TANDEM_GATEWAY__DEFAULT_MAX_TOKENS="16",
    ) as gateway:
        yield gateway
