"""The batches one worker is sent through its shared-memory slots (without instance queues, and
from the sequence batcher): a few slots per worker (slots.py), so the next batch can be written
while the worker computes the current one. A batch holds its slot until the worker answers it
or dies: until then the worker may still write into it.

A worker runs its batches one after the other, so the oldest one sent is the one it runs: the
instance's watchdog is told whenever that may have changed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from service.batching.assemble import Batch
from service.inference import errors
from service.inference.jobs import InferResult
from service.inference.timers import fail_at
from service.workers import bls_calls, message_bounds, protocol, results
from service.workers.slots import SLOTS_PER_WORKER, Slot
from service.workers.spec import WorkerSpec

_T = TypeVar("_T")


@dataclass
class _Pending:
    future: asyncio.Future[InferResult]
    slot: Slot
    batch: Batch
    queue_ns: int
    deadline: float | None  # the batch's (its requests' latest): its BLS calls' too


class SlotBatches:
    def __init__(
        self,
        spec: WorkerSpec,
        outputs: results.Outputs,
        bls: bls_calls.BlsCalls,
        changed: Callable[[], None],
    ) -> None:
        """`outputs`: the model's declared outputs (shared with its streams); `bls`: its BLS
        calls, cancelled with the batch that made them; `changed`: told when the oldest batch
        may have changed (the watchdog)."""
        self._spec = spec
        self._outputs = outputs
        self._bls = bls
        self._changed = changed
        self._slots = [Slot() for _ in range(SLOTS_PER_WORKER)]
        self._free: asyncio.Queue[Slot] = asyncio.Queue()
        for slot in self._slots:
            self._free.put_nowait(slot)
        self._pending: dict[int, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._pending

    @property
    def oldest(self) -> int | None:
        """The batch the worker runs, if any."""
        return next(iter(self._pending), None)

    def free_slot(self) -> Slot | None:
        return None if self._free.empty() else self._free.get_nowait()

    async def next_free(self, deadline: float | None) -> Slot:
        return await _until(self._free.get(), deadline, "deadline exceeded waiting for a worker")

    def give_back(self, slot: Slot) -> None:
        self._free.put_nowait(slot)

    async def run(
        self,
        slot: Slot,
        batch: Batch,
        deadline: float | None,
        request_id: int,
        started_ns: int,
        send_segments: Callable[[Slot], None],
        send: Callable[[protocol.Message], None],
    ) -> InferResult:
        """Send the batch in `slot` (taken from here) to the running worker and wait for its
        result, each request's outputs already copied out of the slot."""
        loop = asyncio.get_running_loop()
        try:
            refs = slot.write(batch)
            send_segments(slot)
            outputs = self._outputs.fetch_names(batch.outputs)
            retired, slot.retired = tuple(slot.retired), []
            message = protocol.Infer(
                request_id,
                slot.input.name,
                slot.output.name,
                slot.output.size,
                refs,
                outputs,
                retired,
                message_bounds.result_inline_bytes(
                    len(batch.row_counts), self._spec.max_message_bytes
                ),
            )
            future: asyncio.Future[InferResult] = loop.create_future()
            queue_ns = time.perf_counter_ns() - started_ns
            self._pending[request_id] = _Pending(future, slot, batch, queue_ns, deadline)
            future.add_done_callback(lambda _: self._bls.cancel(request_id))
            send(message)
            self._changed()
        except BaseException:
            self._free.put_nowait(slot)
            raise
        # From here the slot belongs to the pending entry: the worker may still write into it,
        # so only its answer (or its death) gives the slot back.
        timer = fail_at(
            future, deadline, lambda: errors.deadline_exceeded("deadline exceeded in the worker")
        )
        try:
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            if not future.done():
                future.cancel()

    def complete(self, message: protocol.Result | protocol.Failed) -> bool:
        """The worker's answer to a batch; False if it holds none by that id."""
        pending = self._pending.pop(message.request_id, None)
        if pending is None:
            return False
        self._changed()
        try:
            outcome = (
                results.failure(message, self._spec.model_name)
                if isinstance(message, protocol.Failed)
                else self._outputs.split(pending.slot, pending.batch, message, pending.queue_ns)
            )
        finally:
            self._free.put_nowait(pending.slot)
        if pending.future.done():
            return True
        if isinstance(outcome, errors.ServiceError):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)
        return True

    def caller(self, request_id: int, execution_timeout_s: float | None) -> bls_calls.Caller | None:
        """The batch a BLS call was made for, unless it has ended."""
        pending = self._pending.get(request_id)
        if pending is None or pending.future.done():
            return None
        return bls_calls.Caller(pending.batch.chain, pending.deadline, execution_timeout_s)

    def largest_message(self) -> int:
        """The most bytes the worker may send in its next message (message_bounds.py)."""
        holding = message_bounds.Holding(
            loaded=True,
            decoupled=self._spec.decoupled,
            bls=self._spec.python,
            batches=tuple(len(p.batch.row_counts) for p in self._pending.values()),
        )
        return message_bounds.largest_message(holding, self._spec.max_message_bytes)

    def fail_all(self, error: Callable[[int], errors.ServiceError]) -> None:
        """Fail what the worker held; `error` gets each request's place in the worker's line
        (0: the one it was running)."""
        pending, self._pending = self._pending, {}
        self._changed()
        for index, entry in enumerate(pending.values()):
            self._free.put_nowait(entry.slot)
            if not entry.future.done():
                entry.future.set_exception(error(index))

    def release(self) -> None:
        """The slots' shared memory, once the worker is stopped for good."""
        for slot in self._slots:
            slot.release()


async def _until(awaitable: Awaitable[_T], deadline: float | None, message: str) -> _T:
    if deadline is None:
        return await awaitable
    remaining = deadline - asyncio.get_running_loop().time()
    try:
        return await asyncio.wait_for(awaitable, max(remaining, 0.0))
    except TimeoutError:
        raise errors.deadline_exceeded(message) from None
