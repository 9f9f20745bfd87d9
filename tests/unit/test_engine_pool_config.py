"""The engine pool's configuration (issue 18): `engine.replicas`, `engine.endpoints` and
`engine.extra_args` — what each engine of the pool is, and every bad combination refused with a
message naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.launch.sglang import engine_env, server_argv
from common.config import Config, ConfigError, EngineConfig, load_config, pool_engines
from gateway.engine.pool import EnginePool


def config_from(tmp_path: Path, **engine: str) -> Config:
    path = tmp_path / "config.yaml"
    path.write_text("{}\n")
    env = {f"TANDEM_ENGINE__{key.upper()}": value for key, value in engine.items()}
    return load_config(path, environ=env)


def test_one_replica_is_the_engine_itself() -> None:
    engine = EngineConfig(port=31000, control_socket=None)
    assert pool_engines(engine) == [engine]


def test_replicas_take_consecutive_ports_sockets_and_logs(tmp_path: Path) -> None:
    config = config_from(
        tmp_path, replicas="3", port="31000", log_file="/var/log/engine.log", control_socket="/s"
    )
    engines = pool_engines(config.engine)
    assert [e.port for e in engines] == [31000, 31001, 31002]
    assert [e.control_socket_path for e in engines] == ["/s", "/s.1", "/s.2"]
    assert [e.log_file for e in engines] == [
        "/var/log/engine.log",
        "/var/log/engine-1.log",
        "/var/log/engine-2.log",
    ]
    assert all(e.replicas == 1 and e.launch for e in engines)
    # each launch names its own port and its own control socket
    argvs = [server_argv(e, tmp_path, "m", random_weights=True) for e in engines]
    assert [a[a.index("--port") + 1] for a in argvs] == ["31000", "31001", "31002"]
    settings = [engine_env(e, base={})["TANDEM_ENGINE_SETTINGS"] for e in engines]
    assert len(set(settings)) == 3 and '"/s.2"' in settings[2]


def test_default_sockets_differ_per_replica(tmp_path: Path) -> None:
    engines = pool_engines(config_from(tmp_path, replicas="2", port="31000").engine)
    assert engines[0].control_socket_path != engines[1].control_socket_path
    assert engines[1].control_socket_path.endswith("tandem-engine-31001.sock")


def test_endpoints_are_the_pool_and_launch_nothing(tmp_path: Path) -> None:
    config = config_from(tmp_path, endpoints="[http://10.0.0.5:30000, 'http://127.0.0.1:30001']")
    engines = pool_engines(config.engine)
    assert [(e.host, e.port, e.launch) for e in engines] == [
        ("10.0.0.5", 30000, False),
        ("127.0.0.1", 30001, False),
    ]


def test_extra_args_pass_through_after_tandems_own(tmp_path: Path) -> None:
    config = config_from(tmp_path, extra_args="[--tp-size, '2', --dp-size=2]")
    argv = server_argv(config.engine, tmp_path, "m", random_weights=True)
    assert argv[-3:] == ["--tp-size", "2", "--dp-size=2"]


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"replicas": "0"}, r"engine\.replicas must be at least 1, got 0"),
        ({"replicas": "2", "launch": "false"}, r"engine\.replicas 2 needs engine\.launch true"),
        ({"extra_args": "[--port, '9']"}, r"--port is set by tandem from engine\.port"),
        ({"extra_args": "[--model-path=/m]"}, r"--model-path is set by tandem from model\.path"),
        ({"endpoints": "[localhost:30000]"}, r"engine\.endpoints: 'localhost:30000' is not"),
        ({"endpoints": "['http://h:1/v1']"}, r"must be a base URL"),
        ({"endpoints": "['http://h:1', 'http://h:1']"}, r"lists an engine twice"),
        (
            {"endpoints": "['http://h:1', 'http://h:2']", "replicas": "3"},
            r"engine\.replicas is 3 but engine\.endpoints lists 2 engines",
        ),
        ({"replicas": "3", "port": "65534"}, r"goes past port 65535"),
    ],
)
def test_bad_pools_are_refused_naming_the_key(
    tmp_path: Path, engine: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from(tmp_path, **engine)


def test_as_many_replicas_as_endpoints_is_accepted(tmp_path: Path) -> None:
    config = config_from(
        tmp_path, endpoints="['http://h:1', 'http://h:2']", replicas="2", launch="false"
    )
    assert len(pool_engines(config.engine)) == 2


def test_the_gateway_says_which_attached_engines_it_sees_the_state_of(tmp_path: Path) -> None:
    engine = config_from(
        tmp_path,
        endpoints="['http://127.0.0.1:30000', 'http://10.0.0.5:30000', 'http://127.0.0.1:30002']",
        control_socket=str(tmp_path / "engine.sock"),  # engine i's: engine.sock.i (i >= 1)
    ).engine
    (tmp_path / "engine.sock").touch()  # the first engine's control socket exists
    lines = EnginePool(engine).describe_attachments()
    assert "live state watched" in lines[0]  # local, socket present
    assert "request metadata only" in lines[1]  # another host: no Unix socket reaches it
    assert "request metadata only" in lines[2]  # local, but no socket (stock SGLang)
    assert EnginePool(EngineConfig()).describe_attachments() == []  # launched: nothing to say
