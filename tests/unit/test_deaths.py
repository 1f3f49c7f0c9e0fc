"""How a worker's death is told and what becomes of its requests (service/workers/deaths.py):
the protocol broken fails them for good, a limit of the model's fails them with
RESOURCE_EXHAUSTED, anything else queues them again, and only the server's own doing (a
preloaded launcher or a model template that ended) is not counted against them."""

from __future__ import annotations

import pytest

from service.workers import subreaper
from service.workers.deaths import Death, Fate, death


def told(
    code: int | None,
    misbehaved: str | None = None,
    killed_hung: bool = False,
    parameters: dict[str, str] | None = None,
    python: bool = False,
) -> Death:
    return death(code, misbehaved, killed_hung, 2.5, parameters or {}, python)


@pytest.mark.parametrize(
    ("ended", "expected"),
    [
        (told(-9), Death("was killed by signal 9", Fate.REQUEUE, True)),
        (told(1), Death("exited (1)", Fate.REQUEUE, True)),
        (told(None), Death("exited (None)", Fate.REQUEUE, True)),
        (
            told(-9, killed_hung=True),
            Death("was killed by the watchdog after 2.5 s of execution", Fate.REQUEUE, True),
        ),
        (
            told(-9, misbehaved="9 bytes"),
            Death("broke the worker protocol (9 bytes) and was killed", Fate.FAIL, True),
        ),
        (
            told(subreaper.ENDED_WITH_PRELOADED),
            Death("ended with the preloaded launcher", Fate.REQUEUE, False),
        ),
        (
            told(subreaper.ENDED_WITH_TEMPLATE, killed_hung=True),
            Death("ended with its model template", Fate.REQUEUE, False),
        ),
    ],
)
def test_each_death_is_told_and_decided(ended: Death, expected: Death) -> None:
    assert ended == expected


def test_a_limit_of_the_models_fails_its_requests_as_resource_exhausted() -> None:
    memory = told(subreaper.EXCEEDED_MEMORY, parameters={"memory_mb": "300"})
    assert (memory.fate, memory.limit, memory.blamed) == (Fate.EXHAUSTED, "memory", True)
    assert "its memory limit (memory_mb 300 MiB)" in memory.how
    processes = told(subreaper.EXCEEDED_CHILDREN, python=True)
    assert (processes.fate, processes.limit) == (Fate.EXHAUSTED, "processes")
    assert "python_child_processes" in processes.how
    # Only a Python model's launcher counts processes: for a Paddle one the status is an exit.
    assert told(subreaper.EXCEEDED_CHILDREN).fate is Fate.REQUEUE


def test_breaking_the_protocol_wins_over_how_it_ended() -> None:
    """Killed for what it sent: its requests fail for good, whatever its exit says."""
    for code in (subreaper.EXCEEDED_MEMORY, subreaper.ENDED_WITH_PRELOADED, -9):
        assert told(code, misbehaved="garbage").fate is Fate.FAIL
