"""Server configuration: one table of options, each a CLI flag with an environment variable
equivalent (PADDLEQUIC_<FLAG>); the flag wins over the variable, the variable over the default."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from service.api.restricted import RESTRICTABLE
from service.dataplane.sequence_callers import MODES as SEQUENCE_CALLER_MODES
from service.dataplane.shared_memory import MODES as SHARED_MEMORY_MODES
from service.http.body_budget import BINARY_HOLD_FACTOR, JSON_HOLD_FACTOR
from service.http.body_budget import DEFAULT_PER_ADDRESS as BODY_BUDGET_PER_ADDRESS
from service.http.body_budget import DEFAULT_TOTAL as BODY_BUDGET_TOTAL
from service.observability.logs import LOG_FORMATS
from service.observability.scrape_bounds import DEFAULT_MAX_CONNECTIONS, DEFAULT_TIMEOUT_S
from transport.h3.receive_budget import DEFAULT_PER_ADDRESS, DEFAULT_TOTAL
from transport.h3.settings import H3Settings

ENV_PREFIX = "PADDLEQUIC_"
# Environment variables of repeatable options hold their values separated by this.
ENV_SEPARATOR = ";"
MAX_FRONTENDS = 64
MAX_AUTO_FRONTENDS = 8
MAX_ALT_SVC_MAX_AGE = 7 * 86400  # what a client is told to remember, at most a week
MAX_INSTANCE_QUEUE_MB = 4096  # per instance: reserved in /dev/shm when its worker starts
MAX_H3_TOKEN_LIFETIME = 7 * 86400.0
MAX_STREAM_STALL_TIMEOUT = 3600.0
MAX_SERVER_NAME = 128


@dataclass(frozen=True)
class ServerSettings:
    model_repository: Path = Path("models")
    host: str = "0.0.0.0"
    grpc_port: int = 8001
    http_port: int = 8000
    http_tls: bool = False
    http_max_input_size: int = 64 << 20
    http_keepalive_timeout: float = 5.0
    http_max_connections: int = 1024
    http_body_timeout: float = 30.0
    http_send_timeout: float = 30.0
    http_receive_budget: int = BODY_BUDGET_TOTAL
    http_receive_budget_per_address: int = BODY_BUDGET_PER_ADDRESS
    log_level: str = "info"
    h3: bool = True
    h2_tls: bool = False
    zero_rtt: bool = True
    ticket_ttl: float = 3600.0
    ticket_store: str = "memory"
    ticket_key_file: str = ""
    early_data_methods: str = "default"
    h3_port: int = 0
    alt_svc_max_age: int = 3600
    tls_cert: str = ""
    tls_key: str = ""
    certs_dir: Path = Path("certs")
    grace_period: float = 5.0
    max_message_bytes: int = 64 << 20
    max_concurrent_rpcs: int = 1024
    max_metadata_bytes: int = 16 << 10
    h2_max_connections: int = 1024
    h2_handshake_timeout: float = 10.0
    idle_timeout: float = 60.0
    h3_max_connections: int = 1024
    h3_max_connections_per_address: int = 64
    h3_handshake_timeout: float = 10.0
    h3_retry: str = "auto"
    h3_token_lifetime: float = 86400.0
    h3_receive_budget: int = DEFAULT_TOTAL
    h3_receive_budget_per_address: int = DEFAULT_PER_ADDRESS
    testing_service: bool = False
    model_control_mode: str = "none"
    load_model: str = ""
    poll_repository: float = 0.0
    model_memory_budget: int = 0
    trusted_keys: str = ""
    trusted_ca: str = ""
    require_signed: bool = False
    max_upload_files: int = 64
    max_upload_bytes: int = 32 << 20
    topology: str = ""
    metrics: bool = True
    metrics_port: int = 8002
    metrics_host: str = "127.0.0.1"
    metrics_max_connections: int = DEFAULT_MAX_CONNECTIONS
    metrics_timeout: float = DEFAULT_TIMEOUT_S
    log_format: str = "auto"
    slow_request_ms: float = 1000.0
    log_sample_ratio: float = 0.01
    log_sample_seed: int = -1
    log_failure_burst: int = 20
    log_failure_rate: float = 1.0
    model_output_lines: float = 100.0
    model_output_bytes: float = 65536.0
    preloaded_launcher: bool = True
    model_templates: bool = True
    instance_queues: bool = True
    instance_queue_mb: int = 8
    frontend_queues: bool = True
    trace_console: bool = False
    otlp_endpoint: str = ""
    trace_sample_ratio: float = 1.0
    restricted_protocol: tuple[str, ...] = ()
    tls_client_ca: str = ""
    require_client_cert: bool = False
    frontends: str = "1"
    shared_memory: str = "local"
    stream_stall_timeout: float = 10.0
    stream_buffer_bytes: int = 4 << 20
    sequence_callers: str = "any"
    server_name: str = "paddlequic"


_HELP = {
    "model_repository": "directory of models (NAME/config.pbtxt, NAME/VERSION/...)",
    "host": "address to listen on",
    "grpc_port": "TCP port for gRPC over HTTP/2 (0: any free port)",
    "http_port": "port for the KServe v2 REST API: HTTP/1.1 and HTTP/2 (h2c) on TCP, HTTP/3 on "
    "UDP with --h3 (0: off)",
    "http_tls": "serve the REST port with TLS (the HTTP/3 certificate: --tls-cert or the "
    "development certificates), HTTP/2 or HTTP/1.1 chosen by ALPN; its responses then "
    "advertise HTTP/3 (alt-svc)",
    "http_max_input_size": "largest HTTP request body accepted, in bytes, per request; more is "
    "refused with 400 before it is read",
    "http_max_connections": "REST connections held at once, per front-end (a TLS handshake in "
    "progress counts); more are closed as soon as they are accepted",
    "http_keepalive_timeout": "seconds an HTTP connection may go without a request in progress "
    "(its first request's headers included) before the server closes it",
    "http_body_timeout": "seconds an HTTP request's body may take to arrive, all of it; then "
    "the request is answered 408 and its connection closed",
    "http_send_timeout": "seconds a client may take none of a REST response being sent (each "
    "MiB of it); then its connection is reset (over HTTP/3, its stream)",
    "http_receive_budget": "bytes the REST requests' bodies may hold, all front-ends together, "
    f"while they are read, inflated and parsed (a JSON body {JSON_HOLD_FACTOR} times its "
    f"bytes, binary data {BINARY_HOLD_FACTOR} times), and their answers until sent: a declared "
    "body waits for room within --http-body-timeout, then 429; one that could never fit is "
    "413; an answer that finds no room is 429",
    "http_receive_budget_per_address": "the same budget for the requests of one client IP address",
    "log_level": "debug, info, warning or error",
    "h3": "also serve gRPC and REST over HTTP/3 (QUIC, UDP)",
    "h2_tls": "serve HTTP/2 with TLS too, with the HTTP/3 certificate",
    "zero_rtt": "let resumed HTTP/3 clients send their first requests as 0-RTT early data",
    "ticket_ttl": "seconds a session ticket stays valid (each is single use)",
    "ticket_store": "where HTTP/3 session tickets live: memory (this process), sqlite://PATH "
    "(a file shared by the server processes of one host) or redis://[:PASSWORD@]HOST:PORT/DB "
    "(rediss:// with TLS; shared by every replica), so a ticket is single use across them",
    "ticket_key_file": "file of at least 32 secret bytes that seals tickets in a shared "
    "--ticket-store (the same file on every server); required with sqlite:// and redis://",
    "early_data_methods": "RPCs served from early data: /pkg.Service/Method or /pkg.Service/*, "
    "comma-separated; `default` = health, readiness, metadata, config, statistics, inference",
    "h3_port": "UDP port for HTTP/3 (0: the same number as the HTTP/2 port)",
    "alt_svc_max_age": 'HTTP/2 connections are told `alt-svc: h3=":H3_PORT"; ma=SECONDS`, so '
    "clients (auto://) move to HTTP/3 and remember for that long when it fails (0: no alt-svc)",
    "tls_cert": "PEM certificate chain for HTTP/3 (empty: development certificates)",
    "tls_key": "PEM private key for --tls-cert",
    "certs_dir": "where development certificates are created and found",
    "grace_period": "seconds in-flight calls may take to finish on shutdown",
    "max_message_bytes": "largest request or response message accepted",
    "max_concurrent_rpcs": "RPCs handled at once on each transport, REST requests too, all "
    "front-ends together; more are refused with RESOURCE_EXHAUSTED (REST: 429)",
    "max_metadata_bytes": "largest header block (metadata) accepted, on both transports; "
    "RFC 9114 size: names + values + 32 per entry",
    "h2_max_connections": "HTTP/2 connections held at once, per front-end (grpc core counts "
    "them); more are closed as they arrive",
    "h2_handshake_timeout": "seconds an HTTP/2 connection may take to complete its handshake "
    "(with --h2-tls, its TLS handshake) before grpc core drops it",
    "idle_timeout": "seconds a connection may stay idle (HTTP/2: no call; HTTP/3: no packet) "
    "before the server closes it",
    "h3_max_connections": "HTTP/3 connections held at once; more are refused at once",
    "h3_max_connections_per_address": "HTTP/3 connections held at once from one IP address",
    "h3_handshake_timeout": "seconds an HTTP/3 connection may take to complete its handshake",
    "h3_retry": "QUIC Retry (address validation, one more round trip): auto (while many "
    "handshakes are unfinished), always or never",
    "h3_token_lifetime": "seconds a NEW_TOKEN address token, sent to every HTTP/3 client, "
    "lets it skip the Retry on later connections from the same IP address; sealed with "
    "--ticket-key-file when given, so every server sharing that file accepts it (0: no tokens)",
    "h3_receive_budget": "bytes the HTTP/3 request streams of all clients may hold received "
    "and not yet read, all front-ends together: each open stream reserves its 1 MiB window (64 "
    "KiB past half the budget), a larger message all of itself when its turn comes; a new "
    "stream past it is refused with RESOURCE_EXHAUSTED, a large message waits",
    "h3_receive_budget_per_address": "the same budget for the streams of one IP address, "
    "all its connections together",
    "topology": "a recorded host (JSON) to place workers on instead of discovering GPUs with "
    "NVML; its GPU instances run CPU predictors, logged as simulated",
    "model_control_mode": "none: load every model at start, reload on SIGHUP; poll: also "
    "rescan every --poll-repository seconds; explicit: load --load-model at start, then "
    "RepositoryModelLoad/Unload",
    "load_model": "models to load at start in explicit mode, comma-separated (* = all)",
    "poll_repository": "seconds between repository rescans in poll mode",
    "model_memory_budget": "MB the loaded models may hold together (0: off, every model "
    "stays loaded): models load on their first request, and a load that would go over first "
    "unloads the least recently used idle models; RepositoryModelLoad pins a model",
    "trusted_keys": "directory of ECDSA public keys (*.pem, *.pub) trusted to sign models "
    "(OpenSSF model-signing, MODEL/model.sig): versions signed otherwise, or changed since "
    "signing, are refused",
    "trusted_ca": "PEM file of CA certificates: models signed with a certificate chaining to "
    "one are trusted too",
    "require_signed": "refuse unsigned models too (without it they load with a warning)",
    "max_upload_files": "files one RepositoryModelLoad may send (`file:` parameters), per "
    "request (0: none may be sent)",
    "max_upload_bytes": "bytes of files one RepositoryModelLoad may send, all its `file:` "
    "parameters together, per request; more is refused INTERNAL (as Triton answers)",
    "testing_service": "also serve paddlequic.v1.Testing (transport conformance tests only)",
    "metrics": "serve Prometheus metrics at http://HOST:METRICS_PORT/metrics",
    "metrics_port": "TCP port for /metrics (0: any free port, logged)",
    "metrics_host": "address /metrics listens on (0.0.0.0: every interface)",
    "metrics_max_connections": "/metrics connections held at once (one listener per host, "
    "whatever --frontends); more are closed as soon as they are accepted",
    "metrics_timeout": "seconds a /metrics connection may stay open, its request read and its "
    "answer sent; then it is shut",
    "log_format": "auto (text on a terminal, JSON lines otherwise), json or text; text is "
    "coloured on a terminal unless NO_COLOR is set",
    "slow_request_ms": "requests at least this slow are always logged",
    "log_sample_ratio": "fraction of successful, fast requests logged (errors always are)",
    "log_sample_seed": "seed of the request log sampling (-1: unseeded)",
    "log_failure_burst": "failed requests logged at once per transport, RPC and status, before "
    "--log-failure-rate applies (a flood of bad requests costs a few lines, not one each)",
    "log_failure_rate": "failed-request lines per second per transport, RPC and status after "
    "the burst; those left out are counted in the next line (`left_out`)",
    "model_output_lines": "lines per second a Python model's prints (stdout, stderr) may put in "
    "the log, per model version, with 10 s' worth at once; more are counted "
    "(paddlequic_model_output_dropped_lines) and dropped, and the log says how many",
    "model_output_bytes": "bytes per second of a Python model's prints in the log, per model "
    "version, with 10 s' worth at once (as --model-output-lines)",
    "preloaded_launcher": "fork Paddle CPU workers from one process that imported Paddle "
    "once (a tiny model's worker: about 17 MB of its own instead of 135; Python models' and "
    "GPU workers always start afresh)",
    "model_templates": "with the preloaded launcher, fork the instances of a Paddle CPU model "
    "version that has more than one from one process that built its predictor, so that they "
    "share its weights (resnet18 x 4: about 45 MB less per worker)",
    "instance_queues": "write each request of a Paddle model run by the dynamic batcher "
    "straight into a shared-memory queue of one of its instances, whose worker forms the "
    "batches itself (no batching in this process; sequences, streams, ensembles and Python "
    "models keep the server's batchers)",
    "instance_queue_mb": "MiB of shared memory per instance and process holding calls (this "
    "one, each front-end with --frontend-queues) with --instance-queues, half for requests and "
    "half for answers; one request (or one answer) takes at most a quarter",
    "frontend_queues": "with --frontends N and --instance-queues, each front-end writes the "
    "ModelInfer requests it holds straight into the workers' queues, and this process takes no "
    "part in them (the versions with a fallback model excepted)",
    "trace_console": "write OpenTelemetry spans to stderr, one JSON object per line",
    "otlp_endpoint": "send OpenTelemetry spans to this OTLP/gRPC collector (extra `otlp`)",
    "trace_sample_ratio": "fraction of new traces sampled; calls with a traceparent follow "
    "the caller's decision",
    "restricted_protocol": "CATEGORIES:KEY=VALUE, repeatable (env: `;`-separated): calls in "
    "these comma-separated categories need metadata triton-grpc-protocol-KEY: VALUE, else "
    "UNAUTHENTICATED (REST: the header KEY: VALUE, else 403); categories: "
    + ", ".join(RESTRICTABLE),
    "tls_client_ca": "PEM CA certificates that client certificates must chain to (HTTP/3, "
    "HTTP/2 with --h2-tls, REST with --http-tls)",
    "require_client_cert": "refuse TLS clients without a certificate from --tls-client-ca",
    "frontends": "front-end processes accepting on the same TCP and UDP port (SO_REUSEPORT) "
    f"and feeding one set of model workers, 1 to {MAX_FRONTENDS}; auto: one per two usable "
    f"cores, at most {MAX_AUTO_FRONTENDS}",
    "stream_stall_timeout": "seconds a ModelStreamInfer caller may take no response while one "
    "waits to be sent; then every request of its stream is cancelled (places and batch slots "
    "freed) and the stream ends RESOURCE_EXHAUSTED",
    "stream_buffer_bytes": "bytes of built responses one ModelStreamInfer stream holds for a "
    "caller that has not taken them (one larger response is held alone)",
    "server_name": "the name ServerMetadata answers (`triton` for clients that check it), "
    f"1 to {MAX_SERVER_NAME} printable ASCII characters",
    "shared_memory": "Triton's system shared-memory extension (tensors in POSIX shared memory "
    "on the server's host): local (served to loopback callers only), any, or off",
    "sequence_callers": "who may use sequence models: any (a caller without a client "
    "certificate holds its sequences by their ids alone, a capability) or certified (callers "
    "with a client certificate from --tls-client-ca only); a certified caller's sequences are "
    "its certificate identity's alone either way",
}


# Options that take one of a few words: anything else is refused at parse time.
_CHOICES = {
    "h3_retry": ("auto", "always", "never"),
    "log_format": LOG_FORMATS,
    "shared_memory": SHARED_MEMORY_MODES,
    "sequence_callers": SEQUENCE_CALLER_MODES,
}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def build_parser(prog: str = "paddlequic serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve the models of a repository over gRPC (Open Inference Protocol).",
    )
    defaults = ServerSettings()
    for f in fields(ServerSettings):
        default = getattr(defaults, f.name)
        env = env_name(f.name)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{_HELP[f.name]} (env {env}; default {default})"
        if isinstance(default, bool):
            value = os.environ.get(env)
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default if value is None else value.lower() in ("1", "true", "yes", "on"),
                help=help_text,
            )
            continue
        if isinstance(default, tuple):
            value = os.environ.get(env, "")
            parser.add_argument(
                flag,
                action=_Repeatable,
                default=tuple(v.strip() for v in value.split(ENV_SEPARATOR) if v.strip()),
                help=help_text,
            )
            continue
        kind: Any = type(default)
        parser.add_argument(
            flag,
            type=kind,
            default=kind(os.environ.get(env, default)),
            choices=_CHOICES.get(f.name),
            help=help_text,
        )
    return parser


class _Repeatable(argparse.Action):
    """Each use of the flag adds a value; the flag's values replace the environment's."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        given = () if current is self.default else current
        setattr(namespace, self.dest, (*given, values))


def parse(argv: Sequence[str] | None = None) -> ServerSettings:
    parser = build_parser()
    settings = ServerSettings(**vars(parser.parse_args(argv)))
    if settings.max_concurrent_rpcs < 1:
        parser.error("--max-concurrent-rpcs must be at least 1")
    if settings.model_output_lines < 0 or settings.model_output_bytes < 0:
        parser.error("--model-output-lines and --model-output-bytes must be at least 0")
    if not 0 <= settings.alt_svc_max_age <= MAX_ALT_SVC_MAX_AGE:
        parser.error(f"--alt-svc-max-age must be from 0 to {MAX_ALT_SVC_MAX_AGE}")
    if not 0 < settings.stream_stall_timeout <= MAX_STREAM_STALL_TIMEOUT:
        parser.error(
            f"--stream-stall-timeout must be above 0, at most {MAX_STREAM_STALL_TIMEOUT:g} s"
        )
    if not 1 <= settings.instance_queue_mb <= MAX_INSTANCE_QUEUE_MB:
        parser.error(f"--instance-queue-mb must be from 1 to {MAX_INSTANCE_QUEUE_MB}")
    if settings.model_memory_budget < 0:
        parser.error("--model-memory-budget must be at least 0 (0: off)")
    if settings.max_upload_files < 0 or settings.max_upload_bytes < 0:
        parser.error("--max-upload-files and --max-upload-bytes must be at least 0")
    if not 0 <= settings.http_port <= 65535:
        parser.error("--http-port must be from 0 to 65535")
    if settings.http_max_input_size < 1:
        parser.error("--http-max-input-size must be at least 1")
    if settings.http_max_connections < 1:
        parser.error("--http-max-connections must be at least 1")
    if min(settings.http_receive_budget, settings.http_receive_budget_per_address) < 1 << 20:
        parser.error(
            "--http-receive-budget and --http-receive-budget-per-address must be at least 1 MiB"
        )
    if min(settings.http_keepalive_timeout, settings.http_body_timeout) <= 0:
        parser.error("--http-keepalive-timeout and --http-body-timeout must be above 0")
    if not settings.http_send_timeout > 0:
        parser.error("--http-send-timeout must be above 0")
    if not settings.h2_handshake_timeout > 0:
        parser.error("--h2-handshake-timeout must be above 0")
    if settings.metrics_max_connections < 1 or not settings.metrics_timeout > 0:
        parser.error("--metrics-max-connections must be at least 1, --metrics-timeout above 0")
    if settings.stream_buffer_bytes < 1:
        parser.error("--stream-buffer-bytes must be at least 1")
    name = settings.server_name
    if not (0 < len(name) <= MAX_SERVER_NAME and name.isascii() and name.isprintable()):
        parser.error(f"--server-name takes 1 to {MAX_SERVER_NAME} printable ASCII characters")
    if not 0 <= settings.h3_token_lifetime <= MAX_H3_TOKEN_LIFETIME:
        parser.error(f"--h3-token-lifetime must be from 0 to {MAX_H3_TOKEN_LIFETIME:g}")
    window = H3Settings().stream_window
    for flag, value in (
        ("--h3-receive-budget", settings.h3_receive_budget),
        ("--h3-receive-budget-per-address", settings.h3_receive_budget_per_address),
    ):
        if value < window:
            parser.error(f"{flag} must be at least one stream window ({window} bytes)")
    try:
        frontend_count(settings.frontends)
    except ValueError as exc:
        parser.error(str(exc))
    return settings


def frontend_count(value: str, usable_cores: int | None = None) -> int:
    """--frontends as a number: `auto` is one per two usable cores (this process's CPU
    affinity, which containers and taskset narrow), from 1 to MAX_AUTO_FRONTENDS."""
    if value == "auto":
        cores = len(os.sched_getaffinity(0)) if usable_cores is None else usable_cores
        return max(1, min(MAX_AUTO_FRONTENDS, cores // 2))
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"--frontends takes a number or auto, got {value!r}") from None
    if not 1 <= count <= MAX_FRONTENDS:
        raise ValueError(f"--frontends must be from 1 to {MAX_FRONTENDS}, got {count}")
    return count
