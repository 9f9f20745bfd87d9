"""Config loading: defaults, environment overrides, clear errors naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from common.config import (
    DEFAULT_CONFIG_PATH,
    ENGINE_SETTINGS_ENV,
    ConfigError,
    EngineSettings,
    admin_token,
    engine_settings_from_env,
    load_config,
    new_engine_api_key,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_repository_config_loads_with_documented_defaults() -> None:
    config = load_config(environ={})
    assert config.gateway.port == 8000
    assert config.database.url.startswith("sqlite+aiosqlite:///")
    assert config.engine.kind == "sglang" and config.engine.device == "cpu"
    assert config.model.path is None


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///tandem.db", "sqlite:///{dir}/tandem.db"),
        (
            "sqlite+aiosqlite:///data/t.db?timeout=5",
            "sqlite+aiosqlite:///{dir}/data/t.db?timeout=5",
        ),
        ("sqlite+aiosqlite:////var/lib/tandem/t.db", "sqlite+aiosqlite:////var/lib/tandem/t.db"),
        ("sqlite://", "sqlite://"),
        ("postgresql+asyncpg://u@db/tandem", "postgresql+asyncpg://u@db/tandem"),
    ],
)
def test_a_relative_sqlite_path_is_relative_to_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, expected: str
) -> None:
    # issue 17: resolved against the working directory, `tandem admin` and `tandem db upgrade`
    # run elsewhere made a second, empty database there
    folder = tmp_path / "etc"
    folder.mkdir()
    path = write(folder, f"database:\n  url: {url}\n")
    monkeypatch.chdir(tmp_path)
    want = expected.format(dir=folder.resolve().as_posix())
    assert load_config(path, environ={}).database.url == want
    # an override in the environment is a value of the same config
    assert (
        load_config(write(folder, ""), environ={"TANDEM_DATABASE__URL": url}).database.url == want
    )


def test_the_default_database_lies_beside_the_default_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = load_config(environ={}).database.url
    assert url == f"sqlite+aiosqlite:///{DEFAULT_CONFIG_PATH.parent.as_posix()}/tandem.db"


def test_env_overrides_keep_yaml_types(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway:\n  port: 8000\n")
    config = load_config(
        path,
        environ={
            "TANDEM_GATEWAY__PORT": "8080",
            "TANDEM_ENGINE__LAUNCH": "false",
            "TANDEM_DATABASE__URL": "postgresql://u@h/db",
            "TANDEM_MODEL__PATH": "null",
        },
    )
    assert config.gateway.port == 8080
    assert config.engine.launch is False
    assert config.database.url == "postgresql://u@h/db"
    assert config.model.path is None


def test_env_override_of_a_text_field_is_taken_as_written(tmp_path: Path) -> None:
    """A name or path that YAML would read as a mapping (a trailing ':') or a comment ('#')
    stays the text the operator wrote."""
    config = load_config(
        write(tmp_path, ""),
        environ={"TANDEM_MODEL__NAME": "team:", "TANDEM_MODEL__PATH": "/models/a#1"},
    )
    assert config.model.name == "team:"
    assert config.model.path == "/models/a#1"


def test_a_policy_option_that_can_be_off_is_null_in_the_yaml(tmp_path: Path) -> None:
    # tandem's rt_stretch is None to bound BE by the contracts alone (TandemConfig): an operator
    # turns the shipped 0.3 off by writing null, as the bench's `tandem:rt_stretch=null` does
    config = load_config(
        write(tmp_path, "engine:\n  policy_options:\n    rt_stretch: null\n"), environ={}
    )
    assert config.engine.policy_options == {"rt_stretch": None}


def test_wrong_type_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"gateway\.port"):
        load_config(write(tmp_path, "gateway:\n  port: eighty\n"), environ={})


def test_env_wrong_type_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine\.max_total_tokens"):
        load_config(write(tmp_path, ""), environ={"TANDEM_ENGINE__MAX_TOTAL_TOKENS": "lots"})


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="prot"):
        load_config(write(tmp_path, "gateway:\n  prot: 1\n"), environ={})


def test_unknown_env_section_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TANDEM_GATEWAYY__PORT"):
        load_config(write(tmp_path, ""), environ={"TANDEM_GATEWAYY__PORT": "1"})


def test_non_positive_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine\.max_total_tokens must be positive"):
        load_config(write(tmp_path, "engine:\n  max_total_tokens: 0\n"), environ={})


def test_unsupported_database_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"database\.url"):
        load_config(write(tmp_path, "database:\n  url: mysql://x/y\n"), environ={})


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "gateway: [\n"), environ={})


def test_admin_token_is_required() -> None:
    with pytest.raises(ConfigError, match="TANDEM_ADMIN_TOKEN"):
        admin_token({})
    assert admin_token({"TANDEM_ADMIN_TOKEN": "s3cret-token"}) == "s3cret-token"


def test_engine_settings_travel_as_one_json_variable() -> None:
    settings = EngineSettings(
        policy="tandem",
        profile_path="/p.json",
        policy_options={"latency_budget_s": 0.2, "n": 3, "on": True, "mode": "x", "off": None},
        control_socket="/tmp/c.sock",
        kv_layout="bicache",
        scheduler_trace="/tmp/trace.jsonl",
    )
    env = {ENGINE_SETTINGS_ENV: msgspec.json.encode(settings).decode()}
    decoded = engine_settings_from_env(env)
    assert decoded == settings
    assert [type(v) for v in decoded.policy_options.values()] == [
        float,
        int,
        bool,
        str,
        type(None),
    ]
    # unset or empty: an engine started by hand, metadata only
    assert (
        engine_settings_from_env({})
        == EngineSettings()
        == engine_settings_from_env({ENGINE_SETTINGS_ENV: " "})
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{nope", "TANDEM_ENGINE_SETTINGS is not a JSON object"),
        ('{"policy": "tandem"}', "policy 'tandem' needs profile_path"),
        ('{"policy": "none", "profile_path": "/p"}', "policy 'none' names no policy"),
        ('{"control_socket": "/s"}', "control_socket needs a policy"),
        ('{"kv_layout": "paged"}', "kv_layout: Invalid enum value 'paged'"),
        ('{"policy_options": {"a": [1]}}', "policy_options"),
        ('{"polcy": "tandem"}', "unknown field `polcy`"),
    ],
)
def test_bad_engine_settings_name_the_problem(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        engine_settings_from_env({ENGINE_SETTINGS_ENV: value})


def test_engine_settings_are_no_config_override(tmp_path: Path) -> None:
    # TANDEM_ENGINE_SETTINGS has no "__": load_config never takes it for a section key
    load_config(write(tmp_path, ""), environ={ENGINE_SETTINGS_ENV: '{"policy": 3}'})


@pytest.mark.parametrize(
    "key",
    [
        "restart_backoff_s",
        "restart_backoff_max_s",
        "health_probe_interval_s",
        "health_probe_timeout_s",
        "health_probe_failures",
    ],
)
def test_engine_supervision_settings_must_be_positive(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"engine\.{key} must be positive"):
        load_config(write(tmp_path, f"engine:\n  {key}: 0\n"), environ={})


def test_an_engine_api_key_sglang_would_read_as_a_flag_is_refused() -> None:
    for bad in ("-starts-like-a-flag", "", "   "):
        with pytest.raises(ConfigError, match=r"engine\.api_key"):
            load_config(environ={"TANDEM_ENGINE__API_KEY": bad})
    assert load_config(environ={"TANDEM_ENGINE__API_KEY": "s3cret-key"}).engine.api_key


def test_generated_engine_api_keys_never_start_with_a_dash() -> None:
    # a generated key starting with "-" stopped SGLang from starting (1 in 64 of url-safe ones)
    keys = {new_engine_api_key() for _ in range(2000)}
    assert len(keys) == 2000
    assert not any(key.startswith("-") for key in keys)
    for key in list(keys)[:20]:
        assert load_config(environ={"TANDEM_ENGINE__API_KEY": key}).engine.api_key == key
