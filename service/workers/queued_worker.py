"""A Paddle worker's batches from the processes holding the calls (the server, and each
front-end with --frontends N: its producers): it takes each one's request records, forms
batches itself by Triton's rules (the same `BatchQueue` decisions the server's batcher makes)
across all of them, runs them, and writes each request's answer into its caller's reply ring,
each caller's answers of a batch in one record. Before it runs a batch it writes the batch's
number into every producer's running area, with the ids of that producer's requests in it, so
each caller knows what it was computing if it dies, and each watchdog sees it progressing;
and, after each take, how many requests of the other callers it holds, so a process choosing
an instance weighs what every process gave each one. The loop that drives it, asleep in
poll() between steps, is queued_loop.py."""

from __future__ import annotations

import collections
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple, NoReturn, cast

import numpy as np

from oip.bytes_tensor import to_numpy_bytes
from oip.datatypes import BY_NAME, is_bytes
from service.batching.assemble import BatchInput, plan
from service.batching.queue import BatchQueue, Pending
from service.inference.jobs import Timings
from service.queues import records, replies, wakeups
from service.queues.ring import max_record
from service.workers import protocol
from service.workers.producers import Producer
from service.workers.results import BAD_INPUT_ERRORS
from service.workers.runs import Arrays, Member, Source, gathered
from service.workers.tensor_io import wire_form

MAX_OUTPUT_CHOICES = 64  # the outputs asked for that _output_names keeps the names of


class QueuedWorker:
    def __init__(
        self,
        model: Any,
        setup: protocol.Queues,
        reason: Callable[[BaseException], str],
        testing: tuple[float | None, float | None],
    ) -> None:
        """`testing` (--testing-service only): the input values that make it abort, and
        scribble over its queues."""
        self._model = model
        self._setup = setup
        self.producers: dict[int, Producer] = {}
        self._queue = BatchQueue(replace(setup.policy, max_queue_size=0))
        self._waiting: dict[tuple[int, int], Pending] = {}  # by (producer, request id)
        self._reason = reason
        self._crash_on, self._scribble_on = testing
        self._inputs = [(name, BY_NAME[datatype]) for name, datatype in setup.inputs]
        # BYTES inputs: no fixed row size to gather by, each batch planned request by request.
        self._gathers = not any(datatype.name == "BYTES" for _, datatype in self._inputs)
        self._names: dict[tuple[int, ...], tuple[str, ...]] = {}  # _output_names'
        self._batch = 0  # the number of the batch running
        self._counted = False  # whether an answer of the batch running counts it

    def add(self, key: int, segment: mmap.mmap, wake_in: int, wake_out: int) -> Producer:
        """A producer's queues (replacing those it had under that key)."""
        self.drop(key)
        producer = self.producers[key] = Producer(self._setup.layout, segment, wake_in, wake_out)
        return producer

    def drop(self, key: int) -> None:
        """A producer gone: its requests leave the queue unanswered."""
        producer = self.producers.pop(key, None)
        if producer is None:
            return
        for waiting in [k for k in self._waiting if k[0] == key]:
            self._queue.remove(self._waiting.pop(waiting))
        producer.close()

    def take(self) -> None:
        """Every record the producers wrote, into the queue (cancellations out of it): the
        requests that came together in one form as one run."""
        now = time.monotonic()
        for key, producer in self.producers.items():
            for record in records.read_requests(producer.requests.take_all()):
                self._take(key, record, now)

    def _take(self, key: int, record: records.Run | records.Cancel, now: float) -> None:
        if isinstance(record, records.Cancel):
            pending = self._waiting.pop((key, record.id), None)
            if pending is not None:
                self._queue.remove(pending)
                self._fail(pending, replies.CANCELLED, "cancelled by its caller")
            return
        names = self._output_names(record.outputs)
        source = Source(key, record, self._inputs, names, self._setup.policy.shapes)
        push, waiting = self._queue.push, self._waiting
        for index, request_id in enumerate(record.ids):
            member = Member(source, index, now)
            push(member)
            waiting[key, request_id] = member

    def publish(self) -> None:
        """Tell each producer how many requests of the others the worker holds, after each
        take: those queued, the batch the next step runs among them (what it says stays
        until the loop's next turn, after that batch)."""
        if len(self.producers) == 1:  # alone: nobody else's (written once, after others left)
            for producer in self.producers.values():
                producer.others_held(0)
            return
        total = len(self._waiting)
        own = collections.Counter(key for key, _ in self._waiting)
        for key, producer in self.producers.items():
            producer.others_held(total - own[key])

    def _output_names(self, outputs: tuple[int, ...]) -> tuple[str, ...]:
        """The names of the outputs a request asks for, kept per choice (a model has few)."""
        names = self._names.get(outputs)
        if names is None:
            names = tuple(self._setup.outputs[i] for i in outputs)
            if len(self._names) < MAX_OUTPUT_CHOICES:
                self._names[outputs] = names
        return names

    def step(self) -> float | None:
        """Answer what expired and run the batch due now, if any; when to look again (None:
        when a request comes), or 0.0 after a batch (look again at once)."""
        now = time.monotonic()
        for pending in self._queue.expire(now):
            del self._waiting[pending.ticket[:2]]
            waited = now - pending.arrival
            self._fail(
                pending,
                replies.EXPIRED,
                f"the request waited {waited:.3f} s in the queue and timed out before it ran",
            )
        action = self._queue.next_batch(now)
        if isinstance(action, list):
            for pending in action:
                del self._waiting[pending.ticket[:2]]
            self._run(action, now)
            return 0.0
        return action

    def tell(self) -> None:
        """Wake each producer with replies since it was last woken, once."""
        for producer in self.producers.values():
            producer.tell()

    def _run(self, batch: list[Pending], now: float) -> None:
        self._batch += 1
        for key, producer in self.producers.items():
            producer.running.begin(self._batch, [p.ticket[1] for p in batch if p.ticket[0] == key])
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
                self._fail(pending, replies.FAILED, text)
        finally:
            for producer in self.producers.values():
                producer.running.end()

    def _compute(self, batch: list[Pending], now: float) -> None:
        arrays, names, rows, row_counts = self._inputs_of(batch)
        if _holds(arrays, self._crash_on):
            os.abort()  # test-only (--testing-service): stands in for a crash inside Paddle
        if _holds(arrays, self._scribble_on):
            self._scribble()
        outputs, timings = self._model.run(arrays, names)
        for name, array in outputs.items():
            if rows and (not array.shape or array.shape[0] != rows):
                raise RuntimeError(
                    f"output '{name}' has shape {list(array.shape)}, which does not start with "
                    f"the batch's {rows} rows; the model cannot be batched"
                )
        # One answer record per producer and outputs asked for: each output's rows of those
        # requests together, not one record per request.
        groups: dict[tuple[int, tuple[int, ...]], list[tuple[Pending, int, int]]] = {}
        start = 0
        for pending, count in zip(batch, row_counts, strict=True):
            key, _, wanted = pending.ticket
            groups.setdefault((key, wanted), []).append((pending, start, count))
            start += count
        self._counted = False
        formed = _Formed(rows, sum(row_counts), timings, now)
        for (key, wanted), members in groups.items():
            producer = self.producers.get(key)
            if producer is not None:
                self._answer(producer, wanted, members, outputs, formed)

    def _inputs_of(self, batch: list[Pending]) -> tuple[Arrays, tuple[str, ...], int, list[int]]:
        """The batch's inputs, the outputs it asks for, the rows it runs (0: the model does
        not batch) and each request's: gathered from the runs' arrays where no input is padded
        to sequence buckets, else planned request by request as the server's batcher does."""
        members = cast(list[Member], batch)  # _take queues only Members
        first = members[0].source
        shapes = self._setup.policy.shapes
        row_counts = [member.source.rows for member in members]
        if first.run.batch_size and not shapes.sequence and self._gathers:
            rows = shapes.batch_rows(sum(row_counts))
            return gathered(members, rows), first.names, rows, row_counts
        planned = plan([member.job for member in members], shapes)
        arrays = {tensor.name: _array(tensor) for tensor in planned.inputs}
        return arrays, planned.outputs, planned.rows, list(planned.row_counts)

    def _answer(
        self,
        producer: Producer,
        wanted: tuple[int, ...],
        members: list[tuple[Pending, int, int]],
        outputs: Arrays,
        formed: _Formed,
    ) -> None:
        """The answers to requests of one producer that asked for the same outputs, in one
        record, or each in its own where together they are more than a record takes."""
        parts = []
        for index in wanted:
            array = outputs[self._setup.outputs[index]]
            if formed.rows:  # else the model does not batch: one request, the whole output
                array = _rows(array, [(start, count) for _, start, count in members])
            _, data = wire_form(array)
            parts.append((index, tuple(array.shape), data))
        size = replies.answers_size(len(members), [(shape, d.nbytes) for _, shape, d in parts])
        most = max_record(producer.replies.capacity)
        if size > most:
            if len(members) > 1:
                for member in members:
                    self._answer(producer, wanted, [member], outputs, formed)
                return
            text = (
                f"the outputs take {size} bytes, more than the instance queue's reply ring "
                f"takes ({most}); raise --instance-queue-mb"
            )
            self._fail(members[0][0], replies.TOO_LARGE, text)
            return
        now = formed.now
        answered = [(p.ticket[1], int((now - p.arrival) * 1e9)) for p, _, _ in members]
        batch, counts = self._batch, not self._counted
        self._counted = True
        producer.reply(
            size,
            lambda buf: replies.write_answers(
                buf, batch, formed.formed, formed.timings, counts, answered, parts
            ),
        )

    def _fail(self, pending: Pending, kind: int, text: str) -> None:
        key, request_id, _ = pending.ticket
        producer = self.producers.get(key)
        if producer is not None:
            payload = replies.failure_bytes(request_id, kind, text)
            producer.reply(len(payload), lambda buf: buf.__setitem__(slice(None), payload))

    def flush(self) -> bool:
        """Each producer's waiting answers, as far as its ring has room; whether some wait."""
        return any([producer.flush() for producer in self.producers.values()])

    def _scribble(self) -> NoReturn:
        """Test-only: what hostile model code could do to the queues (random bytes over all
        of their shared memory), then wake the callers and hang."""
        for producer in self.producers.values():
            producer.segment[:] = os.urandom(len(producer.segment))
            wakeups.wake(producer.wake_out)
        while True:
            time.sleep(3600)


class _Formed(NamedTuple):
    """What every answer of a batch says of it."""

    rows: int  # the rows it ran, padding included; 0: the model does not batch
    formed: int  # the rows its requests brought
    timings: Timings
    now: float  # when it was taken from the queue


def _rows(array: np.ndarray[Any, Any], spans: list[tuple[int, int]]) -> np.ndarray[Any, Any]:
    """The rows (start, count) of an output, in that order: a slice where they follow each
    other (one producer's requests, as they usually come)."""
    first, end = spans[0][0], spans[0][0]
    for start, count in spans:
        if start != end:
            return np.concatenate([array[s : s + n] for s, n in spans])
        end += count
    return array[first:end]


def _holds(arrays: dict[str, np.ndarray[Any, Any]], value: float | None) -> bool:
    return value is not None and any((a == value).any() for a in arrays.values())


def _array(tensor: BatchInput) -> np.ndarray[Any, Any]:
    """The batch's input: the one request's bytes as they are, else the requests' rows and
    the padding written into a buffer of its own (BYTES: its elements, as a Python model
    receives them)."""
    dtype = np.dtype(tensor.dtype)
    if len(tensor.parts) == 1 and tensor.consecutive and len(tensor.parts[0].data) == tensor.nbytes:
        data: bytes | bytearray | memoryview = tensor.parts[0].data
    else:
        data = bytearray(tensor.nbytes)
        tensor.write(memoryview(data))
    if is_bytes(dtype):
        return to_numpy_bytes(memoryview(data), tensor.shape)
    return np.frombuffer(data, dtype).reshape(tensor.shape)
