"""One renderer for every OpenAI body, the API's and the batch output's: shapes, finish reasons,
usage, and an id that names the engine request (the usage record's request_id)."""

from __future__ import annotations

from gateway.api.render import (
    ResponseHead,
    StreamRenderer,
    completion_body,
    finish_reason,
    usage_body,
)
from tests.unit.pipeline_factories import chunk

RID = "tdm-0123abcd"


def test_chat_completion_body() -> None:
    head = ResponseHead(endpoint="chat", rid=RID, model="tandem-tiny", created_unix_s=1700)
    body = completion_body(head, "Hello!", "length", usage_body(5, 3, cached_tokens=4))
    assert body == {
        "id": f"chatcmpl-{RID}",
        "object": "chat.completion",
        "created": 1700,
        "model": "tandem-tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!"},
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            # what the engine's prefix cache held of the prompt, as OpenAI reports it
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }


def test_text_completion_body() -> None:
    head = ResponseHead(endpoint="completions", rid=RID, model="m", created_unix_s=1)
    body = completion_body(head, "abc", "stop", usage_body(2, 1))
    assert body["id"] == f"cmpl-{RID}" and body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "abc", "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"]["total_tokens"] == 3


def test_chat_stream_names_the_role_once_and_ends_with_a_usage_only_chunk() -> None:
    render = StreamRenderer(ResponseHead(endpoint="chat", rid=RID, model="m", created_unix_s=1))
    first, last = render.chunk(chunk("He", 1)), render.chunk(chunk("y", 2, finish="stop"))
    assert first["object"] == "chat.completion.chunk" and first["id"] == f"chatcmpl-{RID}"
    assert first["choices"][0]["delta"] == {"content": "He", "role": "assistant"}
    assert first["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["delta"] == {"content": "y"}
    assert last["choices"][0]["finish_reason"] == "stop"
    assert render.chunk(None)["choices"] == []


def test_text_stream_chunks_are_text_completions() -> None:
    render = StreamRenderer(ResponseHead(endpoint="completions", rid=RID, model="m"))
    out = render.chunk(chunk("x", 1))
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == "x"


def test_finish_reasons() -> None:
    assert finish_reason("length") == "length"
    assert finish_reason("stop") == "stop"
    assert finish_reason(None) is None
    assert finish_reason("abort") is None  # the client learns of an abort from the error after it


def test_logprobs_are_rendered_in_openai_shapes_when_asked_for() -> None:
    from gateway.engine.client import TokenLogprob, TopLogprob

    tokens = [
        TokenLogprob(token="Hé", logprob=-0.5, top=(TopLogprob("Hé", -0.5), TopLogprob("a", -2.0))),
        TokenLogprob(token="llo", logprob=-1.0, top=(TopLogprob("llo", -1.0),)),
    ]
    usage = usage_body(2, 2)
    chat = completion_body(
        ResponseHead("chat", "tdm-x", "m", logprobs=True), "Héllo", "length", usage, tokens
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "Hé",
        "logprob": -0.5,
        "bytes": [72, 195, 169],
        "top_logprobs": [
            {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
            {"token": "a", "logprob": -2.0, "bytes": [97]},
        ],
    }
    text = completion_body(
        ResponseHead("completions", "tdm-x", "m", logprobs=True), "Héllo", "length", usage, tokens
    )
    assert text["choices"][0]["logprobs"] == {
        "tokens": ["Hé", "llo"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"Hé": -0.5, "a": -2.0}, {"llo": -1.0}],
        "text_offset": [0, 2],
    }
    plain = completion_body(ResponseHead("chat", "tdm-x", "m"), "Héllo", "length", usage, tokens)
    assert plain["choices"][0]["logprobs"] is None


def test_streamed_completion_logprobs_carry_the_text_offset_across_chunks() -> None:
    from gateway.engine.client import EngineChunk, TokenLogprob

    render = StreamRenderer(ResponseHead("completions", "tdm-x", "m", logprobs=True))
    offsets = []
    for token in ("ab", "c", "def"):
        chunk = EngineChunk(
            text_delta=token, completion_tokens=1, prompt_tokens=1,
            logprobs=[TokenLogprob(token=token, logprob=-1.0)],
        )  # fmt: skip
        offsets += render.chunk(chunk)["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [0, 2, 3]


def test_tokens_that_make_no_text_yet_have_an_event_only_with_continuous_usage() -> None:
    # a token that ends mid-character: the detokenizer holds its bytes back, the text is empty
    steps = [chunk("", 1), chunk("", 2), chunk("é", 3), chunk("", 3), chunk("", 4, finish="length")]
    quiet = StreamRenderer(ResponseHead(endpoint="completions", rid=RID, model="m"))
    assert [len(quiet.events(c)) for c in steps] == [0, 0, 1, 0, 1]
    stepping = StreamRenderer(ResponseHead(endpoint="completions", rid=RID, model="m"))
    events = [stepping.events(c, every_step=True) for c in steps]
    # every new token has its event (its running usage tells the client); no progress, none
    assert [len(e) for e in events] == [1, 1, 1, 0, 1]
    assert [e[0]["choices"][0]["text"] for e in events if e] == ["", "", "é", ""]
