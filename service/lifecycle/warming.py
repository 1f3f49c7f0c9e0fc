"""Driving a loaded version's warm-up (service/lifecycle/warmup.py's plan) through the request
path before it takes traffic, and setting the watchdog's limit from what it measured."""

from __future__ import annotations

import asyncio
import logging

from service.inference import errors
from service.lifecycle.warmup import WarmUpError, warm_ups
from service.registry.statistics import ModelStats
from service.registry.versions import ServedVersion, VersionState
from service.serving.requests import RequestRunner

log = logging.getLogger("paddlequic.models")
WARM_UP_TIMEOUT_S = 120.0
# The watchdog's default limit per batch, where config.pbtxt sets no execution_timeout_ms:
# generous, so only a hung or stopped worker is killed, never a slow batch.
MIN_EXECUTION_TIMEOUT_S = 30.0
WARM_UP_MULTIPLE = 20


async def warm_up(served: ServedVersion, runner: RequestRunner) -> None:
    """Every shape bucket (Paddle models), then the model_warmup samples, before the version
    takes traffic (service/lifecycle/warmup.py); the slowest bucket (the largest) sets the
    watchdog's limit where config.pbtxt sets none. Then the version is READY; a failure
    raises WarmUpError with the reason."""
    if served.generations is not None:
        _ready_unwarmed(served)
        return
    loop = asyncio.get_running_loop()
    queue = served.batcher or served.sequences
    assert queue is not None
    slowest = 0.0
    try:
        plan = warm_ups(served.config, queue.policy.shapes)
        for warm_up in plan:
            for _ in range(warm_up.count):
                started = loop.time()
                deadline = started + WARM_UP_TIMEOUT_S
                if served.sequences is not None:  # run outside any sequence
                    await served.sequences.warm(warm_up.job, deadline)
                else:
                    await runner.infer(served, warm_up.job, deadline)
                if warm_up.bucket:
                    slowest = max(slowest, loop.time() - started)
    except errors.ServiceError as exc:
        raise WarmUpError(exc.message) from exc
    timeout_s = max(MIN_EXECUTION_TIMEOUT_S, WARM_UP_MULTIPLE * slowest)
    buckets = [w for w in plan if w.bucket]
    samples = "".join(f", model_warmup {w.name!r} x{w.count}" for w in plan if not w.bucket)
    log.info(
        "model %s version %d warmed up: %d inferences (%d buckets%s), slowest bucket %.1f ms",
        served.name,
        served.version,
        sum(w.count for w in plan),
        len(buckets),
        samples,
        slowest * 1e3,
    )
    for instance in served.instances:
        if instance.execution_timeout_s is None:
            instance.execution_timeout_s = timeout_s
    served.stats = ModelStats()
    served.state = VersionState.READY


def _ready_unwarmed(served: ServedVersion) -> None:
    """A decoupled model is not warmed up: nothing says which inputs make it answer quickly,
    and a model.py builds what it needs in initialize() (model_warmup is refused when its
    config is read). Its execution_timeout_ms bounds the gap between two responses."""
    for instance in served.instances:
        if instance.execution_timeout_s is None:
            instance.execution_timeout_s = MIN_EXECUTION_TIMEOUT_S
    log.info(
        "model %s version %d is decoupled: no warm-up; up to %.1f s between two responses",
        served.name,
        served.version,
        min(i.execution_timeout_s or MIN_EXECUTION_TIMEOUT_S for i in served.instances),
    )
    served.state = VersionState.READY
