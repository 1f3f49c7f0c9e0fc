"""The private runtime directory of a server with front-ends (0700, removed at exit): the
dispatch socket, the settings every front-end reads, and, when the configuration names none,
the shared ticket store and its sealing key."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from service.observability.logs import LineBudget, RequestLog
from service.observability.metrics import Metrics
from service.observability.observer import Observer
from service.observability.tracing import tracer_provider
from service.settings import ServerSettings

DISPATCH_SOCKET = "dispatch.sock"
SETTINGS_FILE = "settings.json"
TICKET_KEY_FILE = "ticket.key"
TICKET_DB = "tickets.sqlite"
TICKET_KEY_BYTES = 32


# A socket's path takes at most 107 bytes (sun_path's 108, the last a NUL); the longest name
# of a socket in the directory, with its separator.
MAX_SOCKET_PATH = 107
LONGEST_SOCKET = len("/" + DISPATCH_SOCKET)
FALLBACK_TMP = "/tmp"


def make_runtime_dir(tmp: str | None = None) -> Path:
    """mkdtemp makes it 0700: only this user reaches the socket and the key. Under $TMPDIR
    (`tmp`), or under /tmp where a socket's path there would be too long to bind."""
    base = tempfile.gettempdir() if tmp is None else tmp
    # mkdtemp's name: the prefix and 8 characters.
    if len(os.fsencode(base)) + len("/paddlequic-12345678") + LONGEST_SOCKET > MAX_SOCKET_PATH:
        base = FALLBACK_TMP
    return Path(tempfile.mkdtemp(prefix="paddlequic-", dir=base))


def shared_tickets(settings: ServerSettings, runtime_dir: Path) -> ServerSettings:
    """A `memory` store is one process's: front-ends share a SQLite file instead, so a ticket
    stays single use across them; without --ticket-key-file, a key made here seals it."""
    if settings.ticket_store != "memory":
        return settings
    key_file = settings.ticket_key_file
    if not key_file:
        path = runtime_dir / TICKET_KEY_FILE
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(secrets.token_bytes(TICKET_KEY_BYTES))
        key_file = str(path)
    return dataclasses.replace(
        settings, ticket_store=f"sqlite://{runtime_dir / TICKET_DB}", ticket_key_file=key_file
    )


def write_settings(settings: ServerSettings, runtime_dir: Path) -> None:
    values = {f.name: _plain(getattr(settings, f.name)) for f in dataclasses.fields(settings)}
    (runtime_dir / SETTINGS_FILE).write_text(json.dumps(values))


def read_settings(runtime_dir: Path) -> ServerSettings:
    values = json.loads((runtime_dir / SETTINGS_FILE).read_text())
    defaults = ServerSettings()
    kinds = {f.name: type(getattr(defaults, f.name)) for f in dataclasses.fields(defaults)}
    return ServerSettings(**{name: kinds[name](value) for name, value in values.items()})


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def observer_of(
    settings: ServerSettings, metrics: Metrics | None
) -> tuple[Observer, TracerProvider | None]:
    """What a process holding calls observes them with (the server's, each front-end's
    serving its own): its request log and tracing as the settings say."""
    tracing = tracer_provider(
        settings.trace_console, settings.otlp_endpoint, settings.trace_sample_ratio
    )
    observer = Observer(
        metrics,
        RequestLog(
            settings.slow_request_ms,
            settings.log_sample_ratio,
            settings.log_sample_seed if settings.log_sample_seed >= 0 else None,
            LineBudget(settings.log_failure_burst, settings.log_failure_rate),
        ),
        tracing.get_tracer("paddlequic") if tracing else None,
        settings.trace_sample_ratio,
    )
    return observer, tracing
