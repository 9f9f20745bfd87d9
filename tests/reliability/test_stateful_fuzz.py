"""Files and batches, probed with real ids: a hypothesis state machine makes tenants and keys,
uploads files (valid JSONL, odd lines, whatever the schema allows), creates batches on them,
reads, lists, cancels (as the tenant and as the operator) and downloads their results, and sends
generated cases to every operation with a path id filled with ids that exist — its own, another
tenant's, a deleted one's. Every answer is checked as in test_schema_fuzz (no 5xx, documented
status, content type, headers and body), and what a user would notice on top: an owner finds
its own batch, another tenant gets 404 for it, a result file holds JSON lines with a custom_id.
At the end every batch the machine created has ended (nothing is stuck), and a new tenant's
batch still completes: no input of one tenant blocks the batch runner for the others.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import pytest
import requests
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)
from schemathesis import APIOperation, GenerationMode, Response

from tests.gateway.harness import MODEL
from tests.reliability.fuzzing import Prober, fuzz_settings
from tests.reliability.live import LiveGateway
from tests.waiting import wait_until_sync

RUNS = 40
"""State-machine runs (each from a fresh start: its own tenants, files and batches)."""
STEPS = 25
"""Rules per run, at most."""
BATCH_END_TIMEOUT_S = 120.0
"""Every batch of the run ends within this long (each has a few lines of a few tokens; the
simulator is fast: they end within seconds on an idle machine)."""

TERMINAL = {"completed", "failed", "cancelled", "expired"}
ENDPOINTS = ["/v1/chat/completions", "/v1/completions"]
ID_PARAMETERS = {"file_id": "files", "batch_id": "batches", "tenant_id": "tenants"}
"""Path parameters the machine can fill with real ids, and where it keeps those."""


@dataclass(frozen=True)
class Owner:
    """A tenant the machine made, and its key."""

    tenant_id: str
    key: str


@dataclass(frozen=True)
class Owned:
    """A file or batch, and the tenant it belongs to."""

    id: str
    owner: Owner
    exists: bool = True
    """False for a stand-in: the server refused to make it (see `_REFUSED_OWNER`)."""


# A rule that makes something the server refuses still adds a stand-in to its bundle (an id that
# never existed, a key that was never issued): which rules hypothesis may draw next must not
# depend on the server's answers, or a replay of the same choices, meeting another answer,
# aborts the run (FlakyStrategyDefinition). The stand-ins exercise the unknown-id paths too.
_REFUSED_OWNER = Owner("tenant-refused", "tdm_refused_never_issued")


def _request_body(endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    content = st.text(max_size=30)
    max_tokens = st.integers(min_value=1, max_value=8)
    if endpoint == "/v1/chat/completions":
        return st.fixed_dictionaries(
            {
                "model": st.just(MODEL),
                "messages": st.lists(
                    st.fixed_dictionaries({"role": st.just("user"), "content": content}),
                    min_size=1,
                    max_size=2,
                ),
                "max_tokens": max_tokens,
            }
        )
    return st.fixed_dictionaries(
        {"model": st.just(MODEL), "prompt": content, "max_tokens": max_tokens}
    )


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def _line(draw: st.DrawFn) -> bytes:
    """One line of a batch input: mostly a valid request (any custom_id text, NUL included),
    sometimes valid JSON of the wrong shape, sometimes not JSON at all."""
    kind = draw(st.sampled_from(["valid"] * 9 + ["odd url", "json", "text"]))
    if kind == "text":
        return draw(st.binary(max_size=40)).replace(b"\n", b" ")
    if kind == "json":
        return json.dumps(draw(_JSON)).encode()
    endpoint = draw(st.sampled_from(ENDPOINTS))
    line = {
        "custom_id": draw(st.text(min_size=1, max_size=16)),
        "method": "POST",
        "url": draw(st.text(max_size=20)) if kind == "odd url" else endpoint,
        "body": draw(_request_body(endpoint)),
    }
    return json.dumps(line).encode()


def _mostly(valid: list[str], odd: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """One of *valid* about three times in four, else *odd* (hypothesis draws 0, its simplest
    integer, more often than the others: 0 is the valid branch)."""
    return st.integers(0, 3).flatmap(lambda n: odd if n == 3 else st.sampled_from(valid))


_WINDOW = _mostly(
    ["24h", "1h", "30m", "90s"],
    st.from_regex(r"\A[0-9]{1,30}(\.[0-9]{1,4})?[hms]\Z") | st.text(max_size=12),
)
_ENDPOINT = _mostly(ENDPOINTS, st.text(max_size=20))
_METADATA = st.none() | st.dictionaries(st.text(max_size=70), st.text(max_size=20), max_size=3)


class FilesAndBatches(RuleBasedStateMachine):
    """Tenants → files → batches → results, with real ids, through the HTTP API only."""

    prober: Prober
    """Set by the test before the machine runs."""
    created_batches: list[Owned]
    """Every batch any run created (checked at the end of the test)."""

    tenants = Bundle("tenants")
    files = Bundle("files")
    batches = Bundle("batches")

    def __init__(self) -> None:
        super().__init__()
        self.known: dict[str, list[str]] = {"files": [], "batches": [], "tenants": []}
        self.count = 0

    # -- helpers ----------------------------------------------------------------------------

    def op(self, label: str) -> APIOperation:
        return self.prober.operation(label)

    def send(self, label: str, token: str, **case: Any) -> Response | None:
        return self.prober.send(self.op(label).Case(**case), token=token)

    def make_tenant(self, tier: str) -> Owner | None:
        self.count += 1
        slo = {"ttft_ms": 10_000, "tpot_ms": 2_000} if tier == "rt" else {}
        name = f"machine-{id(self):x}-{self.count}"
        admin = self.prober.live.admin_token
        body = {"name": name, "tier": tier, "slo": slo}
        made = self.send("POST /admin/v1/tenants", admin, body=body, media_type="application/json")
        if made is None or made.status_code != 201:
            return None
        tenant_id = made.json()["id"]
        key = self.send(
            "POST /admin/v1/tenants/{tenant_id}/keys",
            admin,
            path_parameters={"tenant_id": tenant_id},
        )
        if key is None or key.status_code != 201:
            return None
        self.known["tenants"].append(tenant_id)
        return Owner(tenant_id, key.json()["key"])

    # -- tenants ----------------------------------------------------------------------------

    @initialize(target=tenants)
    def first_tenant(self) -> Any:
        return self.make_tenant("be") or _REFUSED_OWNER

    @rule(target=tenants, tier=st.sampled_from(["rt", "be"]))
    def new_tenant(self, tier: str) -> Any:
        return self.make_tenant(tier) or _REFUSED_OWNER

    @rule(owner=tenants, data=st.data())
    def patch_tenant(self, owner: Owner, data: st.DataObject) -> None:
        """The operator changes a tenant with whatever the schema allows (or not): quotas,
        tier, SLO targets — the tenant's later requests must still never see a 5xx."""
        mode = data.draw(st.sampled_from([GenerationMode.POSITIVE, GenerationMode.NEGATIVE]))
        operation = self.op("PATCH /admin/v1/tenants/{tenant_id}")
        case = data.draw(
            operation.as_strategy(mode, path_parameters={"tenant_id": owner.tenant_id})
        )
        self.prober.send(case)

    # -- files ------------------------------------------------------------------------------

    @rule(target=files, owner=tenants, lines=st.lists(_line(), min_size=1, max_size=4))
    def upload(self, owner: Owner, lines: list[bytes]) -> Any:
        content = b"\n".join(lines) + b"\n"
        uploaded = self.send(
            "POST /v1/files",
            owner.key,
            body={"file": content, "purpose": "batch"},
            media_type="multipart/form-data",
        )
        if uploaded is None or uploaded.status_code != 200:
            return Owned("file-refused", owner, exists=False)
        self.known["files"].append(uploaded.json()["id"])
        return Owned(uploaded.json()["id"], owner)

    @rule(target=files, owner=tenants, data=st.data())
    def upload_generated(self, owner: Owner, data: st.DataObject) -> Any:
        mode = data.draw(st.sampled_from([GenerationMode.POSITIVE, GenerationMode.NEGATIVE]))
        case = data.draw(self.op("POST /v1/files").as_strategy(mode))
        uploaded = self.prober.send(case, token=owner.key)
        if uploaded is None or uploaded.status_code != 200:
            return Owned("file-refused", owner, exists=False)
        self.known["files"].append(uploaded.json()["id"])
        return Owned(uploaded.json()["id"], owner)

    @rule(file=files, reader=tenants)
    def read_file(self, file: Owned, reader: Owner) -> None:
        for label in ("GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content"):
            got = self.send(label, reader.key, path_parameters={"file_id": file.id})
            if got is not None and reader.tenant_id != file.owner.tenant_id:
                # 401: the machine deleted the reader (its key is revoked)
                assert got.status_code in (401, 404), f"{label}: another tenant's file: {got.text}"

    @rule(owner=tenants)
    def list_files(self, owner: Owner) -> None:
        self.send("GET /v1/files", owner.key)

    @rule(file=files)
    def delete_file(self, file: Owned) -> None:
        self.send(
            "DELETE /v1/files/{file_id}", file.owner.key, path_parameters={"file_id": file.id}
        )

    # -- batches ----------------------------------------------------------------------------

    @rule(
        target=batches,
        file=files,
        creator=tenants,
        endpoint=_ENDPOINT,
        window=_WINDOW,
        metadata=_METADATA,
        own=st.integers(0, 4),
    )
    def create_batch(
        self,
        file: Owned,
        creator: Owner,
        endpoint: str,
        window: str,
        metadata: dict[str, str] | None,
        own: int,
    ) -> Any:
        """Mostly the file's owner creates the batch; sometimes another tenant tries to."""
        who = file.owner if own else creator
        body: dict[str, Any] = {
            "input_file_id": file.id,
            "endpoint": endpoint,
            "completion_window": window,
        }
        if metadata is not None:
            body["metadata"] = metadata
        made = self.send("POST /v1/batches", who.key, body=body, media_type="application/json")
        if made is None or made.status_code != 200:
            return Owned("batch_refused", who, exists=False)
        assert who.tenant_id == file.owner.tenant_id, "a batch was made on another tenant's file"
        batch = Owned(made.json()["id"], who)
        self.known["batches"].append(batch.id)
        type(self).created_batches.append(batch)
        return batch

    @rule(batch=batches, reader=tenants)
    def retrieve_batch(self, batch: Owned, reader: Owner) -> None:
        got = self.send(
            "GET /v1/batches/{batch_id}", reader.key, path_parameters={"batch_id": batch.id}
        )
        if got is None:
            return
        # 401: the machine deleted the reader (its key is revoked)
        if not batch.exists:
            assert got.status_code in (401, 404), f"a batch that was never made: {got.text}"
        elif reader.tenant_id == batch.owner.tenant_id:
            assert got.status_code in (200, 401), f"the owner could not read its batch: {got.text}"
        else:
            assert got.status_code in (401, 404), f"another tenant's batch: {got.text}"

    @rule(owner=tenants, data=st.data())
    def list_batches(self, owner: Owner, data: st.DataObject) -> None:
        query: dict[str, Any] = {}
        if data.draw(st.booleans()):
            query["limit"] = data.draw(st.integers(-5, 150))
        # the same draws whatever the server made so far (see `_REFUSED_OWNER`)
        after = data.draw(st.booleans(), label="after")
        pick = data.draw(st.integers(0, 2**16), label="which batch")
        text = data.draw(st.text(max_size=10), label="or a made-up id")
        if after:
            known = self.known["batches"]
            query["after"] = known[pick // 2 % len(known)] if known and pick % 2 else text
        self.send("GET /v1/batches", owner.key, query=query)

    @rule(batch=batches, as_operator=st.booleans())
    def cancel_batch(self, batch: Owned, as_operator: bool) -> None:
        if as_operator:
            label, token = "POST /admin/v1/batches/{batch_id}/cancel", self.prober.live.admin_token
        else:
            label, token = "POST /v1/batches/{batch_id}/cancel", batch.owner.key
        self.send(label, token, path_parameters={"batch_id": batch.id})

    @rule(batch=batches)
    def download_results(self, batch: Owned) -> None:
        got = self.send(
            "GET /v1/batches/{batch_id}", batch.owner.key, path_parameters={"batch_id": batch.id}
        )
        if got is None or got.status_code != 200:
            return
        for field in ("output_file_id", "error_file_id"):
            file_id = got.json().get(field)
            if not file_id:
                continue
            content = self.send(
                "GET /v1/files/{file_id}/content",
                batch.owner.key,
                path_parameters={"file_id": file_id},
            )
            if content is None or content.status_code != 200:
                continue
            for line in content.content.splitlines():
                assert "custom_id" in json.loads(line), f"{field}: a line without custom_id"

    # -- any operation, with real ids -------------------------------------------------------

    @rule(caller=tenants, data=st.data())
    def generated_case_with_real_ids(self, caller: Owner, data: st.DataObject) -> None:
        """A generated case of an operation with a path id, the id one that exists (the
        caller's own, another tenant's, or a deleted one's)."""
        candidates = [
            op
            for op in self.prober.operations()
            if any(f"{{{name}}}" in op.path for name in ID_PARAMETERS)
        ]
        operation = data.draw(st.sampled_from(candidates))
        path_parameters = {}
        for name, kind in ID_PARAMETERS.items():
            if f"{{{name}}}" in operation.path:
                # the same draws with or without ids known (see `_REFUSED_OWNER`)
                pick = data.draw(st.integers(0, 2**16), label=name)
                known = self.known[kind]
                path_parameters[name] = known[pick % len(known)] if known else f"unknown-{pick}"
        mode = data.draw(st.sampled_from([GenerationMode.POSITIVE, GenerationMode.NEGATIVE]))
        case = data.draw(operation.as_strategy(mode, path_parameters=path_parameters))
        admin = operation.path.startswith("/admin/")
        self.prober.send(case, token=self.prober.live.admin_token if admin else caller.key)


def _batch_status(live: LiveGateway, batch: Owned) -> str:
    reply = requests.get(
        f"{live.base_url}/v1/batches/{batch.id}",
        headers={"Authorization": f"Bearer {batch.owner.key}"},
        timeout=30,
    )
    if reply.status_code == 401:  # the machine revoked the key or deleted the tenant
        return "owner gone"
    assert reply.status_code == 200, reply.text
    return str(reply.json()["status"])


@pytest.mark.slow
def test_files_and_batches_with_real_ids(live: LiveGateway) -> None:
    prober = Prober.of(live)
    FilesAndBatches.prober = prober
    FilesAndBatches.created_batches = []
    run_state_machine_as_test(
        FilesAndBatches,
        settings=fuzz_settings(RUNS, stateful_step_count=STEPS, derandomize=True),
    )
    batches = FilesAndBatches.created_batches
    print(prober.summary("stateful fuzz") + f"; {len(batches)} batches created")

    # nothing is stuck: every batch the machine made ends (completed, failed, cancelled, expired)
    def stuck() -> list[tuple[str, str]]:
        states = [(b.id, _batch_status(live, b)) for b in batches]
        return [s for s in states if s[1] not in TERMINAL and s[1] != "owner gone"]

    last: list[list[tuple[str, str]]] = [[]]

    def all_ended() -> bool:
        last[0] = stuck()
        return not last[0]

    wait_until_sync(
        all_ended, BATCH_END_TIMEOUT_S, what=lambda: f"every batch ended; still {last[0][:5]}"
    )

    # and a new tenant's batch still completes, whatever the others sent
    machine = FilesAndBatches()
    owner = machine.make_tenant("be")
    assert owner is not None
    line: dict[str, Any] = {"custom_id": "after-the-fuzz", "method": "POST", "url": ENDPOINTS[0]}
    line["body"] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    uploaded = machine.upload(owner, [json.dumps(line).encode()])
    assert isinstance(uploaded, Owned)
    batch = machine.create_batch(uploaded, owner, ENDPOINTS[0], "24h", None, 1)
    assert isinstance(batch, Owned)
    started = time.monotonic()
    wait_until_sync(
        lambda: _batch_status(live, batch) == "completed",
        BATCH_END_TIMEOUT_S,
        what="a new tenant's one-line batch completed",
    )
    print(f"a new tenant's batch completed {time.monotonic() - started:.2f} s after creation")
    assert not prober.findings, prober.report()
