"""A decoupled request's answers as ModelStreamInfer responses (Triton's conventions), over
every kind of sequence a model may send: data responses, then one final one that carries data,
only the final flag, or an error."""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.datatypes import BY_NAME
from protos.inference import grpc_service_pb2 as pb
from service.api.stream_responses import (
    EMPTY_FINAL,
    FINAL_RESPONSE,
    decoupled,
    empty_final_wanted,
    parameters,
)
from service.inference import errors
from service.inference.jobs import OutputTensor, StreamAnswer

TOKEN = (OutputTensor("index", BY_NAME["INT32"], (1,), bytes(4)),)


def request(empty_final: bool | None) -> pb.ModelInferRequest:
    sent = pb.ModelInferRequest(model_name="repeat", model_version="", id="r-7")
    if empty_final is not None:
        sent.parameters[EMPTY_FINAL].bool_param = empty_final
    return sent


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    data=st.integers(0, 12),
    ending=st.sampled_from(["data", "flags", "error"]),
    asked=st.sampled_from([None, False, True]),
)
def test_every_response_is_flagged_and_only_the_last_one_final(
    data: int, ending: str, asked: bool | None
) -> None:
    answers = [StreamAnswer(TOKEN, False) for _ in range(data)]
    answers.append(
        {
            "data": StreamAnswer(TOKEN, True),
            "flags": StreamAnswer((), True),
            "error": StreamAnswer((), True, "the model refused"),
        }[ending]
    )
    sent_request = request(asked)
    wanted = empty_final_wanted(sent_request)
    sent = [decoupled("repeat", "1", sent_request, a, wanted) for a in answers]
    responses = [r for r in sent if r is not None]
    flags = [r.infer_response.parameters[FINAL_RESPONSE].bool_param for r in responses]
    assert all(FINAL_RESPONSE in r.infer_response.parameters for r in responses)
    assert {r.infer_response.id for r in responses} <= {"r-7"}
    silent_end = ending == "flags" and not asked
    assert len(responses) == data + (0 if silent_end else 1)
    assert flags == [False] * data + ([] if silent_end else [True])
    if ending == "error":
        assert responses[-1].error_message == "INTERNAL: model 'repeat': the model refused"
    if ending == "flags" and asked:
        assert len(responses[-1].infer_response.outputs) == 0


def test_the_empty_final_parameter_must_be_a_bool() -> None:
    sent = pb.ModelInferRequest()
    sent.parameters[EMPTY_FINAL].string_param = "true"
    with pytest.raises(errors.ServiceError) as refused:
        empty_final_wanted(sent)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_parameters_as_json_keep_their_types() -> None:
    sent = pb.ModelInferRequest()
    sent.parameters["a"].bool_param = True
    sent.parameters["b"].int64_param = -3
    sent.parameters["c"].string_param = "x"
    assert json.loads(parameters(sent)) == {"a": True, "b": -3, "c": "x"}
