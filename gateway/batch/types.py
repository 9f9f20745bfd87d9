"""Plain data of the Files and Batch API (msgspec Structs; never ORM rows) and their OpenAI JSON.

Statuses (OpenAI's batch object)::

    validating ─▶ in_progress ─▶ finalizing ─▶ completed
        │              │  └──────────────────▶ expired    (the completion window ran out)
        ▼              └─▶ cancelling ───────▶ cancelled
      failed (the input file did not validate)

Line (batch_items) statuses: pending → running → succeeded | failed; lines never run end as
expired or cancelled. A restart turns running lines back to pending.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import msgspec

from gateway.api.schemas import Endpoint

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
ItemStatus = Literal["pending", "running", "succeeded", "failed", "expired", "cancelled"]
ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
"""Batch endpoints and the API each runs (OpenAI's /v1/embeddings and /v1/responses are not
served by this gateway)."""
FILE_PURPOSES = ("batch",)
"""Purposes a client may upload; the runner writes `batch_output` files."""


class FileInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A stored file (without its content)."""

    id: str
    tenant_id: str
    purpose: str
    filename: str
    bytes: int
    line_count: int | None
    created_at: datetime
    expires_at: datetime | None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": _unix(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": _unix(self.expires_at),
        }


class RequestCounts(msgspec.Struct, frozen=True, kw_only=True):
    """Lines of a batch: all, finished well, finished with an error."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A batch with its line counts."""

    id: str
    tenant_id: str
    key_id: str | None
    input_file_id: str
    endpoint: str
    completion_window: str
    status: str
    model: str | None
    output_file_id: str | None
    error_file_id: str | None
    errors: list[dict[str, Any]] | None
    metadata: dict[str, str] | None
    request_counts: RequestCounts
    prompt_tokens: int
    completion_tokens: int
    deadline_at: datetime | None
    created_at: datetime
    in_progress_at: datetime | None
    expires_at: datetime
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        counts = self.request_counts
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": None if not self.errors else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": _unix(self.created_at),
            "in_progress_at": _unix(self.in_progress_at),
            "expires_at": _unix(self.expires_at),
            "finalizing_at": _unix(self.finalizing_at),
            "completed_at": _unix(self.completed_at),
            "failed_at": _unix(self.failed_at),
            "expired_at": _unix(self.expired_at),
            "cancelling_at": _unix(self.cancelling_at),
            "cancelled_at": _unix(self.cancelled_at),
            "request_counts": {
                "total": counts.total,
                "completed": counts.completed,
                "failed": counts.failed,
            },
            "metadata": self.metadata,
            "model": self.model,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
            # tandem: when the batch must be done by (short window or BE contract), if ever
            "deadline_at": _unix(self.deadline_at),
        }


class NewItem(msgspec.Struct, frozen=True, kw_only=True):
    """A validated input line, as inserted into batch_items."""

    line_no: int
    custom_id: str
    method: str
    url: str
    body: str


class PendingItem(msgspec.Struct, frozen=True, kw_only=True):
    """A line still to run."""

    line_no: int
    custom_id: str
    body: str
    attempts: int


class ItemResult(msgspec.Struct, frozen=True, kw_only=True):
    """How a line ended."""

    status: ItemStatus
    response: dict[str, Any] | None = None
    """`{"status_code", "request_id", "body"}` of the output/error line."""
    error: dict[str, Any] | None = None
    """`{"code", "message"}` for lines that never got a response."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def _unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())
