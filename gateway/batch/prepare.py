"""From a stored batch line to what the engine needs: its prompt token ids and output cap.

The same steps as a live request (gateway/pipeline/prepare.py), so a line is refused for the same
reasons with the same error body; refused lines go to the batch's error file.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.api.schemas import Endpoint, OpenAIRequest
from gateway.batch.types import PendingItem
from gateway.batch.validate import LineError, body_type, parse_body
from gateway.errors import ApiError
from gateway.pipeline.outcome import Failure, invalid_request
from gateway.pipeline.prepare import PreparedPrompt, prepare_prompt
from gateway.tokenizer import ModelTokenizer


@dataclass(frozen=True)
class PreparedLine:
    """A line ready for the engine."""

    body: OpenAIRequest
    prompt: PreparedPrompt


def prepare_lines(
    pending: list[PendingItem],
    kind: Endpoint,
    tokenizer: ModelTokenizer,
    model: str,
    default_max_tokens: int,
) -> tuple[dict[int, PreparedLine], dict[int, Failure]]:
    """Every line prepared, or refused with the error a live request would get (by line
    number). CPU work (tokenizing): call it in a worker thread."""
    struct = body_type(kind)
    prepared: dict[int, PreparedLine] = {}
    refused: dict[int, Failure] = {}
    for item in pending:
        try:
            body = parse_body(item.body.encode(), struct, model)
            prompt = prepare_prompt(body, tokenizer, default_max_tokens)
        except ApiError as exc:
            refused[item.line_no] = invalid_request(exc)
            continue
        except LineError as exc:
            error = ApiError(400, exc.message, param=exc.param, code=exc.code)
            refused[item.line_no] = invalid_request(error)
            continue
        prepared[item.line_no] = PreparedLine(body=body, prompt=prompt)
    return prepared, refused
