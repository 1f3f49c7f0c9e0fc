"""BLS calls (a Python model calling another model, service/workers/bls_calls.py) on the request
path: the target resolved and the call checked by its validator like an ensemble's step, then
run by RequestRunner.infer (its breaker, fallback and batcher) under the call's deadline. Two
checks end a call that would loop or wait for itself with an error instead of a hang: its depth,
and the process's wait-for graph across every call in flight (service/inference/waits.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

import grpc

from service.inference import errors
from service.inference.calls import BLS_MAX_DEPTH
from service.inference.jobs import OutputTensor, StreamAnswer
from service.inference.waits import Wait, WaitGraph
from service.registry.versions import ServedVersion
from service.serving.requests import RequestRunner
from service.workers.bls_calls import ModelCall


class BlsRunner:
    """The handler of every worker instance's BLS calls (bls_calls.Handler)."""

    def __init__(self, runner: RequestRunner, waits: WaitGraph) -> None:
        self._runner = runner
        self._waits = waits

    async def infer(self, call: ModelCall) -> tuple[OutputTensor, ...]:
        """exec(): the target's outputs."""
        served = await self._resolved(call)
        with self._waits.added(self._waits_of(call, served)):
            job = await self._runner.validated(served, call.inputs, call.outputs, call.chain)
            _, answer = await self._runner.infer(served, job, call.deadline)
        return answer.outputs

    async def responses(self, call: ModelCall) -> AsyncGenerator[StreamAnswer, None]:
        """exec(decoupled=True): each response as the target sends it (the caller bounds how
        many it takes, bls_calls.py; closing this cancels the target's request). A model that
        is not decoupled answers one final response, as in Triton."""
        served = await self._resolved(call)
        with self._waits.added(self._waits_of(call, served)):
            job = await self._runner.validated(served, call.inputs, call.outputs, call.chain)
            if not served.decoupled:
                _, answer = await self._runner.infer(served, job, call.deadline)
                yield StreamAnswer(answer.outputs, final=True)
                return
            client = f"bls {call.instance}"
            stream = self._runner.stream(served, job, "", "{}", call.deadline, client)
            async with contextlib.aclosing(stream) as responses:
                async for response in responses:
                    yield response

    async def _resolved(self, call: ModelCall) -> ServedVersion:
        """The target, once the call is known not to nest too deep (loaded first under
        --model-memory-budget)."""
        if call.chain.depth > BLS_MAX_DEPTH:
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"BLS calls nest {call.chain.depth} deep calling model "
                f"'{errors.echoed(call.model)}', more than {BLS_MAX_DEPTH}: do models call "
                "each other in a loop?",
            )
        return await self._runner.resolve_loaded(call.model, call.version, call.deadline)

    def _waits_of(self, call: ModelCall, served: ServedVersion) -> tuple[Wait, ...]:
        """What the caller's batch waits for while the call runs, unless it would wait for
        itself: one of the target's instances (an ensemble's steps go through their own
        batchers, whose batches hold their waits)."""
        targets = frozenset(id(i) for i in served.instances)
        waits = (Wait(call.instance, targets),) if targets else ()
        if self._waits.blocks(waits):
            raise errors.failed_precondition(
                f"model '{served.name}' has no instance that could run this BLS call: each "
                "one runs a request that waits for it, directly or through other calls in "
                "flight (a model calling itself, or models calling each other in a cycle)"
            )
        return waits
