"""Sequences of a sequence-batched model (Triton's sequence batcher): every request of one
carries the same `sequence_id`, the first `sequence_start`, the last `sequence_end`; the
server runs them in order on the instance that holds the sequence's state."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from clients.streaming import StreamRequest
from clients.tensors import Parameter

# Random ids: 63 bits, so they fit Triton's int64 and uint64 both, and two clients that never
# talk pick the same one with negligible chance.
ID_BITS = 63


def new_sequence_id() -> int:
    return secrets.randbits(ID_BITS) or 1


class SequenceParameters:
    """The sequence parameters of one sequence's requests, in the order they are sent."""

    def __init__(self, sequence_id: int | str | None = None) -> None:
        self.sequence_id = new_sequence_id() if sequence_id is None else sequence_id
        if not self.sequence_id:
            raise ValueError("a sequence id is a non-zero integer or a non-empty string")
        self._started = False
        self.ended = False

    def next(self, end: bool = False) -> dict[str, Parameter]:
        """The parameters of the next request (the first starts the sequence)."""
        if self.ended:
            raise ValueError(f"sequence {self.sequence_id!r} has ended")
        parameters: dict[str, Parameter] = {
            "sequence_id": self.sequence_id,
            "sequence_start": not self._started,
            "sequence_end": end,
        }
        self._started, self.ended = True, end
        return parameters

    def request(
        self,
        model: str,
        inputs: Mapping[str, Any],
        end: bool = False,
        request_id: str = "",
        outputs: Sequence[str] = (),
        version: str = "",
    ) -> StreamRequest:
        """The next request as one for `stream_infer` (a stream keeps a sequence's requests
        in order)."""
        return StreamRequest(model, inputs, request_id, outputs, version, parameters=self.next(end))


_Answer = TypeVar("_Answer", covariant=True)


class Infers(Protocol[_Answer]):
    """A client's `infer` (the sync client's answers, the async client's a coroutine)."""

    def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        outputs: Sequence[str] = (),
        version: str = "",
        timeout: float | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> _Answer: ...


@dataclass
class ClientSequence(Generic[_Answer]):
    """One sequence's requests through a client (`client.sequence(model)`): `end=True` on the
    last. Awaited with the async client."""

    client: Infers[_Answer]
    model: str
    parameters: SequenceParameters
    version: str = ""

    @property
    def sequence_id(self) -> int | str:
        return self.parameters.sequence_id

    def infer(
        self,
        inputs: Mapping[str, Any],
        outputs: Sequence[str] = (),
        end: bool = False,
        timeout: float | None = None,
    ) -> _Answer:
        return self.client.infer(
            self.model, inputs, outputs, self.version, timeout, self.parameters.next(end)
        )
