"""Layer-wise sort, outlier split, unit merge and the dual scanner (BlendServe §2.5–2.8)."""

from __future__ import annotations

import pytest

from backend.policy.batch_order import dfs_order, plan_blend
from backend.policy.batch_order.cost import DensityModel
from backend.policy.batch_order.plan import Unit, dfs_items, layer_sort, merge_units, split_units
from backend.policy.batch_order.scanner import DualScanner, SequentialScanner, partition
from backend.policy.batch_order.tree import OrderItem, PrefixTree


def workload() -> tuple[list[OrderItem], dict[int, int]]:
    """Three kinds: 'mmlu' (shared 300-token prefix per subject, 2-token outputs: dense),
    'chat' (unique prompts, medium outputs) and 'video' (short prompts, long outputs)."""
    items: list[OrderItem] = []
    outputs: dict[int, int] = {}
    for i in range(60):
        kind = ("mmlu", "chat", "video")[i % 3]
        if kind == "mmlu":
            subject = i % 2
            path = [9000 + subject] * 300 + [i]
            cap, out = 2, 2
        elif kind == "chat":
            path = [10_000 + i * 1000 + t for t in range(400)]
            cap, out = 512, 200
        else:
            path = [20_000 + i * 1000 + t for t in range(50)]
            cap, out = 8192, 4000
        items.append(OrderItem(index=i, path=path, prompt_len=len(path), max_output_len=cap))
        outputs[i] = out
    return items, outputs


def test_layer_sort_puts_dense_children_first_and_dfs_keeps_prefix_groups_together() -> None:
    items, outputs = workload()
    tree = PrefixTree(items)
    tree.annotate(DensityModel(), outputs, 100.0)
    layer_sort(tree)
    rhos = [c.rho for c in tree.root.children]
    assert rhos == sorted(rhos, reverse=True)
    order = [tree.items[p].index for p in dfs_items(tree.root)]
    # the MMLU subjects (densest) lead, each subject contiguous; the videos come last
    kinds = ["mmlu" if i % 3 == 0 else "chat" if i % 3 == 1 else "video" for i in order]
    assert kinds[:20] == ["mmlu"] * 20 and kinds[-20:] == ["video"] * 20
    subjects = [i % 2 for i in order[:20]]
    assert subjects == sorted(subjects) or subjects == sorted(subjects, reverse=True)


def test_split_keeps_costly_prefixes_whole_and_sorts_units_by_density() -> None:
    items, outputs = workload()
    tree = PrefixTree(items)
    tree.annotate(DensityModel(), outputs, 100.0)
    layer_sort(tree)
    units, recompute = split_units(tree, threshold_tokens=0.0)
    assert recompute == 0  # only the root (no prefix) was dissolved
    rhos = [u.rho for u in units]
    assert rhos == sorted(rhos, reverse=True)
    # each MMLU subject stayed one unit (splitting it would recompute its 300-token prefix)
    subject_units = [u for u in units if len(u.items) == 10]
    assert len(subject_units) == 2
    big, _ = split_units(tree, threshold_tokens=1e9)
    assert len(big) == 60  # a huge budget dissolves every prefix: one unit per request


def test_merge_never_reorders_and_reaches_the_minimum_size() -> None:
    units = [Unit(items=[i], comp_s=1.0, mem_s=1.0) for i in range(10)]
    merged = merge_units(units, min_items=4)
    assert [p for u in merged for p in u.items] == list(range(10))
    assert [len(u.items) for u in merged] == [4, 4, 2]
    assert merged[0].comp_s == 4.0


def test_partition_reproduces_the_papers_example_and_edge_cases() -> None:
    assert partition(60.0, 3.73, 0.096, 1.27) == pytest.approx(19.38, abs=0.01)
    assert partition(60.0, 1.0, 0.5, 1.5, min_share=0.0) == 60.0  # clamped as in the paper
    assert partition(60.0, 1.0, 0.5, 0.1, min_share=0.0) == 0.0
    assert partition(60.0, 2.0, 2.0, 2.0) == 30.0  # equal densities: half each
    # by default neither stream drops below a tenth of the memory
    assert partition(60.0, 1.0, 0.5, 1.5) == pytest.approx(54.0)
    assert partition(60.0, 70.0, 0.4, 0.9) == pytest.approx(6.0)


def test_dual_scanner_hands_out_everything_once_from_both_ends_within_memory() -> None:
    units = [
        Unit(items=[0, 1, 2], comp_s=9.0, mem_s=1.0),
        Unit(items=[3, 4], comp_s=1.0, mem_s=1.0),
        Unit(items=[5, 6, 7], comp_s=1.0, mem_s=9.0),
    ]
    footprints = [10.0] * 8
    scanner = DualScanner(units, footprints, memory=40.0, rho_target=1.0)
    left_share, right_share = scanner.quotas
    assert left_share + right_share == pytest.approx(40.0)
    first: list[int] = []
    while (pos := scanner.next()) is not None:
        first.append(pos)
    assert 0 in first and 5 in first  # both ends start at once
    # the budget holds 4 lines; a side with a share may run one line beyond its share
    assert 4 <= len(first) <= 5
    seen = list(first)
    while not scanner.exhausted:
        scanner.release(seen[-1] if len(seen) % 2 else seen[0])
        pos = scanner.next()
        if pos is not None:
            seen.append(pos)
    assert sorted(seen) == list(range(8))


def test_sequential_scanner_respects_memory_but_always_runs_one() -> None:
    scanner = SequentialScanner([2, 0, 1], [100.0, 5.0, 5.0], memory=8.0)
    assert scanner.next() == 2  # larger than the budget, but nothing runs yet
    assert scanner.next() is None
    scanner.release(2)
    assert scanner.next() == 0 and scanner.next() is None


def test_plan_and_dfs_cover_every_item() -> None:
    items, outputs = workload()
    plan = plan_blend(items, known_output=outputs, prior_output_len=100.0, min_unit_items=4)
    assert sorted(plan.tree.items[p].index for p in plan.order()) == list(range(60))
    assert sorted(dfs_order(items)) == list(range(60))
    assert plan.rho_target == plan.tree.root.rho
    assert plan.units[0].rho > plan.rho_target > plan.units[-1].rho
