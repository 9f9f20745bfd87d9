"""common.wire: the request metadata the gateway sends to the engine in ``custom_params``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from common.wire import (
    CUSTOM_PARAMS_KEY,
    PRIORITY_BE,
    PRIORITY_BE_DEADLINE,
    PRIORITY_RT,
    RequestMeta,
    meta_from_custom_params,
    meta_to_custom_params,
)


def make_meta(tier: str = "rt", **fields: Any) -> RequestMeta:
    base: dict[str, Any] = {
        "tier": tier,
        "tenant_id": "acme",
        "length_key": "acme/chat",
        "arrival_unix_s": 1_795_000_000.25,
    }
    return msgspec.convert({**base, **fields}, RequestMeta)


@pytest.mark.parametrize(
    "meta",
    [
        make_meta("rt", ttft_target_ms=200.0, tpot_target_ms=40.0, max_tokens=128),
        make_meta("be", deadline_s=86_400.0),
        make_meta("be"),
    ],
)
def test_round_trip(meta: RequestMeta) -> None:
    assert meta_from_custom_params(meta_to_custom_params(meta)) == meta


def test_custom_params_are_one_flat_dict_of_scalars() -> None:
    # SGLang's msgpack IPC rejects anything deeper than dict[str, scalar] (and kills the
    # scheduler doing so), and unset fields are left out rather than sent as null.
    params = meta_to_custom_params(make_meta("rt", ttft_target_ms=200.0))
    assert list(params) == [CUSTOM_PARAMS_KEY]
    inner = params[CUSTOM_PARAMS_KEY]
    assert all(isinstance(v, str | int | float | bool) for v in inner.values())
    assert "tpot_target_ms" not in inner and "deadline_s" not in inner


def test_a_json_round_trip_keeps_every_field() -> None:
    meta = make_meta("rt", ttft_target_ms=150.5, tpot_target_ms=33.0, max_tokens=7)
    wire = msgspec.json.decode(msgspec.json.encode(meta_to_custom_params(meta)))
    assert meta_from_custom_params(wire) == meta


@pytest.mark.parametrize("params", [None, {}, {"someone_else": {"tier": "rt"}}])
def test_absent_metadata_is_none(params: dict[str, Any] | None) -> None:
    assert meta_from_custom_params(params) is None


@pytest.mark.parametrize(
    "inner",
    [
        {"tier": "gold", "tenant_id": "a", "length_key": "a", "arrival_unix_s": 1.0},
        {"tier": "rt", "tenant_id": "a", "length_key": "a"},  # no arrival time
        {"tier": "rt", "tenant_id": 5, "length_key": "a", "arrival_unix_s": 1.0},
        {"tier": "rt", "tenant_id": "a", "length_key": "a", "arrival_unix_s": 1.0, "extra": 1},
        {"tier": "rt", "tenant_id": "a", "length_key": "a", "arrival_unix_s": "soon"},
        "rt",
        ["rt"],
    ],
)
def test_malformed_metadata_is_rejected(inner: Any) -> None:
    with pytest.raises(msgspec.ValidationError):
        meta_from_custom_params({CUSTOM_PARAMS_KEY: inner})


def test_sglang_priority_orders_rt_above_be_deadline_above_be() -> None:
    rt = make_meta("rt", ttft_target_ms=100.0)
    be_deadline = make_meta("be", deadline_s=60.0)
    be = make_meta("be")
    assert (rt.sglang_priority, be_deadline.sglang_priority, be.sglang_priority) == (
        PRIORITY_RT,
        PRIORITY_BE_DEADLINE,
        PRIORITY_BE,
    )
    # Higher is more urgent in SGLang, and RT beats BE by more than SGLang's default priority
    # preemption threshold (10), so an RT arrival may preempt running BE work.
    assert PRIORITY_RT - max(PRIORITY_BE_DEADLINE, PRIORITY_BE) > 10
    assert PRIORITY_BE_DEADLINE > PRIORITY_BE


def test_absolute_deadlines() -> None:
    rt = make_meta("rt", ttft_target_ms=250.0)
    be = make_meta("be", deadline_s=30.0)
    assert rt.ttft_due_unix_s == pytest.approx(rt.arrival_unix_s + 0.25)
    assert rt.deadline_due_unix_s is None
    assert be.deadline_due_unix_s == pytest.approx(be.arrival_unix_s + 30.0)
    assert be.ttft_due_unix_s is None


def test_the_tenant_weight_defaults_to_one_and_must_be_positive() -> None:
    assert make_meta("be").tenant_weight == 1.0
    weighted = make_meta("be", tenant_weight=2.5)
    assert meta_from_custom_params(meta_to_custom_params(weighted)) == weighted
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(msgspec.ValidationError, match="tenant_weight"):
            make_meta("be", tenant_weight=bad)
    with pytest.raises(ValueError, match="tenant_weight"):
        RequestMeta(tier="rt", tenant_id="a", length_key="a", arrival_unix_s=0.0, tenant_weight=0)
