"""The resource-aware prefix tree (BlendServe, digest 002 §2.2–2.4).

A compressed trie over the prompts of a batch: internal nodes are shared prompt segments, a
request ends at the node where its prompt ends. Every node carries its subtree's aggregates:
request count, output-length samples, compute and memory time, the prefix-sharing ratio and the
compute density ρ = (1 − s)·T_comp / T_mem.

Paths are sequences of ints: token ids (`tokens_per_element` = 1, what the gateway's runner
uses) or prefix-cache block hashes (`tokens_per_element` = the block size, what the simulator's
workloads carry). Built from the lexicographically sorted paths and the longest common prefix of
neighbours (one stack pass), so building costs a sort plus O(total shared length) — no per-token
node objects.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from backend.policy.batch_order.cost import DensityModel


@dataclass(frozen=True)
class OrderItem:
    """One request of a batch as the ordering sees it."""

    index: int
    """The caller's id of the request (e.g. its line number); unique within a batch."""
    path: Sequence[int]
    """The prompt: token ids, or one hash per prefix-cache block."""
    prompt_len: int
    """Prompt length, tokens."""
    max_output_len: int | None = None
    """Output cap, tokens (estimates never exceed it)."""


@dataclass(eq=False)
class Node:
    """A node of the compressed trie: the path segment ending `depth` elements from the root."""

    depth: int
    """Path elements from the root to the end of this node."""
    parent: Node | None
    children: list[Node] = field(default_factory=list)
    items: list[int] = field(default_factory=list)
    """Positions (in the tree's item list) of the requests whose path ends here."""
    # --- subtree aggregates (filled by PrefixTree.annotate) ---
    end_tokens: int = 0
    """Tokens from the root to the end of this node (the longest prompt in the subtree caps it)."""
    n_items: int = 0
    n_sampled: int = 0
    sum_sampled: float = 0.0
    unique_below: int = 0
    """Prompt tokens of the segments strictly below this node: with the path down to this node,
    what perfect sharing computes for the subtree's prompts."""
    sum_prompt: int = 0
    sum_output: float = 0.0
    comp_s: float = 0.0
    mem_s: float = 0.0
    sharing: float = 0.0
    """s: share of the subtree's GEMM tokens saved by sharing prefixes inside it (and the path
    above it computed once)."""
    rho: float = 0.0
    """Compute density (1 − s)·T_comp / T_mem."""

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def prefix_tokens(self) -> int:
        """len_prefix: tokens a split must recompute once per child."""
        return self.end_tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """The trie over `items`; call `annotate` (with output-length knowledge) before ordering."""

    def __init__(self, items: Sequence[OrderItem], *, tokens_per_element: int = 1) -> None:
        if tokens_per_element < 1:
            raise ValueError("tokens_per_element must be ≥ 1")
        if len({it.index for it in items}) != len(items):
            raise ValueError("OrderItem.index values must be unique")
        self.items = list(items)
        self.tokens_per_element = tokens_per_element
        self.root = Node(depth=0, parent=None)
        self.estimates: list[float] = [0.0] * len(self.items)
        """Estimated (or known) output length of each item, tokens (after `annotate`)."""
        self.item_comp_s: list[float] = [0.0] * len(self.items)
        """Comp of each item with its estimated output, seconds (after `annotate`)."""
        self.item_mem_s: list[float] = [0.0] * len(self.items)
        """Mem of each item with its estimated output, seconds (after `annotate`)."""
        self._build()

    def _build(self) -> None:
        order = sorted(range(len(self.items)), key=lambda i: tuple(self.items[i].path))
        stack = [self.root]
        previous: Sequence[int] = ()
        for pos in order:
            path = self.items[pos].path
            lcp = _common_prefix(previous, path)
            popped: Node | None = None
            while stack[-1].depth > lcp:
                popped = stack.pop()
            if stack[-1].depth < lcp:  # the shared part ends inside `popped`'s segment: split
                assert popped is not None
                mid = Node(depth=lcp, parent=stack[-1])
                stack[-1].children[-1] = mid  # popped was the last child
                popped.parent = mid
                mid.children.append(popped)
                stack.append(mid)
            if len(path) == stack[-1].depth:
                stack[-1].items.append(pos)
            else:
                leaf = Node(depth=len(path), parent=stack[-1], items=[pos])
                stack[-1].children.append(leaf)
                stack.append(leaf)
            previous = path

    def nodes_postorder(self) -> Iterator[Node]:
        """Every node, children before parents (iterative: deep tries need no recursion)."""
        out: list[Node] = []
        todo = [self.root]
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children)
        return reversed(out)

    def annotate(
        self,
        model: DensityModel,
        known_output: Mapping[int, int],
        prior_output_len: float,
        class_of: Callable[[OrderItem], Hashable] | None = None,
    ) -> None:
        """Estimates every output length and fills the aggregates and ρ of every node.

        `known_output`: true output lengths by item index (pilot samples, or known lengths).
        Unknown ones take the mean of the samples in the nearest enclosing subtree that has any
        (its own, then its siblings' through the parent, …, the root excluded), else the mean of
        the samples of its class (`class_of`, e.g. its output cap: lines of one template), else
        `prior_output_len` (the samples' or the tenant's history mean) — digest §2.3.
        """
        pos_of = {it.index: pos for pos, it in enumerate(self.items)}
        sampled = {pos_of[i]: d for i, d in known_output.items() if i in pos_of}
        for node in self.nodes_postorder():
            node.n_sampled = sum(1 for p in node.items if p in sampled)
            node.sum_sampled = float(sum(sampled[p] for p in node.items if p in sampled))
            for child in node.children:
                node.n_sampled += child.n_sampled
                node.sum_sampled += child.sum_sampled
        by_class: dict[Hashable, list[int]] = {}
        if class_of is not None:
            for pos, d in sampled.items():
                by_class.setdefault(class_of(self.items[pos]), []).append(d)
        class_mean = {k: sum(v) / len(v) for k, v in by_class.items()}

        def fallback(pos: int) -> float:
            # A class nobody has sampled yet: half its cap (a line whose client allows 8K tokens
            # is expected to be long), at least the prior.
            cap = self.items[pos].max_output_len
            unsampled = prior_output_len if cap is None else max(prior_output_len, cap / 2.0)
            if class_of is None:
                return unsampled
            return class_mean.get(class_of(self.items[pos]), unsampled)

        self._estimate(sampled, fallback)
        self._aggregate(model)

    def _estimate(self, sampled: Mapping[int, int], fallback: Callable[[int], float]) -> None:
        todo: list[tuple[Node, float | None]] = [(self.root, None)]
        while todo:
            node, inherited = todo.pop()
            mean = inherited
            if node is not self.root and node.n_sampled:
                mean = node.sum_sampled / node.n_sampled
            for pos in node.items:
                cap = self.items[pos].max_output_len
                if pos in sampled:
                    d = float(sampled[pos])
                else:
                    d = mean if mean is not None else fallback(pos)
                self.estimates[pos] = max(1.0, min(d, cap) if cap is not None else d)
            todo.extend((child, mean) for child in node.children)

    def _aggregate(self, model: DensityModel) -> None:
        tpe = self.tokens_per_element
        items, estimates = self.items, self.estimates
        self.item_comp_s = [
            model.comp_s(it.prompt_len, d) for it, d in zip(items, estimates, strict=True)
        ]
        self.item_mem_s = [
            model.mem_s(it.prompt_len, d) for it, d in zip(items, estimates, strict=True)
        ]
        comp, mem = self.item_comp_s, self.item_mem_s
        for node in self.nodes_postorder():
            longest = max(
                [items[p].prompt_len for p in node.items] + [c.end_tokens for c in node.children],
                default=0,
            )
            node.end_tokens = min(node.depth * tpe, longest)
            node.n_items = len(node.items)
            node.sum_prompt = sum(items[p].prompt_len for p in node.items)
            node.sum_output = sum(estimates[p] for p in node.items)
            node.comp_s = sum(comp[p] for p in node.items)
            node.mem_s = sum(mem[p] for p in node.items)
            node.unique_below = 0
            for child in node.children:
                node.n_items += child.n_items
                node.sum_prompt += child.sum_prompt
                node.sum_output += child.sum_output
                node.comp_s += child.comp_s
                node.mem_s += child.mem_s
                node.unique_below += child.unique_below + child.end_tokens - node.end_tokens
            node.sharing, node.rho = subtree_density(node)


def subtree_density(node: Node) -> tuple[float, float]:
    """(s, ρ) of a subtree whose path from the root is computed once (digest §2.4):
    tokens computed = the subtree's distinct prompt tokens + its outputs."""
    every = node.sum_prompt + node.sum_output
    if every <= 0:
        return 0.0, 0.0
    shared = node.unique_below + node.end_tokens + node.sum_output
    sharing = min(1.0, max(0.0, 1.0 - shared / every))
    rho = (1.0 - sharing) * node.comp_s / node.mem_s if node.mem_s > 0 else float("inf")
    return sharing, rho
