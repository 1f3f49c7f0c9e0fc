"""Classes (Triton's classification extension) on the described path: a front-end's view holds
each described version's labels, within MAX_VIEW_LABEL_BYTES (a version past it is not
described: the parent answers its calls), and a request asking for classes is described with
the outputs to rank and their k, or passed on as bytes when its classification parameter is
one the parent refuses."""

from __future__ import annotations

import asyncio

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.frontends.described_infer import MAX_VIEW_LABEL_BYTES, describable
from service.frontends.descriptors import DescribedRequest, ViewEntry
from service.frontends.model_view import ModelView
from service.inference.validation import RequestValidator
from service.registry.versions import ServedVersion

CONFIG = mc.ModelConfig(
    name="m",
    max_batch_size=4,
    input=[mc.ModelInput(name="x", data_type=mc.TYPE_FP32, dims=[3])],
    output=[mc.ModelOutput(name="y", data_type=mc.TYPE_FP32, dims=[3], label_filename="l.txt")],
)


def served_with(labels: tuple[bytes, ...]) -> ServedVersion:
    served = ServedVersion("m", 1, CONFIG, labels={"y": labels})
    served.validator = RequestValidator(CONFIG)
    return served


@given(st.integers(-3, 3))
def test_a_version_is_described_while_its_labels_fit_the_view(over: int) -> None:
    """At the bound and below, described; one byte past it, the parent's alone."""
    size = MAX_VIEW_LABEL_BYTES + over
    labels = (b"a" * (size // 2), b"b" * (size - size // 2))
    assert describable(served_with(labels)) is (over <= 0)


def request(parameter: pb.InferParameter | None) -> bytes:
    message = pb.ModelInferRequest(model_name="m", id="r")
    message.inputs.add(name="x", datatype="FP32", shape=[1, 3])
    message.raw_input_contents.append(np.zeros((1, 3), np.float32).tobytes())
    output = message.outputs.add(name="y")
    if parameter is not None:
        output.parameters["classification"].CopyFrom(parameter)
    return message.SerializeToString()


def described(message: bytes) -> object:
    view = ModelView()
    view.update([ViewEntry("m", "", 7, CONFIG.SerializeToString(), (("y", (b"cat",)),))])
    return asyncio.run(view.describe(message))


@given(st.integers(1, 2**63 - 1))
def test_a_request_asking_for_classes_is_described_with_them(k: int) -> None:
    got = described(request(pb.InferParameter(int64_param=k)))
    assert isinstance(got, DescribedRequest)
    assert (got.token, got.outputs, got.classes) == (7, ("y",), (("y", k),))


def test_without_classes_none_are_described() -> None:
    got = described(request(None))
    assert isinstance(got, DescribedRequest) and got.classes == ()


@given(
    st.one_of(
        st.integers(-(2**63), 0).map(lambda k: pb.InferParameter(int64_param=k)),
        st.text(max_size=8).map(lambda t: pb.InferParameter(string_param=t)),
        st.booleans().map(lambda b: pb.InferParameter(bool_param=b)),
    )
)
def test_a_classification_the_parent_refuses_goes_on_as_bytes(
    parameter: pb.InferParameter,
) -> None:
    """The parent answers it in its own words, before the request is decoded."""
    assert described(request(parameter)) is None
