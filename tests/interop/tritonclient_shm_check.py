"""Triton's system shared-memory example, with tritonclient's own `utils.shared_memory`, against
the server: run as a separate process (tritonclient's protos and ours cannot share one
descriptor pool), so this file imports nothing from ``protos``, ``service`` or ``tests``.

Input (npz): ``input`` (FP32 [N, 256] for mlp). Output (npz): ``served`` (what the model wrote
into the output region), ``status`` (JSON: the regions the server listed, and what
unregistering left), ``raw_outputs`` (bytes the response carried for the output).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm

MODEL, INPUT, OUTPUT = "mlp", "input", "probabilities"
CLASSES = 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--inputs", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    with np.load(args.inputs) as data:
        array = np.ascontiguousarray(data["input"], dtype=np.float32)
    client = grpcclient.InferenceServerClient(args.url)
    client.unregister_system_shared_memory()
    in_key, out_key = f"/pq_in_{os.getpid()}", f"/pq_out_{os.getpid()}"
    in_bytes, out_bytes = array.nbytes, array.shape[0] * CLASSES * 4
    in_handle = shm.create_shared_memory_region("input_data", in_key, in_bytes)
    out_handle = shm.create_shared_memory_region("output_data", out_key, out_bytes)
    try:
        shm.set_shared_memory_region(in_handle, [array])
        client.register_system_shared_memory("input_data", in_key, in_bytes)
        client.register_system_shared_memory("output_data", out_key, out_bytes)
        inputs = [grpcclient.InferInput(INPUT, list(array.shape), "FP32")]
        inputs[0].set_shared_memory("input_data", in_bytes)
        outputs = [grpcclient.InferRequestedOutput(OUTPUT)]
        outputs[0].set_shared_memory("output_data", out_bytes)
        result = client.infer(MODEL, inputs, outputs=outputs)
        tensor = result.get_output(OUTPUT)
        served = shm.get_contents_as_numpy(out_handle, np.float32, list(tensor.shape))
        listed = client.get_system_shared_memory_status(as_json=True)
        client.unregister_system_shared_memory("input_data")
        client.unregister_system_shared_memory("output_data")
        left = client.get_system_shared_memory_status(as_json=True)
        raw = result.get_response().raw_output_contents
        status = {"listed": listed, "left": left, "raw_lengths": [len(r) for r in raw]}
        np.savez(args.out, served=served, status=np.array(json.dumps(status)))
    finally:
        shm.destroy_shared_memory_region(in_handle)
        shm.destroy_shared_memory_region(out_handle)
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
