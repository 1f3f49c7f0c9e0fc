"""What a worker runs without on this host: its Python sandbox's missing protections, and for
every worker its cgroup when the host offers none (ListInstances, and the log at its start)."""

from __future__ import annotations

import logging

from service.model.parameters import MEMORY_MB, PYTHON_MEMORY_MB
from service.workers import launch, protocol
from service.workers.spec import WorkerSpec

log = logging.getLogger("paddlequic.worker")

SANDBOX_OFF = ("python_sandbox: off",)


def unprotected(spec: WorkerSpec, loaded: protocol.Loaded | None) -> tuple[str, ...]:
    """Nothing before the worker loaded its model (`loaded`)."""
    if loaded is None:
        return ()
    bounds = _bounds_missing(spec)
    if not spec.python:
        return bounds
    sandbox = SANDBOX_OFF if loaded.unprotected is None else loaded.unprotected
    return (*sandbox, *bounds)


def _bounds_missing(spec: WorkerSpec) -> tuple[str, ...]:
    why = launch.worker_cgroups().unavailable
    if not why:
        return ()
    if not spec.python:
        return (
            f"a cgroup of its own ({why}): the worker and what it starts are bounded in "
            f"neither memory ({MEMORY_MB}) nor processes; the launcher still kills them all "
            "when it ends",
        )
    return (
        f"a cgroup of its own ({why}): memory is bounded per process ({PYTHON_MEMORY_MB} "
        "of address space each), not in total; processes by seccomp and the launcher's "
        "count; the launcher kills them all when the worker ends",
    )


def warn_unprotected(spec: WorkerSpec, unprotected: tuple[str, ...] | None) -> None:
    """`unprotected`: what the sandbox lacks, as the worker said (None: it runs without)."""
    name = spec.model_name
    if unprotected is None:
        log.warning("model %s runs without the Python sandbox (%s)", name, *SANDBOX_OFF)
    for missing in unprotected or ():
        log.warning("model %s: this host lacks a Python sandbox protection: %s", name, missing)
    for missing in _bounds_missing(spec):
        log.warning("model %s: this host lacks a worker protection: %s", name, missing)
