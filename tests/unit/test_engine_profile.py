"""Which latency profile `tandem serve` gives the engine (no engine started): a stored profile
of this engine's key, a named one (warned when measured elsewhere), or the bundled one with
--skip-profile; measuring is never reached in these cases."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import msgspec
import pytest

from backend.launch.identity import engine_identity
from backend.policy.latency import load_profile, save_profile
from backend.policy.profile_key import profile_key
from backend.policy.profiles import resolve_profile
from common.config import Config, ConfigError, EngineConfig, ModelConfig
from tandem import engine_profile
from tandem.engine_profile import choose_profile, needs_profile, profile_cache_dir


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 256, "num_hidden_layers": 4}))
    return path


@pytest.fixture(autouse=True)
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_args: object) -> None:
        raise AssertionError("measured a profile")

    monkeypatch.setattr(engine_profile, "measure_profile", fail)


def make_config(tmp_path: Path, **engine: object) -> Config:
    return Config(
        model=ModelConfig(cache_dir=str(tmp_path / "cache")),
        engine=EngineConfig(**engine),  # type: ignore[arg-type]
    )


def test_the_cache_is_under_the_model_cache_unless_named(tmp_path: Path) -> None:
    assert profile_cache_dir(make_config(tmp_path)) == tmp_path / "cache" / "profiles"
    named = make_config(tmp_path, profile_cache_dir=str(tmp_path / "p"))
    assert profile_cache_dir(named) == tmp_path / "p"
    assert needs_profile(make_config(tmp_path))
    for off in ({"policy": "none"}, {"patch": False}, {"launch": False}, {"kind": "sim"}):
        assert not needs_profile(make_config(tmp_path, **off))


def test_a_stored_profile_of_this_engine_is_used(tmp_path: Path, model_dir: Path) -> None:
    config = make_config(tmp_path)
    identity = engine_identity(config.engine, model_dir)
    key = profile_key(identity)
    profile = load_profile(resolve_profile("cpu-tiny"))
    profile.name, profile.key, profile.engine = f"auto-{key}", key, msgspec.to_builtins(identity)
    stored = profile_cache_dir(config) / f"{key}.json"
    stored.parent.mkdir(parents=True)
    save_profile(profile, stored)
    chosen = choose_profile(config, model_dir)
    assert (chosen.path, chosen.engine_key, chosen.matches, chosen.measured) == (
        stored,
        key,
        True,
        False,
    )


def test_a_named_profile_from_elsewhere_is_used_with_one_warning(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tmp_path, profile="cpu-tiny")
    with caplog.at_level(logging.WARNING, "tandem"):
        chosen = choose_profile(config, model_dir)
    assert chosen.name == "cpu-tiny" and not chosen.matches
    [warning] = [r.getMessage() for r in caplog.records]
    assert "latency profile 'cpu-tiny' does not match the served engine" in warning
    assert chosen.engine_key in warning and "unkeyed" in warning


def test_a_keyed_profile_of_another_engine_names_what_differs(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = engine_identity(EngineConfig(max_total_tokens=4096), model_dir)
    profile = load_profile(resolve_profile("cpu-tiny"))
    profile.key, profile.engine = profile_key(other), msgspec.to_builtins(other)
    path = tmp_path / "other.json"
    save_profile(profile, path)
    with caplog.at_level(logging.WARNING, "tandem"):
        chosen = choose_profile(make_config(tmp_path, profile=str(path)), model_dir)
    assert not chosen.matches
    assert "kv_pool_tokens: 4096 → 16384" in caplog.text


def test_skip_profile_uses_the_bundled_profile_without_measuring(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "tandem"):
        chosen = choose_profile(make_config(tmp_path, skip_profile=True), model_dir)
    assert chosen.path == resolve_profile("cpu-tiny") and not chosen.matches
    assert "does not match the served engine" in caplog.text
    # on SGLang's own prompt attention a chunk costs its prefix squared: its own stand-in
    stock = make_config(tmp_path, skip_profile=True, torch_native_extend="stock")
    assert choose_profile(stock, model_dir).path == resolve_profile("cpu-tiny-stock")


def test_bad_profile_names_are_config_errors(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine\.profile: unknown profile 'nope'"):
        choose_profile(make_config(tmp_path, profile="nope"), model_dir)
    with pytest.raises(ConfigError, match=r"engine\.profile is empty"):
        make_config(tmp_path, profile=" ")
