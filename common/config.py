"""Configuration: frozen msgspec Structs, loaded once from config.yaml plus environment overrides.

Every key can be overridden by an environment variable ``TANDEM_<SECTION>__<KEY>`` (for example
``TANDEM_GATEWAY__PORT=8080``); its value is parsed as a YAML scalar, so numbers, booleans and
``null`` keep their types. Bad values raise :class:`ConfigError` with a one-line message naming
the key.

The server's and the engine's environment variables are read here and nowhere else (the
launcher only passes its own environment on to the engine; the ``tandem batch`` and ``tandem
admin`` clients read the gateway's URL, ``TANDEM_URL``, and the batch client its API key
themselves). There are three readers:

* :func:`load_config`: the ``TANDEM_<SECTION>__<KEY>`` overrides;
* :func:`admin_token`: ``TANDEM_ADMIN_TOKEN``;
* :func:`engine_settings_from_env`: ``TANDEM_ENGINE_SETTINGS``, the patched engine's settings
  (:class:`EngineSettings`, one JSON object). The launcher (``backend.launch.sglang``) derives
  them from ``engine.*`` and encodes them; SGLang's scheduler process, where tandem's plugin
  runs, decodes them with this function.

Facts found at run time (the model's context length, the engine's KV capacity) live elsewhere and
are never written back into the config.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
import msgspec.inspect
import yaml

from common.slowdown import Slowdown, check_slowdown, parse_slowdown

ENV_PREFIX = "TANDEM_"
ADMIN_TOKEN_ENV = "TANDEM_ADMIN_TOKEN"
ENGINE_SETTINGS_ENV = "TANDEM_ENGINE_SETTINGS"
"""The patched engine's :class:`EngineSettings`, JSON-encoded (no ``__``: never a config
override)."""
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.yaml"


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the key."""


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class GatewayConfig(_Section, frozen=True):
    """The HTTP gateway."""

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = 8000
    """TCP port of the OpenAI-compatible and admin API."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted request body, bytes; a larger one is answered 413."""
    auth_cache_ttl_s: float = 5.0
    """How long a key→tenant lookup is cached, seconds. A change made through the admin API
    (revocation, tenant, contract, quota) applies at once in this process and, on PostgreSQL, in
    every other gateway process on the database (LISTEN/NOTIFY, gateway/auth_sync.py); this is
    the bound for a change they missed (their listener's connection was down)."""
    engine_retry_after_s: int = 5
    """`Retry-After` sent with a 503 when the engine is unreachable, seconds."""
    default_max_tokens: int = 1024
    """Output cap of a request that sets no max_tokens, tokens (never beyond the context)."""
    router: Literal["slo", "round-robin", "least-load", "prefix"] = "slo"
    """How the place stage picks among several engines (backend/policy/placement.py): "slo"
    sends RT to the engine with the most predicted slack against the request's contract and the
    rest to the most leftover capacity, prompts sharing a prefix only one engine holds kept
    together (a conversation's turns; not a system prompt every engine holds); "round-robin";
    "least-load" (fewest running + waiting tokens); "prefix" (longest cached-prefix match,
    least load when the engines are imbalanced). With one engine the choice is forced."""
    max_inflight_rt: int = 128
    """Interactive RT requests in flight on one engine at once (sent, not finished), requests:
    the RT queue's bound. One more is refused at once with 429 `tier_queue_full` and
    Retry-After instead of queueing without end (gateway/pipeline/tier_queue.py). Larger than
    the BE bound (BE is shed first); the default is twice the bundled engine's request slots
    (engine.max_running_requests 64)."""
    max_inflight_be: int = 64
    """Interactive BE requests in flight on one engine at once, requests: the BE queue's bound
    (429 `tier_queue_full` beyond it). Batch-API lines are bounded by batch.max_inflight
    instead. The default is the bundled engine's request slots: a full set queued behind the
    running ones."""
    slo_recheck_frac: float = 0.25
    """How long an RT request the SLO admission would refuse (or downgrade) only because every
    request slot is held by RT requests may wait at the gateway for the engine's next reports,
    as a share of its TTFT target counted from its arrival: it is judged again on each report
    (the slots free one at a time, at instants the forecast can only average), and admitted as
    soon as its forecast meets the contract; the contract's answer applies when the time is
    up. A forecast over its target for the prompt work queued ahead is answered at once. 0:
    judged once, on arrival. Below 1."""

    # -- the gateway's own protection (gateway/overload.py, gateway/server.py) ----------------
    max_requests_in_flight: int = 512
    """Requests inside this gateway process at once (accepted and not yet answered, streams
    until their last event; every route but the health probes `/healthz`, `/health`, `/readyz`
    and `/metrics`), requests. One more is answered at once, before authentication or reading
    its body, with 503 `server_overloaded` and Retry-After: the gateway-wide bound in front of
    the per-tier queues (`max_inflight_rt` + `max_inflight_be`, which it should exceed), so
    that a flood waits nowhere unbounded."""
    max_queue_wait_s: float = 1.0
    """Longest a request may have waited in the kernel before the gateway reads it (its bytes
    on the connection's socket, or the connection in the listen queue), seconds. An older one is
    answered at once with 503 `server_overloaded` and Retry-After: the gateway is behind its
    clients, and serving it would only make every request behind it later. What is served
    counts its TTFT and SLO time from when its bytes reached the host. Measured on Linux
    (`TCP_INFO`); elsewhere not applied."""
    overload_retry_after_s: int = 1
    """`Retry-After` of a 503 `server_overloaded` (or of a connection refused beyond
    `max_connections`), seconds."""
    max_connections: int = 4096
    """Client connections open at once, connections (idle keep-alive ones included). A
    connection beyond it is answered 503 and closed at once, without reading it, while the open
    ones go on. Lowered to what the process's open-file limit allows, with a warning."""
    idle_timeout_s: float = 15.0
    """How long a client connection may go without a request, seconds: from its opening until
    a request's head has fully arrived, and between two requests of a keep-alive connection.
    Then it is closed (a half-open or trickling connection holds nothing for long)."""
    shutdown_timeout_s: float = 60.0
    """How long a stopping gateway (SIGINT or SIGTERM) lets the requests and batch lines in
    flight finish, seconds. It stops listening at once, refuses new requests on open connections
    (503 `gateway_shutting_down`; /readyz 503) and starts no batch line; what is still in flight
    after this time, or at a second signal, is ended: a stream with an error event and
    `[DONE]`, any other request with the 503, its engine request aborted; a batch line runs
    again after the restart (gateway/shutdown.py). Keep it under what your process manager
    waits before it kills (systemd's TimeoutStopSec: 90 s by default; Kubernetes'
    terminationGracePeriodSeconds: 30 s). 0: end them at once."""
    body_read_timeout_s: float = 120.0
    """How long a request's body may take to arrive in full, seconds from the start of its
    handling; a slower one is answered 408 `request_timeout` and its connection closed."""
    loop_watch_interval_s: float = 0.05
    """How often a thread checks that the event loop answers (`tandem_event_loop_lag_seconds`:
    how late a callback scheduled then ran), seconds."""
    loop_stall_ms: float = 50.0
    """A check later than this is a stall: the loop thread's stack is sampled while held,
    counted in `tandem_event_loop_stalls` by where it was, and logged (one line per 30 s at
    most, with the count since the last), ms; 0 turns the sampling off."""
    # -------------------------------------------------------------------------------------------


class DatabaseConfig(_Section, frozen=True):
    """The SQL store (SQLAlchemy URL; sqlite+aiosqlite or postgresql+asyncpg)."""

    url: str = "sqlite+aiosqlite:///tandem.db"
    """Database URL. A relative SQLite path is relative to the folder of the config file (the
    repository's config.yaml by default), never the working directory: every command reading
    one config finds one database. Plain `sqlite://` and `postgresql://` URLs are given their
    async driver."""
    echo: bool = False
    """Log every SQL statement (debugging)."""


class ModelConfig(_Section, frozen=True):
    """The model served by the engine."""

    name: str = "tandem-tiny"
    """Model id clients pass as `model` and that /v1/models lists."""
    path: str | None = None
    """Local Hugging Face model directory (config.json + tokenizer). None: the built-in tiny model,
    created on first start under `cache_dir`."""
    cache_dir: str = "~/.cache/tandem"
    """Where the built-in tiny model is created, bytes on disk: about 1 MB."""
    random_weights: bool = False
    """Serve `path` with random weights (SGLang's `--load-format dummy`): for a directory that
    holds a model's config and tokenizer but no weight files (load tests, capacity planning).
    False: a `path` without weight files is refused at start, naming it. The built-in tiny model
    (`path` null) always runs with random weights: it has none."""

    @property
    def uses_random_weights(self) -> bool:
        """Whether the engine serves random weights (the built-in model, or `random_weights`)."""
        return self.path is None or self.random_weights


class EngineConfig(_Section, frozen=True):
    """The inference engine behind the gateway."""

    kind: Literal["sglang", "sim"] = "sglang"
    """Engine implementation: the patched SGLang server, or tandem's simulator (same HTTP
    surface, iteration times from a latency profile; for capacity planning and demos)."""
    host: str = "127.0.0.1"
    """Address the engine listens on (loopback: only this host can reach it, and even there only
    with `api_key`)."""
    port: int = 30000
    """Port of the engine's HTTP server."""
    api_key: str | None = None
    """Shared secret the engine requires on its HTTP API (SGLang's `--api-key`, handed over in a
    private file, never on its command line) and the gateway sends as `Authorization: Bearer`,
    so that nothing on the host bypasses the gateway's keys, quotas and usage records (the
    engine's `/health`, `/ready` and `/metrics` stay open). None: `tandem serve` generates a new
    one each time it launches the engine. Set it (better: `TANDEM_ENGINE__API_KEY`) for an
    engine started elsewhere (`launch: false`) with the same key."""
    launch: bool = True
    """Start the engine as a child process of `tandem serve`; False: connect to a running one
    (at `host`:`port`, or the `endpoints`)."""
    replicas: int = 1
    """Engines `tandem serve` launches on this host, engines: replica i listens on `port` + i
    (consecutive ports), runs in its own process group with its own control socket
    (`control_socket` + ".i" for i ≥ 1 when one is set) and log (`log_file` with "-i" before
    its suffix for i ≥ 1), and is supervised and restarted on its own. The gateway places each
    request on one of the replicas that serve (gateway/engine/pool.py). With `launch` false it
    must be 1, or the number of `endpoints`."""
    endpoints: list[str] = msgspec.field(default_factory=list)
    """Base URLs (``http://host:port``) of engines started elsewhere that the gateway attaches
    to instead of launching any: with endpoints, `tandem serve` launches nothing (it says so at
    start) and the pool is exactly these engines. Each should run tandem's plugin; an engine on
    this host whose control socket (tandem-engine-<port>.sock, or `control_socket` + ".i")
    answers reports its live state, any other (another host, or stock SGLang) is used with
    tandem's request metadata only, which the gateway logs at start."""
    patch: bool = True
    """Load tandem's SGLang plugin (RT/BE metadata, co-location seams); False: stock SGLang."""
    policy: str = "tandem"
    """Policy that schedules the patched engine (a name of backend.policy.registry); "none":
    SGLang's own scheduling, with tandem's metadata only. Ignored when `patch` is False."""
    profile: str = "auto"
    """Latency profile the in-engine policy plans with: "auto" (the profile measured for this
    very engine, found under `profile_cache_dir` by its key; `tandem serve` measures and stores
    it when there is none), a name in backend/policy/profiles/, or a .json path. A named profile
    measured on a different engine is used, with a warning naming both."""
    skip_profile: bool = False
    """With profile "auto": never measure; use the stored profile of this engine if there is
    one, else the bundled profile of the device (with a warning that it does not match)."""
    profile_cache_dir: str | None = None
    """Where measured profiles are stored, one <key>.json per engine (a directory); None:
    `profiles/` under `model.cache_dir`."""
    policy_options: dict[str, float | int | bool | str | None] = msgspec.field(default_factory=dict)
    """Options for the policy's constructor (e.g. latency_budget_s for tandem)."""
    control_socket: str | None = None
    """Unix socket of the patched engine's control endpoint (length-history pushes,
    statistics); None: tandem-engine-<port>.sock in the system's temporary directory."""

    @property
    def policy_in_charge(self) -> bool:
        """True when tandem's policy schedules the engine (patch on and a policy named)."""
        return self.kind == "sglang" and self.patch and self.policy not in ("", "none")

    @property
    def dp_size(self) -> int:
        """SGLang data-parallel ranks of each engine launched with these settings
        (`--dp-size N`, `--dp N` or `--data-parallel-size N` in `extra_args`), ranks: each rank
        schedules its own requests and serves its own control socket (`control_socket_of_rank`),
        and the gateway places on each rank as on a replica of its own. 1 without the flag."""
        return _dp_size_of(self.extra_args)

    def control_socket_of_rank(self, dp_rank: int) -> str:
        """The control socket DP rank *dp_rank* of this engine serves: `control_socket_path`
        for rank 0, that path + ".dp<k>" for rank k (backend/sglang_ext/plugin.py)."""
        path = self.control_socket_path
        return path if dp_rank == 0 else f"{path}.dp{dp_rank}"

    @property
    def auth_headers(self) -> dict[str, str]:
        """The headers that authenticate a request to the engine's HTTP API (none without
        `api_key`)."""
        return {} if not self.api_key else {"Authorization": f"Bearer {self.api_key}"}

    @property
    def control_socket_path(self) -> str:
        """The Unix socket of the engine's control endpoint."""
        if self.control_socket:
            return self.control_socket
        import tempfile

        return f"{tempfile.gettempdir()}/tandem-engine-{self.port}.sock"

    device: str = "cpu"
    """Torch device of the engine ("cpu" or "cuda")."""
    dtype: str = "float32"
    """Model dtype passed to SGLang (float32 on CPU; bfloat16 on GPUs)."""
    cpu_threads: int | None = None
    """On CPU: torch threads per engine process (its ``OMP_NUM_THREADS``). None: torch's
    default, one per core. On a small host shared with other work, 1 keeps the engine at about
    its own pace: with one thread per core, a process busy on one core stalls every iteration
    (the threads wait for each other at each operator; a neighbour spinning on one of two
    cores made the tiny model's iterations 7-40× slower, and with one thread about 1.2×). Only for
    device "cpu"."""
    max_total_tokens: int = 16384
    """Size of the KV pool, tokens."""
    max_running_requests: int = 64
    """Largest decode batch, requests."""
    chunked_prefill_size: int = 512
    """Largest prefill chunk per iteration, tokens."""
    context_length: int | None = None
    """Override of the model's context length, tokens (None: from the model config)."""
    enable_priority_scheduling: bool = False
    """Stock SGLang priority scheduling (a baseline; the tandem policy does not need it)."""
    kv_layout: Literal["token", "bicache"] = "token"
    """How the patched engine lays out KV slots: "token" (SGLang's own free list) or "bicache"
    (BROS's bidirectional blocks: RT fills 16-slot blocks from the left, BE from the right, and
    RT may take over the slots of a parked BE request after copying them to host memory; needs
    max_total_tokens a multiple of 16 and runs without the radix cache). Off by default: on this
    engine it does not pay (bench/results/W1-bicache/README.md)."""
    torch_native_extend: Literal["new-rows", "stock"] = "new-rows"
    """How SGLang's torch_native attention backend (the CPU engine's) computes a prompt chunk:
    "new-rows" computes the chunk's own rows over its cached prefix, as GPU kernels do
    (tandem's kernel, ``backend/sglang_ext/cpu_attention.py``, loaded as its own SGLang plugin,
    also with `patch` off: it is part of the engine, not of its scheduling); "stock" runs
    SGLang's own, which computes the whole sequence for every chunk — a 16-token chunk after
    8K cached tokens costs as much as 8K² of attention, and so does each decode that rides in
    an iteration with a prompt. Other attention backends (every GPU one) compute new rows
    only already and are not touched."""
    slowdown: str | None = None
    """Stretch every forward pass of each launched SGLang engine to K times its own time: "K"
    from the start, or a schedule "K1@T1,K2@T2,…" (K× from second T on; every factor ≥ 1). For
    benchmarks and drills: an engine slower than the profile its policy plans with, as on a
    busier host or a slower GPU, reproducibly and for every scheduling policy alike (its own
    SGLang plugin, ``backend/sglang_ext/pace.py``, loaded with `patch` on or off; the engine
    sleeps after each forward pass, so it takes no CPU from anything else). None: the engine's
    own pace."""
    slowdown_start_file: str | None = None
    """With `slowdown`: second 0 of its schedule is the moment this file appears (until then the
    engine runs at its own pace; `tandem bench --engine sglang --engine-slowdown` writes it as
    its replay starts, so λ* and the serving overhead are measured at the engine's own pace);
    None: the engine's start."""
    extra_args: list[str] = msgspec.field(default_factory=list)
    """Further command-line flags for each `sglang.launch_server` (e.g. ``["--tp-size", "2"]``
    or ``["--dp-size", "2"]``: SGLang's own tensor and data parallelism, passed through as
    given; with `--dp-size N` the gateway places on each DP rank as on a replica, `dp_size`).
    Flags tandem sets itself from a config key (`--port`, `--host`, `--model-path`,
    `--served-model-name`, `--device`, `--dtype`, `--max-total-tokens`,
    `--max-running-requests`, `--chunked-prefill-size`, `--context-length`) are refused: set the
    key instead."""
    startup_timeout_s: float = 300.0
    """How long `tandem serve` waits for the engine to become healthy, seconds."""
    request_timeout_s: float = 600.0
    """Upper bound on one engine request, seconds."""
    supervise: bool = True
    """With `launch`: `tandem serve` restarts the engine when it dies (its process exits, one
    of its scheduler processes dies — with tandem's policy in charge, its control socket then
    refuses connections —, or its health probe fails `health_probe_failures` times in a row),
    after a back-off; False:
    a dead engine stays dead (every request gets 503) until `tandem serve` is restarted."""
    restart_backoff_s: float = 1.0
    """Wait before restarting an engine that died, seconds; doubled after each death that
    follows the previous restart within `restart_stable_s`, up to `restart_backoff_max_s`."""
    restart_backoff_max_s: float = 60.0
    """Longest wait before a restart, seconds: an engine that keeps dying is restarted at most
    this often, for ever (nothing gives up on it)."""
    restart_stable_s: float = 120.0
    """An engine that has served this long since its last restart, seconds, starts the back-off
    over at `restart_backoff_s` when it dies."""
    health_probe_interval_s: float = 5.0
    """Time between two health probes (`GET /health`) of the engine, seconds: how stale the
    gateway's view of a live engine may be (`/readyz` answers from it, without a round trip).
    A process that exits is noticed at once, without waiting for a probe."""
    health_probe_timeout_s: float = 30.0
    """How long one health probe may take, seconds (SGLang's own /health gives up on a silent
    scheduler after 20 s and answers 503)."""
    health_probe_failures: int = 3
    """Failed health probes in a row after which a supervised engine that is still running is
    taken for hung: it is killed and restarted. Any failed probe makes `/readyz` answer 503
    until one succeeds."""
    log_file: str | None = None
    """Where the engine's output goes (None: inherited stdout/stderr)."""
    sim_profile: str = "h100-llama8b-analytic"
    """kind sim: latency profile, a name in bench/profiler/ or a file path."""
    sim_policy: str = "fcfs"
    """kind sim: scheduling policy (a name of backend.policy.registry)."""
    sim_kv_tokens: int | None = None
    """kind sim: KV pool size, tokens (None: the profile's capacity)."""


class EngineSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """tandem's settings inside the patched engine (SGLang's scheduler process, where the plugin
    runs): what the launcher derives from ``engine.*``, handed over as one JSON object in
    ``TANDEM_ENGINE_SETTINGS`` and read back by :func:`engine_settings_from_env`.

    The defaults are an engine started by hand with ``SGLANG_PLUGINS=tandem`` and nothing else:
    SGLang schedules, tandem only attaches request metadata."""

    policy: str | None = None
    """Policy that schedules the engine, a name of ``backend.policy.registry`` (the launcher
    checks it); None: SGLang's own scheduling, with tandem's request metadata only."""
    profile_path: str | None = None
    """Latency profile the policy's latency model is fitted from, a JSON file path (the launcher
    resolves `engine.profile` to it); required with `policy`."""
    policy_options: dict[str, float | int | bool | str | None] = msgspec.field(default_factory=dict)
    """Keyword options for the policy's constructor, each in the unit its name says (e.g.
    `latency_budget_s`, seconds)."""
    control_socket: str | None = None
    """Unix socket path of the engine's control endpoint (length-history pushes, statistics);
    None: no control endpoint. Served only with a `policy` (the endpoint talks to it)."""
    engine_key: str | None = None
    """Profile key of this engine as launched (``backend.policy.profile_key``); the engine
    compares it with its profile's key and reports ``profile_matches`` in its statistics. None:
    not known (an engine launched outside `tandem serve`)."""
    kv_layout: Literal["token", "bicache"] = "token"
    """KV slot layout, a name: "token" (SGLang's own free list) or "bicache" (see
    `EngineConfig.kv_layout`; the launcher also turns the radix cache off for it)."""
    slowdown: Slowdown = ()
    """How many times its own time each forward pass takes, from which second on (`EngineConfig
    .slowdown` parsed); () = the engine's own pace. Read by ``backend.sglang_ext.pace``."""
    slowdown_start_file: str | None = None
    """`EngineConfig.slowdown_start_file`: second 0 of `slowdown` is when it appears."""
    scheduler_trace: str | None = None
    """Debug trace file path: the scheduler appends one JSON line per request it creates (the
    metadata as it arrived); None: no trace. Tests set it; `engine.*` has no key for it."""

    def __post_init__(self) -> None:
        if self.policy is not None:
            if self.policy.strip() in ("", "none"):
                raise ValueError(
                    f"policy {self.policy!r} names no policy; leave it out (null) for "
                    "SGLang's own scheduling"
                )
            if not self.profile_path:
                raise ValueError(f"policy {self.policy!r} needs profile_path (a latency profile)")
        if self.control_socket is not None and self.policy is None:
            raise ValueError("control_socket needs a policy (the endpoint serves the policy's)")
        check_slowdown(self.slowdown)
        if any(factor < 1.0 for _, factor in self.slowdown):
            raise ValueError(f"slowdown {self.slowdown}: every factor must be ≥ 1")
        if self.slowdown_start_file is not None and not self.slowdown:
            raise ValueError("slowdown_start_file needs a slowdown")


class UsageConfig(_Section, frozen=True):
    """Usage records and output-length history (written off the hot path)."""

    flush_interval_s: float = 0.5
    """Longest time a finished request's record waits before it is written, seconds."""
    batch_size: int = 500
    """Records written per transaction at most."""
    queue_max: int = 100_000
    """Records buffered in memory at most; beyond it the oldest are dropped and counted."""
    length_history_window: int = 1000
    """Finished output lengths kept per length-history key."""


class BatchConfig(_Section, frozen=True):
    """The Files and Batch API and the batch runner that feeds BE lines to the engine."""

    max_file_bytes: int = 100 * 1024 * 1024
    """Largest uploaded file, bytes; a larger upload is answered 413."""
    max_lines: int = 50_000
    """Most requests (JSONL lines) in one batch input file, lines."""
    max_inflight: int = 64
    """Batch lines running at once per serving engine (all batches together), requests: the
    runner's backpressure bound, times the engines of the pool that serve now (N replicas run
    N times as many lines); it also never exceeds the engine's KV (see the scanner)."""
    poll_interval_s: float = 0.5
    """How often the runner looks for new, cancelled and expired batches, seconds."""
    pilot_fraction: float = 0.01
    """Share of a batch's lines run first to sample output lengths (BlendServe §3.2), 0–1."""
    pilot_max_lines: int = 32
    """Most pilot lines per batch, lines."""
    split_alpha: float = 0.02
    """Outlier-split budget: prefix tokens a split may recompute, as a share of the batch's
    unique prompt tokens (BlendServe Alg. 2 threshold)."""
    engine_kv_tokens: int | None = None
    """KV pool of one engine the scanner partitions, tokens (None: engine.max_total_tokens);
    a pool of N engines gives the scanner N of them."""
    retry_after_s: float = 2.0
    """Pause before a line is retried after the engine was unreachable or aborted it, seconds."""
    max_attempts: int = 5
    """Attempts per line before it is written to the error file, attempts. Counted in SQL when a
    line is sent (so across gateway and engine restarts): an attempt the engine aborted, failed,
    or did not survive (the connection broke, or the gateway stopped with the line in flight)
    counts; one that found the engine unreachable does not."""
    runner_enabled: bool = True
    """Let this gateway process run the batch runner. On PostgreSQL the processes that may run it
    elect one leader through an advisory lock, and another takes over within seconds when it
    dies, resuming its batches (gateway/batch/leader.py); on SQLite the one process always
    runs it. False: this process never runs batches (it still accepts them)."""
    output_expires_days: int = 30
    """Days after which output and error files expire (shown as `expires_at`), days."""


class QuotaConfig(_Section, frozen=True):
    """Per-tenant quotas (gateway.quotas): how gateway processes sharing a database split them."""

    sync_interval_s: float = 1.0
    """How often this process publishes its demand and reads the others', seconds; also the
    longest a limit split stays out of date."""
    instance_timeout_s: float = 5.0
    """A gateway process whose heartbeat is older than this no longer gets a share, seconds."""


class MetricsConfig(_Section, frozen=True):
    """Prometheus /metrics and the dashboard's engine history."""

    engine_poll_s: float = 5.0
    """How often the engine's load (queues, KV use) and the batch backlog are sampled, seconds."""
    history_s: float = 6 * 3600.0
    """How much sampled engine history the dashboard can show, seconds."""
    scrape_token: str | None = None
    """Bearer token `GET /metrics` requires (``Authorization: Bearer <token>``; the admin token
    works too), at least 8 characters; null: /metrics is open to anyone who reaches the port.
    Set it with ``TANDEM_METRICS__SCRAPE_TOKEN`` rather than in a file (quote an all-digit token,
    which the override would read as a number)."""
    tenant_names: bool = False
    """Publish each tenant's name on `tandem_tenant_info` (label `name`, joined to the other
    series by their `tenant` id label). Off: /metrics carries tenant ids and tiers only, so a
    scrape does not list the customers."""


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration (config.yaml)."""

    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    database: DatabaseConfig = msgspec.field(default_factory=DatabaseConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    usage: UsageConfig = msgspec.field(default_factory=UsageConfig)
    quota: QuotaConfig = msgspec.field(default_factory=QuotaConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)

    def __post_init__(self) -> None:
        _check_positive("gateway.port", self.gateway.port)
        _check_positive("engine.port", self.engine.port)
        _check_positive("gateway.max_body_bytes", self.gateway.max_body_bytes)
        _check_positive("gateway.default_max_tokens", self.gateway.default_max_tokens)
        _check_positive("gateway.max_inflight_rt", self.gateway.max_inflight_rt)
        _check_positive("gateway.max_inflight_be", self.gateway.max_inflight_be)
        for key in (  # the gateway's own protection
            "max_requests_in_flight",
            "max_queue_wait_s",
            "overload_retry_after_s",
            "max_connections",
            "idle_timeout_s",
            "body_read_timeout_s",
            "loop_watch_interval_s",
        ):
            _check_positive(f"gateway.{key}", getattr(self.gateway, key))
        if not 0.0 <= self.gateway.slo_recheck_frac < 1.0:
            frac = self.gateway.slo_recheck_frac
            raise ConfigError(f"gateway.slo_recheck_frac must be in [0, 1), got {frac}")
        if not 0 <= self.gateway.shutdown_timeout_s < math.inf:
            timeout_s = self.gateway.shutdown_timeout_s
            raise ConfigError(f"gateway.shutdown_timeout_s must be 0 or more, got {timeout_s}")
        if self.gateway.loop_stall_ms < 0:
            stall_ms = self.gateway.loop_stall_ms
            raise ConfigError(f"gateway.loop_stall_ms must be 0 or more, got {stall_ms}")
        _check_positive("engine.max_total_tokens", self.engine.max_total_tokens)
        _check_positive("engine.max_running_requests", self.engine.max_running_requests)
        _check_positive("engine.chunked_prefill_size", self.engine.chunked_prefill_size)
        _check_positive("engine.restart_backoff_s", self.engine.restart_backoff_s)
        _check_positive("engine.restart_backoff_max_s", self.engine.restart_backoff_max_s)
        _check_positive("engine.health_probe_interval_s", self.engine.health_probe_interval_s)
        _check_positive("engine.health_probe_timeout_s", self.engine.health_probe_timeout_s)
        _check_positive("engine.health_probe_failures", self.engine.health_probe_failures)
        _check_positive("usage.batch_size", self.usage.batch_size)
        _check_positive("usage.length_history_window", self.usage.length_history_window)
        _check_positive("batch.max_file_bytes", self.batch.max_file_bytes)
        _check_positive("batch.max_lines", self.batch.max_lines)
        _check_positive("batch.max_inflight", self.batch.max_inflight)
        _check_positive("batch.poll_interval_s", self.batch.poll_interval_s)
        _check_positive("batch.max_attempts", self.batch.max_attempts)
        threads = self.engine.cpu_threads
        if threads is not None and threads < 1:
            raise ConfigError(f"engine.cpu_threads must be ≥ 1 (or null), got {threads}")
        if threads is not None and self.engine.device != "cpu":
            raise ConfigError(
                f"engine.cpu_threads is for device cpu only (engine.device is "
                f"{self.engine.device!r}); remove it"
            )
        engine_key = self.engine.api_key
        if engine_key is not None and (not engine_key.strip() or engine_key.startswith("-")):
            # SGLang turns its --config file back into flags: a value starting with "-" reads
            # as a flag there, and the engine refuses to start
            raise ConfigError(
                "engine.api_key must be a non-empty secret that does not start with '-'"
            )
        token = self.metrics.scrape_token
        if token is not None and len(token.strip()) < 8:
            raise ConfigError("metrics.scrape_token must be a secret of at least 8 characters")
        if not 0.0 <= self.batch.pilot_fraction <= 1.0:
            raise ConfigError("batch.pilot_fraction must be in [0, 1]")
        if not self.engine.profile.strip():
            raise ConfigError('engine.profile is empty; name a profile, a .json file or "auto"')
        if self.gateway.port > 65535 or self.engine.port > 65535:
            raise ConfigError("gateway.port and engine.port must be at most 65535")
        if self.engine.kv_layout == "bicache" and self.engine.max_total_tokens % 16:
            raise ConfigError(
                "engine.max_total_tokens must be a multiple of 16 with "
                "engine.kv_layout bicache (blocks of 16 slots)"
            )
        _check_pool(self.engine)
        _check_slowdown(self.engine)
        if not self.database.url.split(":", 1)[0].startswith(("sqlite", "postgresql")):
            raise ConfigError(
                f"database.url: unsupported database {self.database.url.split(':', 1)[0]!r} "
                "(use sqlite or postgresql)"
            )


TANDEM_ENGINE_FLAGS = {
    "--port": "engine.port",
    "--host": "engine.host",
    "--model-path": "model.path",
    "--model": "model.path",
    "--served-model-name": "model.name",
    "--device": "engine.device",
    "--dtype": "engine.dtype",
    "--max-total-tokens": "engine.max_total_tokens",
    "--max-running-requests": "engine.max_running_requests",
    "--chunked-prefill-size": "engine.chunked_prefill_size",
    "--context-length": "engine.context_length",
}
"""SGLang launch flags tandem sets from a config key (the key named): refused in
`engine.extra_args`, where a second value would silently win or lose."""


DP_SIZE_FLAGS = ("--dp-size", "--dp", "--data-parallel-size")
"""SGLang's spellings of its data-parallel size flag."""


def _dp_size_of(args: Sequence[str]) -> int:
    """The data-parallel size *args* give SGLang (the last of its flags, as argparse takes it),
    1 without one; ConfigError naming `engine.extra_args` for a value that is not a positive
    integer."""
    size = "1"
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in DP_SIZE_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"engine.extra_args: {flag} needs a value")
            value = args[i + 1]
        size = value
    try:
        dp = int(size)
    except ValueError:
        dp = 0
    if dp < 1:
        raise ConfigError(
            f"engine.extra_args: the data-parallel size must be a positive integer, got {size!r}"
        )
    return dp


def _check_slowdown(engine: EngineConfig) -> None:
    """`engine.slowdown` and `engine.slowdown_start_file` (see their docstrings)."""
    if engine.slowdown is None:
        if engine.slowdown_start_file is not None:
            raise ConfigError("engine.slowdown_start_file needs engine.slowdown")
        return
    if engine.kind != "sglang" or not engine.launch:
        raise ConfigError(
            "engine.slowdown stretches the forward passes of SGLang engines tandem serve "
            "launches (engine.kind sglang, engine.launch true); the simulator has "
            "tandem bench --engine-slowdown"
        )
    schedule = engine_slowdown_schedule(engine)
    slow = [factor for _, factor in schedule if factor < 1.0]
    if slow:
        raise ConfigError(
            f"engine.slowdown {engine.slowdown!r}: factor {slow[0]:g} < 1 (a real engine can be "
            "made slower, not faster)"
        )


def engine_slowdown_schedule(engine: EngineConfig) -> Slowdown:
    """`engine.slowdown` as a schedule (() without one); ConfigError naming the key."""
    if engine.slowdown is None:
        return ()
    try:
        return parse_slowdown(engine.slowdown)
    except ValueError as exc:
        raise ConfigError(f"engine.slowdown {engine.slowdown!r}: {exc}") from None


def _check_pool(engine: EngineConfig) -> None:
    """The engine pool's keys: replicas, endpoints and extra_args (see their docstrings)."""
    if engine.replicas < 1:
        raise ConfigError(f"engine.replicas must be at least 1, got {engine.replicas}")
    _dp_size_of(engine.extra_args)
    for arg in engine.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in TANDEM_ENGINE_FLAGS:
            raise ConfigError(
                f"engine.extra_args: {flag} is set by tandem from "
                f"{TANDEM_ENGINE_FLAGS[flag]}; set that key instead"
            )
    for url in engine.endpoints:
        _endpoint_address(url)
    if len(set(engine.endpoints)) != len(engine.endpoints):
        raise ConfigError("engine.endpoints lists an engine twice")
    if engine.endpoints:
        if engine.replicas not in (1, len(engine.endpoints)):
            raise ConfigError(
                f"engine.replicas is {engine.replicas} but engine.endpoints lists "
                f"{len(engine.endpoints)} engines: with endpoints the pool is exactly those "
                "(leave replicas at 1)"
            )
    elif engine.replicas > 1 and not engine.launch:
        raise ConfigError(
            f"engine.replicas {engine.replicas} needs engine.launch true (tandem serve starts "
            "them); to use engines started elsewhere, list them in engine.endpoints"
        )
    elif engine.replicas > 1 and engine.port + engine.replicas - 1 > 65535:
        raise ConfigError(
            f"engine.replicas {engine.replicas} from engine.port {engine.port} goes past port 65535"
        )


def _endpoint_address(url: str) -> tuple[str, int]:
    """(host, port) of an `engine.endpoints` URL; ConfigError naming it when it is not
    ``http(s)://host:port``."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ConfigError(f"engine.endpoints: {url!r} is not an http://host:port URL")
    if parts.path.strip("/") or parts.query:
        raise ConfigError(f"engine.endpoints: {url!r} must be a base URL (no path or query)")
    return parts.hostname, port


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def pool_engines(engine: EngineConfig) -> list[EngineConfig]:
    """One `EngineConfig` per engine of the pool, each describing that engine alone (its
    `host`, `port`, `control_socket`, `log_file`; `replicas` 1, no `endpoints`): the launched
    replicas (`launch` on, no endpoints: replica i on `port` + i), the engines of `endpoints`
    (`launch` off), or the one engine at `host`:`port`. Replica 0 of a launched pool is
    *engine* itself, unchanged: one replica behaves exactly as a single engine."""
    if engine.endpoints:
        attached = []
        for i, url in enumerate(engine.endpoints):
            host, port = _endpoint_address(url)
            socket = None
            if engine.control_socket is not None:
                socket = engine.control_socket if i == 0 else f"{engine.control_socket}.{i}"
            attached.append(
                msgspec.structs.replace(
                    engine,
                    host=host,
                    port=port,
                    launch=False,
                    replicas=1,
                    endpoints=[],
                    control_socket=socket,
                )
            )
        return attached
    if engine.replicas == 1:
        return [msgspec.structs.replace(engine, endpoints=[])]
    replicas = []
    for i in range(engine.replicas):
        socket = engine.control_socket
        log_file = engine.log_file
        if i > 0:
            socket = None if socket is None else f"{socket}.{i}"
            if log_file is not None:
                path = Path(log_file)
                log_file = str(path.with_name(f"{path.stem}-{i}{path.suffix}"))
        replicas.append(
            msgspec.structs.replace(
                engine,
                port=engine.port + i,
                replicas=1,
                control_socket=socket,
                log_file=log_file,
            )
        )
    return replicas


def new_engine_api_key() -> str:
    """A fresh random `engine.api_key` for an engine tandem launches: hexadecimal, so that it
    never starts with "-" (SGLang would read such a value of its --config file as a flag)."""
    return secrets.token_hex(32)


def _check_positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be positive, got {value}")


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Reads *path* (default: the repository's config.yaml), applies ``TANDEM_*`` overrides;
    a relative SQLite path in ``database.url`` is made absolute against *path*'s folder."""
    env = os.environ if environ is None else environ
    config_path = Path(path) if path else DEFAULT_CONFIG_PATH
    raw = _read_yaml(config_path)
    _apply_env_overrides(raw, env)
    try:
        config = msgspec.convert(raw, Config)
        url = _sqlite_path_from(config.database.url, config_path.resolve().parent)
        if url == config.database.url:
            return config
        database = msgspec.structs.replace(config.database, url=url)
        return msgspec.structs.replace(config, database=database)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config: {_describe(exc)}") from None
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"config: {exc}") from None


def _sqlite_path_from(url: str, folder: Path) -> str:
    """*url* with a relative SQLite file path made absolute against *folder* (in-memory and
    absolute paths, other databases: unchanged)."""
    scheme, sep, rest = url.partition(":///")
    if not sep or not scheme.startswith("sqlite"):
        return url
    file, question, query = rest.partition("?")
    if not file or file.startswith(("/", ":memory:", "file:")):
        return url
    return f"{scheme}:///{(folder / Path(file).expanduser()).as_posix()}{question}{query}"


def admin_token(environ: Mapping[str, str] | None = None) -> str:
    """The admin bearer token (``TANDEM_ADMIN_TOKEN``); required to serve."""
    env = os.environ if environ is None else environ
    token = env.get(ADMIN_TOKEN_ENV, "")
    if len(token) < 8:
        raise ConfigError(f"{ADMIN_TOKEN_ENV} must be set to a secret of at least 8 characters")
    return token


def engine_settings_from_env(environ: Mapping[str, str] | None = None) -> EngineSettings:
    """The patched engine's settings: ``TANDEM_ENGINE_SETTINGS`` decoded (the defaults when it
    is unset or empty). Called once, in SGLang's scheduler process; a bad value raises
    :class:`ConfigError` naming the variable and the field (the engine must not start on it)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENGINE_SETTINGS_ENV, "").strip()
    if not raw:
        return EngineSettings()
    try:
        return msgspec.json.decode(raw, type=EngineSettings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{ENGINE_SETTINGS_ENV}: {_describe(exc)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{ENGINE_SETTINGS_ENV} is not a JSON object: {exc}") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return data


def _apply_env_overrides(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    sections = {f.name for f in msgspec.structs.fields(Config)}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name or name == ADMIN_TOKEN_ENV:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if section not in sections:
            raise ConfigError(f"{name}: unknown config section {section!r}")
        parsed = _parse_env_value(section, key, value)
        target = raw.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        target[key] = parsed


def _parse_env_value(section: str, key: str, value: str) -> Any:
    """An override's value: as written for a text field (a token or path ending in ':' or
    holding '#' stays itself; "null" unsets an optional one), YAML for any other (numbers,
    booleans, lists, mappings)."""
    field_type = _field_types().get((section, key))
    if field_type is not None and _is_text(field_type):
        optional = isinstance(field_type, msgspec.inspect.UnionType) and any(
            isinstance(t, msgspec.inspect.NoneType) for t in field_type.types
        )
        return None if optional and value.strip() in ("null", "~") else value
    try:
        return yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        return value


def _field_types() -> dict[tuple[str, str], msgspec.inspect.Type]:
    types: dict[tuple[str, str], msgspec.inspect.Type] = {}
    config = msgspec.inspect.type_info(Config)
    assert isinstance(config, msgspec.inspect.StructType)
    for section in config.fields:
        if isinstance(section.type, msgspec.inspect.StructType):
            for field in section.type.fields:
                types[(section.name, field.name)] = field.type
    return types


def _is_text(field_type: msgspec.inspect.Type) -> bool:
    if isinstance(field_type, msgspec.inspect.StrType):
        return True
    if isinstance(field_type, msgspec.inspect.LiteralType):
        return all(isinstance(v, str) for v in field_type.values)
    if isinstance(field_type, msgspec.inspect.UnionType):
        kinds = [t for t in field_type.types if not isinstance(t, msgspec.inspect.NoneType)]
        return bool(kinds) and all(_is_text(t) for t in kinds)
    return False


def _describe(exc: msgspec.ValidationError) -> str:
    # msgspec says "Expected `int`, got `str` - at `$.gateway.port`"; turn the path into a key.
    text = str(exc)
    if " - at `$." in text:
        message, _, where = text.rpartition(" - at `$.")
        return f"{where.rstrip('`')}: {message}"
    return text
