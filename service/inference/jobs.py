"""The inference path's types, owned by no single stage.

The servicer decodes a protobuf request into an InferJob and encodes an Answer into the
response; below it (the request runner, ensembles, warm-up, batcher, worker instances) only these
types travel, so the protocol stays at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass

from oip.datatypes import Datatype
from service.inference.calls import ROOT, CallChain
from service.inference.identity import ANYONE, Identity


@dataclass(frozen=True)
class InputTensor:
    name: str
    datatype: Datatype
    shape: tuple[int, ...]
    # Little-endian, row-major, exactly prod(shape) * itemsize bytes; BYTES: prod(shape)
    # elements, each a 4-byte little-endian length and its contents.
    data: bytes


@dataclass(frozen=True)
class SequenceFlags:
    """Triton's sequence parameters of a request (`sequence_id`, `sequence_start`,
    `sequence_end`): which sequence it belongs to, for a model with sequence_batching."""

    corrid: int | str
    start: bool = False
    end: bool = False
    owner: Identity = ANYONE  # the caller's identity: a sequence is its starter's alone


@dataclass(frozen=True)
class InferJob:
    """A validated request: every declared input exactly once, and the outputs to return."""

    inputs: tuple[InputTensor, ...]
    outputs: tuple[str, ...]
    batch_size: int  # 0 when the model does not batch
    priority: int | None = None  # Triton's request parameter (1 = highest); None: the default
    timeout_s: float | None = None  # Triton's request parameter `timeout`; None: the default
    chain: CallChain = ROOT  # the BLS calls it was made by (calls.py); ROOT: a client's
    sequence: SequenceFlags | None = None  # None: the request names no sequence

    @property
    def rows(self) -> int:
        """The rows it takes in a batch (1 for a model that does not batch)."""
        return max(self.batch_size, 1)


@dataclass(frozen=True)
class Timings:
    """Where a batch's time in the worker went (pickled between the processes)."""

    input_ns: int
    infer_ns: int
    output_ns: int


@dataclass(frozen=True)
class OutputTensor:
    name: str  # the name callers see
    datatype: Datatype  # as the model declares it (BF16 and FP16 stay labelled right)
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class InferResult:
    """One batch's execution: each request's outputs, in the order of the batch's requests."""

    outputs: tuple[tuple[OutputTensor, ...], ...]
    timings: Timings
    queue_ns: int  # from handing the batch to the instance to the worker getting it


@dataclass(frozen=True)
class Answer:
    """One request's outputs and what its batch cost."""

    outputs: tuple[OutputTensor, ...]
    timings: Timings  # of the whole batch
    queue_ns: int  # this request's wait: in the batcher's queue and for a worker slot
    batch_rows: int


@dataclass(frozen=True)
class StreamAnswer:
    """One response of a decoupled model's request (it answers with zero to many)."""

    outputs: tuple[OutputTensor, ...]  # none: a final response that only says it is final
    final: bool
    error: str | None = None  # the model's error response, or why the request failed in it
    status: str = "INTERNAL"  # the gRPC status name the error is reported under
