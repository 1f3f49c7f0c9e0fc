"""tritonclient's own gRPC client asks `mlp_labels` for the top 3 of its probabilities
(`InferRequestedOutput(..., class_count=3)`) and for the plain tensor, and prints both as JSON.
Run in its own process: tritonclient's protos and ours cannot share one descriptor pool."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    args = parser.parse_args(argv)
    client = grpcclient.InferenceServerClient(args.url)
    batch = np.random.default_rng(7).standard_normal((2, 256)).astype(np.float32)
    tensor = grpcclient.InferInput("input", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    ranked = client.infer(
        "mlp_labels", [tensor], outputs=[grpcclient.InferRequestedOutput("probabilities", 3)]
    )
    plain = client.infer("mlp_labels", [tensor])
    top = ranked.as_numpy("probabilities")
    summary = {
        "datatype": ranked.get_output("probabilities").datatype,
        "top": [[t.decode() for t in row] for row in top],
        "probabilities": plain.as_numpy("probabilities").tolist(),
        "extensions": list(client.get_server_metadata().extensions),
    }
    json.dump(summary, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
