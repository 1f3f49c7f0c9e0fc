"""BLS calls (a Python model calling another model, service/workers/bls_calls.py) on the request
path: the target resolved and the call checked by its validator like an ensemble's step, then
run by RequestRunner.infer (its breaker, fallback and batcher) under the call's deadline. Two
checks end a call that would loop or wait for itself with an error instead of a hang."""

from __future__ import annotations

import grpc

from service.inference import errors
from service.inference.calls import BLS_MAX_DEPTH
from service.inference.jobs import OutputTensor
from service.serving.requests import RequestRunner
from service.workers.bls_calls import ModelCall


class BlsRunner:
    """The handler of every worker instance's BLS calls (bls_calls.Handler)."""

    def __init__(self, runner: RequestRunner) -> None:
        self._runner = runner

    async def __call__(self, call: ModelCall) -> tuple[OutputTensor, ...]:
        if call.chain.depth > BLS_MAX_DEPTH:
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"BLS calls nest {call.chain.depth} deep calling model "
                f"'{errors.echoed(call.model)}', more than {BLS_MAX_DEPTH}: do models call "
                "each other in a loop?",
            )
        served = self._runner.registry.resolve(call.model, call.version)
        # A worker runs one batch at a time: an instance blocked in one of this call's callers
        # can never run it.
        if served.instances and all(id(i) in call.chain.waiting for i in served.instances):
            raise errors.failed_precondition(
                f"model '{served.name}' has no instance that could run this BLS call: each "
                "one runs a request that waits for it (a model calling itself, directly or "
                "through others)"
            )
        job = await self._runner.validated(served, call.inputs, call.outputs, call.chain)
        _, answer = await self._runner.infer(served, job, call.deadline)
        return answer.outputs
