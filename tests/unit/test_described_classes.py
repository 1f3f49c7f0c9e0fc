"""Classes (Triton's classification extension) on the described path: a front-end's view holds
each described version's labels, all together within MAX_VIEW_LABEL_BYTES (a version past it
is not described: the parent answers its calls), and a request asking for classes is
described with the outputs to rank and their k, or passed on as bytes when its
classification parameter is one the parent refuses."""

from __future__ import annotations

import asyncio
from typing import cast

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.frontends.described_call import Serving
from service.frontends.described_infer import MAX_VIEW_LABEL_BYTES, DescribedInfer
from service.frontends.descriptors import DescribedRequest, ViewEntry, decode_view
from service.frontends.model_view import ModelView
from service.inference.validation import RequestValidator
from service.registry.versions import ModelRegistry, ServedVersion, VersionState

CONFIG = mc.ModelConfig(
    name="m",
    max_batch_size=4,
    input=[mc.ModelInput(name="x", data_type=mc.TYPE_FP32, dims=[3])],
    output=[mc.ModelOutput(name="y", data_type=mc.TYPE_FP32, dims=[3], label_filename="l.txt")],
)


def served_with(name: str, labels: tuple[bytes, ...]) -> ServedVersion:
    served = ServedVersion(name, 1, CONFIG, VersionState.READY, labels={"y": labels})
    served.validator = RequestValidator(CONFIG)
    return served


def viewed(sizes: list[int]) -> dict[str, tuple[bytes, ...] | None]:
    """The parent's view of versions whose labels are one line of each size (models m0, m1,
    ...): each described version's labels as the view carries them (None: not described)."""
    registry = ModelRegistry(lambda: None)
    for index, size in enumerate(sizes):
        registry.publish(f"m{index}", {1: served_with(f"m{index}", (b"x" * size,))})
    parent = DescribedInfer(registry, cast(Serving, None))
    shown: dict[str, tuple[bytes, ...] | None] = {f"m{i}": None for i in range(len(sizes))}
    for entry in decode_view(parent.view()).entries:
        assert entry.version in ("", "1")
        if entry.version:  # the labels, once per version: under its number
            shown[entry.model] = dict(entry.labels)["y"]
        else:
            assert entry.labels == ()
    return shown


@given(st.lists(st.integers(0, MAX_VIEW_LABEL_BYTES), min_size=1, max_size=4))
@example([MAX_VIEW_LABEL_BYTES - 4])  # exactly the bound
@example([MAX_VIEW_LABEL_BYTES - 3])  # a byte past it
@example([MAX_VIEW_LABEL_BYTES // 2, MAX_VIEW_LABEL_BYTES // 2 - 8, 0])  # the second just fits
@example([MAX_VIEW_LABEL_BYTES // 2, MAX_VIEW_LABEL_BYTES // 2 - 7, 0])  # it does not; the third
def test_the_views_labels_stay_within_their_bound(sizes: list[int]) -> None:
    """All versions' labels together, as encoded (a line and its 4-byte length): a version
    past what is left is not described (the parent answers its calls); the others are, with
    their labels whole."""
    shown = viewed(sizes)
    left = MAX_VIEW_LABEL_BYTES
    for index, size in enumerate(sizes):  # in the order of the model names
        fits = size + 4 <= left
        left -= size + 4 if fits else 0
        assert shown[f"m{index}"] == ((b"x" * size,) if fits else None)


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
