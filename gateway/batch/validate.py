"""Validating a batch's input file, line by line (OpenAI's `validating` step).

Structural problems — a line that is not a JSON object, a missing or repeated `custom_id`, a
`method` other than POST, a `url` other than the batch's endpoint, a `body` that is not a valid
request of that endpoint (wrong types, out-of-range sampling values, `stream`) — fail the whole
batch, with one error per bad line (`line` is 1-based, as OpenAI reports it), so nothing runs
until the file is right. Problems of what a line asks for rather than how it is written — a model
this gateway does not serve (404 `model_not_found`, as a live request gets), a parameter tandem
does not honour (400 `unsupported_parameter`, likewise), a prompt longer than the context, a
token id beyond its vocabulary — fail that line alone, into the error file, while the rest runs
(gateway/batch/prepare.py); so does a line stored before a check was added, when the batch is
loaded.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec

from gateway.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    check_parameters,
    check_sampling,
)
from gateway.batch.types import NewItem
from gateway.errors import ApiError, validation_error

MAX_REPORTED_ERRORS = 100
"""Errors listed in the batch object at most (the count of the rest is added)."""
MAX_CUSTOM_ID_CHARS = 512
"""Longest custom_id, characters (the column's size)."""


class _Line(msgspec.Struct, kw_only=True):
    custom_id: Any = None
    method: Any = None
    url: Any = None
    body: Any = None


def body_type(endpoint_kind: Endpoint) -> type[msgspec.Struct]:
    """The request Struct of an endpoint kind ("chat" or "completions")."""
    return ChatCompletionRequest if endpoint_kind == "chat" else CompletionRequest


def validate_lines(
    content: bytes, endpoint: str, endpoint_kind: Endpoint
) -> tuple[list[NewItem], list[dict[str, Any]]]:
    """The lines as NewItems, and the errors (empty when the file is valid)."""
    items: list[NewItem] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    kind = body_type(endpoint_kind)
    total_errors = 0
    for index, raw in enumerate(content.split(b"\n")):
        if not raw.strip():
            continue
        line_no = index + 1
        try:
            item = _check_line(raw, line_no, endpoint, kind, seen)
        except LineError as exc:
            total_errors += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(
                    {"code": exc.code, "message": exc.message, "param": exc.param, "line": line_no}
                )
            continue
        seen[item.custom_id] = line_no
        items.append(item)
    if not items and not errors:
        errors.append(
            {
                "code": "empty_file",
                "message": "the input file has no requests",
                "param": None,
                "line": None,
            }
        )
    if total_errors > len(errors):
        errors.append(
            {
                "code": "too_many_errors",
                "message": f"{total_errors - len(errors)} more invalid lines not listed",
                "param": None,
                "line": None,
            }
        )
    return items, errors


class LineError(Exception):
    """A line that cannot run: its error code, message and the field at fault."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _check_line(
    raw: bytes,
    line_no: int,
    endpoint: str,
    kind: type[msgspec.Struct],
    seen: dict[str, int],
) -> NewItem:
    try:
        line = msgspec.json.decode(raw, type=_Line)
    except msgspec.DecodeError as exc:
        raise LineError("invalid_json", f"line {line_no} is not valid JSON: {exc}") from None
    except msgspec.ValidationError:
        raise LineError("invalid_json", f"line {line_no} is not a JSON object") from None
    except UnicodeDecodeError:
        raise LineError("invalid_json", f"line {line_no} is not UTF-8 text") from None
    except RecursionError:
        raise LineError("invalid_json", f"line {line_no} is nested too deeply") from None
    custom_id = line.custom_id
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "custom_id must be a non-empty string", "custom_id")
    if "\x00" in custom_id:
        # stored as text: PostgreSQL refuses a NUL, and the batch could never start
        raise LineError(
            "invalid_custom_id", "custom_id must not contain a NUL character (\\u0000)", "custom_id"
        )
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError(
            "invalid_custom_id",
            f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters",
            "custom_id",
        )
    if custom_id in seen:
        raise LineError(
            "duplicate_custom_id",
            f"custom_id {custom_id!r} was already used on line {seen[custom_id]}",
            "custom_id",
        )
    if line.method != "POST":
        raise LineError("invalid_method", f"method must be 'POST', got {line.method!r}", "method")
    if line.url != endpoint:
        raise LineError(
            "mismatched_url",
            f"url must be the batch's endpoint {endpoint!r}, got {line.url!r}",
            "url",
        )
    if not isinstance(line.body, dict):
        raise LineError("invalid_body", "body must be a JSON object", "body")
    body = msgspec.json.encode(line.body)
    # a parameter tandem does not honour (ApiError): the line goes to the error file (module doc)
    with contextlib.suppress(ApiError):
        parse_body(body, kind)
    return NewItem(
        line_no=line_no, custom_id=custom_id, method="POST", url=endpoint, body=body.decode()
    )


def parse_body(body: bytes, kind: type[msgspec.Struct], *, declares_tools: bool = False) -> Any:
    """The request Struct of a line's body; raises LineError naming the field, or the ApiError
    `unsupported_parameter` a live request would get for a parameter tandem does not honour. The
    model it names is not checked here: another model fails the line alone
    (gateway/batch/prepare.py)."""
    try:
        endpoint: Endpoint = "chat" if kind is ChatCompletionRequest else "completions"
        check_parameters(msgspec.json.decode(body), endpoint, declares_tools=declares_tools)
        request = msgspec.json.decode(body, type=kind)
        assert isinstance(request, (ChatCompletionRequest, CompletionRequest))
        check_sampling(request)
    except msgspec.ValidationError as exc:
        err = validation_error(exc)
        raise LineError(
            "invalid_body", f"body.{err.message}", f"body.{err.param}" if err.param else "body"
        ) from None
    except ApiError as exc:
        if exc.code == "unsupported_parameter":
            raise  # not the file's structure: the line alone is refused, into the error file
        raise LineError(
            "invalid_body",
            f"body.{exc.param}: {exc.message}" if exc.param else exc.message,
            f"body.{exc.param}" if exc.param else "body",
        ) from None
    if request.stream:
        raise LineError("invalid_body", "body.stream must be false in a batch", "body.stream")
    return request
