"""The simulator with the bidirectional KV layout (SimConfig.kv_layout = "bicache",
backend/sim/bikv.py): what a lazy eviction keeps, what RT takes, what a resumed BE request costs,
and that every policy still runs correctly on it."""

from __future__ import annotations

import pytest

from backend.policy.latency import BatchShape
from backend.policy.registry import POLICY_NAMES, make_policy
from backend.policy.types import Plan, PrefillChunk, Snapshot
from backend.sim.config import SimConfig
from backend.sim.engine import simulate
from backend.sim.records import SimResult
from backend.sim.source import ListSource
from tests.unit.sim_factories import LATENCY, make_request
from tests.unit.test_sim_engine import _check_invariants, _Checked, _mixed_workload, _Scripted

KV_BYTES, HOST_GB_S = 131072, 25.0
TOKEN_COPY_S = KV_BYTES / (HOST_GB_S * 1e9)


def _bicache(**fields: object) -> SimConfig:
    return SimConfig(
        **{
            "kv_layout": "bicache",
            "prefix_cache": False,
            "kv_bytes_per_token": KV_BYTES,
            "host_copy_gb_s": HOST_GB_S,
            **fields,
        }
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_runs_on_the_bicache_layout_under_memory_pressure(name: str) -> None:
    reqs = _mixed_workload(seed=2)
    if name == "rt-only":
        reqs = [r for r in reqs if r.tier == "rt"]
    policy = _Checked(make_policy(name, LATENCY))
    res = simulate(
        ListSource(reqs),
        policy,
        LATENCY,
        _bicache(kv_capacity_tokens=4000, max_prefill_tokens=2048, reveal_lengths=name == "oracle"),
    )
    _check_invariants(res, 4000)
    assert all(r.finish_s is not None for r in res.requests)
    stats = res.kv_layout_stats
    assert stats["checkpointed_tokens"] == (
        stats["restored_tokens"] + stats["discarded_checkpoint_tokens"]
    )


class _Spy(_Scripted):
    """Scripted plans; records what the policy sees of request x while it waits evicted."""

    def __init__(self, plans: list[Plan]) -> None:
        super().__init__(plans)
        self.x_waiting: list[tuple[int, int]] = []  # (prefilled, prefill_len)
        self.evictable: list[int] = []

    def plan(self, snapshot: Snapshot) -> Plan:
        for r in snapshot.waiting:
            if r.rid == "x" and r.num_evictions:
                self.x_waiting.append((r.prefilled, r.prefill_len))
                self.evictable.append(snapshot.kv_evictable_tokens)
        return super().plan(snapshot)


def _evict_and_squeeze(config: SimConfig) -> tuple[SimResult, _Spy]:
    """BE x (100-token prompt) decodes twice and is evicted; RT r (40 tokens) then needs more
    room than is free; r finishes and x comes back."""
    plans = [
        Plan(prefills=[PrefillChunk("x", 100)]),
        Plan(decodes=["x"]),
        Plan(decodes=["x"]),
        Plan(evictions=["x"]),
        Plan(prefills=[PrefillChunk("r", 40)]),
        Plan(decodes=["r"]),
    ]
    spy = _Spy(plans)
    reqs = [
        make_request(rid="x", tier="be", prompt_len=100, output_len=6),
        make_request(rid="r", tier="rt", prompt_len=40, output_len=2),
    ]
    return simulate(ListSource(reqs), spy, LATENCY, config), spy


def test_a_lazily_evicted_be_request_loses_only_the_slots_rt_takes() -> None:
    res, spy = _evict_and_squeeze(_bicache(kv_capacity_tokens=128))  # 8 blocks of 16
    # evicted with 102 tokens of KV (prompt + 2 decodes); nothing copied yet
    assert spy.x_waiting[0] == (102, 103)
    assert spy.evictable[0] == 102
    # r's prompt took the free block (16), the free tail of x's last block (10) and 14 of x's
    # slots; its decode one more
    assert spy.x_waiting[-1] == (87, 103)
    stats = res.kv_layout_stats
    assert stats["checkpointed_tokens"] == 15 and stats["restored_tokens"] == 15
    assert stats["rt_tokens_in_be_blocks"] == 25 and stats["lazy_evictions"] == 1
    x = next(r for r in res.requests if r.rid == "x")
    assert x.generated == 6 and x.evictions == 1 and x.finish_s is not None
    # coming back computes one token (the last emitted one); the 15 others are copied back
    it = res.iterations
    assert [it.prefill_tokens[i] for i in range(len(it)) if it.num_prefill[i]] == [100, 40, 1]
    # the iteration that overwrote x's slots waited for their 14 copies to the host
    plain = LATENCY.predict(
        BatchShape(prefill_tokens=40, num_prefill=1, prefill_attn=1600.0, prefill_attn_full=1600.0)
    )
    assert it.duration_s[4] == pytest.approx(plain + 14 * TOKEN_COPY_S)


def test_the_token_pool_recomputes_the_evicted_request_instead() -> None:
    res, spy = _evict_and_squeeze(SimConfig(kv_capacity_tokens=128, prefix_cache=False))
    assert spy.x_waiting[0] == (0, 103) and res.kv_layout_stats == {}
    it = res.iterations
    assert [it.prefill_tokens[i] for i in range(len(it)) if it.num_prefill[i]] == [100, 40, 103]


def test_blocks_are_one_request_per_side_so_the_engine_retracts_be_when_rt_cannot_grow() -> None:
    """Two RT requests fill a block each but the last; BE holds the rest. Slot counts say one
    free slot per RT decode is left, but both RT requests need a fresh block: the engine
    retracts the BE request (lazily) as SGLang's retract_decode would, and every request still
    finishes with its full output."""
    plans = [
        Plan(prefills=[PrefillChunk("a", 16), PrefillChunk("b", 16)]),
        Plan(decodes=["a", "b"], prefills=[PrefillChunk("x", 28)]),
        Plan(decodes=["a", "b", "x"]),
    ]
    reqs = [
        make_request(rid="a", prompt_len=16, output_len=4),
        make_request(rid="b", prompt_len=16, output_len=4),
        make_request(rid="x", tier="be", prompt_len=28, output_len=3),
    ]
    res = simulate(ListSource(reqs), _Scripted(plans), LATENCY, _bicache(kv_capacity_tokens=64))
    assert res.kv_layout_stats["engine_retractions"] >= 1
    assert res.num_evictions >= 1
    assert all(r.finish_s is not None and r.generated == r.output_len_target for r in res.requests)


def test_slot_reporting_runs_tandem_and_tells_the_policy_every_free_slot() -> None:
    seen: list[tuple[int, int, int]] = []

    class Spy(_Checked):
        def plan(self, snapshot: Snapshot) -> Plan:
            seen.append(
                (snapshot.kv_free_tokens, snapshot.kv_evictable_tokens, snapshot.kv_capacity_tokens)
            )
            return super().plan(snapshot)

    reqs = _mixed_workload(seed=4)
    res = simulate(
        ListSource(reqs),
        Spy(make_policy("tandem", LATENCY)),
        LATENCY,
        _bicache(kv_capacity_tokens=4000, max_prefill_tokens=2048, bicache_report="slots"),
    )
    _check_invariants(res, 4000)
    assert all(r.finish_s is not None for r in res.requests)
    assert min(free for free, _, _ in seen) < 4000 and max(ev for _, ev, _ in seen) > 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_layout": "bicache"}, "page_size 1 and prefix_cache off"),
        (
            {
                "kv_layout": "bicache",
                "prefix_cache": False,
                "page_size": 16,
                "prefix_block_tokens": 512,
            },
            "page_size 1",
        ),
        ({"kv_layout": "paged"}, "kv_layout must be"),
        ({"host_copy_gb_s": 0.0}, "host_copy_gb_s must be > 0"),
        ({"bicache_report": "all"}, "bicache_report must be"),
    ],
)
def test_layout_config_is_validated(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimConfig(kv_capacity_tokens=1024, **fields)  # type: ignore[arg-type]


def test_a_be_chunk_the_blocks_cannot_hold_is_cut_as_sglangs_prefill_adder_would() -> None:
    """Three BE prompts of 20 tokens: 60 of 64 slots, but each needs two blocks of its own and
    the pool has four. The third chunk is cut (to nothing here), not a failed run; its prompt
    runs once the others have finished, and every request gets its full output."""
    plans = [Plan(prefills=[PrefillChunk(rid, 20) for rid in "xyz"])]
    reqs = [make_request(rid=rid, tier="be", prompt_len=20, output_len=2) for rid in "xyz"]
    res = simulate(ListSource(reqs), _Scripted(plans), LATENCY, _bicache(kv_capacity_tokens=64))
    it = res.iterations
    assert it.prefill_tokens[0] == 40 and it.num_prefill[0] == 2
    assert it.duration_s[0] == pytest.approx(
        LATENCY.predict(
            BatchShape(
                prefill_tokens=40, num_prefill=2, prefill_attn=800.0, prefill_attn_full=800.0
            )
        )
    )
    assert all(r.finish_s is not None and r.generated == r.output_len_target for r in res.requests)
    z = next(r for r in res.requests if r.rid == "z")
    assert z.first_token_s is not None and z.first_token_s > it.duration_s[0]
