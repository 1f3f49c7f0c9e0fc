"""A front-end's own socket to a decoupled worker (service/frontends/remote_streams.py), over a
real socket pair: the other end plays the worker. What a worker writes there is input: a
message that breaks the protocol fails this process's requests in it for good (not run
again) and is reported so the parent ends the worker; a death the parent reports ends them
as its fate says."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from oip.datatypes import BY_NAME
from service.frontends.remote_streams import RemoteStreams
from service.inference import errors
from service.inference.errors import WorkerDied
from service.inference.jobs import InferJob, InputTensor
from service.workers import deaths, protocol
from service.workers.results import Outputs

MAX_MESSAGE = 1 << 20
READY = {"numa": 0, "timeout": None, "launch": 1, "ready": True, "failure": None}


class Worker:
    """The worker's end of the pair, and what the front-end reported of it."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.troubles: list[tuple[int, str]] = []

    def attach(self, launch: int, fds: list[int]) -> None:
        (fd,) = fds
        self.sock = socket.socket(fileno=os.dup(fd))  # the caller closes its own copy

    def trouble(self, launch: int, reason: str) -> None:
        self.troubles.append((launch, reason))

    async def submitted(self) -> protocol.Submit:
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        header = await loop.sock_recv(self.sock, protocol.header_size())
        body = b""
        while len(body) < protocol.body_size(header):
            body += await loop.sock_recv(self.sock, protocol.body_size(header) - len(body))
        message = protocol.decode(body)
        assert isinstance(message, protocol.Submit)
        return message

    async def send(self, data: bytes) -> None:
        assert self.sock is not None
        await asyncio.get_running_loop().sock_sendall(self.sock, data)


@pytest.fixture
async def remote() -> AsyncIterator[tuple[RemoteStreams, Worker]]:
    worker = Worker()
    outputs = Outputs()
    outputs.declare({"y": BY_NAME["INT32"]}, {})
    instance = RemoteStreams("m", dict(READY), outputs, MAX_MESSAGE, worker.attach, worker.trouble)
    assert worker.sock is not None
    worker.sock.setblocking(False)
    yield instance, worker
    instance.stop()
    worker.sock.close()


def job() -> InferJob:
    x = InputTensor("x", BY_NAME["INT32"], (1,), np.array([7], np.int32).tobytes())
    return InferJob((x,), ("y",), 0)


def response(request_id: int, value: int, final: bool) -> bytes:
    data = np.array([value], np.int32).tobytes()
    ref = protocol.TensorRef("y", "<i4", (1,), 0, len(data))
    return protocol.encode(protocol.Response(request_id, (ref,), data, final))


async def test_responses_come_on_the_front_ends_own_socket(
    remote: tuple[RemoteStreams, Worker],
) -> None:
    instance, worker = remote
    request = await instance.submit(job(), "caller", "{}")
    submit = await worker.submitted()
    assert (submit.id, submit.outputs, submit.parameters) == ("caller", ("y",), "{}")
    assert instance.outstanding == 1
    await worker.send(response(submit.request_id, 1, False) + response(submit.request_id, 2, True))
    values = []
    while (answer := await request.next(None, 10.0)) is not None:
        values.append(np.frombuffer(answer.outputs[0].data, np.int32)[0])
    assert values == [1, 2]
    request.close()
    assert instance.outstanding == 0 and worker.troubles == []


def header(size: int) -> bytes:
    return struct.pack("<I", size)


def unreadable() -> bytes:
    body = pickle.dumps(os.getcwd, protocol=pickle.HIGHEST_PROTOCOL)  # a class not allowed
    return header(len(body)) + body


BREACHES: dict[str, Any] = {
    "oversized": lambda request_id: header(4 * MAX_MESSAGE),  # nothing after it read
    "unreadable": lambda request_id: unreadable(),
    "not a response": lambda request_id: protocol.encode(protocol.Credit(request_id, 1)),
    "past its credit": lambda request_id: b"".join(
        response(request_id, n, False) for n in range(protocol.RESPONSE_WINDOW + 1)
    ),
}


@pytest.mark.parametrize("breach", sorted(BREACHES))
async def test_a_worker_breaking_the_protocol_fails_its_requests_for_good(
    remote: tuple[RemoteStreams, Worker], breach: str
) -> None:
    instance, worker = remote
    request = await instance.submit(job(), "caller", "{}")
    submit = await worker.submitted()
    await worker.send(BREACHES[breach](submit.request_id))
    with pytest.raises(errors.ServiceError) as failed:
        while await request.next(None, 10.0) is not None:
            pass
    assert not isinstance(failed.value, WorkerDied)  # never run again
    assert "broke the protocol" in failed.value.message
    ((launch, _),) = worker.troubles
    assert launch == 1  # the parent ends that launch


async def test_a_death_the_parent_reports_ends_requests_as_its_fate_says(
    remote: tuple[RemoteStreams, Worker],
) -> None:
    instance, worker = remote
    request = await instance.submit(job(), "caller", "{}")
    await worker.submitted()
    how = "was killed by signal 9"
    event = {"event": "ended", "how": how, "fate": deaths.Fate.REQUEUE.value, "blamed": True}
    instance.told(event)
    with pytest.raises(WorkerDied):  # no response yet: it may run again
        await request.next(None, 10.0)
    assert instance.outstanding == 0
