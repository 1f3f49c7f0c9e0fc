"""Drive a decoupled generation model with tritonclient's stream API, unmodified, as Triton's
own examples do: ``start_stream(callback)``, ``async_stream_infer(...,
enable_empty_final_response=True)`` for several prompts at once, ``stop_stream()``.

Run as a separate process (``python tests/interop/tritonclient_stream_check.py --url ... --out
FILE.json --prompt TEXT ...``): tritonclient's generated protos and ours cannot share one
descriptor pool, so this file imports only numpy and tritonclient. It writes a JSON document:
``streams`` (request id -> every response in arrival order: text delta, finish reason, final
flag, error), ``cancelled`` (a stream stopped with ``cancel_requests=True`` after its first
response), ``unary`` (ModelInfer on the model: the error it got) and ``errors`` (a check that
raised). The calling test decides what must hold.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

TIMEOUT_S = 120.0


def _inputs(prompt: str, max_tokens: int) -> list[Any]:
    text = grpcclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    limit = grpcclient.InferInput("max_tokens", [1], "INT32")
    limit.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    return [text, limit]


def _arrival(result: Any, error: InferenceServerException | None) -> dict[str, Any]:
    if error is not None:
        return {"error": error.message()}
    response = result.get_response()
    delta, finish = result.as_numpy("text_delta"), result.as_numpy("finish_reason")
    return {
        "id": response.id,
        "final": response.parameters["triton_final_response"].bool_param,
        "delta": None if delta is None else bytes(delta[0]).decode(),
        "finish_reason": None if finish is None else bytes(finish[0]).decode(),
    }


def streams(url: str, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """All prompts go out on one stream before anything is read; stop_stream() waits until
    every request had its final response."""
    received: queue.Queue[dict[str, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url=url)
    try:
        client.start_stream(
            callback=lambda result, error: received.put(_arrival(result, error)),
            stream_timeout=TIMEOUT_S,
        )
        for index, prompt in enumerate(prompts):
            client.async_stream_infer(
                model,
                _inputs(prompt, max_tokens),
                request_id=f"p{index}",
                enable_empty_final_response=True,
            )
        client.stop_stream()
    finally:
        client.close()
    by_id: dict[str, list[dict[str, Any]]] = {}
    while not received.empty():
        arrival = received.get_nowait()
        by_id.setdefault(arrival.get("id", "?"), []).append(arrival)
    return by_id


def cancelled(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One long generation, its stream stopped with cancel_requests=True after the first
    response arrived."""
    received: queue.Queue[dict[str, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url=url)
    try:
        client.start_stream(
            callback=lambda result, error: received.put(_arrival(result, error)),
            stream_timeout=TIMEOUT_S,
        )
        client.async_stream_infer(
            model, _inputs(prompt, max_tokens), request_id="c", enable_empty_final_response=True
        )
        first = received.get(timeout=TIMEOUT_S)
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    return {"first": first}


def unary(url: str, model: str, prompt: str) -> dict[str, Any]:
    client = grpcclient.InferenceServerClient(url=url)
    try:
        client.infer(model, _inputs(prompt, 4), client_timeout=TIMEOUT_S)
    except InferenceServerException as error:
        return {"status": error.status(), "message": error.message()}
    finally:
        client.close()
    return {"status": None, "message": "no error raised"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", required=True, help="HOST:PORT of the gRPC endpoint")
    parser.add_argument("--model", default="generate")
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--cancel-max-tokens", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    summary: dict[str, Any] = {}
    checks: dict[str, Callable[[], Any]] = {
        "streams": lambda: streams(args.url, args.model, args.prompt, args.max_tokens),
        "cancelled": lambda: cancelled(
            args.url, args.model, args.prompt[0], args.cancel_max_tokens
        ),
        "unary": lambda: unary(args.url, args.model, args.prompt[0]),
    }
    for name, check in checks.items():
        try:
            summary[name] = check()
        except Exception as error:
            summary.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
    with open(args.out, "w") as handle:
        json.dump(summary, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
