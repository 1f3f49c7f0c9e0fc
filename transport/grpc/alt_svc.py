"""The `alt-svc` header (RFC 7838) as gRPC uses it (proposal G2): an HTTP/2 response tells the
client that the same service answers over HTTP/3 on a UDP port, for `ma` seconds."""

from __future__ import annotations

import re
from dataclasses import dataclass

HEADER = "alt-svc"
H3_ALPN = "h3"
DEFAULT_MAX_AGE_S = 86400  # RFC 7838 section 3.1, when `ma` is absent
# One alternative: protocol-id="[host]:port" followed by `; name=value` parameters.
_ALTERNATIVE = re.compile(
    r'\s*(?P<alpn>[!#$%&\'*+.^_`|~0-9A-Za-z-]+)="(?P<host>\[[^\]"]*\]|[^":]*):(?P<port>\d{1,5})"'
    r"(?P<params>(?:\s*;\s*[!#$%&\'*+.^_`|~0-9A-Za-z-]+=(?:\"[^\"]*\"|[^,;\s]*))*)\s*(?:,|$)"
)
_MAX_AGE = re.compile(r";\s*ma=\"?(\d+)\"?")


@dataclass(frozen=True)
class Alternative:
    """Where HTTP/3 answers: `host` empty means the origin's host."""

    host: str
    port: int
    max_age_s: int


def h3_header(port: int, max_age_s: int) -> str:
    """What the server sends: HTTP/3 on `port` of the same host, for `max_age_s` seconds."""
    return f'{H3_ALPN}=":{port}"; ma={max_age_s}'


def parse_h3(value: str) -> Alternative | None:
    """The first HTTP/3 alternative in a header value; None for `clear`, for a value naming no
    HTTP/3 alternative and for one that does not parse (a client then stays where it is)."""
    value = value.strip()
    if value == "clear":
        return None
    position = 0
    while position < len(value):
        match = _ALTERNATIVE.match(value, position)
        if match is None:
            return None
        position = match.end()
        port = int(match["port"])
        if match["alpn"] != H3_ALPN or not 0 < port < 65536:
            continue
        max_age = _MAX_AGE.search(match["params"])
        return Alternative(
            match["host"].strip("[]"),
            port,
            int(max_age[1]) if max_age else DEFAULT_MAX_AGE_S,
        )
    return None
