"""The request body parser answers every body with a request or a 4xx naming the problem, never
another exception (which the client would get as a 500): bytes that are not UTF-8, JSON nested
past the recursion limit, any shape of JSON (issue 16)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from gateway.errors import ApiError
from gateway.pipeline.prepare import parse_body

MODEL = "m"

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "other"]) | _JSON,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "x"]) | _JSON},
                optional={"content": st.text(max_size=10) | _JSON},
            ),
            max_size=3,
        )
        | _JSON,
        "prompt": st.text(max_size=10) | st.lists(st.integers(), max_size=3) | _JSON,
        "max_tokens": st.integers() | _JSON,
        "temperature": st.floats() | _JSON,
        "top_k": st.integers() | _JSON,
        "stop": st.lists(st.text(max_size=3), max_size=6) | _JSON,
        "stream_options": _JSON,
    },
)
_BODIES = st.one_of(
    st.binary(max_size=200),
    _JSON.map(lambda v: json.dumps(v).encode()),
    _FIELDS.map(lambda v: json.dumps(v).encode()),
    # a valid body cut, or with a byte replaced (UTF-8 broken inside a string)
    st.tuples(_FIELDS, st.integers(0, 300), st.binary(min_size=1, max_size=2)).map(
        lambda t: _mangle(json.dumps(t[0]).encode(), t[1], t[2])
    ),
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 200_000).map(lambda n: b'{"model":' * n + b"1" + b"}" * n),
)


def _mangle(raw: bytes, at: int, patch: bytes) -> bytes:
    at = at % (len(raw) + 1)
    return raw[:at] + patch + raw[at + len(patch) :]


@settings(max_examples=600, deadline=None)
@given(raw=_BODIES, endpoint=st.sampled_from(["chat", "completions"]))
def test_any_body_is_a_request_or_a_4xx(raw: bytes, endpoint: Any) -> None:
    try:
        body = parse_body(raw, endpoint, MODEL)
    except ApiError as exc:
        assert 400 <= exc.status < 500 and exc.message
        return
    assert isinstance(body, (ChatCompletionRequest, CompletionRequest))


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}', "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    ],
)
def test_undecodable_json_is_a_400_saying_why(raw: bytes, words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_body(raw, "chat", MODEL)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert words in info.value.message
