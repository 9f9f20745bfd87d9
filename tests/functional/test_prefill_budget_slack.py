"""tandem's prefill admission on SGLang's own PrefillBudget: only the KV a prompt needs now is
charged, plus the slots the bicache layout loses to each prompt (its last block's unused side),
so a prefill batch never asks the layout for more than it can place."""

from __future__ import annotations

import warnings
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # imports torch (and Triton or SGLang): seconds, not a unit test

BLOCK_SLACK = 15  # kv_layout_engine.prompt_slack_tokens() with the layout installed


@pytest.fixture(scope="module")
def adder() -> ModuleType:
    """The prefill adder module, imported as in the scheduler process (SGLang's import-time
    warnings about CUDA-only kernels are expected on CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from backend.sglang_ext import prefill_adder
    return prefill_adder


@pytest.fixture
def budget(adder: ModuleType) -> Any:
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    def make(free_slots: int, slack: int) -> Any:
        allocator = SimpleNamespace(page_size=1, available_size=lambda: free_slots)
        tree = SimpleNamespace(evictable_size=lambda: 0, supports_mamba=lambda: False)
        b = PrefillBudget(allocator, tree)
        b.check_prefill = adder._immediate_check(b, slack)
        b.reserve = adder._immediate_reserve(b, slack)
        return b

    return make


def admit(b: Any, prompt: int, max_new: int = 500) -> bool:
    ok, _ = b.check_prefill(
        extend_input_len=prompt,
        total_tokens=prompt + max_new,
        max_new_tokens=max_new,
        input_tokens=prompt,
        swa_host_hit_length=0,
        chunk_limit=None,
    )
    if ok:
        b.reserve(prompt, max_new)
    return bool(ok)


def test_token_pool_admits_what_fits_now_without_future_tokens(budget: Any) -> None:
    b = budget(64, slack=0)
    # 17 + 1 (page) each, no room kept for the 500 tokens each may generate
    assert [admit(b, 17) for _ in range(4)] == [True, True, True, False]


def test_bicache_layout_charges_each_prompt_its_last_blocks_unused_side(budget: Any) -> None:
    b = budget(64, slack=BLOCK_SLACK)
    # 17 tokens take two blocks of 16 on the layout: 17 + 1 + 15 charged, so a second prompt
    # (needing 17 + 15 more) no longer fits in the 31 left
    assert [admit(b, 17), admit(b, 17)] == [True, False]
    assert admit(b, 8) is True  # 8 + 15 ≤ 31: a prompt that fits in the remaining blocks


def test_the_slack_is_zero_without_the_layout(adder: ModuleType) -> None:
    from backend.sglang_ext import kv_layout_engine

    assert kv_layout_engine.prompt_slack_tokens() == 0
