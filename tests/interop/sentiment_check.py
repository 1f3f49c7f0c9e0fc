"""Ask the `sentiment` ensemble with Triton's own client (tritonclient[grpc]), unmodified:
BYTES in through set_data_from_numpy, BYTES and FP32 out through as_numpy.

Runs as a separate process (`python tests/interop/sentiment_check.py --url HOST:PORT TEXT...`):
tritonclient's protos and ours cannot share a process, so this imports nothing of the project.
Prints one JSON document: model_name, labels and scores, in the order of the texts."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("texts", nargs="+")
    args = parser.parse_args()
    client = grpcclient.InferenceServerClient(url=args.url)
    text = np.array([[t.encode()] for t in args.texts], dtype=np.object_)
    tensor = grpcclient.InferInput("text", list(text.shape), "BYTES")
    tensor.set_data_from_numpy(text)
    result = client.infer(
        "sentiment",
        [tensor],
        outputs=[
            grpcclient.InferRequestedOutput("label"),
            grpcclient.InferRequestedOutput("score"),
        ],
        client_timeout=60,
    )
    labels = result.as_numpy("label")
    scores = result.as_numpy("score")
    summary = {
        "model_name": result.get_response().model_name,
        "labels": [v.decode() for v in labels.reshape(-1)],
        "scores": [float(v) for v in scores.reshape(-1)],
        "shapes": [list(labels.shape), list(scores.shape)],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
