"""The Content-Disposition of downloads: one header line, whatever the file name holds."""

from __future__ import annotations

import pytest
from aiohttp.multipart import content_disposition_filename, parse_content_disposition

from gateway.api.disposition import FALLBACK_NAME, attachment


@pytest.mark.parametrize(
    ("name", "saved_as", "plain"),
    [
        ("input.jsonl", "input.jsonl", "input.jsonl"),
        ("a\r\nX-Evil: 1.jsonl", "a__X-Evil: 1.jsonl", "a__X-Evil: 1.jsonl"),
        ("tab\there\x00\x7f.jsonl", "tab_here__.jsonl", "tab_here__.jsonl"),
        ("line\u2028sep.jsonl", "line_sep.jsonl", "line_sep.jsonl"),
        ('say "hi" \\ bye.jsonl', 'say "hi" \\ bye.jsonl', "say _hi_ _ bye.jsonl"),
        ("naïve 日本 %41.jsonl", "naïve 日本 %41.jsonl", "na_ve __ %41.jsonl"),
        ("", FALLBACK_NAME, FALLBACK_NAME),
        ("\r\n", FALLBACK_NAME, FALLBACK_NAME),
    ],
)
def test_any_name_makes_one_parseable_header_line(name: str, saved_as: str, plain: str) -> None:
    value = attachment(name)
    assert value.isascii() and value.isprintable()  # no byte that ends or splits a header
    kind, params = parse_content_disposition(value)
    assert kind == "attachment"
    assert content_disposition_filename(params, "filename") == saved_as  # filename* wins
    assert params["filename"] == plain
