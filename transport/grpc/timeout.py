"""The grpc-timeout header: 1-8 ASCII digits followed by a unit (H M S m u n)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import grpc

from transport.grpc.errors import ProtocolError

# Unit -> seconds per unit as (numerator, denominator), kept exact so rounding is controlled.
_UNITS: dict[str, tuple[int, int]] = {
    "n": (1, 10**9),
    "u": (1, 10**6),
    "m": (1, 10**3),
    "S": (1, 1),
    "M": (60, 1),
    "H": (3600, 1),
}
_MAX_VALUE = 99_999_999
_TIMEOUT_RE = re.compile(r"([0-9]{1,8})([HMSmun])")


def parse_timeout(value: str) -> float:
    """Seconds in a grpc-timeout value.

    A zero value is accepted (the deadline has already passed) although the spec asks for a
    positive integer. Malformed values fail the call with INTERNAL, as grpc-go does.
    """
    match = _TIMEOUT_RE.fullmatch(value)
    if match is None:
        raise ProtocolError(grpc.StatusCode.INTERNAL, f"malformed grpc-timeout {value!r}")
    numerator, denominator = _UNITS[match.group(2)]
    # int / int is correctly rounded, so the result never undercuts the encoded value.
    return int(match.group(1)) * numerator / denominator


def format_timeout(seconds: float) -> str:
    """The grpc-timeout value for `seconds`, in the finest unit whose count fits 8 digits.

    Rounds up so the peer never sees a shorter deadline; non-positive timeouts become "1n"
    (expire at once) and timeouts beyond 99999999 hours are capped there.
    """
    if math.isnan(seconds):
        raise ValueError("timeout is NaN")
    if seconds <= 0:
        return "1n"
    if seconds > _MAX_VALUE * 3600:
        return f"{_MAX_VALUE}H"
    for unit, (numerator, denominator) in _UNITS.items():
        count = _units_covering(seconds, numerator, denominator)
        if count <= _MAX_VALUE:
            return f"{count}{unit}"
    raise AssertionError("unreachable: hours always fit below the cap")


def _units_covering(seconds: float, numerator: int, denominator: int) -> int:
    """Fewest units that parse_timeout turns back into at least `seconds`.

    The exact ceiling can be one too many: the float 0.1 lies just above 1/10, yet
    100000u parses back to exactly that float.
    """
    count = math.ceil(Fraction(seconds) * denominator / numerator)
    if count > 1 and (count - 1) * numerator / denominator >= seconds:
        count -= 1
    return count
