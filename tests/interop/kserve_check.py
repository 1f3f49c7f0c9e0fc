"""The KServe SDK's clients (`kserve.InferenceRESTClient` with the v2 protocol and
`kserve.InferenceGRPCClient`), unmodified, as a KServe user calls a server: run in a process of
its own by tests/interop/test_kserve_client.py, it prints what each call got as JSON.

All it is given comes as JSON on stdin, not as arguments, which kserve parses as its model
server's when imported: {"rest": "http://HOST:PORT", "grpc": "HOST:PORT", "calls": {model:
{input name: [datatype, nested list]}}}.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

DTYPES = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32}


def request(model: str, inputs: dict[str, Any], binary: bool | None) -> InferRequest:
    """binary None: the tensors as the SDK puts them without numpy (JSON `data`)."""
    tensors = []
    for name, (datatype, values) in inputs.items():
        array = np.asarray(values, dtype=DTYPES[datatype])
        if binary is None:
            tensor = InferInput(name, list(array.shape), datatype, array.ravel().tolist())
        else:
            tensor = InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array, binary_data=binary)
        tensors.append(tensor)
    return InferRequest(model_name=model, infer_inputs=tensors, request_id="kserve-sdk")


def outputs(response: Any) -> dict[str, Any]:
    return {
        o.name: {"shape": list(o.shape), "datatype": o.datatype, "data": o.as_numpy().tolist()}
        for o in response.outputs
    }


async def over_rest(base: str, calls: dict[str, Any]) -> dict[str, Any]:
    config = RESTConfig(protocol="v2", retries=0, timeout=60)
    async with InferenceRESTClient(config) as client:
        got: dict[str, Any] = {
            "live": await client.is_server_live(base),
            "ready": await client.is_server_ready(base),
            "unknown_model_ready": await client.is_model_ready(base, "no_such_model"),
        }
        for model, inputs in calls.items():
            mine = got[model] = {"model_ready": await client.is_model_ready(base, model)}
            for way, binary in (("json", None), ("numpy_json", False), ("binary", True)):
                answer = await client.infer(base, request(model, inputs, binary), model)
                mine[way] = {
                    "id": answer.id,
                    "model": answer.model_name,
                    "outputs": outputs(answer),
                }
            wrong = request(model, {k: [t, [v]] for k, (t, v) in inputs.items()}, None)
            try:
                await client.infer(base, wrong, model)
                mine["wrong_shape"] = None
            except httpx.HTTPStatusError as error:
                mine["wrong_shape"] = {"status": error.response.status_code, "message": str(error)}
    return got


async def over_grpc(address: str, calls: dict[str, Any]) -> dict[str, Any]:
    client = InferenceGRPCClient(address, retries=0, timeout=60)
    try:
        got: dict[str, Any] = {
            "live": await client.is_server_live(),
            "ready": await client.is_server_ready(),
        }
        for model, inputs in calls.items():
            answer = await client.infer(request(model, inputs, binary=True))
            got[model] = {
                "model_ready": await client.is_model_ready(model),
                "binary": {"id": answer.id, "model": answer.model_name, "outputs": outputs(answer)},
            }
        return got
    finally:
        await client.close()


def main() -> None:
    given = json.load(sys.stdin)
    got = {
        "rest": asyncio.run(over_rest(given["rest"], given["calls"])),
        "grpc": asyncio.run(over_grpc(given["grpc"], given["calls"])),
    }
    json.dump(got, sys.stdout)


if __name__ == "__main__":
    main()
