"""Carrying out a :class:`~backend.sglang_ext.directive.Directive` on SGLang's running batch and
waiting queue: the row operations the hooks apply (no sglang import; the objects come through
``backend.sglang_ext.views``, so these run on stand-ins in unit tests too).

Every operation goes through SGLang's own batch methods (``filter_batch``, ``merge_batch``,
``release_req``), which slice and concatenate every per-row tensor consistently; tandem never
edits a batch's fields row by row.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

from backend.sglang_ext.views import BatchView, ReqView, SchedulerView

logger = logging.getLogger(__name__)


def evict(sched: SchedulerView, batch: BatchView, rids: Sequence[str]) -> None:
    """Retracts the rows *rids* of the running *batch* the way SGLang's own out-of-memory
    retraction does: KV freed (not cached), request re-queued to resume by recomputation."""
    rows = {str(req.rid): i for i, req in enumerate(batch.reqs)}
    indices = [rows[rid] for rid in rids if rid in rows]
    if not indices:
        return
    victims = set(indices)
    keep = [i for i in range(len(batch.reqs)) if i not in victims]
    released: list[ReqView] = []
    for n, idx in enumerate(indices):
        # SGLang's second argument: how many rows remain after this one is released.
        if batch.release_req(idx, len(keep) + len(indices) - n - 1):
            released.append(batch.reqs[idx])
    batch.filter_batch(keep_indices=keep)
    batch.batch_is_full = False
    for req in released:
        sched._add_request_to_queue(req, is_retracted=True)
    if len(released) < len(indices):
        logger.warning(
            "tandem: %d evicted requests had no way to resume", len(indices) - len(released)
        )


def release_chunked(
    sched: SchedulerView, release_kv: Callable[[SchedulerView, ReqView], None]
) -> tuple[ReqView, int] | None:
    """Sends SGLang's in-progress chunked prompt back to the waiting queue: *release_kv* frees
    its KV row (keeping what it computed in the prefix cache, from which it resumes), it is
    reset as SGLang resets a retracted request, and it is re-queued as one. Returns it with the
    tokens of KV it had computed, or None when no prompt is mid-prefill."""
    req = sched.chunked_req
    if req is None:
        return None
    computed = int(req.prefix_len)
    release_kv(sched, req)
    req.reset_for_retract()
    sched.chunked_req = None
    sched._add_request_to_queue(req, is_retracted=True)
    return req, computed


def penalizers_required(batch: BatchView) -> bool:
    """True when the batch's sampling needs penalizers (frequency/presence penalties,
    ``min_new_tokens``): they keep per-row state in one object that a split would share."""
    orchestrator = getattr(getattr(batch, "sampling_info", None), "penalizer_orchestrator", None)
    return orchestrator is not None and bool(getattr(orchestrator, "is_required", False))


def split_off(batch: BatchView, rids: Sequence[str]) -> BatchView | None:
    """Splits *batch* in place: the rows *rids* come back as a new batch (their KV kept), the
    others stay. None when no row matches. The copy gets its own sampling info (per-row
    tensors are sliced by ``filter_batch``)."""
    wanted = set(rids)
    park = [i for i, req in enumerate(batch.reqs) if str(req.rid) in wanted]
    if not park:
        return None
    keep = [i for i, req in enumerate(batch.reqs) if str(req.rid) not in wanted]
    parked = _shallow_copy(batch)
    parked.filter_batch(keep_indices=park)
    batch.filter_batch(keep_indices=keep)
    return parked


def merge_back(running: BatchView | None, parked: BatchView | None) -> BatchView | None:
    """The running batch with the *parked* rows merged back in; SGLang's scheduler takes the
    result as its running batch (the parked batch itself when the running one is empty)."""
    if parked is None or parked.is_empty():
        return running
    if running is None or running.is_empty():
        return parked
    running.merge_batch(parked)
    return running


def put_first(waiting_queue: list[Any], rids: Sequence[str]) -> None:
    """Reorders *waiting_queue* in place: the requests *rids* first, in that order, then the
    others in their order."""
    if not rids:
        return
    position = {rid: i for i, rid in enumerate(rids)}
    first: list[Any] = []
    rest: list[Any] = []
    for req in waiting_queue:
        (first if str(req.rid) in position else rest).append(req)
    first.sort(key=lambda req: position[str(req.rid)])
    waiting_queue[:] = first + rest


def _shallow_copy(batch: BatchView) -> BatchView:
    parked = copy.copy(batch)
    if getattr(batch, "sampling_info", None) is not None:
        parked.sampling_info = copy.copy(batch.sampling_info)
    return parked
