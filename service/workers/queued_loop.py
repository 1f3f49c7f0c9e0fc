"""A Paddle worker that takes its requests straight from the process holding the calls: it
reads them from its request ring, forms batches itself by Triton's rules (the same
`BatchQueue` decisions the server's batcher makes), runs them, and writes each request's answer
into its reply ring, waking the caller's process once per batch, not once per request.

It sleeps in poll() on its wake-up descriptor and its message socket until a request comes or
the queue's next decision is due (the oldest request's batching window, a queue timeout):
an idle worker uses no CPU. Before it runs a batch it writes the batch's requests into the
running area, so the caller knows what it was computing if it dies."""

from __future__ import annotations

import math
import mmap
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn, cast

import numpy as np

from oip.datatypes import BY_NAME
from service.batching.assemble import BatchInput, plan
from service.batching.queue import BatchQueue, Pending
from service.inference.jobs import InferJob, InputTensor, Timings
from service.queues import records, wakeups
from service.queues.ring import max_record
from service.workers import protocol
from service.workers.results import BAD_INPUT_ERRORS

FULL_REPLIES_WAIT_S = 0.001  # the caller reads replies as they come: only a burst fills the ring


class QueuedWorker:
    def __init__(
        self,
        model: Any,
        setup: protocol.Queues,
        segment: mmap.mmap,
        wake_out: int,
        reason: Callable[[BaseException], str],
        testing: tuple[float | None, float | None],
    ) -> None:
        """`testing` (--testing-service only): the input values that make it abort, and
        scribble over its queues."""
        self._model = model
        self._segment = segment
        self._wake_out = wake_out
        self._setup = setup
        self._requests, self._replies, self._running = setup.layout.worker_end(memoryview(segment))
        self._queue = BatchQueue(replace(setup.policy, max_queue_size=0))
        self._waiting: dict[int, Pending] = {}
        self._reason = reason
        self._crash_on, self._scribble_on = testing
        self._inputs = [(name, BY_NAME[datatype]) for name, datatype in setup.inputs]
        self._batch = 0  # the number of the batch running
        self.written = 0  # replies so far: the caller is woken once for those of a step

    def take(self) -> None:
        """Every record the caller wrote, into the queue (cancellations out of it)."""
        now = time.monotonic()
        while (payload := self._requests.take()) is not None:
            record = records.read_request(payload)
            if isinstance(record, records.Cancel):
                pending = self._waiting.pop(record.id, None)
                if pending is not None:
                    self._queue.remove(pending)
                    self._fail(pending, records.CANCELLED, "cancelled by its caller")
                continue
            job = InferJob(
                tuple(
                    InputTensor(*self._inputs[t.position], t.shape, cast(bytes, t.data))
                    for t in record.inputs
                ),
                tuple(self._setup.outputs[i] for i in record.outputs),
                record.batch_size,
                record.priority,
            )
            pending = Pending(job, now, record.expires, record.priority, record.deadline)
            pending.alone = bool(record.flags & records.ALONE)
            pending.ticket = (record.id, record.outputs)
            self._queue.push(pending)
            self._waiting[record.id] = pending

    def step(self) -> float | None:
        """Answer what expired and run the batch due now, if any; when to look again (None:
        when a request comes), or 0.0 after a batch (look again at once)."""
        now = time.monotonic()
        for pending in self._queue.expire(now):
            del self._waiting[pending.ticket[0]]
            waited = now - pending.arrival
            self._fail(
                pending,
                records.EXPIRED,
                f"the request waited {waited:.3f} s in the queue and timed out before it ran",
            )
        action = self._queue.next_batch(now)
        if isinstance(action, list):
            for pending in action:
                del self._waiting[pending.ticket[0]]
            self._run(action, now)
            return 0.0
        return action

    def _run(self, batch: list[Pending], now: float) -> None:
        self._batch = self._running.begin([p.ticket[0] for p in batch])
        try:
            self._compute(batch, now)
        except Exception as exc:
            text = self._reason(exc)
            if len(batch) > 1 and any(kind in text for kind in BAD_INPUT_ERRORS):
                # One request's values failed the batch: each alone, so only it fails.
                for pending in batch:
                    self._run([pending], now)
                return
            for pending in batch:
                self._fail(pending, records.FAILED, text)
        finally:
            self._running.end()

    def _compute(self, batch: list[Pending], now: float) -> None:
        planned = plan([p.job for p in batch], self._setup.policy.shapes)
        arrays = {tensor.name: _array(tensor) for tensor in planned.inputs}
        if _holds(arrays, self._crash_on):
            os.abort()  # test-only (--testing-service): stands in for a crash inside Paddle
        if _holds(arrays, self._scribble_on):
            self._scribble()
        outputs, timings = self._model.run(arrays, planned.outputs)
        for name, array in outputs.items():
            if planned.rows and (not array.shape or array.shape[0] != planned.rows):
                raise RuntimeError(
                    f"output '{name}' has shape {list(array.shape)}, which does not start with "
                    f"the batch's {planned.rows} rows; the model cannot be batched"
                )
        start = 0
        for pending, rows in zip(batch, planned.row_counts, strict=True):
            request_id, wanted = pending.ticket
            parts = []
            for index in wanted:
                array = outputs[self._setup.outputs[index]]
                if planned.rows:
                    array = array[start : start + rows]
                data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                parts.append((index, tuple(array.shape), data))
            start += rows
            queue_ns = int((now - pending.arrival) * 1e9)
            self._answer(request_id, planned.formed, timings, queue_ns, parts)

    def _answer(
        self,
        request_id: int,
        rows: int,
        timings: Timings,
        queue_ns: int,
        parts: list[tuple[int, tuple[int, ...], Any]],
    ) -> None:
        size = records.reply_size([(shape, data.nbytes) for _, shape, data in parts])
        if size > max_record(self._replies.capacity):
            text = (
                f"the outputs take {size} bytes, more than the instance queue's reply ring "
                f"takes ({max_record(self._replies.capacity)}); raise --instance-queue-mb"
            )
            self._reply(records.failure_bytes(request_id, records.TOO_LARGE, text))
            return
        buf = self._reserve(size)
        records.write_answer(buf, request_id, self._batch, rows, timings, queue_ns, parts)
        buf.release()
        self._replies.commit()
        self.written += 1

    def _fail(self, pending: Pending, kind: int, text: str) -> None:
        self._reply(records.failure_bytes(pending.ticket[0], kind, text))

    def _reply(self, payload: bytes) -> None:
        buf = self._reserve(len(payload))
        buf[:] = payload
        buf.release()
        self._replies.commit()
        self.written += 1

    def _reserve(self, size: int) -> memoryview:
        """Room in the reply ring; while it is full, the caller is reading it: wait."""
        while (buf := self._replies.reserve(size)) is None:
            time.sleep(FULL_REPLIES_WAIT_S)
        return buf

    def _scribble(self) -> NoReturn:
        """Test-only: what hostile model code could do to the queues (random bytes over all
        of their shared memory), then wake the caller and hang."""
        self._segment[:] = os.urandom(len(self._segment))
        self.written += 1
        wakeups.wake(self._wake_out)
        while True:
            time.sleep(3600)


def _holds(arrays: dict[str, np.ndarray[Any, Any]], value: float | None) -> bool:
    return value is not None and any((a == value).any() for a in arrays.values())


def _array(tensor: BatchInput) -> np.ndarray[Any, Any]:
    """The batch's input: the one request's bytes as they are, else the requests' rows and
    the padding written into a buffer of its own."""
    dtype = np.dtype(tensor.dtype)
    if len(tensor.parts) == 1 and tensor.consecutive and len(tensor.parts[0].data) == tensor.nbytes:
        return np.frombuffer(tensor.parts[0].data, dtype).reshape(tensor.shape)
    buf = bytearray(tensor.nbytes)
    tensor.write(memoryview(buf))
    return np.frombuffer(buf, dtype).reshape(tensor.shape)


def serve_queued(
    model: Any,
    setup: protocol.Queues,
    recv: Callable[[], protocol.Message | None],
    sock: socket.socket,
    channel: socket.socket,
    reason: Callable[[BaseException], str],
    testing: tuple[float | None, float | None],
) -> int:
    """Serve from the rings until Shutdown or the caller's socket closes."""
    _, fds, _, _ = socket.recv_fds(channel, 256, 3)
    if len(fds) != 3:
        return 2
    segment_fd, wake_in, wake_out = fds
    segment = mmap.mmap(segment_fd, setup.layout.size)
    os.close(segment_fd)
    worker = QueuedWorker(model, setup, segment, wake_out, reason, testing)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(wake_in, select.POLLIN)
    told = 0
    while True:
        worker.take()
        look = worker.step()
        if worker.written != told:
            told = worker.written
            wakeups.wake(wake_out)
        if look == 0.0:
            continue
        timeout = -1 if look is None else max(0, math.ceil((look - time.monotonic()) * 1000))
        for fd, _ in poller.poll(timeout):
            if fd == wake_in:
                wakeups.clear(wake_in)
                continue
            msg = recv()
            if msg is None or isinstance(msg, protocol.Shutdown):
                if isinstance(msg, protocol.Shutdown) and hasattr(model, "finalize"):
                    model.finalize()
                return 0
