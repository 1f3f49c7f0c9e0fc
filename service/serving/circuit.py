"""The error of a version whose circuit breaker is open."""

from __future__ import annotations

from service.inference import errors
from service.registry.versions import ServedVersion


def open_circuit(
    served: ServedVersion, failure: str | None, detail: str = ""
) -> errors.ServiceError:
    why = f"no instance can start ({failure})" if failure else "too many recent requests failed"
    message = (
        f"model '{served.name}' version {served.version} is open-circuited: {why}; it will be "
        f"retried in {served.breaker.retry_in_s():.1f} s"
    )
    return errors.unavailable(f"{message}; {detail}" if detail else message)
