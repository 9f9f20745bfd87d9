"""The engine pool's configuration (issue 18): `engine.replicas`, `engine.endpoints` and
`engine.extra_args` — what each engine of the pool is, and every bad combination refused with a
message naming the key."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from backend.launch.sglang import cpu_threads_bind, engine_env, server_argv
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


def test_data_parallel_ranks_are_replicas_of_their_own(tmp_path: Path) -> None:
    config = config_from(
        tmp_path, replicas="2", port="31000", control_socket="/s", extra_args="[--dp-size, '2']"
    )
    assert config.engine.dp_size == 2
    pool = EnginePool(config.engine)
    assert [r.name for r in pool.replicas] == [
        "http://127.0.0.1:31000#dp0",
        "http://127.0.0.1:31000#dp1",
        "http://127.0.0.1:31001#dp0",
        "http://127.0.0.1:31001#dp1",
    ]
    # each rank reads its own control socket (the plugin's names), requests go to its engine
    assert [r.control_socket for r in pool.replicas] == ["/s", "/s.dp1", "/s.1", "/s.1.dp1"]
    assert [r.url for r in pool.replicas] == ["http://127.0.0.1:31000"] * 2 + [
        "http://127.0.0.1:31001"
    ] * 2
    assert [r.dp_rank for r in pool.replicas] == [0, 1, 0, 1]
    # the ranks of one engine share its health (one process group): its supervisor feeds both
    ranks = pool.of_engine(1)
    assert [r.name for r in ranks] == [pool.replicas[2].name, pool.replicas[3].name]
    assert ranks[0].health is ranks[1].health is not pool.replicas[0].health
    # without the flag, or with SGLang scheduling on its own, an engine is one replica
    assert [r.name for r in EnginePool(EngineConfig(port=31000)).replicas] == [
        "http://127.0.0.1:31000"
    ]
    stock = EngineConfig(port=31000, policy="none", extra_args=["--dp", "2"])
    assert [r.dp_rank for r in EnginePool(stock).replicas] == [None]


@pytest.mark.parametrize(
    ("args", "dp_size"),
    [
        ([], 1),
        (["--dp-size", "3"], 3),
        (["--dp=2"], 2),
        (["--data-parallel-size", "4", "--tp-size", "2"], 4),
        (["--dp", "2", "--dp-size", "3"], 3),  # the last wins, as in SGLang's argparse
    ],
)
def test_the_data_parallel_size_is_read_from_extra_args(args: list[str], dp_size: int) -> None:
    assert EngineConfig(extra_args=args).dp_size == dp_size


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ("[--dp-size, '0']", r"data-parallel size must be a positive integer, got '0'"),
        ("[--dp=two]", r"data-parallel size must be a positive integer, got 'two'"),
        ("[--dp-size]", r"engine\.extra_args: --dp-size needs a value"),
    ],
)
def test_a_bad_data_parallel_size_is_refused(tmp_path: Path, extra_args: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from(tmp_path, extra_args=extra_args)


def test_ranks_on_cpu_get_their_share_of_the_cores() -> None:
    assert cpu_threads_bind(2, [0, 1]) == "0|1"
    assert cpu_threads_bind(2, [0, 1, 2, 3, 4]) == "0,1|2,3,4"
    assert cpu_threads_bind(3, [4, 5]) == "4|5|4"  # more ranks than cores: shared
    dp = EngineConfig(extra_args=["--dp-size", "2"])
    bind = engine_env(dp, base={})["SGLANG_CPU_OMP_THREADS_BIND"]
    assert len(bind.split("|")) == 2
    tp_dp = EngineConfig(extra_args=["--dp-size", "2", "--tp", "2"])
    assert len(engine_env(tp_dp, base={})["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 4
    # the operator's own binding is kept; one rank, or a GPU, needs none
    given = {"SGLANG_CPU_OMP_THREADS_BIND": "0-7|8-15"}
    assert engine_env(dp, base=given)["SGLANG_CPU_OMP_THREADS_BIND"] == "0-7|8-15"
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in engine_env(EngineConfig(), base={})
    gpu = EngineConfig(device="cuda", extra_args=["--dp-size", "2"])
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in engine_env(gpu, base={})


def test_an_attached_engine_shows_the_ranks_whose_sockets_answer(tmp_path: Path) -> None:
    sock = tmp_path / "e.sock"
    engine = config_from(
        tmp_path, endpoints="['http://127.0.0.1:30000']", control_socket=str(sock)
    ).engine
    servers = []
    try:
        for path in (sock, Path(f"{sock}.dp1")):
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(str(path))
            server.listen()
            servers.append(server)
        assert [r.name for r in EnginePool(engine).replicas] == [
            "http://127.0.0.1:30000#dp0",
            "http://127.0.0.1:30000#dp1",
        ]
        servers.pop().close()  # rank 1's socket no longer answers: one replica
        assert [r.dp_rank for r in EnginePool(engine).replicas] == [None]
    finally:
        for server in servers:
            server.close()


def test_cpu_threads_set_the_engines_torch_threads(tmp_path: Path) -> None:
    cfg = config_from(tmp_path, cpu_threads="1")
    assert engine_env(cfg.engine, base={"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "1"
    # unset: torch's default (or whatever the operator's environment says)
    assert "OMP_NUM_THREADS" not in engine_env(EngineConfig(), base={})
    assert engine_env(EngineConfig(), base={"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"cpu_threads": "0"}, r"engine\.cpu_threads must be ≥ 1 \(or null\), got 0"),
        (
            {"cpu_threads": "2", "device": "cuda", "dtype": "bfloat16"},
            r"engine\.cpu_threads is for device cpu only \(engine\.device is 'cuda'\)",
        ),
    ],
)
def test_a_bad_thread_count_is_refused_naming_the_key(
    tmp_path: Path, engine: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from(tmp_path, **engine)
