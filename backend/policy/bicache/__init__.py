"""Bidirectional KV blocks with lazy checkpointing (BROS §2.7): pure slot bookkeeping.

The KV pool is cut into blocks of `block_slots` (b, default 16) token slots. A block hosts at most
one real-time (RT) and one best-effort (BE) request: the RT request fills it from the left, the BE
request from the right::

      slot:  0    1    2    3    4    5    6    7    8    9   10   11   12   13   14   15
           +----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+
    blk 7  | R0 | R1 | R2 | R3 | R4 |    |    |    |    |    | B5 | B4 | B3 | B2 | B1 | B0 |
           +----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+
             RT "a" → rt_fill = 5        free (either side)        ← be_fill = 6, BE "x"

    RT "a" grows right, BE "x" grows left. Once the fronts meet, only RT may go on, and only
    over a BE request the scheduler has given up for now (a *dormant* one, see below):

           +----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+
    blk 7  | R0 | R1 | R2 | R3 | R4 | R5 | R6 | R7 | R8 | R9 | R10| R11| B3 | B2 | B1 | B0 |
           +----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+
                                                          ↑ B5, B4 were copied to host
                                                            (checkpointed) just before
                                                            R10, R11 overwrote them

Each request's KV is a list of *segments* in logical (token) order: a run of slots in one block,
or a run of checkpointed tokens held on the host. For BE "x" above the list is
`[..., (blk 7: B0–B3), (host: B4, B5), ...]`. A BE request with any host segment must be restored
(`restore`: host→device copies into fresh slots) before it can run again; this never needs a
device→device move, because the restored tokens simply form a new segment in another block.

Who may use which free slots:

* RT: the left part of a block without an RT owner, as BROS's FindBlock / FindPreemptBlock: its
  own last block; then free blocks; then the free tail of a BE block, most room first
  ("borrowing"); then, with `steal=True`, slots of a dormant BE request, inner end first, each one
  checkpointed first.
* BE: the right part of a block without a BE owner: its own last block, then free blocks, then
  the free tail of an RT block, most room first; then the segment of a *dormant* BE request,
  which is checkpointed whole (two BE requests never share a block). BE never overwrites RT.

A BE request is *dormant* between `suspend` (the scheduler evicted it: its KV stays in place
until the room is needed, and only what is overwritten is copied out: lazy checkpointing) and
`resume`. Tokens marked with `protect` (a prefix the radix cache shares with other requests) are
never overwritten.

No torch, no sglang: `backend/sglang_ext/kv_layout.py` turns the slot lists and checkpoint
records into tensor copies, and the simulator (`backend/sim/bikv.py`) into copy time.

Modules (import each name from the module that defines it): `records` (constants
DEFAULT_BLOCK_SLOTS and HOST, the errors BiCacheError / NoRoom / NeedsRestore, Checkpoint / Grant
/ Restore), `blocks` (the block map, its room indexes and the allocation search), `checkpoints`
(suspend / resume, checkpoint and restore bookkeeping), `layout` (`BiCache`, the public class).
"""
