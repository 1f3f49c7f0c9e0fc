"""Every request the server must refuse, against the real server.

Paddle silently accepts some bad inputs (int32 ids, extra ranks, a missing input reuses the
previous caller's data), so each rule is checked end to end: the
exact status code, a message that says what was wrong, and a server that still answers
correctly afterwards.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from protos.inference import grpc_service_pb2 as pb
from tests.reference import EXAMPLES, example_inputs, output_names, run_reference
from tests.servers import ServerProcess

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
_ITEMSIZE = {"FP16": 2, "FP32": 4, "FP64": 8, "INT32": 4, "INT64": 8, "BOOL": 1}


@dataclass(frozen=True)
class Tensor:
    """One input as a client sends it; raw bytes default to the right length for the shape."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    nbytes: int | None = None

    def raw(self) -> bytes:
        count = math.prod(self.shape) if all(d >= 0 for d in self.shape) else 0
        return bytes(count * _ITEMSIZE[self.datatype] if self.nbytes is None else self.nbytes)


def request(
    model: str,
    *tensors: Tensor,
    version: str = "",
    outputs: Sequence[str] = (),
    raw: Sequence[bytes] | None = None,
) -> pb.ModelInferRequest:
    """A request with raw contents for every tensor unless `raw` overrides them."""
    message = pb.ModelInferRequest(model_name=model, model_version=version)
    for tensor in tensors:
        message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
    message.raw_input_contents.extend([t.raw() for t in tensors] if raw is None else raw)
    for name in outputs:
        message.outputs.add(name=name)
    return message


def typed(model: str, tensor: Tensor, values: int, raw: bool = False) -> pb.ModelInferRequest:
    """A request sending `values` FP32 typed contents (and raw bytes too when `raw`)."""
    message = request(model, tensor, raw=[tensor.raw()] if raw else [])
    message.inputs[0].contents.fp32_contents.extend([0.5] * values)
    return message


MLP = Tensor("input", "FP32", (2, 256))
USER = Tensor("user", "FP32", (2, 32))
ITEM = Tensor("item", "FP32", (2, 48))
IMAGE = Tensor("image", "FP32", (1, 3, 224, 224))
TOKENS = Tensor("token_ids", "INT64", (2, 7))


@dataclass(frozen=True)
class Case:
    """A bad request, the status it must get, and substrings its message must contain."""

    id: str
    request: pb.ModelInferRequest
    code: grpc.StatusCode
    message: tuple[str, ...] = field(default=())

    @property
    def validated(self) -> bool:
        """Whether the request names a served model version, so its failure is counted."""
        return self.request.model_name in EXAMPLES and self.request.model_version in ("", "1")


_PLAIN_NAME = "is not a plain name"
_VERSION = "is not a version number"
TRAVERSAL_NAMES = ("../x", "x/../../y", "..", "/etc/passwd")

CASES: tuple[Case, ...] = (
    # Which model and version.
    Case(
        "unknown model",
        request("no_such_model", MLP),
        NOT_FOUND,
        ("Request for unknown model: 'no_such_model' is not found", "mlp"),
    ),
    Case(
        "unknown version",
        request("mlp", MLP, version="2"),
        NOT_FOUND,
        ("Request for unknown model: 'mlp' version 2 is not found", "[1]"),
    ),
    Case("version zero", request("mlp", MLP, version="0"), NOT_FOUND, ("'mlp' version 0 is not",)),
    *(
        Case(f"version {v!r}", request("mlp", MLP, version=v), INVALID, (repr(v), _VERSION))
        for v in ("one", "-1", "1.0", " 1", "1 ", "+1", "0x1", "\uff11", "9" * 20)
    ),
    *(
        Case(f"name {n!r}", request(n, MLP), INVALID, (repr(n), _PLAIN_NAME))
        for n in (*TRAVERSAL_NAMES, "", "mlp/../mlp", "./mlp", "mlp\0")
    ),
    # Which inputs.
    Case("no inputs", request("mlp"), INVALID, ("missing input(s) ['input']",)),
    Case("missing item", request("two_tower", USER), INVALID, ("missing input(s) ['item']",)),
    Case(
        "unknown extra input",
        request("mlp", MLP, Tensor("extra", "FP32", (2, 256))),
        INVALID,
        ("no input 'extra'", "['input']"),
    ),
    Case("wrong input name", request("mlp", Tensor("x", "FP32", (2, 256))), INVALID, ("'x'",)),
    Case("duplicate input", request("mlp", MLP, MLP), INVALID, ("'input' appears more than once",)),
    # Datatypes: Paddle raises on some and silently accepts others (INT32 ids for INT64).
    *(
        Case(
            f"{dt} for FP32",
            request("mlp", Tensor("input", dt, (2, 256))),
            INVALID,
            ("input 'input'", f"expected datatype FP32, got {dt}"),
        )
        for dt in ("FP64", "INT32", "FP16", "BOOL")
    ),
    Case(
        "INT32 ids for INT64",
        request("text_classifier", Tensor("token_ids", "INT32", (2, 7))),
        INVALID,
        ("input 'token_ids'", "expected datatype INT64, got INT32"),
    ),
    Case(
        "no datatype",
        request("mlp", Tensor("input", "", (2, 256), nbytes=2048)),
        INVALID,
        ("input 'input'", "expected datatype FP32, got none"),
    ),
    Case(
        "FP16 typed contents",
        typed("mlp", Tensor("input", "FP16", (1, 256)), 256),
        INVALID,
        ("input 'input'", "expected datatype FP32, got FP16"),
    ),
    # Shapes: Paddle accepts (2, 1, 256) for [-1, 256] and computes garbage.
    *(
        Case(
            f"rank {shape}",
            request("mlp", Tensor("input", "FP32", shape)),
            INVALID,
            ("input 'input'", "expected rank 2", f"got shape {list(shape)}"),
        )
        for shape in ((2, 1, 256), (256,), ())
    ),
    Case(
        "image without batch dim",
        request("resnet18", Tensor("image", "FP32", (3, 224, 224))),
        INVALID,
        ("input 'image'", "expected rank 4"),
    ),
    Case(
        "wrong feature size",
        request("mlp", Tensor("input", "FP32", (2, 255))),
        INVALID,
        ("input 'input'", "dimension 1 must be 256"),
    ),
    Case(
        "wrong image size",
        request("resnet18", Tensor("image", "FP32", (1, 3, 224, 225))),
        INVALID,
        ("input 'image'", "dimension 3 must be 224"),
    ),
    Case(
        "item with user's size",
        request("two_tower", USER, Tensor("item", "FP32", (2, 32))),
        INVALID,
        ("input 'item'", "dimension 1 must be 48"),
    ),
    *(
        Case(
            f"dim {shape}",
            request(model, Tensor(name, dt, shape)),
            INVALID,
            (f"input '{name}'", "every dimension must be >= 1", str(list(shape))),
        )
        for model, name, dt, shape in (
            ("mlp", "input", "FP32", (0, 256)),
            ("text_classifier", "token_ids", "INT64", (2, 0)),
            ("text_classifier", "token_ids", "INT64", (0, 0)),
            ("mlp", "input", "FP32", (-1, 256)),
            ("mlp", "input", "FP32", (2, -256)),
            ("text_classifier", "token_ids", "INT64", (1, -1)),
        )
    ),
    Case(
        "mlp batch 65",
        request("mlp", Tensor("input", "FP32", (65, 256))),
        INVALID,
        ("input 'input'", "batch size 65 exceeds max_batch_size 64"),
    ),
    Case(
        "text batch 33",
        request("text_classifier", Tensor("token_ids", "INT64", (33, 4))),
        INVALID,
        ("input 'token_ids'", "batch size 33 exceeds max_batch_size 32"),
    ),
    # Bytes.
    *(
        Case(
            f"raw {n} bytes",
            request("mlp", Tensor("input", "FP32", (2, 256), nbytes=n)),
            INVALID,
            ("input 'input'", f"needs 2048 bytes of raw_input_contents, got {n}"),
        )
        for n in (0, 2047, 2049, 4096)
    ),
    Case(
        "raw INT32-sized ids",
        request("text_classifier", Tensor("token_ids", "INT64", (2, 7), nbytes=56)),
        INVALID,
        ("input 'token_ids'", "needs 112 bytes", "got 56"),
    ),
    Case(
        "two raw for one input",
        request("mlp", MLP, raw=[bytes(2048), bytes(2048)]),
        INVALID,
        ("2 raw_input_contents for 1 inputs",),
    ),
    Case(
        "one raw for two inputs",
        request("two_tower", USER, ITEM, raw=[bytes(256)]),
        INVALID,
        ("1 raw_input_contents for 2 inputs",),
    ),
    Case(
        "raw and typed",
        typed("mlp", MLP, 512, raw=True),
        INVALID,
        ("contents field must not be specified when using raw_input_contents for 'input'",),
    ),
    *(
        Case(
            f"typed {n} values",
            typed("mlp", MLP, n),
            INVALID,
            ("input 'input'", f"needs 512 values in contents.fp32_contents, got {n}"),
        )
        for n in (0, 511, 513)
    ),
    # Outputs.
    Case(
        "unknown output",
        request("mlp", MLP, outputs=["nope"]),
        INVALID,
        ("has no output 'nope'", output_names("mlp")[0]),
    ),
    Case(
        "duplicate output",
        request("two_tower", USER, ITEM, outputs=[output_names("two_tower")[0]] * 2),
        INVALID,
        (output_names("two_tower")[0], "more than once"),
    ),
    # Several inputs.
    Case(
        "batch sizes disagree",
        request("two_tower", USER, Tensor("item", "FP32", (3, 48))),
        INVALID,
        ("batch size", "[2, 3]"),
    ),
)


def rpc_error(call: Callable[[], object]) -> grpc.Call:
    """The error a call fails with; the test fails if it succeeds."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert isinstance(error, grpc.Call)
    return error


def assert_refused(server: ServerProcess, case: Case) -> None:
    error = rpc_error(lambda: server.stub.ModelInfer(case.request, timeout=30))
    details = error.details() or ""
    assert (error.code(), case.id) == (case.code, case.id), details
    for part in case.message:
        assert part in details, f"{case.id}: {part!r} not in {details!r}"


def test_case_ids_are_unique() -> None:
    """Parametrized ids must not collide, or pytest would silently rename cases."""
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request_is_refused(server: ServerProcess, case: Case) -> None:
    assert_refused(server, case)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request_in_a_stream_yields_its_error(server: ServerProcess, case: Case) -> None:
    """A stream answers each bad request with an error_message and goes on."""
    good = build_request("mlp", example_inputs("mlp"), request_id="good")
    bad = pb.ModelInferRequest()
    bad.CopyFrom(case.request)
    bad.id = "bad"
    responses = list(server.stub.ModelStreamInfer(iter([bad, good]), timeout=60))
    by_id = {r.infer_response.id: r for r in responses}
    assert sorted(by_id) == ["bad", "good"]
    assert by_id["bad"].error_message.startswith(f"{case.code.name}: ")
    for part in case.message:
        assert part in by_id["bad"].error_message
    assert by_id["good"].error_message == ""


@pytest.mark.parametrize(
    ("model", "omitted"), [("mlp", ("input",)), ("two_tower", ("item",)), ("two_tower", ("user",))]
)
def test_omitted_input_never_reuses_the_previous_request(
    server: ServerProcess, model: str, omitted: tuple[str, ...]
) -> None:
    """Paddle keeps the last value of an input that is not set; the server must refuse."""
    inputs = example_inputs(model, seed=7)
    server.stub.ModelInfer(build_request(model, inputs), timeout=30)
    partial = {k: v for k, v in inputs.items() if k not in omitted}
    error = rpc_error(lambda: server.stub.ModelInfer(build_request(model, partial), timeout=30))
    assert error.code() == INVALID
    assert f"missing input(s) {list(omitted)}" in (error.details() or "")


def _fail_counts(server: ServerProcess) -> dict[str, int]:
    stats = server.stub.ModelStatistics(pb.ModelStatisticsRequest(), timeout=10).model_stats
    return {s.name: s.inference_stats.fail.count for s in stats if s.version == "1"}


def test_server_answers_correctly_after_bad_input(server: ServerProcess) -> None:
    """Refused requests are counted as failures, and leave nothing behind in the workers."""
    before = _fail_counts(server)
    for case in CASES:
        assert_refused(server, case)
    after = _fail_counts(server)
    # Only requests that name a served version reach validation and its statistics.
    expected = Counter(c.request.model_name for c in CASES if c.validated)
    assert {m: after[m] - before[m] for m in EXAMPLES} == {m: expected[m] for m in EXAMPLES}
    for model in EXAMPLES:
        inputs = example_inputs(model, seed=3)
        served = parse_response(server.stub.ModelInfer(build_request(model, inputs), timeout=60))
        reference = run_reference(model, inputs)
        assert list(served) == list(reference)
        for name, array in reference.items():
            np.testing.assert_allclose(served[name], array, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [*TRAVERSAL_NAMES, ""])
def test_model_ready_refuses_traversal_names(server: ServerProcess, name: str) -> None:
    error = rpc_error(lambda: server.stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=10))
    assert error.code() == INVALID
    assert _PLAIN_NAME in (error.details() or "")


def test_model_ready_refuses_a_bad_version(server: ServerProcess) -> None:
    request = pb.ModelReadyRequest(name="mlp", version="latest")
    error = rpc_error(lambda: server.stub.ModelReady(request, timeout=10))
    assert error.code() == INVALID
    assert _VERSION in (error.details() or "")


def test_model_ready_is_false_for_unknown_models_and_versions(server: ServerProcess) -> None:
    """Triton answers ready=false, not an error, for what it does not serve."""
    for name, version in (("no_such_model", ""), ("mlp", "2")):
        request = pb.ModelReadyRequest(name=name, version=version)
        assert not server.stub.ModelReady(request, timeout=10).ready


NAMED_RPCS: dict[str, Callable[[ServerProcess, str, str], object]] = {
    "ModelMetadata": lambda s, n, v: s.stub.ModelMetadata(
        pb.ModelMetadataRequest(name=n, version=v), timeout=10
    ),
    "ModelConfig": lambda s, n, v: s.stub.ModelConfig(
        pb.ModelConfigRequest(name=n, version=v), timeout=10
    ),
    "ModelStatistics": lambda s, n, v: s.stub.ModelStatistics(
        pb.ModelStatisticsRequest(name=n, version=v), timeout=10
    ),
}


@pytest.mark.parametrize(
    ("name", "version", "expected"),
    [
        ("no_such_model", "", "Request for unknown model: 'no_such_model' is not found"),
        ("mlp", "2", "Request for unknown model: 'mlp' version 2 is not found"),
    ],
)
@pytest.mark.parametrize("rpc", sorted(NAMED_RPCS))
def test_unknown_model_or_version_is_not_found(
    server: ServerProcess, rpc: str, name: str, version: str, expected: str
) -> None:
    error = rpc_error(lambda: NAMED_RPCS[rpc](server, name, version))
    assert error.code() == NOT_FOUND, error.details()
    assert expected in (error.details() or "")


@pytest.mark.parametrize("name", TRAVERSAL_NAMES)
@pytest.mark.parametrize("rpc", sorted(NAMED_RPCS))
def test_every_rpc_refuses_traversal_names(server: ServerProcess, rpc: str, name: str) -> None:
    """Every RPC that takes a model name from the network checks it before using it."""
    error = rpc_error(lambda: NAMED_RPCS[rpc](server, name, ""))
    assert error.code() == INVALID, error.details()
    assert _PLAIN_NAME in (error.details() or "")


@pytest.mark.parametrize("name", TRAVERSAL_NAMES)
def test_control_list_instances_refuses_traversal_names(server: ServerProcess, name: str) -> None:
    """The Control API takes model names from the network too."""
    error = rpc_error(lambda: server.instances(name))
    assert error.code() == INVALID, error.details()
    assert _PLAIN_NAME in (error.details() or "")
