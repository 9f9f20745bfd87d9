"""What a running batch keeps in memory: its prepared lines stay while it runs (the feed's prefix
tree holds their prompts), so each prompt token must cost a pointer, not a fresh int object
(a 50,000-line batch of 355-token prompts took about 700 MB that way)."""

from __future__ import annotations

import gc
import json
import random
import tracemalloc

from gateway.batch.prepare import prepare_lines
from gateway.batch.runner import _prepare_compact
from gateway.batch.types import PendingItem

TOKENS = 355


class TinyTokenizer:
    """The tokenizer facts preparing token-id prompts needs."""

    context_len = 4096
    vocab_size = 32_000
    declares_tools = False
    tool_family = None


def lines(count: int) -> list[PendingItem]:
    rng = random.Random(7)
    return [
        PendingItem(
            line_no=n,
            custom_id=f"line-{n}",
            body=json.dumps(
                {
                    "model": "m",
                    "prompt": [rng.randrange(300, 32_000) for _ in range(TOKENS)],
                    "max_tokens": 2,
                }
            ),
            attempts=0,
        )
        for n in range(count)
    ]


def bytes_per_line(prepare: object, pending: list[PendingItem]) -> tuple[float, object]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        prepared = prepare(pending, "completions", TinyTokenizer(), "m", 16)  # type: ignore[operator]
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return grown / len(pending), prepared


def test_prepared_lines_share_token_ints_and_hold_the_same_prompts() -> None:
    pending = lines(1000)
    plain_bytes, (plain, _) = bytes_per_line(prepare_lines, pending)
    compact_bytes, (compact, refused) = bytes_per_line(_prepare_compact, pending)
    assert not refused and sorted(compact) == sorted(plain)
    for line_no, line in plain.items():
        assert compact[line_no].prompt == line.prompt and compact[line_no].body == line.body
    assert plain_bytes > TOKENS * 30  # a fresh int per token (the measurement sees it)
    # a pointer per token (and the table of ids' ints, shared by the whole batch)
    assert compact_bytes < TOKENS * 16, f"{compact_bytes:.0f} B per line"
    assert compact_bytes < plain_bytes / 3, (compact_bytes, plain_bytes)
