"""Ordering a batch's requests: the resource-aware prefix tree of BlendServe (digest 002
§2.2–2.9) and the DFS / FCFS baselines. Pure: standard library only (no aiohttp, sqlalchemy,
torch), so the gateway's batch runner and the bench's simulated feed run the same code.

    plan = plan_blend(items, known_output=pilot_lengths, prior_output_len=history_mean)
    scanner = plan.scanner(memory_tokens=kv_pool)
    pos = scanner.next() ... scanner.release(pos)          # feed under backpressure
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backend.policy.batch_order.cost import LLAMA8B_A100, DensityModel
from backend.policy.batch_order.plan import (
    MIN_UNIT_ITEMS,
    Unit,
    dfs_items,
    layer_sort,
    merge_units,
    split_units,
)
from backend.policy.batch_order.scanner import DualScanner, footprint_tokens
from backend.policy.batch_order.tree import OrderItem, PrefixTree

DEFAULT_SPLIT_ALPHA = 0.02
"""Outlier-split budget as a share of the batch's unique prompt tokens (digest §2.6 proposal)."""

__all__ = ["BlendPlan", "dfs_order", "pilot_sample", "plan_blend"]


@dataclass
class BlendPlan:
    """The ordered units of one batch and what the scanner needs."""

    tree: PrefixTree
    units: list[Unit]
    """ρ-sorted units (densest first), each in DFS order."""
    rho_target: float
    """ρ of the root: the blend both scanners aim at together."""
    recompute_tokens: int
    """Prefix tokens the outlier splits recompute (the price of the split)."""

    @property
    def estimates(self) -> list[float]:
        """Output-length estimate of each item position, tokens."""
        return self.tree.estimates

    def footprints(self) -> list[float]:
        """Lifetime-average KV footprint of each item position, tokens."""
        return [
            footprint_tokens(it.prompt_len, d)
            for it, d in zip(self.tree.items, self.tree.estimates, strict=True)
        ]

    def order(self) -> list[int]:
        """Item positions in unit order (the rank stored per line; the scanner reads the unit
        list from both ends)."""
        return [pos for unit in self.units for pos in unit.items]

    def scanner(self, memory_tokens: float) -> DualScanner:
        """A dual scanner over this plan that keeps `memory_tokens` of footprint in flight."""
        return DualScanner(self.units, self.footprints(), memory_tokens, self.rho_target)


def plan_blend(
    items: Sequence[OrderItem],
    *,
    known_output: Mapping[int, int],
    prior_output_len: float,
    model: DensityModel = LLAMA8B_A100,
    tokens_per_element: int = 1,
    split_alpha: float = DEFAULT_SPLIT_ALPHA,
    min_unit_items: int = MIN_UNIT_ITEMS,
) -> BlendPlan:
    """Builds, annotates, sorts, splits and merges (digest §2.9 `preprocess`)."""
    if split_alpha < 0:
        raise ValueError("split_alpha must be ≥ 0")
    tree = PrefixTree(items, tokens_per_element=tokens_per_element)
    tree.annotate(model, known_output, prior_output_len)
    layer_sort(tree)
    threshold = split_alpha * tree.root.unique_below
    units, recompute = split_units(tree, threshold)
    units = merge_units(units, min_unit_items)
    return BlendPlan(tree=tree, units=units, rho_target=tree.root.rho, recompute_tokens=recompute)


def dfs_order(items: Sequence[OrderItem], *, tokens_per_element: int = 1) -> list[int]:
    """Item positions in DFS order of the plain trie (children in path order): the
    prefix-sharing optimum without resource awareness (the `dfs` baseline)."""
    tree = PrefixTree(items, tokens_per_element=tokens_per_element)
    return list(dfs_items(tree.root))


def pilot_sample(
    indices: Sequence[int], fraction: float, max_items: int, seed: int = 0
) -> list[int]:
    """The items run first to sample output lengths (digest §2.3): a deterministic,
    evenly spread `fraction` of them (at least one while any exist), at most `max_items`."""
    if not indices or fraction <= 0 or max_items <= 0:
        return []
    count = min(max_items, len(indices), max(1, round(fraction * len(indices))))
    ordered = sorted(indices, key=lambda i: _mix(i, seed))
    return sorted(ordered[:count])


def _mix(value: int, seed: int) -> int:
    """A cheap deterministic hash (splitmix64) so the sample is spread over the file."""
    z = (value * 0x9E3779B97F4A7C15 + seed + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)
