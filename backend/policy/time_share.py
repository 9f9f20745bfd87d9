"""RT's share of an iteration's time: what the latency model says the iteration would take with
only its RT work (its fixed per-iteration cost included), next to the whole batch.

Summed over a run it is the engine time RT occupies — the simulator's `rt_busy_frac` metric and
the engine driver's `rt_busy_s` counter; the rest is BE's marginal cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from backend.policy.latency import BatchShape, LatencyModel
from backend.policy.types import Plan, ReqState


def shape_of(decode_contexts: Iterable[int], chunks: Iterable[tuple[int, int]]) -> BatchShape:
    """The batch shape of decodes attending to `decode_contexts` tokens each and prefill
    `chunks` given as (tokens, prefix before the chunk)."""
    contexts = list(decode_contexts)
    pairs = list(chunks)
    ends = [prefix + tokens for tokens, prefix in pairs]
    return BatchShape(
        prefill_tokens=sum(tokens for tokens, _ in pairs),
        num_prefill=len(pairs),
        prefill_attn=float(sum(tokens * end for (tokens, _), end in zip(pairs, ends, strict=True))),
        prefill_attn_full=float(sum(end * end for end in ends)),
        decode_context=sum(contexts),
        num_decode=len(contexts),
        decode_context_sq=float(sum(c * c for c in contexts)),
    )


def plan_times_s(
    latency: LatencyModel, plan: Plan, states: Mapping[str, ReqState]
) -> tuple[float, float]:
    """(predicted time of the whole plan, of its RT work alone), seconds; `states` are the
    requests as they stood when the plan was made (requests it names that are missing are left
    out)."""
    decodes, chunks = _plan_parts(plan, states)
    if not decodes and not chunks:
        return 0.0, 0.0
    full = latency.predict(_shape(decodes, chunks))
    rt_decodes = [s for s in decodes if s.tier == "rt"]
    rt_chunks = [(s, n) for s, n in chunks if s.tier == "rt"]
    if not rt_decodes and not rt_chunks:
        return full, 0.0
    if len(rt_decodes) == len(decodes) and len(rt_chunks) == len(chunks):
        return full, full
    rt = latency.predict(_shape(rt_decodes, rt_chunks))
    return full, min(full, rt)


def plan_shape(plan: Plan, states: Mapping[str, ReqState]) -> BatchShape:
    """The batch shape of *plan* (what the latency model reads), from the requests as they
    stood when it was made (`states`; requests it names that are missing are left out)."""
    return _shape(*_plan_parts(plan, states))


def _plan_parts(
    plan: Plan, states: Mapping[str, ReqState]
) -> tuple[list[ReqState], list[tuple[ReqState, int]]]:
    """The plan's decoding requests, and its prefill chunks as (request, tokens)."""
    decodes = [states[rid] for rid in plan.decodes if rid in states]
    chunks = [(states[c.rid], c.tokens) for c in plan.prefills if c.rid in states]
    return decodes, chunks


def _shape(decodes: Sequence[ReqState], chunks: Sequence[tuple[ReqState, int]]) -> BatchShape:
    return shape_of(
        (s.prompt_len + s.generated for s in decodes), ((n, s.prefilled) for s, n in chunks)
    )
