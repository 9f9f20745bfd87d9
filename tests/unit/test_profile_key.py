"""The profile key: the same engine always gets the same key, any change that alters speed gets
another, and a profile measured elsewhere says what differs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
import pytest

from backend.launch.identity import engine_identity, model_speed_config
from backend.policy.latency import load_profile
from backend.policy.profile_key import EngineIdentity, identity_differences, profile_key
from backend.policy.profiles import resolve_profile
from common.config import EngineConfig

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
    "torch_dtype": "float32",
}


def make_identity(**overrides: object) -> EngineIdentity:
    fields: dict[str, object] = {
        "model": dict(TINY),
        "dtype": "float32",
        "device": "cpu",
        "device_name": "AMD EPYC",
        "device_count": 2,
        "kv_pool_tokens": 16384,
        "chunked_prefill_tokens": 512,
        "attention_backend": "torch_native",
        "sglang_version": "0.5.23",
    }
    fields.update(overrides)
    return EngineIdentity(**fields)  # type: ignore[arg-type]


def test_the_same_facts_give_the_same_key() -> None:
    key = profile_key(make_identity())
    assert key == profile_key(make_identity())
    assert len(key) == 16 and int(key, 16) >= 0
    # the model's keys in another order are the same model
    reordered = make_identity(model=dict(reversed(list(TINY.items()))))
    assert profile_key(reordered) == key


@pytest.mark.parametrize(
    "change",
    [
        {"model": {**TINY, "num_hidden_layers": 8}},
        {"model": {**TINY, "hidden_size": 512}},
        {"model": {**TINY, "vocab_size": 32000}},
        {"model": {**TINY, "quantization_config": {"quant_method": "fp8"}}},
        {"dtype": "bfloat16"},
        {"device": "cuda"},
        {"device_name": "NVIDIA H100 80GB HBM3"},
        {"device_count": 4},
        {"tensor_parallel": 2},
        {"pipeline_parallel": 2},
        {"kv_pool_tokens": 8192},
        {"chunked_prefill_tokens": 256},
        {"attention_backend": "flashinfer"},
        {"kv_layout": "bicache"},
        {"sglang_version": "0.5.24"},
        {"extra_args": ["--enable-torch-compile"]},
        {"cpu_threads": 1},
    ],
)
def test_any_speed_relevant_change_changes_the_key(change: dict[str, object]) -> None:
    assert profile_key(make_identity(**change)) != profile_key(make_identity())


def test_differences_name_each_changed_fact() -> None:
    before = msgspec.to_builtins(make_identity())
    after = msgspec.to_builtins(
        make_identity(kv_pool_tokens=8192, model={**TINY, "hidden_size": 1})
    )
    assert identity_differences(before, after) == [
        "kv_pool_tokens: 16384 → 8192",
        "model.hidden_size: 256 → 1",
    ]
    assert identity_differences(before, before) == []


def test_the_identity_of_a_configured_engine(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "_name_or_path": "x"}))
    assert model_speed_config(tmp_path) == TINY  # names and paths are not speed
    cfg = EngineConfig(extra_args=["--tp-size", "2", "--attention-backend=triton"])
    identity = engine_identity(cfg, tmp_path)
    assert identity.tensor_parallel == 2 and identity.attention_backend == "triton"
    assert identity.kv_pool_tokens == cfg.max_total_tokens
    assert identity == engine_identity(cfg, tmp_path)
    other = engine_identity(EngineConfig(max_total_tokens=4096), tmp_path)
    assert profile_key(other) != profile_key(identity)
    # tandem's prompt attention on the CPU engine runs at another speed than SGLang's own
    assert engine_identity(EngineConfig(), tmp_path).attention_backend == "torch_native+new-rows"
    stock = engine_identity(EngineConfig(torch_native_extend="stock"), tmp_path)
    assert stock.attention_backend == "torch_native"
    one_thread = engine_identity(EngineConfig(cpu_threads=1), tmp_path)
    assert one_thread.cpu_threads == 1
    assert engine_identity(EngineConfig(), tmp_path).cpu_threads is None
    with pytest.raises(ValueError, match="--tp-size must be a positive integer"):
        engine_identity(EngineConfig(extra_args=["--tp-size", "two"]), tmp_path)
    with pytest.raises(ValueError, match="cannot read the model config"):
        engine_identity(cfg, tmp_path / "missing")


def test_bundled_profiles_are_unkeyed() -> None:
    """Profiles from before keys load, and match no engine."""
    profile = load_profile(resolve_profile("cpu-tiny"))
    assert profile.key is None and profile.engine is None


def test_a_default_thread_count_keeps_the_keys_measured_before_it_existed() -> None:
    # engine.cpu_threads came after the first profiles were stored: an engine that leaves it
    # unset keeps its key (the profile measured for it is still found), one that sets it
    # gets its own (its speed differs)
    identity = make_identity()
    fields = msgspec.to_builtins(identity)
    del fields["cpu_threads"]
    canonical = json.dumps(
        {"v": 1, **fields}, sort_keys=True, separators=(",", ":"), ensure_ascii=True
    )
    assert profile_key(identity) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert profile_key(make_identity(cpu_threads=2)) != profile_key(make_identity(cpu_threads=1))
