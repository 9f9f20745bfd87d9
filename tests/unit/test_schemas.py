"""The range checks of request bodies (gateway/api/schemas.py): each refusal is a 400 naming the
field and its allowed range; the edges of each range pass."""

from __future__ import annotations

import math

import msgspec
import pytest

from gateway.api.schemas import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    ChatCompletionRequest,
    check_float_range,
    check_int_range,
    check_sampling,
    check_token_ids,
)
from gateway.errors import ApiError


def chat(**fields: object) -> ChatCompletionRequest:
    return msgspec.convert({"model": "m", "messages": [], **fields}, ChatCompletionRequest)


def refusal(fields: dict[str, object]) -> ApiError:
    with pytest.raises(ApiError) as info:
        check_sampling(chat(**fields))
    assert info.value.status == 400 and info.value.code == "invalid_value"
    return info.value


def test_int_range_is_inclusive_and_names_param_and_range() -> None:
    check_int_range("n", None, 1, 3)
    check_int_range("n", 1, 1, 3)
    check_int_range("n", 3, 1, 3)
    with pytest.raises(ApiError) as info:
        check_int_range("n", 4, 1, 3)
    assert info.value.param == "n" and info.value.message == "n must be in [1, 3], got 4"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, 1.5])
def test_float_range_refuses_non_finite_and_the_open_end(value: float) -> None:
    with pytest.raises(ApiError) as info:
        check_float_range("top_p", value, 0.0, 1.0, low_open=True)
    assert info.value.param == "top_p" and "finite number in (0.0, 1.0]" in info.value.message


def test_float_range_passes_its_edges() -> None:
    check_float_range("top_p", 1.0, 0.0, 1.0, low_open=True)
    check_float_range("min_p", 0.0, 0.0, 1.0)
    check_float_range("min_p", None, 0.0, 1.0)


def test_token_ids_are_checked_against_the_vocabulary_naming_the_first_bad_one() -> None:
    check_token_ids("prompt", [0, 99], 100)
    with pytest.raises(ApiError) as info:
        check_token_ids("prompt", [0, 100, -1], 100)
    assert info.value.param == "prompt[1]"
    assert "[0, 99]" in info.value.message and "100 tokens" in info.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
        ({"min_tokens": 2**31}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"seed": INT64_MAX + 1}, "seed"),
        ({"seed": INT64_MIN - 1}, "seed"),
        ({"repetition_penalty": 2.01}, "repetition_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"temperature": math.nan}, "temperature"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"stop": ["a"] * 5}, "stop"),
    ],
)
def test_values_the_engine_cannot_take_are_refused_naming_the_field(
    fields: dict[str, object], param: str
) -> None:
    assert refusal(fields).param == param


def test_the_edges_of_every_range_pass() -> None:
    check_sampling(
        chat(
            top_k=INT32_MAX,
            max_tokens=INT32_MAX,
            max_completion_tokens=1,
            min_tokens=INT32_MAX,
            seed=INT64_MIN,
            repetition_penalty=2.0,
            temperature=0.0,
            top_p=1.0,
            min_p=1.0,
            presence_penalty=-2.0,
            frequency_penalty=2.0,
        )
    )
    check_sampling(chat(top_k=-1, seed=INT64_MAX, min_tokens=0, temperature=0.0))
