"""From a stored batch line to what the engine needs: its prompt token ids and output cap.

The same steps as a live request (gateway/api/prepare.py), so a line is refused for the same
reasons with the same error body; refused lines go to the batch's error file.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.api.prepare import chat_prompt_ids, completion_prompt_ids, output_cap
from gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from gateway.batch.types import PendingItem
from gateway.batch.validate import LineError, body_type, parse_body
from gateway.errors import ApiError
from gateway.tokenizer import ModelTokenizer


@dataclass(frozen=True)
class PreparedLine:
    """A line ready for the engine."""

    body: ChatCompletionRequest | CompletionRequest
    input_ids: list[int]
    max_tokens: int
    """The output cap, tokens (the request's, or the gateway's default; within the context)."""


def prepare_lines(
    pending: list[PendingItem],
    kind: str,
    tokenizer: ModelTokenizer,
    model: str,
    default_max_tokens: int,
) -> tuple[dict[int, PreparedLine], dict[int, ApiError]]:
    """Every line prepared, or refused with the ApiError a live request would get (by line
    number). CPU work (tokenizing): call it in a worker thread."""
    struct = body_type(kind)
    prepared: dict[int, PreparedLine] = {}
    refused: dict[int, ApiError] = {}
    for item in pending:
        try:
            body = parse_body(item.body.encode(), struct, model)
            if isinstance(body, ChatCompletionRequest):
                ids = chat_prompt_ids(body, tokenizer)
                requested = body.max_completion_tokens or body.max_tokens
            else:
                if body.echo:
                    raise ApiError(400, "echo is not supported", param="echo")
                ids = completion_prompt_ids(body, tokenizer)
                requested = body.max_tokens
            cap = output_cap(body, requested, len(ids), tokenizer.context_len, default_max_tokens)
        except ApiError as exc:
            refused[item.line_no] = exc
            continue
        except LineError as exc:
            refused[item.line_no] = ApiError(400, exc.message, param=exc.param, code=exc.code)
            continue
        prepared[item.line_no] = PreparedLine(body=body, input_ids=ids, max_tokens=cap)
    return prepared, refused
