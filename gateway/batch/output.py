"""What a finished line looks like in the output and error files (OpenAI's batch output format).

Output file, one line per successful request::

    {"id": "batch_req_…", "custom_id": "…",
     "response": {"status_code": 200, "request_id": "tdm-…", "body": <the chat.completion object>},
     "error": null}

Error file: requests the API refused (`response.status_code` ≥ 400, `body` the error object), and
lines that never ran (`response` null, `error` {"code": "batch_expired" | "batch_cancelled",
"message"}). Lines keep the input file's order; each `custom_id` appears
exactly once in the two files together. The `body` of a successful line is rendered by
gateway/api/render.py, as the API renders it; its `id` and `request_id` name the engine request.
"""

from __future__ import annotations

import msgspec

from gateway.batch.store import request_id

_encoder = msgspec.json.Encoder()

NEVER_RAN = {
    "expired": (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    "cancelled": (
        "batch_cancelled",
        "This request was not executed because the batch was cancelled.",
    ),
}


def result_line(
    batch_id: str,
    line_no: int,
    custom_id: str,
    status: str,
    response: str | None,
    error: str | None,
) -> bytes:
    """One JSONL line of the output or error file (stored response/error JSON spliced in)."""
    head = {"id": request_id(batch_id, line_no), "custom_id": custom_id}
    resp = msgspec.json.decode(response) if response else None
    err = msgspec.json.decode(error) if error else None
    if resp is None and err is None and status in NEVER_RAN:
        code, message = NEVER_RAN[status]
        err = {"code": code, "message": message}
    return _encoder.encode({**head, "response": resp, "error": err}) + b"\n"


def build_files(
    batch_id: str, lines: list[tuple[int, str, str, str | None, str | None]]
) -> tuple[bytes | None, int, bytes | None, int]:
    """(output file, its lines, error file, its lines) from every line of a batch; a file with
    no lines is None (OpenAI leaves its id null)."""
    out: list[bytes] = []
    err: list[bytes] = []
    for line_no, custom_id, status, response, error in lines:
        if status in ("pending", "running"):
            continue  # finalize is only called when nothing is left; be safe anyway
        target = out if status == "succeeded" else err
        target.append(result_line(batch_id, line_no, custom_id, status, response, error))
    return (b"".join(out) if out else None, len(out), b"".join(err) if err else None, len(err))
