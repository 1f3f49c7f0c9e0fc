"""The steps of Triton's image classification clients (`image_client.py` over `http` and
`grpc`, `grpc_image_client.py`'s raw `ModelInferRequest` as `grpc_raw`, and
`ensemble_image_client.py` over `ensemble_http` and `ensemble_grpc`, in `src/python/examples/`
of triton-inference-server/client) made with tritonclient's API as they make them (written
here, not copied). The first three read the model's metadata and config and check them as their
`parse_model` does, preprocess one image as their `preprocess` does (PIL, bilinear resize,
scaling, NCHW), ask for the top `--classes` with the classification extension and split each
answer as their `postprocess` does, and write the tensor they sent to `--sent` (.npy); the
ensemble's sends the image files' bytes, a batch of them, and asks every output for its top
classes. Prints the answers as JSON, for the test to rank in Paddle. Run in its own process
(tritonclient's protos and ours cannot share one descriptor pool)."""

from __future__ import annotations

import argparse
import json
import struct
import sys
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.model_config_pb2 as mc
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.grpc import service_pb2, service_pb2_grpc


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"FAILED: {what}")


def parse_model(metadata: dict[str, Any], config: dict[str, Any]) -> tuple[str, str, list[int]]:
    """`parse_model`'s checks, on metadata and config as JSON (REST's form; gRPC's converted):
    one input of 3 dims in NCHW, one FP32 output that is a vector, no batching here. Returns
    the input's name, the output's name and the input's [c, h, w]."""
    check(len(metadata["inputs"]) == 1 and len(metadata["outputs"]) == 1, "one input, one output")
    check(len(config["input"]) == 1, "one input in the config")
    check("max_batch_size" in config, "the config answers max_batch_size (0 included)")
    batching = int(config["max_batch_size"]) > 0
    check(not batching, f"densenet_onnx does not batch: {config['max_batch_size']}")
    output = metadata["outputs"][0]
    check(output["datatype"] == "FP32", f"output datatype {output['datatype']}")
    shape = [int(d) for d in output["shape"]]
    check(sum(d > 1 for d in shape) == 1, f"the output is a vector: {shape}")
    dims = [int(d) for d in metadata["inputs"][0]["shape"]]
    check(len(dims) == 3, f"the input has 3 dims: {dims}")
    check(config["input"][0].get("format") == "FORMAT_NCHW", f"format {config['input'][0]}")
    return metadata["inputs"][0]["name"], output["name"], dims


def preprocess(path: str, scaling: str, c: int, h: int, w: int) -> np.ndarray[Any, Any]:
    """As the examples' `preprocess` does it, for an FP32 NCHW input."""
    image = Image.open(path).convert("L" if c == 1 else "RGB")
    resized = np.array(image.resize((w, h), Image.Resampling.BILINEAR))
    if resized.ndim == 2:
        resized = resized[:, :, np.newaxis]
    typed = resized.astype(np.float32)
    if scaling == "INCEPTION":
        typed = (typed / 127.5) - 1
    elif scaling == "VGG":
        typed = typed - np.asarray((123, 117, 104) if c == 3 else (128,), dtype=np.float32)
    return np.ascontiguousarray(np.transpose(typed, (2, 0, 1)), dtype=np.float32)


def split(answers: list[bytes]) -> list[list[str]]:
    """`postprocess`: each answer as characters, split on ':' into score, index and label."""
    return ["".join(chr(x) for x in answer).split(":") for answer in answers]


def deserialize_bytes_tensor(encoded: bytes) -> list[bytes]:
    """grpc_image_client.py's own reading of BYTES: a 4-byte little-endian length before each."""
    items, offset = [], 0
    while offset < len(encoded):
        (length,) = struct.unpack_from("<I", encoded, offset)
        items.append(encoded[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return items


def classify_http(args: argparse.Namespace) -> tuple[np.ndarray[Any, Any], list[bytes]]:
    client = httpclient.InferenceServerClient(url=args.url)
    metadata, config = client.get_model_metadata(args.model), client.get_model_config(args.model)
    input_name, output_name, (c, h, w) = parse_model(metadata, config)
    image = preprocess(args.image, args.scaling, c, h, w)
    tensor = httpclient.InferInput(input_name, list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    requested = httpclient.InferRequestedOutput(output_name, class_count=args.classes)
    result = client.infer(args.model, [tensor], request_id="1", outputs=[requested])
    check(result.get_response()["id"] == "1", f"request id {result.get_response()}")
    return image, list(result.as_numpy(output_name))


def grpc_json(client: grpcclient.InferenceServerClient, model: str) -> tuple[Any, Any]:
    """Metadata and config over gRPC, as JSON (what REST answers): the checks are the same."""
    metadata = client.get_model_metadata(model, as_json=True)
    config = client.get_model_config(model, as_json=True)["config"]
    config.setdefault("max_batch_size", 0)  # proto3 JSON leaves zeros out; the field is there
    return metadata, config


def grpc_image_json(client: grpcclient.InferenceServerClient, model: str) -> tuple[Any, Any]:
    """grpc_json, and the input's format as the gRPC clients read it: the proto's enum."""
    format = client.get_model_config(model).config.input[0].format
    check(format == mc.ModelInput.FORMAT_NCHW, f"gRPC's ModelInput.format: {format}")
    return grpc_json(client, model)


def classify_grpc(args: argparse.Namespace) -> tuple[np.ndarray[Any, Any], list[bytes]]:
    client = grpcclient.InferenceServerClient(url=args.url)
    input_name, output_name, (c, h, w) = parse_model(*grpc_image_json(client, args.model))
    image = preprocess(args.image, args.scaling, c, h, w)
    tensor = grpcclient.InferInput(input_name, list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    requested = grpcclient.InferRequestedOutput(output_name, class_count=args.classes)
    result = client.infer(args.model, [tensor], request_id="1", outputs=[requested])
    check(result.get_response().id == "1", "request id")
    return image, list(result.as_numpy(output_name))


def classify_grpc_raw(args: argparse.Namespace) -> tuple[np.ndarray[Any, Any], list[bytes]]:
    """grpc_image_client.py: service_pb2 messages on a plain channel, the image as
    raw_input_contents, the classification parameter set by hand."""
    client = grpcclient.InferenceServerClient(url=args.url)
    metadata, config = grpc_image_json(client, args.model)
    input_name, output_name, (c, h, w) = parse_model(metadata, config)
    image = preprocess(args.image, args.scaling, c, h, w)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(args.url))
    request = service_pb2.ModelInferRequest(model_name=args.model, model_version="")
    output = request.outputs.add(name=output_name)
    output.parameters["classification"].int64_param = args.classes
    request.inputs.add(name=input_name, datatype="FP32", shape=[c, h, w])
    request.raw_input_contents.append(image.tobytes())
    response = stub.ModelInfer(request, timeout=120)
    check(len(response.outputs) == 1, f"one output: {response.outputs}")
    check(len(response.raw_output_contents) == 1, "one raw output content")
    answers = deserialize_bytes_tensor(response.raw_output_contents[0])
    check([len(answers)] == list(response.outputs[0].shape), f"shape {response.outputs[0]}")
    return image, answers


def classify_ensemble(args: argparse.Namespace) -> dict[str, list[list[list[str]]]]:
    """ensemble_image_client.py: as many of the files (sorted) as the model's max_batch_size
    takes, each file's bytes a BYTES [1], stacked into one request; each output's top classes
    per file."""
    api: Any = httpclient if args.protocol == "ensemble_http" else grpcclient
    client = api.InferenceServerClient(url=args.url)
    if api is httpclient:
        metadata, config = (
            client.get_model_metadata(args.model),
            client.get_model_config(args.model),
        )
    else:
        metadata, config = grpc_json(client, args.model)
    check(len(metadata["inputs"]) == 1 and len(config["input"]) == 1, "one input")
    files = sorted(args.image)[: int(config["max_batch_size"])]
    images = []
    for name in files:
        with open(name, "rb") as file:
            images.append(np.array([file.read()], dtype=bytes))
    batch = np.stack(images, axis=0)
    tensor = api.InferInput(metadata["inputs"][0]["name"], list(batch.shape), "BYTES")
    names = [output["name"] for output in metadata["outputs"]]
    if api is httpclient:
        tensor.set_data_from_numpy(batch, binary_data=True)
        requested = [
            api.InferRequestedOutput(n, binary_data=True, class_count=args.classes) for n in names
        ]
    else:
        tensor.set_data_from_numpy(batch)
        requested = [api.InferRequestedOutput(n, class_count=args.classes) for n in names]
    result = client.infer(args.model, [tensor], outputs=requested)
    answers = {}
    for name in names:
        rows = result.as_numpy(name)
        check(len(rows) == len(files), f"{len(files)} results for {name}, got {len(rows)}")
        answers[name] = [split(list(row)) for row in rows]
    return answers


CLIENTS = {"http": classify_http, "grpc": classify_grpc, "grpc_raw": classify_grpc_raw}
ENSEMBLE_CLIENTS = ("ensemble_http", "ensemble_grpc")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--protocol", required=True, choices=[*sorted(CLIENTS), *ENSEMBLE_CLIENTS])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="densenet_onnx")
    parser.add_argument("--image", required=True, nargs="+", help="image files")
    parser.add_argument("--scaling", choices=["NONE", "INCEPTION", "VGG"], default="NONE")
    parser.add_argument("--classes", type=int, default=1)
    parser.add_argument("--sent", help="where to write the tensor sent (.npy)")
    args = parser.parse_args(argv)
    if args.protocol in ENSEMBLE_CLIENTS:
        json.dump({"outputs": classify_ensemble(args)}, sys.stdout)
        return 0
    if args.sent is None or len(args.image) != 1:
        parser.error(f"--protocol {args.protocol} takes one --image and --sent")
    args.image = args.image[0]
    image, answers = CLIENTS[args.protocol](args)
    np.save(args.sent, image)
    json.dump({"classes": split(answers)}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
