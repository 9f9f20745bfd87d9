"""The batch runner's dispatch order across tenants (gateway/batch/fair.py) on hand-built
batches: tenants by weighted fair share, a tenant's batches most urgent first, each batch's
lines in its own order; the weight comes from the tenant record when it has one."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.batch.fair import DEFAULT_WEIGHT, TenantShares, tenant_weight


@dataclass
class FakeBatch:
    tenant: str
    lines: list[int]
    sent: list[int] = field(default_factory=list)

    def next_line(self) -> int | None:
        if not self.lines:
            return None
        self.sent.append(self.lines.pop(0))
        return self.sent[-1]


def dispatch(
    shares: TenantShares, batches: dict[str, list[FakeBatch]], weights: dict[str, float], n: int
) -> list[tuple[str, int]]:
    """`n` lines, each 100 prompt tokens, charged as they are sent (as the runner does)."""
    out = []
    for batch, line in shares.pick_lines(batches, FakeBatch.next_line, n):
        shares.charge(batch.tenant, 100, weights[batch.tenant])
        out.append((batch.tenant, line))
    return out


def test_lines_go_to_tenants_in_the_ratio_of_their_weights_in_each_batchs_order() -> None:
    shares = TenantShares()
    gold, bronze = FakeBatch("gold", list(range(10))), FakeBatch("bronze", list(range(10)))
    batches = {"gold": [gold], "bronze": [bronze]}
    shares.set_backlogged(batches)
    sent = dispatch(shares, batches, {"gold": 2.0, "bronze": 1.0}, 9)
    assert [t for t, _ in sent].count("gold") == 6  # 2 : 1
    assert gold.sent == list(range(6)) and bronze.sent == list(range(3))  # own order kept


def test_a_tenants_urgent_batch_goes_first_and_a_blocked_tenant_is_passed_over() -> None:
    shares = TenantShares()
    urgent, later = FakeBatch("a", [7, 8]), FakeBatch("a", [1, 2])
    blocked = FakeBatch("b", [])  # its feed has nothing to send now
    batches = {"a": [urgent, later], "b": [blocked]}
    shares.set_backlogged(batches)
    sent = dispatch(shares, batches, {"a": 1.0, "b": 1.0}, 3)
    assert sent == [("a", 7), ("a", 8), ("a", 1)]


def test_a_tenant_back_after_idling_starts_level_not_ahead() -> None:
    shares = TenantShares()
    busy = FakeBatch("busy", list(range(20)))
    shares.set_backlogged(["busy"])
    dispatch(shares, {"busy": [busy]}, {"busy": 1.0}, 10)  # 1000 tokens while alone
    late = FakeBatch("late", list(range(20)))
    batches = {"busy": [busy], "late": [late]}
    shares.set_backlogged(batches)
    sent = dispatch(shares, batches, {"busy": 1.0, "late": 1.0}, 6)
    assert [t for t, _ in sent].count("late") == 3  # alternating, not 6 in a row to catch up
    shares.set_backlogged(["late"])  # busy's batch ended
    assert shares.fair.backlogged == {"late"}


def test_the_weight_comes_from_the_tenants_slo_contract_when_it_has_one() -> None:
    @dataclass
    class Contract:
        weight: float

    @dataclass
    class Tenant:
        slo: Contract

    class Without:
        pass

    assert tenant_weight(Tenant(Contract(3.0))) == 3.0
    assert tenant_weight(Without()) == DEFAULT_WEIGHT == 1.0
    assert tenant_weight(Tenant(Contract(0.0))) == DEFAULT_WEIGHT  # not a valid weight
