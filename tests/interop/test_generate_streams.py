"""The `generate` example (a decoupled model: one response per token) through third-party
clients, unmodified, each in its own process: tritonclient's stream API and grpcurl. What they
stream must be what the numpy client streams for the same prompt (greedy decoding is
deterministic), each request's last response marked final."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.inference_client import InferenceClient
from tests.interop.test_grpcurl import GRPCURL, GRPCURL_TIMEOUT_S
from tests.servers import REPO_ROOT, ServerProcess, model_repository, running_server

MODEL = "generate"
PROMPTS = ["Once upon a time", "The cat", "42 is"]
MAX_TOKENS = 12
CANCEL_MAX_TOKENS = 200  # within the context; the stream is cancelled after one
SCRIPT = Path(__file__).with_name("tritonclient_stream_check.py")
CHECK_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("generate")
    repository = model_repository(root / "models", [MODEL])
    with running_server(repository, root / "log") as process:
        yield process


@pytest.fixture(scope="module")
def expected(server: ServerProcess) -> dict[str, tuple[str, str | None]]:
    """Each prompt's text and finish reason from the numpy client, one generation at a time."""
    answers = {}
    with InferenceClient(server.url) as client:
        for prompt in PROMPTS:
            pieces = list(client.generate(MODEL, prompt, MAX_TOKENS, timeout=CHECK_TIMEOUT_S))
            answers[prompt] = ("".join(c.text for c in pieces), pieces[-1].finish_reason)
    return answers


@pytest.fixture(scope="module")
def triton(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tritonclient") / "out.json"
    command = [sys.executable, str(SCRIPT), "--url", server.address, "--out", str(out)]
    command += ["--max-tokens", str(MAX_TOKENS), "--cancel-max-tokens", str(CANCEL_MAX_TOKENS)]
    for prompt in PROMPTS:
        command += ["--prompt", prompt]
    finished = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
    )
    assert finished.returncode == 0, finished.stderr
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def test_tritonclient_raised_nothing(triton: dict[str, Any]) -> None:
    assert triton.get("errors", {}) == {}


def test_tritonclient_streams_every_prompt_token_by_token(
    triton: dict[str, Any], expected: dict[str, tuple[str, str | None]]
) -> None:
    streams = triton["streams"]
    assert sorted(streams) == [f"p{i}" for i in range(len(PROMPTS))]
    for index, prompt in enumerate(PROMPTS):
        arrivals = streams[f"p{index}"]
        assert all("error" not in a for a in arrivals), arrivals
        # Exactly one final response, and it is the last.
        assert [a["final"] for a in arrivals] == [False] * (len(arrivals) - 1) + [True]
        text = "".join(a["delta"] or "" for a in arrivals)
        assert (text, arrivals[-1]["finish_reason"]) == expected[prompt]
        tokens = [a for a in arrivals if a["delta"] is not None]
        assert 0 < len(tokens) <= MAX_TOKENS


def test_tritonclient_cancel_requests_ends_a_long_generation(triton: dict[str, Any]) -> None:
    """stop_stream(cancel_requests=True) returned (the script finished) after the first token
    of a generation asked for far more."""
    first = triton["cancelled"]["first"]
    assert first["id"] == "c" and first["final"] is False and first["delta"] is not None


def test_tritonclient_model_infer_names_model_stream_infer(triton: dict[str, Any]) -> None:
    assert "ModelStreamInfer" in triton["unary"]["message"], triton["unary"]


def _grpcurl_stream(server: ServerProcess, requests: list[dict[str, Any]]) -> list[Any]:
    assert GRPCURL is not None
    command = [str(GRPCURL), "-plaintext", "-d", "\n".join(json.dumps(r) for r in requests)]
    command += [server.address, "inference.GRPCInferenceService/ModelStreamInfer"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=GRPCURL_TIMEOUT_S)
    assert finished.returncode == 0, finished.stderr
    decoder, text, messages = json.JSONDecoder(), finished.stdout.strip(), []
    while text:
        message, end = decoder.raw_decode(text)
        messages.append(message)
        text = text[end:].lstrip()
    return messages


def _bytes_element(raw: str) -> str:
    """A BYTES tensor of one element: a 4-byte little-endian length, then the bytes."""
    data = base64.b64decode(raw)
    assert int.from_bytes(data[:4], "little") == len(data) - 4
    return data[4:].decode()


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl is not installed (dev extra)")
def test_grpcurl_streams_the_same_tokens(
    server: ServerProcess, expected: dict[str, tuple[str, str | None]]
) -> None:
    """Hand-written JSON (typed contents, the empty-final parameter); proto3 JSON leaves a
    false bool_param out."""
    requests = [
        {
            "model_name": MODEL,
            "id": f"g{index}",
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [1],
                    "contents": {"bytes_contents": [base64.b64encode(prompt.encode()).decode()]},
                },
                {
                    "name": "max_tokens",
                    "datatype": "INT32",
                    "shape": [1],
                    "contents": {"int_contents": [MAX_TOKENS]},
                },
            ],
            "parameters": {"triton_enable_empty_final_response": {"bool_param": True}},
        }
        for index, prompt in enumerate(PROMPTS)
    ]
    by_id: dict[str, list[dict[str, Any]]] = {}
    for message in _grpcurl_stream(server, requests):
        assert "error_message" not in message, message
        response = message["infer_response"]
        by_id.setdefault(response["id"], []).append(response)
    assert sorted(by_id) == [f"g{i}" for i in range(len(PROMPTS))]
    for index, prompt in enumerate(PROMPTS):
        responses = by_id[f"g{index}"]
        finals = [
            r["parameters"]["triton_final_response"].get("bool_param", False) for r in responses
        ]
        assert finals == [False] * (len(responses) - 1) + [True]
        values: dict[str, list[str]] = {"text_delta": [], "finish_reason": []}
        for response in responses:
            for tensor, raw in zip(
                response.get("outputs", []), response.get("raw_output_contents", []), strict=True
            ):
                values[tensor["name"]].append(_bytes_element(raw))
        text, finish = expected[prompt]
        assert "".join(values["text_delta"]) == text
        assert values["finish_reason"] == ([finish] if finish else [])
