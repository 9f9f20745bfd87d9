"""The resource-aware prefix tree: trie shape, output-length estimates, density (BlendServe)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backend.policy.batch_order.cost import DensityModel
from backend.policy.batch_order.tree import Node, OrderItem, PrefixTree


def item(index: int, path: list[int], cap: int | None = None) -> OrderItem:
    return OrderItem(index=index, path=path, prompt_len=len(path), max_output_len=cap)


def child_paths(node: Node, tree: PrefixTree) -> list[list[int]]:
    return [list(tree.items[c.items[0]].path[: c.depth]) if c.items else [] for c in node.children]


def test_shared_prefixes_become_one_internal_node() -> None:
    tree = PrefixTree([item(0, [1, 2, 3]), item(1, [1, 2, 4]), item(2, [1, 5]), item(3, [6])])
    root = tree.root
    assert [c.depth for c in root.children] == [1, 1]  # [1…] and [6]
    shared = root.children[0]
    assert shared.n_items == 0 and [c.depth for c in shared.children] == [2, 2]
    two = shared.children[0]  # [1, 2] then 3 / 4
    assert [tree.items[c.items[0]].index for c in two.children] == [0, 1]
    tree.annotate(DensityModel(), {}, 10.0)
    assert root.n_items == 4 and shared.n_items == 3 and two.n_items == 2
    # distinct prompt tokens under perfect sharing: 1,2,3,4,5,6
    assert root.unique_below == 6


def test_identical_prompts_end_at_one_node_and_a_prefix_prompt_at_its_inner_node() -> None:
    tree = PrefixTree([item(0, [7, 8]), item(1, [7, 8]), item(2, [7, 8, 9])])
    node = tree.root.children[0]
    assert sorted(node.items) == [0, 1] and len(node.children) == 1


def test_estimates_use_the_subtree_then_the_cap_class_then_the_prior() -> None:
    items = [
        item(0, [1, 2, 3], cap=100),
        item(1, [1, 2, 4], cap=100),  # subtree [1,2]
        item(2, [5, 6], cap=4000),
        item(3, [9, 9], cap=4000),  # class 4000, no subtree
        item(4, [7], cap=None),
        item(5, [8], cap=50),
    ]
    tree = PrefixTree(items)
    tree.annotate(
        DensityModel(),
        {0: 40, 2: 3000},
        prior_output_len=200.0,
        class_of=lambda it: it.max_output_len,
    )
    est = {tree.items[p].index: d for p, d in enumerate(tree.estimates)}
    assert est[0] == 40  # its own sample
    assert est[1] == 40  # its sibling's, through the shared prefix
    assert est[3] == 3000  # the sample of its output-cap class
    assert est[4] == 200  # nothing known: the prior
    # an unsampled class: half its cap, at least the prior, never above the cap
    assert est[5] == 50


def test_density_matches_the_papers_worked_example() -> None:
    model = DensityModel()  # Llama-3.1-8B on A100-80GB
    assert model.density(512, 256) == pytest.approx(3.73, rel=0.01)
    assert model.density(256, 16384) == pytest.approx(0.096, rel=0.03)


def test_sharing_lowers_a_subtrees_density() -> None:
    model = DensityModel()
    prefix = list(range(1000))
    shared = PrefixTree([item(i, [*prefix, 5000 + i]) for i in range(8)])
    alone = PrefixTree([item(i, [10_000 * (i + 1) + t for t in range(1001)]) for i in range(8)])
    for tree in (shared, alone):
        tree.annotate(model, {}, 100.0)
    subtree = shared.root.children[0]
    assert subtree.sharing == pytest.approx(1 - (1000 + 8 + 800) / (8 * 1001 + 800), rel=1e-6)
    assert alone.root.sharing == 0.0
    assert subtree.rho < alone.root.rho


def test_block_hash_paths_count_tokens_per_block_capped_by_the_prompt() -> None:
    items = [OrderItem(index=i, path=[11, 12, 100 + i], prompt_len=1100) for i in range(3)]
    tree = PrefixTree(items, tokens_per_element=512)
    tree.annotate(DensityModel(), {}, 2.0)
    node = tree.root.children[0]
    assert node.end_tokens == 1024  # two shared 512-token blocks
    assert all(c.end_tokens == 1100 for c in node.children)
    assert tree.root.unique_below == 1024 + 3 * 76


def test_unique_indices_are_required() -> None:
    with pytest.raises(ValueError, match="unique"):
        PrefixTree([item(1, [1]), item(1, [2])])


def test_the_ordering_code_is_pure() -> None:
    code = (
        "import sys, backend.policy.batch_order, backend.policy.batch_order.feed; "
        "print(','.join(m for m in ('aiohttp', 'sqlalchemy', 'torch', 'sglang') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
