"""The front-end's shared-memory slots for one worker: a batch's inputs written into one, the
worker's outputs read back from it, and the channel that hands the worker their segments.

A worker has a few slots, so the next request can be written while the worker computes the
current one.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Mapping

import grpc

from oip.datatypes import Datatype
from service.batching.assemble import Batch, BatchOutput
from service.inference import errors
from service.workers import protocol
from service.workers.shm import Segment, layout

SLOTS_PER_WORKER = 2


class Slot:
    def __init__(self) -> None:
        self.input = Segment(0)
        self.output = Segment(0)
        self.retired: list[str] = []  # segments replaced since the worker last heard of it

    def _replace(self, segment: Segment, size: int) -> Segment:
        bigger = grown(segment, size)
        if bigger is not segment:
            self.retired.append(segment.name)
        return bigger

    def write(self, batch: Batch) -> tuple[protocol.TensorRef, ...]:
        """Each request's rows straight to their offset in the input segment."""
        offsets, total = layout(t.nbytes for t in batch.inputs)
        self.input = self._replace(self.input, total)
        buf = self.input.buf
        refs = []
        for tensor, offset in zip(batch.inputs, offsets, strict=True):
            tensor.write(buf[offset : offset + tensor.nbytes])
            refs.append(
                protocol.TensorRef(tensor.name, tensor.dtype, tensor.shape, offset, tensor.nbytes)
            )
        return tuple(refs)

    def read(
        self, result: protocol.Result, names: Mapping[str, str], datatypes: Mapping[str, Datatype]
    ) -> list[BatchOutput]:
        """The outputs under the names callers see, as views of the output segment: valid
        until the slot is used again."""
        if result.inline:
            # Grown for next time; while shared memory is short, big results stay inline.
            _, needed = layout(ref.nbytes for ref in result.outputs)
            with contextlib.suppress(errors.ServiceError):
                self.output = self._replace(self.output, needed)
            sources: Mapping[str, bytes | memoryview] = result.inline
        else:
            buf = self.output.buf
            sources = {r.name: buf[r.offset : r.offset + r.nbytes] for r in result.outputs}
        outputs = []
        for ref in result.outputs:
            name = names.get(ref.name, ref.name)
            outputs.append(BatchOutput(name, datatypes[name], ref.shape, sources[ref.name]))
        return outputs

    def release(self) -> None:
        self.input.release()
        self.output.release()


def grown(segment: Segment, size: int) -> Segment:
    """`segment`, or a bigger one replacing it. When shared memory is exhausted the request
    fails with RESOURCE_EXHAUSTED and `segment` stays in use, so the slot keeps working."""
    if size <= segment.size:
        return segment
    try:
        bigger = Segment(size)
    except OSError as exc:
        raise errors.ServiceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no shared memory for a request of {size} bytes ({exc.strerror or exc}); "
            "retry later or send less",
        ) from None
    segment.release()
    return bigger


class SegmentChannel:
    """The socket one worker process gets its segments on, as descriptors, and which of them
    it has been given."""

    def __init__(self, channel: socket.socket) -> None:
        self._channel = channel
        self._sent: set[str] = set()  # segments the running worker has been given

    def send(self, slot: Slot) -> None:
        """The slot's segments the worker has not been given yet, before the message naming
        them. The channel never blocks the loop: a worker that stops taking them raises
        OSError here."""
        self._sent.difference_update(slot.retired)
        for segment in (slot.input, slot.output):
            if segment.name in self._sent:
                continue
            segment.send(self._channel)
            self._sent.add(segment.name)

    def send_fds(self, fds: list[int]) -> None:
        """Descriptors the worker takes as a group (its queues: service/workers/queued_loop.py)."""
        socket.send_fds(self._channel, [b"queues"], fds)

    def close(self) -> None:
        self._channel.close()
