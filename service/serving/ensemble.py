"""Running an ensemble's graph for one request: a step runs once all its input tensors exist,
so independent steps run concurrently; every step goes through its model's own batcher and
instances, and intermediate tensors never leave the server."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from oip.datatypes import Datatype
from service.inference import errors
from service.inference.jobs import InferJob, InputTensor, OutputTensor
from service.model.ensemble import Step


@dataclass(frozen=True)
class Tensor:
    datatype: Datatype
    shape: tuple[int, ...]
    data: bytes


# Runs one step on its model (its inputs, the outputs it asks for): the outputs it answered with.
RunStep = Callable[
    [Step, tuple[InputTensor, ...], tuple[str, ...]], Awaitable[tuple[OutputTensor, ...]]
]


async def run(
    name: str, steps: tuple[Step, ...], job: InferJob, run_step: RunStep
) -> tuple[OutputTensor, ...]:
    """Run the graph for one validated request; a failing step fails it with the step named
    (and the other steps still running are cancelled)."""
    tensors = {t.name: Tensor(t.datatype, t.shape, t.data) for t in job.inputs}
    waiting = list(steps)
    running: dict[asyncio.Task[tuple[OutputTensor, ...]], Step] = {}
    try:
        while waiting or running:
            for step in [s for s in waiting if set(s.inputs.values()) <= tensors.keys()]:
                waiting.remove(step)
                inputs = tuple(
                    InputTensor(name, tensors[t].datatype, tensors[t].shape, tensors[t].data)
                    for name, t in step.inputs.items()
                )
                running[asyncio.ensure_future(run_step(step, inputs, tuple(step.outputs)))] = step
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                step = running.pop(task)
                try:
                    outputs = task.result()
                except errors.ServiceError as exc:
                    raise errors.ServiceError(
                        exc.code, f"ensemble '{name}' {step.describe()} failed: {exc.message}"
                    ) from None
                for output in outputs:
                    if output.name in step.outputs:
                        tensors[step.outputs[output.name]] = Tensor(
                            output.datatype, output.shape, output.data
                        )
    finally:
        for task in running:
            task.cancel()
    return tuple(
        OutputTensor(n, tensors[n].datatype, tensors[n].shape, tensors[n].data) for n in job.outputs
    )
