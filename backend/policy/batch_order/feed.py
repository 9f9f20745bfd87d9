"""The batch runner's feed, as pure bookkeeping: which line to send to the engine next.

Shared by the gateway's runner (real engine, lines from SQL) and the bench (simulated engine), so
both run the same decisions::

    feed = BatchFeed(items, FeedSettings(ordering="blend", memory_tokens=kv_pool, ...))
    while (index := feed.next()) is not None: send(index)      # as long as the engine has room
    feed.finished(index, output_len)                            # on every completion

Phases. The pilot lines (a small sample, every output-cap class represented) go first; their
real output lengths are the samples of the prefix tree (digest 002 §2.3). Planning does not
wait for the slowest pilot: the rest is planned at once from what is known (the tenant's history
as the prior), and re-planned when a quarter, half and all of the pilot has finished. A re-plan
keeps what is in flight: the new scanner starts with the in-flight footprint charged and gets it
back as those lines finish.

Orderings: `fcfs` (file order), `dfs` (trie DFS: the sharing optimum) and `blend` (BlendServe's
dual scanner over ρ-sorted units).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from backend.policy.batch_order.cost import LLAMA8B_A100, DensityModel
from backend.policy.batch_order.plan import (
    MIN_UNIT_ITEMS,
    Unit,
    dfs_items,
    layer_sort,
    merge_units,
    split_units,
)
from backend.policy.batch_order.scanner import DualScanner, SequentialScanner, footprint_tokens
from backend.policy.batch_order.tree import OrderItem, PrefixTree

Ordering = Literal["fcfs", "dfs", "blend"]
ORDERINGS: tuple[Ordering, ...] = ("fcfs", "dfs", "blend")
_REPLAN_AT = (0.25, 0.5, 1.0)  # shares of the pilot finished at which the rest is re-planned


@dataclass(frozen=True)
class FeedSettings:
    """How one batch is fed."""

    ordering: Ordering = "blend"
    """Line order: fcfs (file order), dfs (prefix-trie DFS) or blend (BlendServe)."""
    memory_tokens: float = 16384.0
    """KV footprint kept in flight, tokens (the engine's KV pool, maybe over-committed)."""
    max_inflight: int = 64
    """Lines in flight at most, requests."""
    pilot_fraction: float = 0.01
    """Share of the lines run first to sample output lengths, 0–1."""
    pilot_max_lines: int = 32
    """Most pilot lines."""
    prior_output_len: float = 256.0
    """Output length assumed before any sample (the tenant's history mean), tokens."""
    split_alpha: float = 0.02
    """Outlier-split budget, share of the batch's unique prompt tokens (digest §2.6)."""
    min_unit_items: int = MIN_UNIT_ITEMS
    """Small neighbouring units merge up to this many lines (digest §2.7)."""
    tokens_per_element: int = 1
    """Tokens per path element (1: token ids; the block size for block hashes)."""
    model: DensityModel = field(default=LLAMA8B_A100)
    """The cost model behind ρ."""


def choose_pilot(items: Sequence[OrderItem], fraction: float, max_lines: int) -> list[int]:
    """Indices of the pilot: `fraction` of the lines (≥ 1, ≤ max_lines), spread over the file,
    and one line of every output-cap class first (a class nobody sampled would be guessed)."""
    if not items or fraction <= 0 or max_lines <= 0:
        return []
    count = min(max_lines, len(items), max(1, round(fraction * len(items))))
    chosen: dict[int, None] = {}
    seen_caps: set[int | None] = set()
    for it in items:
        if it.max_output_len not in seen_caps and len(chosen) < count:
            seen_caps.add(it.max_output_len)
            chosen[it.index] = None
    stride = max(1, len(items) // count)
    for it in items[::stride]:
        if len(chosen) >= count:
            break
        chosen.setdefault(it.index, None)
    return sorted(chosen)


class BatchFeed:
    """Which line of one batch goes to the engine next (see the module docstring)."""

    def __init__(
        self,
        items: Sequence[OrderItem],
        settings: FeedSettings,
        *,
        known_output: Mapping[int, int] | None = None,
        defer_replans: bool = False,
    ) -> None:
        """`items`: the lines still to run. `known_output`: output lengths of lines of the same
        batch that already finished (after a restart: they are samples, not work).
        `defer_replans`: a pilot result that calls for a re-plan only sets `replan_due`, and the
        owner re-plans (`draft_replan` in a worker thread, then `adopt`): re-planning 50,000
        lines takes a second or more, too long for a server's event loop."""
        self.settings = settings
        self._defer_replans = defer_replans
        self.replan_due = False
        """A re-plan is called for and not yet adopted (only with `defer_replans`)."""
        self._items = {it.index: it for it in items}
        self._known: dict[int, int] = dict(known_output or {})
        self._pilot = (
            []
            if self._known
            else choose_pilot(list(items), settings.pilot_fraction, settings.pilot_max_lines)
        )
        self._pilot_queue = list(self._pilot)
        self._pilot_done = 0
        self._handed: set[int] = set()
        self._in_flight: dict[int, float] = {}  # index -> footprint charged
        self._scanner: DualScanner | SequentialScanner | None = None
        self._scanner_items: list[int] = []
        self._pos_in_scanner: dict[int, int] = {}
        self._scanner_owned: set[int] = set()
        """Scanner positions handed out by the current scanner (released back to it)."""
        self._carried = 0.0
        """Footprint in flight from before the current plan, tokens."""
        self._estimates: dict[int, float] = {}
        self._order: list[int] = []
        self._replans_done = 0
        self.plans = 0
        """How many times the rest was (re)planned."""
        self._plan()

    # --- queries ---
    @property
    def in_flight(self) -> int:
        """Lines handed out and not finished."""
        return len(self._in_flight)

    @property
    def exhausted(self) -> bool:
        """Every line has been handed out."""
        return len(self._handed) >= len(self._items)

    @property
    def pilot(self) -> list[int]:
        """The pilot's indices."""
        return list(self._pilot)

    def estimate(self, index: int) -> float:
        """The current output-length estimate of a line, tokens."""
        return self._estimates.get(index, self.settings.prior_output_len)

    def planned_order(self) -> list[int]:
        """The lines of the current plan in order (pilot first; then blend: the ρ-sorted units
        the two scanners read from both ends; dfs/fcfs: the order they are sent in)."""
        return list(self._pilot) + [i for i in self._order if i not in self._pilot]

    # --- decisions ---
    def next(self) -> int | None:
        """The next line to send, or None while the in-flight bound or memory share is full."""
        if len(self._in_flight) >= self.settings.max_inflight:
            return None
        while self._pilot_queue:
            index = self._pilot_queue.pop(0)
            if index not in self._handed:
                return self._hand(index, from_scanner=False)
        scanner = self._scanner
        if scanner is None:
            return None
        while True:
            pos = scanner.next()
            if pos is None:
                return None
            index = self._scanner_items[pos]
            if index in self._handed:  # a pilot line the plan still listed
                scanner.release(pos)
                continue
            return self._hand(index, from_scanner=True)

    def finished(self, index: int, output_len: int | None) -> None:
        """A handed-out line ended: `output_len` its real length (None: it failed or was
        dropped). Frees its share; pilot results may trigger a re-plan."""
        charged = self._in_flight.pop(index, None)
        if charged is None:
            return
        if self._scanner is not None:
            pos = self._pos_in_scanner.get(index)
            if pos is not None and pos in self._scanner_owned:
                self._scanner_owned.discard(pos)
                self._scanner.release(pos)
            else:  # handed out before the current plan: give its memory back to the scanner
                self._carried -= charged
                self._scanner_grow(charged)
        if output_len is not None:
            self._known[index] = output_len
        if index in self._pilot:
            self._pilot_done += 1
            share = self._pilot_done / len(self._pilot)
            if self._replans_done < len(_REPLAN_AT) and share >= _REPLAN_AT[self._replans_done]:
                while (
                    self._replans_done < len(_REPLAN_AT) and share >= _REPLAN_AT[self._replans_done]
                ):
                    self._replans_done += 1
                if self._defer_replans:
                    self.replan_due = True
                else:
                    self._plan()

    # --- internals ---
    def _hand(self, index: int, *, from_scanner: bool) -> int:
        self._handed.add(index)
        self._in_flight[index] = self._footprint(index)
        if from_scanner:
            self._scanner_owned.add(self._pos_in_scanner[index])
        return index

    def _footprint(self, index: int) -> float:
        return footprint_tokens(self._items[index].prompt_len, self.estimate(index))

    def _plan(self) -> None:
        """(Re)plans the lines not yet handed out."""
        self.adopt(self.draft_replan()())

    def draft_replan(self) -> Callable[[], PlanDraft]:
        """The expensive half of a re-plan (the prefix tree, its estimates and units), as a call
        on a snapshot of what is known now: it touches nothing of the feed, so it may run in a
        worker thread while the feed goes on handing out lines; `adopt` installs its result."""
        s = self.settings
        rest = [it for i, it in self._items.items() if i not in self._handed]
        known = dict(self._known)
        prior = statistics.fmean(known.values()) if known else s.prior_output_len
        # The finished lines stay in the tree as samples of their subtrees; the scanner skips them.
        sampled = [self._items[i] for i in known if i in self._items and i in self._handed]
        return lambda: _draft(rest + sampled, known, prior, s)

    def adopt(self, draft: PlanDraft) -> None:
        """Installs a re-plan: its order without the lines handed out meanwhile (they stay in
        flight, charged to the new scanner until they finish)."""
        s = self.settings
        tree = draft.tree
        self.replan_due = False
        self._estimates = {it.index: tree.estimates[p] for p, it in enumerate(tree.items)}
        self._scanner_items = [it.index for it in tree.items]
        self._pos_in_scanner = {index: p for p, index in enumerate(self._scanner_items)}
        self._scanner_owned = set()
        handed_pos = {p for p, i in enumerate(self._scanner_items) if i in self._handed}
        footprints = [
            footprint_tokens(it.prompt_len, d)
            for it, d in zip(tree.items, tree.estimates, strict=True)
        ]
        self._carried = sum(self._in_flight.values())
        memory = max(0.0, s.memory_tokens - self._carried)
        if draft.units is not None:
            units = [
                replace(u, items=[p for p in u.items if p not in handed_pos]) for u in draft.units
            ]
            units = merge_units([u for u in units if u.items], s.min_unit_items)
            self._scanner = DualScanner(units, footprints, memory, tree.root.rho)
            self._order = [self._scanner_items[p] for u in units for p in u.items]
        else:
            order = [p for p in draft.order if p not in handed_pos]
            self._scanner = SequentialScanner(order, footprints, memory)
            self._order = [self._scanner_items[p] for p in order]
        self.plans += 1

    def _scanner_grow(self, tokens: float) -> None:
        assert self._scanner is not None
        self._scanner.add_memory(tokens)


@dataclass(frozen=True)
class PlanDraft:
    """A re-plan before it is installed (`BatchFeed.draft_replan`)."""

    tree: PrefixTree
    """The tree of the lines not handed out when it was drafted (and the finished samples)."""
    units: list[Unit] | None
    """blend: the ρ-sorted units of tree positions (None for dfs and fcfs)."""
    order: list[int]
    """dfs / fcfs: the tree positions in sending order (empty for blend)."""


def _draft(
    tree_items: list[OrderItem], known: dict[int, int], prior: float, s: FeedSettings
) -> PlanDraft:
    tree = PrefixTree(tree_items, tokens_per_element=s.tokens_per_element)
    tree.annotate(s.model, known, prior, class_of=_cap_class)
    if s.ordering == "blend":
        layer_sort(tree)
        units, _ = split_units(tree, s.split_alpha * tree.root.unique_below)
        return PlanDraft(tree=tree, units=units, order=[])
    if s.ordering == "dfs":
        order = list(dfs_items(tree.root))
    else:
        order = sorted(range(len(tree.items)), key=lambda p: tree.items[p].index)
    return PlanDraft(tree=tree, units=None, order=order)


def _cap_class(item: OrderItem) -> int | None:
    """Lines with the same output cap come from the same template: a fallback sample group."""
    return item.max_output_len
