"""How big the next message from one worker may be. A worker runs model.py, which can write
anything to its socket, so the front-end checks each message's header against the largest
message the worker could legitimately send now, before it reads a byte of the body.

Pure: the decision takes what the front-end knows of the worker (its model's kind and the work
it holds) and the server's --max-message-bytes; the instance reads its header, asks, and kills
a worker that declares more (instance.py)."""

from __future__ import annotations

from dataclasses import dataclass

from service.workers import protocol

# Any message without tensor bytes (Loaded, LoadFailed, Failed, a Result whose outputs are in
# shared memory) and the framing around a message's tensor bytes.
DESCRIPTOR_MAX = 64 << 10


@dataclass(frozen=True)
class Holding:
    """What the front-end expects from one worker now."""

    loaded: bool  # False: only Loaded or LoadFailed may come
    decoupled: bool  # its responses carry their outputs inline, and may come after a Cancel
    bls: bool  # a Python model: a batch it runs may make BLS calls (inputs inline)
    batches: tuple[int, ...] = ()  # requests of each batch it holds


def result_inline_bytes(requests: int, max_message: int) -> int:
    """The most tensor bytes a batch's Result may carry inline: what its callers could receive
    (each at most --max-message-bytes); the worker is told it with the batch (Infer)."""
    return min(max(requests, 1) * max_message, protocol.MAX_MESSAGE - DESCRIPTOR_MAX)


def bls_inline_bytes(max_message: int) -> int:
    """The most input bytes one BLS call may carry: a request to the target model."""
    return min(protocol.BLS_MAX_BYTES, max_message)


def largest_message(holding: Holding, max_message: int) -> int:
    """The most bytes (body, after the header) the worker's next message may declare."""
    if not holding.loaded:
        return DESCRIPTOR_MAX
    inline = max_message if holding.decoupled else 0
    if holding.batches:
        inline = max(inline, result_inline_bytes(max(holding.batches), max_message))
        if holding.bls:
            inline = max(inline, bls_inline_bytes(max_message))
    return min(DESCRIPTOR_MAX + inline, protocol.MAX_MESSAGE)
