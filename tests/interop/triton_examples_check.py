"""The steps of Triton's example clients (`src/python/examples/` of
triton-inference-server/client), one per `--example`, made with tritonclient's API as each
example makes them (written here, not copied), with the checks each makes; exits non-zero
with the reason when one fails. Run as a separate process (tritonclient's protos and ours
cannot share one descriptor pool), so this file imports nothing from ``protos``, ``service`` or
``tests``. The server serves tests/fixtures' stand-ins for Triton's sample models: `simple`,
`simple_int8`, `simple_string`, `simple_identity`, `simple_sequence`."""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils as utils
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

Client = Any  # tritonclient.http's or tritonclient.grpc's InferenceServerClient


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"FAILED: {what}")


def error_of(call: Callable[[], object]) -> InferenceServerException:
    try:
        call()
    except InferenceServerException as exc:
        return exc
    raise SystemExit("FAILED: expected an error")


def module(client: Client) -> Any:
    return grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient


def shm_numeric(client: Client) -> None:
    """simple_{http,grpc}_shm_client.py: `simple`'s inputs and outputs in system shared
    memory."""
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    api = module(client)
    first = np.arange(16, dtype=np.int32)
    second = np.ones(16, dtype=np.int32)
    size = first.nbytes
    tag = os.getpid()
    out = shm.create_shared_memory_region("output_data", f"/output_simple_{tag}", size * 2)
    client.register_system_shared_memory("output_data", f"/output_simple_{tag}", size * 2)
    ins = shm.create_shared_memory_region("input_data", f"/input_simple_{tag}", size * 2)
    shm.set_shared_memory_region(ins, [first])
    shm.set_shared_memory_region(ins, [second], offset=size)
    client.register_system_shared_memory("input_data", f"/input_simple_{tag}", size * 2)
    try:
        inputs = [
            api.InferInput("INPUT0", [1, 16], "INT32"),
            api.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_shared_memory("input_data", size)
        inputs[1].set_shared_memory("input_data", size, offset=size)
        outputs = [api.InferRequestedOutput("OUTPUT0"), api.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("output_data", size)
        outputs[1].set_shared_memory("output_data", size, offset=size)
        results = client.infer("simple", inputs, outputs=outputs)
        output0 = results.get_output("OUTPUT0")
        check(output0 is not None, "OUTPUT0 is missing in the response")
        sums = shm.get_contents_as_numpy(out, np.int32, [1, 16])
        diffs = shm.get_contents_as_numpy(out, np.int32, [1, 16], offset=size)
        check((sums[0] == first + second).all(), f"sums {sums}")
        check((diffs[0] == first - second).all(), f"differences {diffs}")
        status = client.get_system_shared_memory_status()
        names = {r["name"] for r in status} if isinstance(status, list) else set(status.regions)
        check(names == {"input_data", "output_data"}, f"status lists {names}")
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(ins)
        shm.destroy_shared_memory_region(out)
    left = client.get_system_shared_memory_status()
    check(not (left if isinstance(left, list) else left.regions), f"left registered: {left}")


def shm_string(client: Client) -> None:
    """simple_{http,grpc}_shm_string_client.py: `simple_string`'s BYTES tensors in system
    shared memory, serialized as tritonclient serializes them."""
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    api = module(client)
    first, second = np.arange(16, dtype=np.int32), np.ones(16, dtype=np.int32)

    def text(values: np.ndarray) -> np.ndarray:
        return np.array([str(v).encode() for v in values], dtype=np.object_)

    given = [utils.serialize_byte_tensor(text(first)), utils.serialize_byte_tensor(text(second))]
    wanted = [
        utils.serialize_byte_tensor(text(first + second)),
        utils.serialize_byte_tensor(text(first - second)),
    ]
    tag = os.getpid()
    handles = []
    try:
        for i, data in enumerate(given):
            key, size = f"/input{i}_simple_{tag}", utils.serialized_byte_size(data)
            handles.append(shm.create_shared_memory_region(f"input{i}_data", key, size))
            shm.set_shared_memory_region(handles[-1], [data])
            client.register_system_shared_memory(f"input{i}_data", key, size)
        for i, data in enumerate(wanted):
            key, size = f"/output{i}_simple_{tag}", utils.serialized_byte_size(data)
            handles.append(shm.create_shared_memory_region(f"output{i}_data", key, size))
            client.register_system_shared_memory(f"output{i}_data", key, size)
        inputs = []
        for i, data in enumerate(given):
            inputs.append(api.InferInput(f"INPUT{i}", [1, 16], "BYTES"))
            inputs[-1].set_shared_memory(f"input{i}_data", utils.serialized_byte_size(data))
        outputs = []
        for i, data in enumerate(wanted):
            outputs.append(api.InferRequestedOutput(f"OUTPUT{i}"))
            outputs[-1].set_shared_memory(f"output{i}_data", utils.serialized_byte_size(data))
        results = client.infer("simple_string", inputs, outputs=outputs)
        for i, expected in enumerate((first + second, first - second)):
            output = results.get_output(f"OUTPUT{i}")
            check(output is not None, f"OUTPUT{i} is missing in the response")
            got = shm.get_contents_as_numpy(handles[2 + i], np.object_, [1, 16])
            check([int(v) for v in got[0]] == expected.tolist(), f"OUTPUT{i}: {got}")
    finally:
        client.unregister_system_shared_memory()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def strings(client: Client) -> None:
    """simple_{http,grpc}_string_infer_client.py: `simple_string` on integers as text, and
    `simple_identity` on elements with NUL bytes and bytes that are not UTF-8 (over REST: as
    binary data and as JSON)."""
    api = module(client)
    http = api is httpclient
    first, second = np.arange(16, dtype=np.int32), np.ones(16, dtype=np.int32)
    inputs = [
        api.InferInput("INPUT0", [1, 16], "BYTES"),
        api.InferInput("INPUT1", [1, 16], "BYTES"),
    ]
    for tensor, values in zip(inputs, (first, second), strict=True):
        tensor.set_data_from_numpy(np.array([[str(v).encode() for v in values]], dtype=np.object_))
    results = client.infer("simple_string", inputs)
    sums = [int(v) for v in results.as_numpy("OUTPUT0")[0]]
    check(sums == (first + second).tolist(), f"sums {sums}")
    nul = np.array([[b"he\x00llo"] * 16], dtype=np.object_)
    raw = np.array([[b"\x00\x01\x02\x03"] * 16], dtype=np.bytes_)
    for array in (nul, raw):
        for binary in (True, False) if http else (True,):
            tensor = api.InferInput("INPUT0", list(array.shape), "BYTES")
            requested = api.InferRequestedOutput(
                "OUTPUT0", **({"binary_data": binary} if http else {})
            )
            if http:
                tensor.set_data_from_numpy(array, binary_data=binary)
            else:
                tensor.set_data_from_numpy(array)
            got = client.infer("simple_identity", [tensor], outputs=[requested]).as_numpy("OUTPUT0")
            if array.dtype == np.object_ and binary:
                check(np.array_equal(array, got), f"identity {got}")
            else:  # JSON carries text: compared as the example compares it
                check(np.array_equal(array, np.char.encode(got.astype(str))), f"identity {got}")


def sequences(client: Client) -> None:
    """simple_{http,grpc}_sequence_sync_infer_client.py: two sequences with numeric ids and one
    with a string id, on `simple_sequence`."""
    api = module(client)
    values = [11, 7, 5, 3, 2, 0, 1]
    tag = os.getpid() % 10000 * 4
    runs: list[tuple[int | str, list[int]]] = [
        (1000 + tag, [0, *values]),
        (1001 + tag, [100, *(-v for v in values)]),
        (str(uuid.uuid4()), [20, *(-v for v in values)]),
    ]
    for sequence_id, sent in runs:
        results = []
        for count, value in enumerate(sent, 1):
            tensor = api.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.full([1, 1], value, dtype=np.int32))
            result = client.infer(
                "simple_sequence",
                [tensor],
                outputs=[api.InferRequestedOutput("OUTPUT")],
                sequence_id=sequence_id,
                sequence_start=count == 1,
                sequence_end=count == len(sent),
            )
            results.append(int(result.as_numpy("OUTPUT")[0][0]))
        expected = [sent[0] + 1, *sent[1:]]
        check(results == expected, f"sequence {sequence_id}: {results}, expected {expected}")


def reuse(client: Client) -> None:
    """reuse_infer_objects_client.py: the same InferInput and InferRequestedOutput objects
    with shared memory set, unset and set again."""
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    api = module(client)
    first, second = np.arange(16, dtype=np.int32), np.ones(16, dtype=np.int32)
    size = first.nbytes
    tag = os.getpid()
    names = ["input0_data", "input1_data", "output0_data", "output1_data"]
    handles = [shm.create_shared_memory_region(n, f"/{n}_{tag}", size) for n in names]
    for name in names:
        client.register_system_shared_memory(name, f"/{name}_{tag}", size)
    shm.set_shared_memory_region(handles[0], [first])
    shm.set_shared_memory_region(handles[1], [second])
    inputs = [
        api.InferInput("INPUT0", [1, 16], "INT32"),
        api.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    outputs = [api.InferRequestedOutput("OUTPUT0"), api.InferRequestedOutput("OUTPUT1")]
    try:
        for use_shm in (True, False, True):
            if use_shm:
                for tensor, name in zip(inputs + outputs, names, strict=True):
                    tensor.set_shared_memory(name, size)
            else:
                inputs[0].set_data_from_numpy(first.reshape(1, 16))
                inputs[1].set_data_from_numpy(second.reshape(1, 16))
                for output in outputs:
                    output.unset_shared_memory()
            results = client.infer("simple", inputs, outputs=outputs)
            if use_shm:
                sums = shm.get_contents_as_numpy(handles[2], np.int32, [1, 16])
                diffs = shm.get_contents_as_numpy(handles[3], np.int32, [1, 16])
            else:
                sums, diffs = results.as_numpy("OUTPUT0"), results.as_numpy("OUTPUT1")
            check((sums[0] == first + second).all(), f"sums {sums} (shm {use_shm})")
            check((diffs[0] == first - second).all(), f"differences {diffs} (shm {use_shm})")
    finally:
        client.unregister_system_shared_memory()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def model_control(client: Client, models: int) -> None:
    """simple_{http,grpc}_model_control.py in explicit mode: the index counts every model of
    the repository, a config override that is not JSON fails with "failed to load", one that
    is applies, unloading ends readiness, a file name longer than NAME_MAX (gRPC) answers
    INTERNAL "failed to poll from model repository", an unknown model "failed to load"."""
    over_grpc = isinstance(client, grpcclient.InferenceServerClient)
    index = client.get_model_repository_index()
    count = len(index.models) if over_grpc else len(index)
    check(count == models, f"the index lists {count} models, the repository holds {models}")
    client.load_model("simple")
    check(client.is_model_ready("simple"), "simple not ready once loaded")
    bad = '"parameters": {"config": {{"max_batch_size": "16"}}}'
    check(
        "failed to load" in error_of(lambda: client.load_model("simple", config=bad)).message(),
        "bad config",
    )
    client.load_model("simple", config='{"max_batch_size":"16"}')
    config = client.get_model_config("simple")
    batch = config.config.max_batch_size if over_grpc else config["max_batch_size"]
    check(batch == 16, f"max_batch_size {batch} after the override")
    client.unload_model("simple")
    check(not client.is_model_ready("simple"), "simple still ready once unloaded")
    if over_grpc:
        exc = error_of(
            lambda: client.load_model("simple", config="{}", files={"file:" + "A" * 256: b"a"})
        )
        check(exc.status() == "StatusCode.INTERNAL", f"oversized file parameter: {exc.status()}")
        check("failed to poll from model repository" in exc.message(), exc.message())
        check(client.is_server_live(), "server not live after a rejected load")
    exc = error_of(lambda: client.load_model("wrong_model_name"))
    check("failed to load" in exc.message(), exc.message())
    client.load_model("simple")  # as config.pbtxt has it, for the examples after this one


def explicit_int8(url: str) -> None:
    """grpc_explicit_int8_content_client.py: `simple_int8` with typed `int_contents`, through
    tritonclient's generated stubs; a version string that is not a number in Triton's words."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(url))
    request = service_pb2.ModelInferRequest(model_name="simple_int8")
    for name, values in (("INPUT0", list(range(16))), ("INPUT1", [1] * 16)):
        tensor = request.inputs.add(name=name, datatype="INT8", shape=[1, 16])
        tensor.contents.int_contents[:] = values
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT1")
    response = stub.ModelInfer(request)
    sums, diffs = (np.frombuffer(raw, dtype=np.int8) for raw in response.raw_output_contents)
    check(sums.tolist() == [i + 1 for i in range(16)], f"sums {sums}")
    check(diffs.tolist() == [i - 1 for i in range(16)], f"differences {diffs}")
    request.model_version = "wrong_specification"
    try:
        stub.ModelInfer(request)
    except grpc.RpcError as exc:
        wanted = "failed to get model version from specified version string 'wrong_specification'"
        check(wanted in str(exc), str(exc))
    else:
        raise SystemExit("FAILED: a version string that is not a number was served")


EXAMPLES: dict[str, Callable[[Client], None]] = {
    "shm": shm_numeric,
    "shm_string": shm_string,
    "string": strings,
    "sequence": sequences,
    "reuse": reuse,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    choices = [*EXAMPLES, "model_control", "explicit_int8"]
    parser.add_argument("--example", required=True, choices=choices)
    parser.add_argument("--protocol", required=True, choices=["http", "grpc"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--models", type=int, default=0, help="the repository's models")
    args = parser.parse_args(argv)
    api = httpclient if args.protocol == "http" else grpcclient
    client = api.InferenceServerClient(url=args.url)
    if args.example == "model_control":
        model_control(client, args.models)
    elif args.example == "explicit_int8":
        explicit_int8(args.url)
    else:
        EXAMPLES[args.example](client)
    print(f"PASS: {args.example} over {args.protocol}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
