"""A version's circuit breaker in front of a request: its admission, and the error when it
is open."""

from __future__ import annotations

from service.inference import errors
from service.registry.versions import ServedVersion
from service.resilience.breaker import Admission, BreakerState


def open_circuit(
    served: ServedVersion, failure: str | None, detail: str = ""
) -> errors.ServiceError:
    why = f"no instance can start ({failure})" if failure else "too many recent requests failed"
    message = (
        f"model '{served.name}' version {served.version} is open-circuited: {why}; it will be "
        f"retried in {served.breaker.retry_in_s():.1f} s"
    )
    return errors.unavailable(f"{message}; {detail}" if detail else message)


def admit(served: ServedVersion) -> tuple[Admission | None, str | None]:
    """The breaker's admission (None: refused) and why no instance can start, if none can: a
    version that cannot start trips its closed breaker first, so it refuses at once."""
    failure = served.start_failure()
    if failure is not None and served.breaker.state is BreakerState.CLOSED:
        served.breaker.trip()
    return served.breaker.admit(), failure
