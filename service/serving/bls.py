"""BLS calls (a Python model calling another model, service/workers/bls_calls.py) on the request
path: the target resolved and the call checked by its validator like an ensemble's step, then
run by RequestRunner.infer (its breaker, fallback and batcher) under the call's deadline. Two
checks end a call that would loop or wait for itself with an error instead of a hang: its depth,
and the process's wait-for graph across every call in flight (service/inference/waits.py)."""

from __future__ import annotations

import contextlib

import grpc

from service.inference import errors
from service.inference.calls import BLS_MAX_DEPTH
from service.inference.jobs import InferJob, OutputTensor, StreamAnswer
from service.inference.waits import Wait, WaitGraph
from service.registry.versions import ServedVersion
from service.serving.requests import RequestRunner
from service.workers.bls_calls import BLS_MAX_RESPONSES, ModelCall
from service.workers.protocol import BLS_MAX_BYTES


class BlsRunner:
    """The handler of every worker instance's BLS calls (bls_calls.Handler)."""

    def __init__(self, runner: RequestRunner, waits: WaitGraph) -> None:
        self._runner = runner
        self._waits = waits

    async def __call__(
        self, call: ModelCall
    ) -> tuple[OutputTensor, ...] | tuple[StreamAnswer, ...]:
        if call.chain.depth > BLS_MAX_DEPTH:
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"BLS calls nest {call.chain.depth} deep calling model "
                f"'{errors.echoed(call.model)}', more than {BLS_MAX_DEPTH}: do models call "
                "each other in a loop?",
            )
        served = await self._runner.resolve_loaded(call.model, call.version, call.deadline)
        # The caller's batch waits until one of the target's instances runs the call (an
        # ensemble's steps go through their own batchers, whose batches hold their waits).
        targets = frozenset(id(i) for i in served.instances)
        waits = (Wait(call.instance, targets),) if targets else ()
        if self._waits.blocks(waits):
            raise errors.failed_precondition(
                f"model '{served.name}' has no instance that could run this BLS call: each "
                "one runs a request that waits for it, directly or through other calls in "
                "flight (a model calling itself, or models calling each other in a cycle)"
            )
        with self._waits.added(waits):
            job = await self._runner.validated(served, call.inputs, call.outputs, call.chain)
            if call.decoupled:
                return await self._responses(served, job, call)
            _, answer = await self._runner.infer(served, job, call.deadline)
        return answer.outputs

    async def _responses(
        self, served: ServedVersion, job: InferJob, call: ModelCall
    ) -> tuple[StreamAnswer, ...]:
        """exec(decoupled=True): every response, gathered (the model gets them at once when
        the last has come), at most BLS_MAX_RESPONSES and BLS_MAX_BYTES of outputs, else the
        call fails and the target's request is cancelled. A model that is not decoupled
        answers one final response, as in Triton."""
        if not served.decoupled:
            _, answer = await self._runner.infer(served, job, call.deadline)
            return (StreamAnswer(answer.outputs, final=True),)
        gathered: list[StreamAnswer] = []
        size = 0
        client = f"bls {call.instance}"
        stream = self._runner.stream(served, job, "", "{}", call.deadline, client)
        async with contextlib.aclosing(stream) as responses:
            async for response in responses:
                gathered.append(response)
                size += sum(len(t.data) for t in response.outputs)
                if len(gathered) > BLS_MAX_RESPONSES or size > BLS_MAX_BYTES:
                    raise errors.ServiceError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"model '{served.name}' answered the decoupled BLS call with more than "
                        f"{BLS_MAX_RESPONSES} responses or {BLS_MAX_BYTES} bytes of outputs, "
                        "the most one call may gather",
                    )
        return tuple(gathered)
