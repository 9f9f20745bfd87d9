"""Turning SGLang's cumulative stream into deltas."""

from __future__ import annotations

from typing import Any

from gateway.engine.client import _GenerateOut, _to_chunk


def out(text: str, finish: Any = None, tokens: int = 1, **meta: Any) -> _GenerateOut:
    return _GenerateOut(
        text=text,
        meta_info={
            "finish_reason": finish,
            "prompt_tokens": 5,
            "completion_tokens": tokens,
            **meta,
        },
    )


def replay(updates: list[_GenerateOut]) -> list[str]:
    emitted, deltas = 0, []
    for update in updates:
        chunk = _to_chunk(update, emitted)
        emitted += len(chunk.text_delta)
        deltas.append(chunk.text_delta)
    return deltas


def test_cumulative_text_becomes_deltas() -> None:
    assert replay([out("He"), out("Hello"), out("Hello!", {"type": "length"})]) == [
        "He",
        "llo",
        "!",
    ]


def test_half_a_character_is_held_back_until_completed() -> None:
    deltas = replay([out("caf"), out("caf\ufffd"), out("café"), out("café!", {"type": "stop"})])
    assert deltas == ["caf", "", "é", "!"]
    assert "\ufffd" not in "".join(deltas)


def test_last_chunk_carries_finish_and_counts() -> None:
    chunk = _to_chunk(
        out(
            "x",
            {"type": "stop", "matched": "\n"},
            tokens=3,
            queue_time=0.25,
            cached_tokens=2,
            num_retractions=1,
        ),
        0,
    )
    assert chunk.finish_reason == "stop" and chunk.matched_stop == "\n"
    assert chunk.completion_tokens == 3 and chunk.prompt_tokens == 5
    assert chunk.queue_time_s == 0.25 and chunk.cached_tokens == 2 and chunk.num_retractions == 1
