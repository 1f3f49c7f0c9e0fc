"""A queued Python worker's BLS link as its loop's inbox (BlsLink.queued): the loop sleeps in
poll() on the link's eventfd, so every message the link's thread reads must wake it, also one
read before the loop turned to its queues; and the model's BLS calls are refused, naming the
parameter that asked for the queues."""

from __future__ import annotations

import queue
import select
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from service.backend.python_runtime import triton_python_backend_utils as pb_utils
from service.workers import protocol
from service.workers.bls_link import BlsLink

WAIT_MS = 10_000


@pytest.fixture
def link() -> Iterator[tuple[BlsLink, queue.SimpleQueue[protocol.Message | None]]]:
    """A link whose thread reads what the test puts (None: the server closed the socket)."""
    server, worker = socket.socketpair()
    sent: queue.SimpleQueue[protocol.Message | None] = queue.SimpleQueue()
    try:
        yield BlsLink(worker, sent.get, 1 << 20), sent
    finally:
        sent.put(None)
        server.close()
        worker.close()


def readable(link: BlsLink, wait_ms: int) -> bool:
    poller = select.poll()
    poller.register(link.fileno(), select.POLLIN)
    return bool(poller.poll(wait_ms))


def test_every_message_wakes_the_loop_also_one_read_before_it_turned_to_its_queues(
    link: tuple[BlsLink, queue.SimpleQueue[protocol.Message | None]],
) -> None:
    bls, sent = link
    sent.put(protocol.AddProducer(1))
    assert bls.recv() == protocol.AddProducer(1)  # the loop before its queues: blocking
    sent.put(protocol.AddProducer(2))
    while bls._inbox.empty():  # read by the link's thread, not yet taken
        pass
    bls.queued("mine")
    assert readable(bls, WAIT_MS)
    assert bls.take() == [protocol.AddProducer(2)]
    assert not readable(bls, 0)
    assert bls.take() == []
    sent.put(protocol.DropProducer(2))
    sent.put(protocol.Shutdown())
    assert readable(bls, WAIT_MS)
    taken: list[protocol.Message | None] = []
    while len(taken) < 2:
        assert readable(bls, WAIT_MS)
        taken += bls.take()
    assert taken == [protocol.DropProducer(2), protocol.Shutdown()]


def test_a_bls_call_is_refused_naming_the_parameter(
    link: tuple[BlsLink, queue.SimpleQueue[protocol.Message | None]],
) -> None:
    bls, _ = link
    bls.queued("mine")
    request = pb_utils.InferenceRequest(
        model_name="other",
        requested_output_names=["y"],
        inputs=[pb_utils.Tensor("x", np.zeros(2, np.float32))],
    )
    with pytest.raises(pb_utils.TritonModelException, match="python_instance_queues"):
        bls.submit(request, decoupled=False)
