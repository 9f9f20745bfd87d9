"""One scheduler iteration's marching orders: the policy's plan, translated into what SGLang's
scheduler must do (plain data, no sglang import).

:meth:`~backend.sglang_ext.driver.EngineDriver.plan_iteration` makes one :class:`Directive` per
iteration from a snapshot of the scheduler; the hooks (``backend.sglang_ext.hooks``) carry it
out at the seams, in this order: evict, park, release the in-progress chunked prefill, reorder
the waiting queue, skip or run the prefill pass, and admit exactly the planned prompts in it.
It is frozen and names rows by request id (never by SGLang object or row index), so it stays
valid while the hooks reshape the batch, and it is the only thing that passes from the planning
seam to the prefill pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


def _no_chunks() -> Mapping[str, int]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Directive:
    """What SGLang's scheduler does this iteration (see the module docstring). The default is
    an iteration with nothing planned yet: no row moves, and the prefill pass admits nothing."""

    own_admission: bool = False
    """True: the policy planned nothing for an idle engine with requests waiting, so SGLang's
    own admission runs this iteration, its KV reservation included (an engine must never sit
    idle on queued work); every other field is empty then."""
    evict: tuple[str, ...] = ()
    """Rows of the running batch to retract, by rid, in the plan's order: KV freed (not
    cached) and the request re-queued to resume by recomputation, as SGLang's own
    out-of-memory retraction does."""
    park: tuple[str, ...] = ()
    """Decode rows (of the running batch after the evictions) that sit this iteration out, by
    rid, in batch order: split off with their KV kept, merged back after the batch's results.
    Every row only when the plan runs a prompt (which then runs alone, as SGLang runs one
    before any decode); otherwise never every row (SGLang goes on to decode the running batch,
    and its batch code needs that one non-empty). The hooks decode
    the batch whole instead when its penalizers keep per-row state a split would corrupt."""
    prefill_first: tuple[str, ...] = ()
    """Planned prompts in the order they go to the head of the waiting queue: plan order,
    whole prompts before the one that will be cut into a chunk (SGLang cuts at most one per
    pass)."""
    prefill_tokens: Mapping[str, int] = field(default_factory=_no_chunks)
    """rid → planned chunk, tokens, in plan order (read-only): the prefill pass admits exactly
    these prompts, each cut at its chunk; the in-progress chunked request advances by its own,
    or sits the pass out (its KV kept) when the plan leaves it out."""
    release_chunked: bool = False
    """True: SGLang's in-progress chunked prefill goes back to the waiting queue before the
    pass, the KV it computed kept in the prefix cache (it resumes from there), because a planned
    prompt must be cut and SGLang cuts one prompt at a time. Only where the prefix cache keeps
    a request's KV for later (`EngineDriver.plan_iteration`)."""
    skip_prefill: bool = False
    """True: SGLang skips its prefill pass (the plan prefills nothing, the in-progress chunk
    included), so the iteration only decodes."""

    def chunk_for_continuing(self, rid: str) -> int | None:
        """Chunk for SGLang's in-progress chunked prefill *rid* this pass, tokens; None: it sits
        this pass out (the plan leaves it out), so the pass computes only what the plan put in
        it — a chunk of a long prompt costs about as much as its whole prefix, however short the
        chunk (attention reads all of it), so even a few tokens of it would hold the pass up."""
        return self.prefill_tokens.get(rid)


NOTHING_PLANNED = Directive()
"""The directive between iterations (and before the first plan)."""
