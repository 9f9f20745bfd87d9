"""Batches of two tenants running at the same time share the engine by weighted fair share
(gateway/batch/fair.py): with one line in flight at a time, from the moment both batches are
being fed their lines alternate (equal weights, equal lines), where urgency order alone would
run the first batch to its end before the second starts."""

from __future__ import annotations

from tests.gateway.conftest import GatewayFactory
from tests.gateway.test_batches import chat_line, create_batch, jsonl, upload, wait_for

LINES = 8


async def test_two_tenants_batches_interleave_line_by_line(make_gateway: GatewayFactory) -> None:
    async with make_gateway(TANDEM_BATCH__MAX_INFLIGHT="1") as gw:
        tenants = [await gw.new_tenant(name, "be") for name in ("fair-a", "fair-b")]
        files = []
        for name, (_, key) in zip("ab", tenants, strict=True):
            lines = [chat_line(f"{name}-{i}", f"Line {i}: name a colour.") for i in range(LINES)]
            file = await upload(gw, key, jsonl(lines))
            assert file.status == 200, file
            files.append(file.body["id"])
        batches = []
        for (_, key), file_id in zip(tenants, files, strict=True):
            created = await create_batch(gw, key, file_id)
            assert created.status == 200, created
            batches.append(created.body["id"])
        for (_, key), batch_id in zip(tenants, batches, strict=True):
            done = await wait_for(gw, key, batch_id)
            assert done["request_counts"]["completed"] == LINES, done
        # dispatch order: each line's usage record starts when the runner sent it
        starts = []
        for tenant_id, _ in tenants:
            starts += [(r["created_at"], tenant_id) for r in await gw.records(tenant_id, LINES)]
        order = [tenant_id for _, tenant_id in sorted(starts)]
    assert sorted(order) == sorted([t for t, _ in tenants] * LINES)
    first = order[0]
    joined = next(i for i, t in enumerate(order) if t != first)  # the second's first line
    # from there until one of them has sent every line, neither gets two lines ahead
    lead, sent = 0, {t: order[:joined].count(t) for t, _ in tenants}
    for tenant_id in order[joined:]:
        lead += 1 if tenant_id == first else -1
        sent[tenant_id] += 1
        assert abs(lead) <= 1, order
        if max(sent.values()) == LINES:
            break
    assert joined <= LINES // 2, order  # the second did not wait for the first to finish
