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
from gateway.pipeline.prepare import (
    PreparedPrompt,
    PromptSource,
    check_model,
    finish_prompt,
    prompt_ids,
    prompt_source,
)
from gateway.tokenizer import ModelTokenizer, TextTooLong


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
    number). CPU work: call it in a worker thread. The prompts are tokenized a chunk of lines
    per call that releases the GIL (`ModelTokenizer.encode_many`), so the event loop keeps
    serving while a large batch is loaded."""
    struct = body_type(kind)
    refused: dict[int, Failure] = {}
    sources: dict[int, tuple[OpenAIRequest, PromptSource]] = {}
    for item in pending:
        try:
            body = parse_body(item.body.encode(), struct, declares_tools=tokenizer.declares_tools)
            check_model(body.model, model)  # 404 model_not_found, as a live request gets
            sources[item.line_no] = (body, prompt_source(body, tokenizer))
        except ApiError as exc:
            refused[item.line_no] = invalid_request(exc)
        except LineError as exc:
            error = ApiError(400, exc.message, param=exc.param, code=exc.code)
            refused[item.line_no] = invalid_request(error)
    texts = {n: src for n, (_, src) in sources.items() if src.text is not None}
    encoded: dict[int, list[int] | TextTooLong] = {}
    for add_special_tokens in (True, False):
        group = [n for n, src in texts.items() if src.add_special_tokens == add_special_tokens]
        if not group:
            continue
        results = tokenizer.encode_many(
            [texts[n].text or "" for n in group], add_special_tokens=add_special_tokens
        )
        encoded.update(zip(group, results, strict=True))
    prepared: dict[int, PreparedLine] = {}
    for line_no, (body, source) in sources.items():
        try:
            ids = prompt_ids(source, tokenizer, encoded.get(line_no))
            prepared[line_no] = PreparedLine(
                body=body, prompt=finish_prompt(body, ids, tokenizer, default_max_tokens)
            )
        except ApiError as exc:
            refused[line_no] = invalid_request(exc)
    return prepared, refused
