"""Which RPCs may run from 0-RTT early data.

Early data can be replayed by anyone who recorded it, so only idempotent RPCs are served from
it: health, readiness, metadata, configuration, statistics and inference (no side effects).
Repository load/unload and the project's control service never are. Server and client use the
same list: the client sends only these as early data; the server holds anything else that
arrives early until the handshake completes (a replayed handshake never completes), so it runs
exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

_INFERENCE = "/inference.GRPCInferenceService/"
DEFAULT_EARLY_DATA_METHODS: frozenset[str] = frozenset(
    {
        *(
            _INFERENCE + name
            for name in (
                "ServerLive",
                "ServerReady",
                "ModelReady",
                "ServerMetadata",
                "ModelMetadata",
                "ModelConfig",
                "ModelStatistics",
                "ModelInfer",
                "ModelStreamInfer",
            )
        ),
        "/grpc.health.v1.Health/*",
    }
)


def parse_allowlist(text: str) -> frozenset[str]:
    """A comma-separated list of `/package.Service/Method` or `/package.Service/*`;
    `default` stands for DEFAULT_EARLY_DATA_METHODS."""
    entries: set[str] = set()
    for item in (part.strip() for part in text.split(",")):
        if item == "default":
            entries |= DEFAULT_EARLY_DATA_METHODS
        elif item:
            if not item.startswith("/") or item.count("/") != 2:
                raise ValueError(f"{item!r} is not /package.Service/Method or /package.Service/*")
            entries.add(item)
    return frozenset(entries)


def allowed(method: str, allowlist: Iterable[str]) -> bool:
    service = method.rpartition("/")[0]
    names = set(allowlist)
    return method in names or f"{service}/*" in names
