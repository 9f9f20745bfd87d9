"""The contract between tandem and the pinned SGLang: every hooked attribute still exists, every
attribute tandem reads through ``backend.sglang_ext.views`` is one SGLang's real classes have,
our plugin is (or is not) loaded as the launcher intends, every launch flag is one SGLang
accepts, the launcher's settings reach the engine intact, and the scheduler-side hook attaches
the client's metadata as ``req.tandem`` without ever raising.

Imports SGLang's scheduler once for the whole module (about 10 s on 2 cores)."""

from __future__ import annotations

import argparse
import ast
import asyncio
import collections
import dataclasses
import inspect
import json
import logging
import pkgutil
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, cast

import pytest

from backend.launch.sglang import engine_env, server_argv
from backend.policy.profiles import resolve_profile
from backend.sglang_ext import plugin, views
from backend.sglang_ext.request_meta import tpot_target_s
from common.config import EngineConfig, EngineSettings, engine_settings_from_env
from common.wire import RequestMeta, meta_to_custom_params
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # imports torch (and Triton or SGLang): seconds, not a unit test

PINNED_SGLANG = "0.5.23"


@pytest.fixture(scope="module")
def sglang() -> ModuleType:
    """SGLang with its scheduler imported, as in the engine's scheduler process."""
    # SGLang's tokenizer manager (the main process's, whose SIGTERM watchdog the plugin hooks)
    # makes uvloop the process's event loop policy when imported: the later tests' subprocesses
    # need asyncio's own (uvloop's has no child watcher).
    policy = asyncio.get_event_loop_policy()
    with warnings.catch_warnings():
        # Import-time UserWarnings about CUDA-only kernels (AWQ, GGUF, Triton) are expected on CPU.
        warnings.simplefilter("ignore")
        import sglang
        import sglang.srt.managers.detokenizer_manager
        import sglang.srt.managers.scheduler
        import sglang.srt.managers.tokenizer_manager
        import sglang.srt.plugins
        import sglang.srt.server_args
    asyncio.set_event_loop_policy(policy)
    return cast(ModuleType, sglang)


def test_sglang_is_the_pinned_version(sglang: ModuleType) -> None:
    assert sglang.__version__ == PINNED_SGLANG


@pytest.mark.parametrize("seam", plugin.SEAMS)
def test_every_hooked_seam_exists(sglang: ModuleType, seam: str) -> None:
    assert callable(pkgutil.resolve_name(seam)), seam


def _attributes(cls: type) -> set[str]:
    """What an instance of *cls* has: class attributes, dataclass fields, and every
    ``self.name = ...`` (plain, annotated, augmented or tuple) in the methods of its classes."""
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("sglang."):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            while targets:
                target = targets.pop()
                if isinstance(target, ast.Tuple | ast.List):
                    targets += target.elts
                elif (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
    return names


def _members(view: type) -> list[str]:
    """The attributes and methods a Protocol of ``views`` declares."""
    declared = set(getattr(view, "__annotations__", {}))
    declared |= {
        name
        for name, value in vars(view).items()
        if not (name.startswith("__") and name.endswith("__"))
        and (callable(value) or isinstance(value, property))
    }
    return sorted(declared)


@pytest.mark.parametrize("view", list(views.SGLANG_CLASSES), ids=lambda v: v.__name__)
def test_every_view_member_exists_in_sglang(sglang: ModuleType, view: type) -> None:
    cls = pkgutil.resolve_name(views.SGLANG_CLASSES[view])
    members = _members(view)
    assert members, view
    missing = [name for name in members if name not in _attributes(cls)]
    assert missing == [], f"{cls.__qualname__} has no {missing} (views.{view.__name__})"


def test_the_attribute_check_notices_a_missing_attribute(sglang: ModuleType) -> None:
    req = pkgutil.resolve_name(views.SGLANG_CLASSES[views.ReqView])
    found = _attributes(req)
    assert {"rid", "kv", "retraction_count", "finished"} <= found  # __init__ and methods
    assert "no_such_field_anywhere" not in found
    sched = _attributes(pkgutil.resolve_name(views.SGLANG_CLASSES[views.SchedulerView]))
    assert "max_total_num_tokens" in sched  # assigned by tuple unpacking


def test_stand_ins_are_used_only_without_the_real_packages(sglang: ModuleType) -> None:
    import sgl_kernel
    import triton
    from sglang.srt.utils import cpu_has_amx_support

    for module in (sgl_kernel, triton):
        if getattr(module, "IS_TANDEM_CPU_STUB", False):
            assert "cpu_shims" in str(module.__file__)
    if getattr(sgl_kernel, "IS_TANDEM_CPU_STUB", False):
        # No AMX op registered: every layer takes its pure-torch path.
        assert not cpu_has_amx_support()
    if getattr(triton, "IS_TANDEM_CPU_STUB", False):

        def kernel(x: int) -> int:
            return x

        assert triton.jit(kernel) is kernel and triton.jit(do_not_specialize=[0])(kernel) is kernel
        assert triton.cdiv(7, 2) == 4 and triton.next_power_of_2(5) == 8


def test_torchvision_imports_next_to_cpu_torch(sglang: ModuleType) -> None:
    # SGLang imports torchvision.transforms at start-up; tandem_tv_shim supplies the operator
    # schemas that torchvision's CUDA-built _C cannot register next to CPU torch.
    import torch
    import torchvision.transforms  # noqa: F401

    assert hasattr(torch.ops.torchvision, "nms")


OUR_PLUGINS = {"tandem", "tandem_cpu_attention", "tandem_pace"}


@pytest.mark.parametrize(
    ("patch", "extend", "slowdown", "inherited", "expected"),
    [
        (True, "stock", None, None, {"tandem"}),
        (False, "stock", None, None, set()),
        (False, "stock", None, "tandem,tandem_cpu_attention,tandem_pace", set()),
        # tandem's prompt attention is part of the engine, scheduling patched or not
        (True, "new-rows", None, None, {"tandem", "tandem_cpu_attention"}),
        (False, "new-rows", None, "tandem", {"tandem_cpu_attention"}),
        # so is a slowed pace: every policy's engine alike
        (False, "stock", "2", None, {"tandem_pace"}),
        (True, "new-rows", "1@0,3@60", None, OUR_PLUGINS),
    ],
)
def test_sglang_loads_our_plugins_exactly_as_configured(
    sglang: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    patch: bool,
    extend: str,
    slowdown: str | None,
    inherited: str | None,
    expected: set[str],
) -> None:
    base = {} if inherited is None else {"SGLANG_PLUGINS": inherited}
    engine = EngineConfig(patch=patch, torch_native_extend=extend, slowdown=slowdown)
    env = engine_env(engine, base=base)
    monkeypatch.setenv("SGLANG_PLUGINS", env["SGLANG_PLUGINS"])
    # SGLang's own discovery, which runs in each of its processes; the plugins' register() is
    # only loaded here, not called.
    loaded = sglang.srt.plugins.load_plugins_by_group(sglang.srt.plugins.GENERAL_PLUGINS_GROUP)
    assert set(loaded) & OUR_PLUGINS == expected


def test_sglang_accepts_every_launch_flag(sglang: ModuleType, tmp_path: Path) -> None:
    from sglang.srt.server_args import ServerArgs

    (tmp_path / "config.json").write_text("{}")
    cfg = EngineConfig(context_length=2048, enable_priority_scheduling=True)
    argv = server_argv(cfg, tmp_path, "m", random_weights=True)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv[3:])  # exits (SystemExit) on an unknown flag or choice
    assert args.device == "cpu" and args.attention_backend == "torch_native"
    assert args.load_format == "dummy" and args.enable_priority_scheduling


def test_the_launchers_settings_reach_the_engine_intact() -> None:
    cfg = EngineConfig(policy_options={"latency_budget_s": 0.2, "x": 3}, port=31000)
    settings = engine_settings_from_env(engine_env(cfg, base={}, scheduler_trace="/tmp/t"))
    assert settings == EngineSettings(
        policy="tandem",
        # engine.profile auto without a measured profile: the device's bundled one
        profile_path=str(resolve_profile("cpu-tiny")),
        policy_options={"latency_budget_s": 0.2, "x": 3},
        control_socket=cfg.control_socket_path,
        kv_layout="token",
        scheduler_trace="/tmp/t",
    )
    # no policy in charge: metadata only (and the layout, which works either way)
    for off in (EngineConfig(policy="none"), EngineConfig(patch=False)):
        assert engine_settings_from_env(engine_env(off, base={})) == EngineSettings()
    bicache = EngineConfig(policy="none", kv_layout="bicache")
    assert engine_settings_from_env(engine_env(bicache, base={})).kv_layout == "bicache"
    # one variable carries it all: nothing else of tandem's goes to the engine
    env = engine_env(cfg, base={})
    assert sorted(k for k in env if k.startswith("TANDEM_")) == ["TANDEM_ENGINE_SETTINGS"]
    with pytest.raises(ValueError, match=r"engine\.policy 'nope' is not a policy"):
        engine_env(EngineConfig(policy="nope"), base={})


def test_register_hooks_only_where_the_scheduler_lives(
    sglang: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # A fresh class-level registry, so nothing is applied to this process; restored after.
    monkeypatch.setattr(HookRegistry, "_hooks", collections.defaultdict(list))
    monkeypatch.delenv("TANDEM_ENGINE_SETTINGS", raising=False)  # metadata only
    with monkeypatch.context() as m:
        m.delitem(sys.modules, plugin.SCHEDULER_MODULE)  # the detokenizer process
        plugin.register()
    assert not HookRegistry._hooks
    with monkeypatch.context() as m:
        m.delitem(sys.modules, plugin.SCHEDULER_MODULE)  # the HTTP server's main process
        m.delitem(sys.modules, plugin.DETOKENIZER_MODULE)
        plugin.register()
    assert list(HookRegistry._hooks) == [plugin.SIGTERM_WATCHDOG_SEAM]
    assert [(t, h) for t, h, _ in HookRegistry._hooks[plugin.SIGTERM_WATCHDOG_SEAM]] == [
        (HookType.AROUND, plugin.around_sigterm_watchdog)
    ]
    HookRegistry._hooks.clear()
    plugin.register()
    hooks = HookRegistry._hooks[plugin.CREATE_REQ_SEAM]
    assert [(t, h) for t, h, _ in hooks] == [(HookType.AFTER, plugin.after_create_generation_req)]
    assert plugin.SIGTERM_WATCHDOG_SEAM not in HookRegistry._hooks


async def test_a_sigterm_hands_over_to_sglangs_watchdog_within_a_poll() -> None:
    """The main process's watchdog sees SGLang's SIGTERM flag within one short poll (SGLang's
    own looks every 5 s) and then runs SGLang's drain-and-stop once."""

    class Manager:
        """SGLang's tokenizer manager as the watchdog sees it: the flag, and how often read."""

        def __init__(self) -> None:
            self.flag = False
            self.looks = 0

        @property
        def gracefully_exit(self) -> bool:
            self.looks += 1
            return self.flag

    manager = Manager()
    handed_over: list[bool] = []

    async def sglang_watchdog(tokenizer_manager: Manager) -> None:
        handed_over.append(tokenizer_manager.gracefully_exit)

    watchdog = asyncio.create_task(plugin.around_sigterm_watchdog(sglang_watchdog, manager))
    await wait_until(lambda: manager.looks >= 3, 60, what="the watchdog looking three times")
    assert not watchdog.done() and handed_over == []  # no SIGTERM: it keeps watching
    manager.flag = True  # what SGLang's SIGTERM handler does
    await asyncio.wait_for(watchdog, timeout=60)
    assert handed_over == [True]


def _fake_req(custom_params: Any, rid: str = "r1") -> SimpleNamespace:
    return SimpleNamespace(
        rid=rid, priority=5, sampling_params=SimpleNamespace(custom_params=custom_params)
    )


def test_hook_attaches_the_metadata_as_it_arrived() -> None:
    meta = RequestMeta(
        tier="rt",
        tenant_id="a",
        length_key="a",
        arrival_unix_s=100.0,
        ttft_target_ms=200,
        tpot_target_ms=50,
    )
    req = _fake_req(meta_to_custom_params(meta))
    plugin.after_create_generation_req(req, object(), object())  # returns None: keeps SGLang's Req
    attached = plugin.get_meta(req)
    assert isinstance(attached, RequestMeta) and attached == meta
    assert attached.ttft_due_unix_s == pytest.approx(100.2)
    assert tpot_target_s(attached) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "custom_params", [{"tandem": {"tier": "x"}}, {"tandem": 3}, "not a dict", {"tandem": None}]
)
def test_hook_survives_malformed_metadata(
    custom_params: Any, caplog: pytest.LogCaptureFixture
) -> None:
    req = _fake_req(custom_params)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.attach_meta(req)
    assert req.tandem is None
    assert "malformed metadata of request r1" in caplog.text


def test_hook_without_metadata_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    for params in (None, {}, {"someone_else": 1}):
        req = _fake_req(params)
        plugin.attach_meta(req)
        assert req.tandem is None
    assert caplog.text == ""


def test_trace_has_one_line_per_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setattr(plugin, "_trace_path", str(trace))
    meta = RequestMeta(tier="be", tenant_id="b", length_key="b", arrival_unix_s=1.0, deadline_s=9)
    plugin.attach_meta(_fake_req(meta_to_custom_params(meta), rid="ok"))
    plugin.attach_meta(_fake_req({"tandem": "bad"}, rid="bad"))
    ok, bad = (json.loads(line) for line in trace.read_text().splitlines())
    assert ok["event"] == "request" and ok["process"] == "scheduler" and ok["priority"] == 5
    assert ok["rid"] == "ok" and ok["meta"]["deadline_due_unix_s"] == 10.0 and ok["error"] is None
    assert ok["meta"]["deadline_s"] == 9 and ok["meta"]["ttft_due_unix_s"] is None
    assert ok["meta"]["sglang_priority"] == meta.sglang_priority
    assert bad["rid"] == "bad" and bad["meta"] is None and "ValidationError" in bad["error"]


def test_cpu_kv_copy_matches_the_kernel_contract(sglang: ModuleType) -> None:
    import sgl_kernel
    import torch

    if not getattr(sgl_kernel, "IS_TANDEM_CPU_STUB", False):
        pytest.skip("a real sgl_kernel is installed")
    # Two layers' K and V buffers of [slots, heads, head_dim]; rows move by slot index, and the
    # target and source sets overlap (slot 2 is both), which must behave as gather-then-scatter.
    buffers = [torch.randn(8, 2, 4) for _ in range(4)]
    expected = [b.clone() for b in buffers]
    tgt, src = torch.tensor([2, 5, 7]), torch.tensor([1, 2, 3])
    for b in expected:
        b[tgt] = b[src].clone()
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers], dtype=torch.int64)
    sgl_kernel.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt.int(), src.int())
    for got, want in zip(buffers, expected, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.some_cuda_op"):
        sgl_kernel.some_cuda_op()


def test_the_engine_api_key_reaches_sglang_but_not_its_command_line(
    sglang: ModuleType, tmp_path: Path
) -> None:
    from sglang.srt.server_args import prepare_server_args

    (tmp_path / "config.json").write_text("{}")
    key = "engine-key-5f2c"
    argv = server_argv(EngineConfig(api_key=key), tmp_path, "m", random_weights=True)
    assert not any(key in arg for arg in argv)  # `ps` shows the command line to every user
    key_file = Path(argv[argv.index("--config") + 1])
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert prepare_server_args(argv[3:]).api_key == key  # how SGLang's launcher reads it


def test_the_dp_controller_is_where_the_plugin_looks_for_it(sglang: ModuleType) -> None:
    """The plugin tells SGLang's DP controller process apart by its entry point's name on the
    stack (`plugin.in_dp_controller`): that function must exist and load the plugins."""
    import inspect

    from sglang.srt.managers import data_parallel_controller

    entry = getattr(data_parallel_controller, plugin.DP_CONTROLLER_FUNCTION)
    assert "load_plugins()" in inspect.getsource(entry)


def test_the_gateway_drops_an_idle_engine_connection_before_sglang_does() -> None:
    """A request sent on a kept-alive connection the engine has just closed fails at once (503
    "engine lost" in a live W6 run): the gateway must let idle connections go first."""
    from sglang.srt.environ import envs

    from gateway.app import ENGINE_KEEPALIVE_S

    assert envs.SGLANG_TIMEOUT_KEEP_ALIVE.get() > ENGINE_KEEPALIVE_S
