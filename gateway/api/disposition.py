"""The `Content-Disposition` of a download (RFC 6266): the stored file name, made safe for a
header whatever the uploader named the file.

A file name is the uploader's text: it may hold CR/LF (which would end the header and start
another), quotes and backslashes (which would end the quoted string), or any Unicode. The header
carries it twice: ``filename="..."``, printable ASCII with every other character replaced by
``_`` (for old clients), and ``filename*=UTF-8''...``, the whole name percent-encoded (RFC 8187),
which clients that know it prefer. Control characters are replaced in both: no file should be
saved under a name holding a line break.
"""

from __future__ import annotations

import urllib.parse

FALLBACK_NAME = "download"
"""The name given when nothing of the original is left (an empty name)."""
_ATTR_CHARS = "!#$&+-.^_`|~"
"""RFC 8187 attr-char punctuation (letters and digits are always kept): not percent-encoded."""


def attachment(filename: str) -> str:
    """The header value that makes a client save the body as *filename*."""
    name = "".join("_" if _is_control(c) else c for c in filename.strip()) or FALLBACK_NAME
    ascii_name = "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in name)
    encoded = urllib.parse.quote(name, safe=_ATTR_CHARS, encoding="utf-8")
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{encoded}"


def _is_control(c: str) -> bool:
    code = ord(c)
    return code < 32 or 127 <= code < 160 or c in "\u2028\u2029"
