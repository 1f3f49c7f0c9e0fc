"""BLS's pure pieces: the chain of calls, a call's deadline and inputs, the status codes a model
sees, and pb_utils' InferenceRequest as Triton's BLS models build it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from oip.datatypes import BY_NAME
from service.backend.python_runtime import triton_python_backend_utils as pb_utils
from service.inference import errors
from service.inference.calls import ROOT, CallChain, joined
from service.workers import protocol
from service.workers.bls_calls import Caller, call_deadline, call_inputs
from service.workers.results import triton_code
from service.workers.tensor_io import inline_arrays


def test_a_chain_grows_by_one_call_and_a_batch_joins_its_requests_chains() -> None:
    first = ROOT.called_from(7)
    assert first == CallChain(1, frozenset({7}))
    second = first.called_from(9)
    assert second == CallChain(2, frozenset({7, 9}))
    assert joined([ROOT, ROOT]) is ROOT
    assert joined([first, ROOT, CallChain(1, frozenset({3}))]) == CallChain(1, frozenset({3, 7}))


def test_a_call_ends_by_the_sooner_of_its_timeout_and_its_callers_deadline() -> None:
    assert call_deadline(100.0, 2_000_000, Caller(ROOT, 101.0, 30.0)) == 101.0
    assert call_deadline(100.0, 500_000, Caller(ROOT, 101.0, 30.0)) == 100.5
    assert call_deadline(100.0, 0, Caller(ROOT, None, None)) is None
    # Neither sets one: the caller's execution limit, so a call that never runs still ends.
    assert call_deadline(100.0, 0, Caller(ROOT, None, 30.0)) == 130.0


def call(refs: tuple[protocol.TensorRef, ...], data: bytes) -> protocol.BlsCall:
    return protocol.BlsCall(1, 1, "mlp", "", refs, data, ("probabilities",), 0)


def test_a_calls_inputs_arrive_as_the_worker_sent_them() -> None:
    text = np.array([[b"ab"], [b""]], dtype=np.object_)
    numbers = np.arange(6, dtype=np.float32).reshape(2, 3)
    refs, data = inline_arrays([("text", text), ("numbers", numbers)])
    got = call_inputs(call(refs, data))
    assert [(t.name, t.datatype, t.shape) for t in got] == [
        ("text", BY_NAME["BYTES"], (2, 1)),
        ("numbers", BY_NAME["FP32"], (2, 3)),
    ]
    assert np.frombuffer(got[1].data, np.float32).tolist() == numbers.ravel().tolist()


def test_a_call_described_wrong_is_invalid() -> None:
    outside = (protocol.TensorRef("x", "<f4", (4,), 0, 16),)
    with pytest.raises(errors.ServiceError, match="lies outside the call") as raised:
        call_inputs(call(outside, b"\0" * 8))
    assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(errors.ServiceError, match="no protocol datatype"):
        call_inputs(call((protocol.TensorRef("x", "<c8", (1,), 0, 8),), b"\0" * 8))


def test_statuses_reach_the_model_as_tritons_codes() -> None:
    assert triton_code(grpc.StatusCode.INVALID_ARGUMENT) == pb_utils.TritonError.INVALID_ARG
    assert triton_code(grpc.StatusCode.NOT_FOUND) == pb_utils.TritonError.NOT_FOUND
    assert triton_code(grpc.StatusCode.CANCELLED) == pb_utils.TritonError.CANCELLED
    assert triton_code(grpc.StatusCode.DEADLINE_EXCEEDED) == pb_utils.TritonError.UNAVAILABLE
    assert triton_code(grpc.StatusCode.RESOURCE_EXHAUSTED) == pb_utils.TritonError.UNAVAILABLE
    assert triton_code(grpc.StatusCode.DATA_LOSS) == pb_utils.TritonError.UNKNOWN


def test_a_bls_request_takes_tritons_keywords() -> None:
    request = pb_utils.InferenceRequest(
        model_name="mlp",
        requested_output_names=["probabilities"],
        inputs=[pb_utils.Tensor("input", np.zeros((1, 256), np.float32))],
        model_version=2,
        timeout=1000,
        parameters={"key": "value"},
    )
    assert (request.model_name, request.model_version, request.timeout()) == ("mlp", 2, 1000)
    assert request.parameters() == '{"key": "value"}'
    assert request.requested_output_names() == ["probabilities"]


def test_a_model_name_may_be_bytes_as_a_bytes_input_gives_it() -> None:
    request = pb_utils.InferenceRequest([], ["y"], model_name=np.array([b"mlp"], np.object_)[0])
    assert request.model_name == "mlp"


def test_exec_needs_a_model_that_can_call() -> None:
    request = pb_utils.InferenceRequest([], ["y"], model_name="mlp")
    with pytest.raises(pb_utils.TritonModelException, match="that is not decoupled"):
        request.exec(decoupled=True)
