"""Preparing a stored batch's lines: a line the gateway can no longer run (one stored before a
check was added, or one only the model can judge) becomes that line's error, with the body a
client of the API would get; the other lines are prepared, none is lost."""

from __future__ import annotations

import json
from typing import Any

from gateway.batch.prepare import prepare_lines
from gateway.batch.types import PendingItem


class TinyTokenizer:
    """The tokenizer facts preparing token-id prompts needs."""

    context_len = 64
    vocab_size = 100
    declares_tools = False
    tool_family = None


def pending(line_no: int, **body: Any) -> PendingItem:
    return PendingItem(
        line_no=line_no,
        custom_id=f"line-{line_no}",
        body=json.dumps({"model": "m", "prompt": [1, 2], "max_tokens": 2, **body}),
        attempts=0,
    )


def test_lines_that_would_crash_the_engine_are_refused_one_by_one_and_the_rest_prepared() -> None:
    items = [
        pending(1),
        pending(2, top_k=2**31),  # stored before the int32 check existed
        pending(3, prompt=[5, 100]),  # one id beyond the vocabulary
        pending(4, prompt=[[99]]),
        pending(5, seed=2**64),
    ]
    prepared, refused = prepare_lines(items, "completions", TinyTokenizer(), "m", 16)  # type: ignore[arg-type]
    assert sorted(prepared) == [1, 4]
    assert prepared[4].prompt.input_ids == [99]
    assert sorted(refused) == [2, 3, 5]
    params = {n: f.api_error().param for n, f in refused.items()}
    assert params == {2: "body.top_k", 3: "prompt[1]", 5: "body.seed"}
    assert {f.http_status for f in refused.values()} == {400}
