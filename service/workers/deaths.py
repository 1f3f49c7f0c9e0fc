"""How a worker ended, told from what its instance knows once the process is gone, and what
becomes of the requests it held: a pure decision, so that each case is tested alone."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from service.inference import errors
from service.model.parameters import MEMORY_MB, PYTHON_MEMORY_MB, child_processes, worker_memory_mb
from service.workers import subreaper

# Ended by the server's own doing, whatever the worker was computing.
_NOT_BLAMED = {
    subreaper.ENDED_WITH_PRELOADED: "ended with the preloaded launcher",
    subreaper.ENDED_WITH_TEMPLATE: "ended with its model template",
}


class Fate(enum.Enum):
    """What becomes of the requests the worker held (the words are the log's)."""

    REQUEUE = "go back to the queue"  # run again on the next worker
    FAIL = "fail"  # it broke the protocol: what a model sends on purpose it would send again
    EXHAUSTED = "fail (RESOURCE_EXHAUSTED)"  # it went past a limit of its model's


@dataclass(frozen=True)
class Death:
    how: str  # "was killed by signal 9": what the log and the requests' errors say
    fate: Fate
    blamed: bool  # the death counts against the request it was computing (poison)
    limit: str | None = None  # the limit it went past: "memory" or "processes"


def death(
    code: int | None,
    misbehaved: str | None,
    killed_hung: bool,
    execution_timeout_s: float | None,
    parameters: Mapping[str, str],
    python: bool,
) -> Death:
    """`code`: the launcher's exit code (negative: a signal); `misbehaved`: why it was killed
    for breaking the protocol; `killed_hung`: the watchdog killed it."""
    if misbehaved is not None:
        return Death(f"broke the worker protocol ({misbehaved}) and was killed", Fate.FAIL, True)
    if code == subreaper.EXCEEDED_MEMORY:
        mb = worker_memory_mb(parameters, python)
        name = MEMORY_MB if MEMORY_MB in parameters or not python else PYTHON_MEMORY_MB
        how = f"was killed for exceeding its memory limit ({name} {mb} MiB)"
        return Death(how, Fate.EXHAUSTED, True, "memory")
    if code == subreaper.EXCEEDED_CHILDREN and python:
        count = child_processes(parameters)
        how = f"was killed for running more than python_child_processes ({count}) processes"
        return Death(how, Fate.EXHAUSTED, True, "processes")
    if code in _NOT_BLAMED:
        return Death(_NOT_BLAMED[code], Fate.REQUEUE, False)
    if killed_hung and execution_timeout_s is not None:  # the watchdog runs with a timeout
        how = f"was killed by the watchdog after {execution_timeout_s:.1f} s of execution"
    elif code is not None and code < 0:
        how = f"was killed by signal {-code}"
    else:
        how = f"exited ({code})"
    return Death(how, Fate.REQUEUE, True)


def requests_error(ended: Death, model_name: str) -> Callable[[int], errors.ServiceError]:
    """How the requests the worker held fail, by their place in its line (0: the one it was
    running)."""
    message = (
        f"the worker process for model '{model_name}' {ended.how} while holding "
        "this request; it is being restarted"
    )
    if ended.fate is Fate.FAIL:
        refused = errors.internal(f"{message}; the request is not run again")
        return lambda _: refused
    if ended.fate is Fate.EXHAUSTED:
        # The model's own doing: its requests fail, none is retried on the next worker.
        return lambda _: errors.resource_exhausted(message)
    blamed = ended.blamed
    return lambda index: errors.WorkerDied(message, running=blamed and index == 0)
