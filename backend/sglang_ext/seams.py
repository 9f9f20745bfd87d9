"""Every SGLang attribute tandem hooks or relies on, as dotted paths (no sglang import here).

``tests/functional/test_sglang_seams.py`` resolves each one in the pinned SGLang, so an upgrade that
moves or renames one fails loudly instead of leaving a hook silently unapplied (SGLang's
``HookRegistry`` only logs a hook it cannot apply). What each hook does:
``backend.sglang_ext.hooks``.
"""

from __future__ import annotations

SCHED = "sglang.srt.managers.scheduler.Scheduler"
BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
NEXT_BATCH_SEAM = f"{SCHED}.get_next_batch_to_run"
DEFER_PREFILL_SEAM = f"{SCHED}._should_defer_prefill"
ADDER_CLASS_SEAM = f"{SCHED}.get_prefill_adder_class"
RESULT_SEAM = f"{SCHED}.process_batch_result"
RETRACT_ORDER_SEAM = f"{BATCH}._get_decode_retraction_order"
INFLIGHT_SEAM = f"{SCHED}.collect_inflight_reqs"
IDLE_SEAM = f"{SCHED}.is_fully_idle"
ADD_TO_QUEUE = f"{SCHED}._add_request_to_queue"

CREATE_REQ_SEAM = f"{SCHED}._create_generation_req"
SIGTERM_WATCHDOG_SEAM = "sglang.srt.managers.tokenizer_manager.TokenizerManager.sigterm_watchdog"
"""In the HTTP server's process (``backend.sglang_ext.plugin.register_prompt_shutdown``)."""
SERVER_ARGS_SEAM = "sglang.srt.server_args.ServerArgs.resolve_once"
"""In the HTTP server's process: the engine's arguments checked against the KV layout before
any scheduler starts (``backend.sglang_ext.plugin.refuse_unfit_layout``)."""

SEAMS: tuple[str, ...] = (
    CREATE_REQ_SEAM,
    SIGTERM_WATCHDOG_SEAM,
    SERVER_ARGS_SEAM,
    NEXT_BATCH_SEAM,
    DEFER_PREFILL_SEAM,
    ADDER_CLASS_SEAM,
    RESULT_SEAM,
    RETRACT_ORDER_SEAM,
    INFLIGHT_SEAM,
    IDLE_SEAM,
    ADD_TO_QUEUE,
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req",
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.release_req",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.filter_batch",
    "sglang.srt.managers.schedule_batch.ScheduleBatch.merge_batch",
    "sglang.srt.mem_cache.prefill_budget.PrefillBudget.check_prefill",
    "sglang.srt.mem_cache.prefill_budget.PrefillBudget.reserve",
    # hooks.admit_ready_grammars: constrained requests reach the waiting queue before planning
    "sglang.srt.constrained.grammar_manager.GrammarManager.has_waiting_grammars",
    "sglang.srt.constrained.grammar_manager.GrammarManager.get_ready_grammar_requests",
)
"""Every SGLang attribute the co-location hooks touch or rely on."""

KV_INIT_SEAM = f"{SCHED}.init_running_status"
KV_EXTEND_SEAM = "sglang.srt.managers.schedule_batch.alloc_for_extend"
KV_DECODE_SEAM = "sglang.srt.managers.schedule_batch.alloc_for_decode"
_KV_ALLOCATOR = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"
KV_LAYOUT_SEAMS: tuple[str, ...] = (
    KV_INIT_SEAM,
    KV_EXTEND_SEAM,
    KV_DECODE_SEAM,
    "sglang.srt.mem_cache.allocation.alloc_for_decode_default",
    f"{_KV_ALLOCATOR}.alloc",
    f"{_KV_ALLOCATOR}.free",
    f"{_KV_ALLOCATOR}.available_size",
    f"{_KV_ALLOCATOR}.check_decode_capacity",
    f"{_KV_ALLOCATOR}.clear",
    f"{_KV_ALLOCATOR}.get_kvcache",
    f"{_KV_ALLOCATOR}._copy_for_free_group",
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
)
"""What the bicache KV layout (``backend.sglang_ext.kv_layout_engine``) hooks or relies on."""
SEAMS = SEAMS + KV_LAYOUT_SEAMS

RUN_BATCH_SEAM = f"{SCHED}.run_batch"
"""Wrapped by ``backend.sglang_ext.pace`` (``engine.slowdown``): each forward pass stretched."""
SEAMS = (*SEAMS, RUN_BATCH_SEAM)

TORCH_NATIVE_EXTEND_SEAM = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
    "._run_sdpa_forward_extend"
)
"""Replaced by ``backend.sglang_ext.cpu_attention`` (``engine.torch_native_extend: new-rows``)."""
SEAMS = (*SEAMS, TORCH_NATIVE_EXTEND_SEAM)
