"""tandem's new-rows prompt attention for SGLang's torch_native backend gives SGLang's own result.

``backend.sglang_ext.cpu_attention.extend_new_rows`` replaces
``TorchNativeAttnBackend._run_sdpa_forward_extend`` (which computes each request's whole
sequence and keeps its last rows); both run here on the same random batch, built the way SGLang
lays one out: a KV pool, a request-to-slot table, and per request its cached prefix and new
tokens (a fresh prompt, a chunk after a long prefix, decodes riding as 1-token extends).
"""

from __future__ import annotations

import time
import warnings
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")  # the engine's install (scripts/install) always has it

from backend.sglang_ext.cpu_attention import extend_new_rows  # noqa: E402

HEADS, HEAD_DIM = 4, 64


@pytest.fixture(scope="module")
def backend_class() -> Any:
    with warnings.catch_warnings():
        # import-time warnings about CUDA-only kernels and torch.jit are expected on CPU
        warnings.simplefilter("ignore")
        import sglang.srt.layers.attention.torch_native_backend as module

    assert isinstance(module, ModuleType)
    return module.TorchNativeAttnBackend


def batch(prefixes: list[int], new: list[int], kv_heads: int = HEADS) -> dict[str, Any]:
    """A batch of requests with `prefixes[i]` cached and `new[i]` new tokens, their KV spread
    over a shuffled pool (as slots are after a while)."""
    gen = torch.Generator().manual_seed(sum(prefixes) + 7 * sum(new))
    seq_lens = [p + n for p, n in zip(prefixes, new, strict=True)]
    slots = torch.randperm(sum(seq_lens) + 16, generator=gen)
    req_to_token = torch.zeros((len(seq_lens) + 2, max(seq_lens) + 4), dtype=torch.int64)
    start = 0
    for i, length in enumerate(seq_lens):
        req_to_token[i + 2, :length] = slots[start : start + length]
        start += length
    pool = len(slots)
    return {
        "query": torch.randn(sum(new), HEADS, HEAD_DIM, generator=gen),
        "k_cache": torch.randn(pool, kv_heads, HEAD_DIM, generator=gen),
        "v_cache": torch.randn(pool, kv_heads, HEAD_DIM, generator=gen),
        "req_to_token": req_to_token,
        "req_pool_indices": torch.arange(2, len(seq_lens) + 2),
        "seq_lens": torch.tensor(seq_lens),
        "extend_prefix_lens": torch.tensor(prefixes),
        "extend_seq_lens": torch.tensor(new),
    }


def both(backend_class: Any, inputs: dict[str, Any], **options: Any) -> tuple[Any, Any]:
    """(SGLang's output, tandem's output) for the same inputs."""
    backend = object.__new__(backend_class)  # the method reads nothing else of the backend
    outputs = []
    for run in (backend_class._run_sdpa_forward_extend, extend_new_rows):
        out = torch.full_like(inputs["query"], float("nan"))
        run(backend, inputs["query"], out, **{k: v for k, v in inputs.items() if k != "query"},
            **options)  # fmt: skip
        outputs.append(out)
    return outputs[0], outputs[1]


@pytest.mark.parametrize(
    ("prefixes", "new"),
    [
        ([0], [37]),  # a fresh prompt
        ([900], [16]),  # a chunk deep into a prompt
        ([0, 300, 40, 41, 1200], [64, 128, 1, 1, 1]),  # prompts with decodes riding along
    ],
)
def test_the_new_rows_are_sglangs_rows(
    backend_class: Any, prefixes: list[int], new: list[int]
) -> None:
    stock, ours = both(backend_class, batch(prefixes, new), scaling=HEAD_DIM**-0.5, causal=True)
    assert not torch.isnan(ours).any()
    torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-5)


def test_the_same_with_grouped_query_heads_and_a_sliding_window(backend_class: Any) -> None:
    inputs = batch([500, 0], [32, 20], kv_heads=2)
    for window in (None, 64):
        stock, ours = both(
            backend_class, inputs, enable_gqa=True, causal=True, sliding_window_size=window
        )
        torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-5)


def test_a_chunk_deep_into_a_prompt_costs_its_own_rows(backend_class: Any) -> None:
    # what the patch is for: a short chunk after a long prefix no longer pays the prefix squared
    # (compared within the run: the same chunk by both, best of three each)
    inputs = batch([3000], [16])

    def best(run: Any) -> float:
        backend = object.__new__(backend_class)
        times = []
        for _ in range(3):
            out = torch.empty_like(inputs["query"])
            started = time.perf_counter()
            run(backend, inputs["query"], out, **{k: v for k, v in inputs.items() if k != "query"},
                causal=True)  # fmt: skip
            times.append(time.perf_counter() - started)
        return min(times)

    assert best(extend_new_rows) < best(backend_class._run_sdpa_forward_extend)
