"""BROS's bidirectional KV layout on SGLang's token pool: the allocator adapter (nothing here
patches SGLang by itself; `kv_layout_engine.py` wires it in when `engine.kv_layout` is bicache).

`BiCacheKvLayout` hands out KV slots the way `backend/policy/bicache.py` lays them out (blocks
of 16 slots, RT from the left, BE from the right, RT may overwrite dormant BE slots after
checkpointing them) and does the copies: checkpointed rows go to a host store, and come back
into fresh slots on restore (`backend/kernels/kv_copy.py` on a GPU, its torch reference on CPU).

Why the attention kernels need no change: with page_size 1, SGLang's attention backends
(torch_native on CPU, FlashInfer / Triton / FA3 on GPU) read a request's KV through its row of
`req_to_token` (token position → slot). Which slot a token sits in, and whether a block is
filled left-to-right or right-to-left, only changes the numbers in that row, never the kernel.
So the same tokens come out with the layout on or off
(`tests/functional/test_engine_bicache.py` checks exactly that on the CPU engine). The one thing
the layout must keep true is that a row never points at a slot another request has taken over:
when a checkpoint moves a dormant BE token to the host, its entry in that request's row is set to
SGLang's padding slot 0 (`rows` tells which row), and the restore writes the new slots back
before the request is scheduled again.

The engine wiring (hooks, allocator routing, statistics) is `kv_layout_engine.py`.

Where it plugs in (SGLang 0.5.23, page_size 1; `kv_layout_engine.py` does each of these):

* extend: `alloc_for_extend(batch)` (imported by name into `schedule_batch`) asks the allocator
  for `batch.extend_num_tokens` slots and writes them into `req_to_token` request by request, in
  `batch.reqs` order; the layout answers `alloc([(rid, tier, extend_len), ...])`, same order and
  length, so `write_cache_indices` needs no change.
* decode: `alloc_for_decode(batch, 1)` (imported by name into `schedule_batch` too) restores
  the batch's dormant requests (`resume_and_restore`, which rewrites their rows), then
  `alloc([(rid, tier, 1), ...])`.
  `check_decode_capacity` (SGLang's gate before it, which retracts on False) is `fits`.
* free: `release_kv_cache` → `free_kv_row` → `TokenToKVPoolAllocator.free` → `free` here
  (whole requests only); `available_size` counts free room plus dormant slots either tier may
  take over.
* dormancy: a BE decode row the policy parks is `suspend`ed; its slots stay until another
  request takes them over (each copied to the host first: lazy checkpointing).
* radix cache: a BE token the tree shares as a prefix must never be overwritten: `protect(rid,
  tokens)` marks it, and the bookkeeping then neither steals it (RT) nor takes its segment over
  (BE) (`tests/functional/test_bicache_kv_layout.py`). The engine wiring runs with
  `--disable-radix-cache` (the launcher adds it): slots the tree keeps would outlive their
  request, and `free` rejects the partial free of a request that would show it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from backend.policy.bicache.layout import BiCache
from backend.policy.bicache.records import DEFAULT_BLOCK_SLOTS, HOST, BiCacheError, Checkpoint
from common.wire import Tier


class BiCacheKvLayout:
    """Slots of one KV pool under the bidirectional layout, and the KV copies it implies.

    `layers`: the pool's buffers, K and V of every layer, each `[num_slots, heads, head_dim]`
    (SGLang's `MHATokenToKVPool.k_buffer` + `v_buffer`). Slots are 0 … num_slots − 1 of those
    buffers; SGLang's padding slot 0 is kept out by `reserved_slots`."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        *,
        block_slots: int = DEFAULT_BLOCK_SLOTS,
        reserved_slots: int = 1,
    ) -> None:
        num_slots = layers[0].shape[0]
        self.offset = reserved_slots
        """Slot of the layout's slot 0 (SGLang keeps slot 0 as the padding slot)."""
        self.cache = BiCache((num_slots - reserved_slots) // block_slots, block_slots)
        self.layers = list(layers)
        self._kernels = None
        if self.layers[0].is_cuda:  # Triton only where it compiles; torch reference elsewhere
            from backend.kernels.kv_copy import KvLayers

            self._kernels = KvLayers(self.layers)
        self.host: dict[tuple[str, int], torch.Tensor] = {}
        """(rid, token index) → its rows, [num_layers, heads, head_dim], on the host."""
        self._owner: dict[int, str] = {}  # slot → rid (for free-by-index)
        self.req_to_token: torch.Tensor | None = None
        """SGLang's token → slot table (`ReqToTokenPool.req_to_token`); None in unit tests."""
        self.rows: dict[str, int] = {}
        """rid → its row of `req_to_token` (checkpointed tokens' entries are reset there)."""
        self.suspends = 0
        """Times a BE request became dormant."""
        self.restores = 0
        """Times a dormant BE request was brought back (with or without host rows)."""

    # --- SGLang's allocator surface -----------------------------------------------------------

    def available_size(self) -> int:
        """Slots a new request of either tier can take now, without any checkpoint."""
        return min(self.cache.room("rt"), self.cache.room("be"))

    def alloc(self, requests: Sequence[tuple[str, Tier, int]]) -> torch.Tensor:
        """Slots for `(rid, tier, tokens)` of every request, concatenated in that order (the
        order SGLang writes them into req_to_token). Checkpoints the dormant BE rows it
        overwrites first. Raises bicache.NoRoom when the layout cannot place them (SGLang then
        retracts, as on an out-of-memory allocation)."""
        out: list[int] = []
        for rid, tier, tokens in requests:
            grant = self.cache.allocate(rid, tier, tokens)
            self._checkpoint(grant.checkpoints)
            out.extend(grant.slots)
            for slot in grant.slots:
                self._owner[slot] = rid
        return torch.tensor(
            [s + self.offset for s in out], dtype=torch.int64, device=self.layers[0].device
        )

    def free(self, free_index: torch.Tensor) -> None:
        """Frees whole requests by their slots (what `release_kv_cache` passes without the
        radix cache); a partial free of a request is rejected."""
        # Entries of checkpointed tokens point at the padding slot: below the layout, skipped.
        slots = [int(s) - self.offset for s in free_index.tolist() if int(s) >= self.offset]
        rids = {self._owner[s] for s in slots if s in self._owner}
        freed = set(slots)
        for rid in rids:
            mine = [s for s in self.cache.slots(rid) if s != HOST]
            if not freed.issuperset(mine):
                raise ValueError(
                    f"partial free of request {rid!r}: the bicache layout frees "
                    f"whole requests (run with --disable-radix-cache)"
                )
            self.release(rid)

    # --- the request life cycle ---------------------------------------------------------------

    def release(self, rid: str) -> None:
        """A request ended: its slots and host rows go."""
        for slot in self.cache.slots(rid):
            self._owner.pop(slot, None)
        for index in self.cache.checkpointed(rid):
            self.host.pop((rid, index), None)
        self.cache.release(rid)
        self.rows.pop(rid, None)

    def suspend(self, rid: str) -> None:
        """A BE request was evicted: its KV stays until RT needs the slots."""
        if not self.cache.is_dormant(rid):
            self.suspends += 1
        self.cache.suspend(rid)

    def resume_and_restore(self, rid: str) -> list[int]:
        """Brings a suspended BE request back: copies its checkpointed rows into fresh slots and
        returns its whole token → slot row (write it into req_to_token)."""
        self.cache.resume(rid)
        restore = self.cache.restore(rid)
        self.restores += 1
        self._checkpoint(restore.checkpoints)
        if restore.loads:
            dst = torch.tensor(
                [slot + self.offset for _, slot in restore.loads], device=self.layers[0].device
            )
            rows = torch.stack([self.host.pop((rid, index)) for index, _ in restore.loads], dim=1)
            if self._kernels is not None:
                self._kernels.scatter(dst, rows.pin_memory(), check=False)
            else:
                from backend.kernels.kv_copy_ref import scatter_slots_reference

                scatter_slots_reference(self.layers, dst, rows)
            for _, slot in restore.loads:
                self._owner[slot] = rid
        slots = [s + self.offset for s in self.cache.slots(rid)]
        row = self.rows.get(rid)
        if self.req_to_token is not None and row is not None:
            table = self.req_to_token
            table[row, : len(slots)] = torch.tensor(slots, dtype=table.dtype, device=table.device)
        return slots

    def fits(self, requests: Sequence[tuple[str, Tier, int]]) -> bool:
        """Whether `alloc(requests)` would succeed after every dormant one among them is
        resumed and restored (in that order: what the decode path does). Exact: a dry run on a
        copy of the bookkeeping, skipped when free room alone covers a fresh block per
        request."""
        b = self.cache.b
        need_blocks = b * len(requests)
        if (
            not any(self.cache.is_dormant(rid) for rid, _, _ in requests)
            and self.cache.room("rt") >= need_blocks
            and self.cache.room("be") >= need_blocks
        ):
            return True  # ≥ len(requests) blocks with room on each side: nothing can fail
        trial = copy.deepcopy(self.cache)
        try:
            for rid, _, _ in requests:
                if trial.is_dormant(rid):
                    trial.resume(rid)
                    trial.restore(rid)
            for rid, tier, tokens in requests:
                trial.allocate(rid, tier, tokens)
        except BiCacheError:
            return False
        return True

    def stats(self) -> dict[str, int]:
        """Counters of the layout since start (the control endpoint's `kv_layout`)."""
        cache = self.cache
        return {
            "capacity_slots": cache.capacity,
            "used_slots": cache.used,
            "dormant_slots": cache.dormant_used,
            "host_tokens": cache.on_host,
            "checkpointed_tokens": cache.checkpointed_total,
            "restored_tokens": cache.restored_total,
            "discarded_tokens": cache.discarded_total,
            "borrowed_slots": cache.borrowed_total,
            "suspends": self.suspends,
            "restores": self.restores,
        }

    def protect(self, rid: str, tokens: int) -> None:
        """Its first `tokens` tokens are shared (radix cache): never overwrite them."""
        self.cache.protect(rid, tokens)

    def _checkpoint(self, checkpoints: tuple[Checkpoint, ...]) -> None:
        """Copies the rows about to be overwritten to the host, before the forward pass writes
        their slots."""
        if not checkpoints:
            return
        src = torch.tensor(
            [c.slot + self.offset for c in checkpoints], device=self.layers[0].device
        )
        if self._kernels is not None:
            rows = self._kernels.gather(src, check=False)
            torch.cuda.current_stream().synchronize()  # the forward pass overwrites them next
        else:
            from backend.kernels.kv_copy_ref import gather_slots_reference

            rows = gather_slots_reference(self.layers, src)
        for i, c in enumerate(checkpoints):
            self.host[(c.rid, c.index)] = rows[:, i].clone()
            self._owner.pop(c.slot, None)
            row = self.rows.get(c.rid)
            if self.req_to_token is not None and row is not None:
                # its slot is someone else's from now on: the row points at the padding slot
                self.req_to_token[row, c.index] = 0
