"""From an annotated prefix tree to an ordered list of units (BlendServe, digest 002 §2.5–2.7).

* `layer_sort`: every node's children by ρ, densest first (Alg. 1). Only siblings move, so a DFS
  of the sorted tree still shares every prefix.
* `split_units`: dissolve a node into its children when recomputing its prefix once per child
  costs at most the threshold t (tokens), which is divided among the children on the way down
  (Alg. 2, with the digest's leaf fix). What is not dissolved is a *unit*, consumed in DFS order.
* `merge_units`: adjacent units in the ρ-sorted list merge while they are small, so the
  scanner's memory partition does not jump at every tiny unit (§2.7).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from backend.policy.batch_order.tree import Node, PrefixTree

MIN_UNIT_ITEMS = 64
"""Units smaller than this merge with their neighbour in the sorted list (§2.7 proposal)."""


@dataclass
class Unit:
    """A run of requests the scanner consumes in order, with its aggregate density."""

    items: list[int] = field(default_factory=list)
    """Positions in the tree's item list, in DFS order."""
    comp_s: float = 0.0
    """Σ (1 − s)·Comp over the unit: compute time after sharing, seconds."""
    mem_s: float = 0.0
    """Σ Mem over the unit, seconds."""

    @property
    def rho(self) -> float:
        """Compute density of the unit."""
        return self.comp_s / self.mem_s if self.mem_s > 0 else float("inf")

    def absorb(self, other: Unit) -> None:
        """Appends `other` (order kept)."""
        self.items.extend(other.items)
        self.comp_s += other.comp_s
        self.mem_s += other.mem_s


def layer_sort(tree: PrefixTree) -> None:
    """Sorts every node's children by ρ, descending (stable, so ties keep trie order)."""
    for node in tree.nodes_postorder():
        node.children.sort(key=lambda c: c.rho, reverse=True)


def dfs_items(node: Node) -> Iterator[int]:
    """Item positions of a subtree in DFS order (a node's own requests before its children's:
    their prompt is the prefix the children extend)."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield from current.items
        todo.extend(reversed(current.children))


def _unit_of(tree: PrefixTree, node: Node) -> Unit:
    """A whole subtree as one unit (its sharing lowers its compute)."""
    return Unit(
        items=list(dfs_items(node)), comp_s=node.comp_s * (1.0 - node.sharing), mem_s=node.mem_s
    )


def _own_items_unit(tree: PrefixTree, node: Node) -> Unit:
    """The requests ending exactly at a dissolved internal node, as a unit of their own."""
    return Unit(
        items=list(node.items),
        comp_s=sum(tree.item_comp_s[p] for p in node.items),
        mem_s=sum(tree.item_mem_s[p] for p in node.items),
    )


def split_units(tree: PrefixTree, threshold_tokens: float) -> tuple[list[Unit], int]:
    """Alg. 2: the units, sorted by ρ descending, and the prefix tokens the splits recompute."""
    units: list[Unit] = []
    recompute = 0
    todo: list[tuple[Node, float]] = [(tree.root, float(threshold_tokens))]
    while todo:
        node, budget = todo.pop()
        fanout = len(node.children)
        if node is not tree.root and (node.is_leaf or node.prefix_tokens * fanout > budget):
            units.append(_unit_of(tree, node))
            continue
        if node.items:
            units.append(_own_items_unit(tree, node))
        if node is not tree.root:
            recompute += node.prefix_tokens * max(0, fanout - 1)
        todo.extend((child, budget / fanout) for child in node.children)
    units.sort(key=lambda u: u.rho, reverse=True)
    return units, recompute


def merge_units(units: list[Unit], min_items: int = MIN_UNIT_ITEMS) -> list[Unit]:
    """§2.7: neighbours in the ρ-sorted list merge while the unit being built holds fewer than
    `min_items` requests (neighbours have similar ρ, so little balance is lost). Never reorders
    requests."""
    merged: list[Unit] = []
    for unit in units:
        if merged and len(merged[-1].items) < min_items:
            merged[-1].absorb(unit)
        else:
            merged.append(Unit(items=list(unit.items), comp_s=unit.comp_s, mem_s=unit.mem_s))
    return merged
